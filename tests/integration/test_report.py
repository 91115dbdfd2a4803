"""Issue 2, point 9: the graft report, the BERT ``.*Attention`` trap, uninitialised parameters, strict mode."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, BertModel
from transformers.models.bert.modeling_bert import BertSelfAttention
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP

from families import family
from modelgraft import StrictModeError, patched, register_patch_mapping, report


class CustomMLP(LlamaMLP):
    pass


class MyBertAttention(BertSelfAttention):
    pass


class RawParameterAttention(torch.nn.Module):
    """Keeps the checkpoint's projections but adds a raw parameter that nothing fills."""

    def __init__(self, config: object, layer_idx: int) -> None:
        super().__init__()
        self.inner = LlamaAttention(config, layer_idx)
        self.gate = torch.nn.Parameter(torch.empty(4))

    def forward(self, *args: object, **kwargs: object) -> tuple:
        return self.inner(*args, **kwargs)


def test_report_lists_replaced_paths_and_unmatched_keys(tiny_llama_dir: Path) -> None:
    register_patch_mapping({"LlamaMLP": CustomMLP, "NoSuchBlock": CustomMLP, "^Nothing.*$": CustomMLP})
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    rep = report(model)
    assert rep.model_class == "LlamaForCausalLM"
    assert [(r.path, r.original, r.replacement, r.key) for r in rep.replaced] == [
        (
            f"model.layers.{i}.mlp",
            "transformers.models.llama.modeling_llama.LlamaMLP",
            f"{__name__}.CustomMLP",
            "LlamaMLP",
        )
        for i in range(2)
    ]
    assert rep.unmatched_keys == ["NoSuchBlock", "^Nothing.*$"]
    assert rep.ok  # unmatched global keys are information, not problems


def test_an_untouched_model_has_an_empty_report(tiny_llama_dir: Path) -> None:
    rep = report(AutoModelForCausalLM.from_pretrained(tiny_llama_dir))
    assert rep.replaced == [] and rep.unmatched_keys == [] and rep.ok


def test_bert_trap_is_reported_by_name_with_the_dropped_keys(tiny_checkpoint: Callable[[str], Path]) -> None:
    checkpoint = tiny_checkpoint("bert")
    with patched({".*Attention": MyBertAttention}):
        model = BertModel.from_pretrained(checkpoint)
    rep = report(model)
    containers = [r for r in rep.replaced if r.path.endswith(".attention")]
    assert [r.path for r in containers] == ["encoder.layer.0.attention", "encoder.layer.1.attention"]
    assert {r.original for r in containers} == {"transformers.models.bert.modeling_bert.BertAttention"}
    dropped = rep.dropped_checkpoint_keys["encoder.layer.0.attention"]
    assert "encoder.layer.0.attention.self.query.weight" in dropped
    assert "encoder.layer.0.attention.output.dense.weight" in dropped
    assert {k.split(".")[4] for k in dropped} == {"self", "output"}
    trap = next(p for p in rep.problems if "has no place for" in p)
    assert "`BertAttention" in trap and "`MyBertAttention`" in trap and "`output`, `self`" in trap
    assert any("randomly initialised" in p and "attention.query.weight" in p for p in rep.problems)
    assert not rep.ok


def test_narrow_key_on_bert_is_clean(tiny_checkpoint: Callable[[str], Path]) -> None:
    checkpoint = tiny_checkpoint("bert")
    with patched({".*SelfAttention$": MyBertAttention}, strict=True):
        model = BertModel.from_pretrained(checkpoint)
    assert len(report(model).replaced) == 2 and report(model).ok


def test_strict_raises_on_the_bert_trap(tiny_checkpoint: Callable[[str], Path]) -> None:
    checkpoint = tiny_checkpoint("bert")
    with (
        pytest.raises(
            StrictModeError,
            match=r"(?s)Strict mode: loading `BertModel` found .*`BertAttention` was replaced",
        ),
        patched({".*Attention": MyBertAttention}, strict=True),
    ):
        BertModel.from_pretrained(checkpoint)


def test_env_strict_raises(tiny_checkpoint: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoint = tiny_checkpoint("bert")
    monkeypatch.setenv("MODELGRAFT_STRICT", "1")
    register_patch_mapping({".*Attention": MyBertAttention})
    with pytest.raises(StrictModeError, match="has no place for the checkpoint's `output`, `self`"):
        BertModel.from_pretrained(checkpoint)


def test_raw_parameter_nothing_fills_is_reported(tiny_llama_dir: Path) -> None:
    register_patch_mapping({"LlamaAttention": RawParameterAttention})
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    rep = report(model)
    assert rep.unloaded_parameters == ["model.layers.0.self_attn.gate", "model.layers.1.self_attn.gate"]
    assert any("uninitialised memory" in p for p in rep.problems)
    with (
        pytest.raises(StrictModeError, match=r"model\.layers\.0\.self_attn\.gate"),
        patched({"LlamaAttention": RawParameterAttention}, strict=True),
    ):
        AutoModelForCausalLM.from_pretrained(tiny_llama_dir)


def test_strict_rejects_a_scoped_key_that_matched_nothing(tiny_llama_dir: Path) -> None:
    with (
        pytest.raises(StrictModeError, match="Scoped patch key `LlamaMlp` matched no module"),
        patched({"LlamaMlp": CustomMLP}, strict=True),
    ):
        AutoModelForCausalLM.from_pretrained(tiny_llama_dir)


def test_strict_from_config_passes_a_clean_graft() -> None:
    with patched({"LlamaMLP": CustomMLP}, strict=True):
        model = AutoModelForCausalLM.from_config(family("llama").config())
    assert len(report(model).replaced) == 2


def _with_placeholders(base: type[torch.nn.Module]) -> type[torch.nn.Module]:
    """``base`` with what a quantizer's placeholder layer has: an int32 packed weight and a float
    scale, neither in the checkpoint."""

    class WithPlaceholders(base):  # type: ignore[misc, valid-type]
        def __init__(self, config: object, layer_idx: int) -> None:
            super().__init__(config, layer_idx)
            self.weight_packed = torch.nn.Parameter(torch.zeros(4, dtype=torch.int32), requires_grad=False)
            self.weight_scale = torch.nn.Parameter(torch.empty(4))

    WithPlaceholders.__name__ = f"WithPlaceholders{base.__name__}"
    return WithPlaceholders


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_missing_keys_beside_integer_placeholders_are_reported_not_a_crash(
    model_type: str, tiny_checkpoint: Callable[[str], Path]
) -> None:
    """Issue 27 point 4: the weight-init probe filled every parameter of the owner with NaN, and
    ``fill_(nan)`` on an int32 placeholder raised inside ``from_pretrained``."""
    from modelgraft.grafts import linear_experts

    fam = family(model_type)
    attention = type(fam.causal_lm().model.layers[0].self_attn)
    source = tiny_checkpoint(model_type)
    with linear_experts(model_type).applied(), patched({attention.__name__: _with_placeholders(attention)}):
        model = AutoModelForCausalLM.from_pretrained(source)
    rep = report(model)
    layers = model.config.num_hidden_layers
    scales = [f"model.layers.{i}.self_attn.weight_scale" for i in range(layers)]
    packed = [f"model.layers.{i}.self_attn.weight_packed" for i in range(layers)]
    assert rep.unloaded_parameters == scales  # nothing filled the float scale
    assert sorted(rep.not_loaded) == sorted(scales + packed)
    assert model.model.layers[0].self_attn.weight_packed.dtype == torch.int32
    assert any("weight_scale" in p for p in rep.problems) and any("weight_packed" in p for p in rep.problems)
