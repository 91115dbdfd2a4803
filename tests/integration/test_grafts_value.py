"""One graft value (classes plus conversions) accepted everywhere a patch mapping is (issue 14, point 1).

A user's ``modelgraft.Graft(mapping, conversions)`` and the ready-made grafts are the same type: each
goes to ``patched``, ``graft_model``, ``verify``, ``register_graft`` and the CLI's ``--graft`` as one
value, and grafts add up with ``+``. (The CLI's and the registry scope's tests of this read private
modules, so they live in those modules' own unit files: tests/cli/test_cli.py, tests/unit/test_registry.py.)
"""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP

import modelgraft
from families import family
from modelgraft import (
    Concatenate,
    ConversionError,
    Graft,
    PatchRegistrationError,
    ReplacementTypeError,
    WeightConverter,
    get_checkpoint_conversion_mapping,
    graft_model,
    register_graft,
    report,
    unregister_graft,
)
from modelgraft.grafts import GraftConflictError, fused_gate_up_class, fused_qkv, fused_qkv_class

ATOL = 1e-5


def _qkv_converter() -> WeightConverter:
    names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    return WeightConverter(names, ["self_attn.qkv_proj"], [Concatenate(dim=0)])


def _user_graft() -> Graft:
    """Fused QKV for Llama written by hand: a class and the conversion that goes with it."""
    return Graft({"LlamaAttention": fused_qkv_class(LlamaAttention)}, {"llama": [_qkv_converter()]})


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, nn.Module]:
    torch.manual_seed(0)
    model = family("llama").causal_lm().eval()
    path = tmp_path_factory.mktemp("graft-value-llama")
    model.save_pretrained(path)
    return path, model


def _logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(**family("llama").inputs(model.config)).logits


def _attn(model: nn.Module) -> str:
    return type(model.model.layers[0].self_attn).__name__


def test_a_users_graft_loads_under_patched(llama: tuple[Path, nn.Module]) -> None:
    path, plain = llama
    with modelgraft.patched(_user_graft(), strict=True):
        grafted = AutoModelForCausalLM.from_pretrained(path).eval()
    assert _attn(grafted) == "FusedQKVLlamaAttention"
    assert "model.layers.0.self_attn.qkv_proj.weight" in grafted.state_dict()
    torch.testing.assert_close(_logits(grafted), _logits(plain), atol=ATOL, rtol=0)
    assert modelgraft.get_patch_mapping() == {} and get_checkpoint_conversion_mapping("llama") is None


def test_a_users_graft_grafts_a_built_model(llama: tuple[Path, nn.Module]) -> None:
    _, plain = llama
    grafted = graft_model(copy.deepcopy(plain), _user_graft())
    assert _attn(grafted) == "FusedQKVLlamaAttention"
    assert [r.key for r in report(grafted).replaced] == ["LlamaAttention", "LlamaAttention"]
    torch.testing.assert_close(_logits(grafted), _logits(plain), atol=ATOL, rtol=0)


def test_a_users_graft_is_verified() -> None:
    result = modelgraft.verify("llama", _user_graft())
    assert result.passed, result.format_table()
    assert "LlamaAttention -> FusedQKVLlamaAttention x2" in result["builds"].detail


def test_register_graft_registers_classes_and_conversions_until_unregistered(
    llama: tuple[Path, nn.Module],
) -> None:
    path, _ = llama
    graft = _user_graft()
    register_graft(graft)
    try:
        assert list(modelgraft.get_patch_mapping()) == ["LlamaAttention"]
        assert get_checkpoint_conversion_mapping("llama") == [_qkv_converter()]
        assert _attn(AutoModelForCausalLM.from_pretrained(path)) == "FusedQKVLlamaAttention"
    finally:
        unregister_graft(graft)
    assert modelgraft.get_patch_mapping() == {} and get_checkpoint_conversion_mapping("llama") is None
    assert _attn(AutoModelForCausalLM.from_pretrained(path)) == "LlamaAttention"


def test_register_graft_is_all_or_nothing() -> None:
    modelgraft.register_checkpoint_conversion_mapping("llama", [])
    with pytest.raises(ConversionError, match=r"already has conversions for `llama`.*overwrite=True"):
        register_graft(_user_graft())
    assert modelgraft.get_patch_mapping() == {}  # the classes did not go in either
    assert get_checkpoint_conversion_mapping("llama") == []
    register_graft(_user_graft(), overwrite=True)
    assert get_checkpoint_conversion_mapping("llama") == [_qkv_converter()]
    unregister_graft(_user_graft())
    assert modelgraft.get_patch_mapping() == {} and get_checkpoint_conversion_mapping("llama") is None


def test_a_users_graft_and_a_ready_made_one_add_up(llama: tuple[Path, nn.Module]) -> None:
    path, plain = llama
    gate_up = WeightConverter(["mlp.gate_proj", "mlp.up_proj"], ["mlp.gate_up_proj"], [Concatenate(dim=0)])
    mine = Graft({"LlamaMLP": fused_gate_up_class(LlamaMLP)}, {"llama": [gate_up]}, name="my MLP")
    graft = mine + fused_qkv("llama")
    assert graft.name == "my MLP + fused QKV" and graft.model_types == ("llama",)
    assert sorted(graft.mapping) == ["LlamaAttention", "LlamaMLP"]
    assert graft.conversions == {"llama": [gate_up, _qkv_converter()]}
    with modelgraft.patched(graft, strict=True):
        grafted = AutoModelForCausalLM.from_pretrained(path).eval()
    layer = grafted.model.layers[1]
    assert (type(layer.self_attn).__name__, type(layer.mlp).__name__) == (
        "FusedQKVLlamaAttention",
        "FusedGateUpLlamaMLP",
    )
    torch.testing.assert_close(_logits(grafted), _logits(plain), atol=ATOL, rtol=0)


def test_conversions_given_next_to_a_graft_are_added_to_it(llama: tuple[Path, nn.Module]) -> None:
    path, plain = llama
    classes_only = Graft({"LlamaAttention": fused_qkv_class(LlamaAttention)})
    with modelgraft.patched(classes_only, conversions={"llama": [_qkv_converter()]}, strict=True):
        grafted = AutoModelForCausalLM.from_pretrained(path).eval()
    torch.testing.assert_close(_logits(grafted), _logits(plain), atol=ATOL, rtol=0)


def test_grafts_that_replace_one_key_differently_are_refused_everywhere() -> None:
    other = Graft({"LlamaAttention": nn.Identity})
    with pytest.raises(GraftConflictError, match=r"`LlamaAttention` is replaced by both"):
        _user_graft() + other
    # verify takes one graft, added up beforehand: it has no second way to combine them
    with pytest.raises(modelgraft.UnexpectedArgumentError, match=r"add grafts together with `\+`"):
        modelgraft.verify("llama", _user_graft(), graft=other)


@pytest.mark.parametrize(
    ("mapping", "conversions", "error", "match"),
    [
        ({"(": nn.Identity}, None, PatchRegistrationError, r"`\(` is not a valid regular expression"),
        ({"LlamaMLP": 3}, None, ReplacementTypeError, r"Replacement for key `LlamaMLP` must be a class"),
        ([("LlamaMLP", nn.Identity)], None, PatchRegistrationError, r"`mapping` must be a dict"),
        (None, {"llama": ["q_proj"]}, ConversionError, r"in the conversion mapping for `llama`"),
    ],
    ids=["bad-regex", "not-a-class", "not-a-dict", "bad-converter"],
)
def test_a_bad_graft_is_refused_when_it_is_made(mapping, conversions, error, match: str) -> None:
    with pytest.raises(error, match=match):
        Graft(mapping, conversions)


def test_a_graft_pickles_as_what_it_resolves_to() -> None:
    graft = fused_qkv("llama") + _user_graft()
    copied = pickle.loads(pickle.dumps(graft))
    assert (copied.name, copied.model_types) == (graft.name, graft.model_types)
    assert copied.mapping == graft.mapping and copied.conversions == graft.conversions
