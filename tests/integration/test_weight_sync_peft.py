"""Weight sync of a PEFT (LoRA) policy (issue 19, point 6).

``original_state_dict`` of a PEFT model yields the base model's original checkpoint names (no
``base_model.model.``, ``base_layer`` or ``lora_`` names) with the adapters merged, as verl and
OpenRLHF sync LoRA policies: ``merge_adapter()``, sync, ``unmerge_adapter()``. An unmerged adapter
is refused. Plain and ``fused_qkv``-grafted bases; values compared with ``merge_and_unload`` of a
copy, bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from _versions import TRANSFORMERS_VERSION
from modelgraft import ConversionError, graft_model, original_state_dict
from modelgraft.grafts import fused_qkv
from modelgraft.testing import tiny_config

peft = pytest.importorskip("peft", reason=f"peft is not installed (transformers {TRANSFORMERS_VERSION})")
from peft import LoraConfig, get_peft_model  # noqa: E402


def _policy(grafted: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    plain_names = list(base.state_dict())
    if grafted:
        graft_model(base, fused_qkv("llama"))
    config = LoraConfig(
        r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False
    )
    model = get_peft_model(base, config)
    model.plain_names = plain_names  # type: ignore[attr-defined]
    return model


@pytest.mark.parametrize("grafted", [False, True], ids=["plain", "fused_qkv"])
def test_a_merged_peft_model_streams_the_base_checkpoint_names_with_the_adapters_merged(
    grafted: bool,
) -> None:
    model = _policy(grafted)
    expected = dict(copy.deepcopy(model).merge_and_unload().state_dict())
    if grafted:
        expected = dict(original_state_dict(copy.deepcopy(model).merge_and_unload()))
    model.merge_adapter()
    got = dict(original_state_dict(model))
    assert list(got) == [n for n in model.plain_names if n in got] and sorted(got) == sorted(
        model.plain_names
    )
    assert not any("lora_" in n or "base_layer" in n or n.startswith("base_model") for n in got)
    for name, tensor in got.items():
        assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name
    model.unmerge_adapter()
    # The LoRA layers are back in place after the iteration.
    assert any(
        type(m).__module__.startswith("peft.") for n, m in model.named_modules() if n.endswith("q_proj")
    )


def test_an_unmerged_adapter_is_refused_and_the_model_is_untouched() -> None:
    model = _policy(False)
    before = [type(m) for m in model.modules()]
    with pytest.raises(ConversionError, match=r"adapter of `.*q_proj` is not merged.*merge_adapter\(\)"):
        original_state_dict(model)
    assert [type(m) for m in model.modules()] == before


def test_stopping_the_iteration_early_puts_the_lora_layers_back() -> None:
    model = _policy(False)
    model.merge_adapter()
    stream = original_state_dict(model)
    next(stream)
    assert not any(type(m).__module__.startswith("peft.tuners") for m in model.get_base_model().modules())
    stream.close()
    assert any(type(m).__module__.startswith("peft.tuners") for m in model.get_base_model().modules())
