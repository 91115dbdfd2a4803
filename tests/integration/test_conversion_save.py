"""Saving grafted models: original layout by default (exact), grafted layout on request."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conversion_helpers import GATE_UP, QKV, FusedGateUpLlamaMLP, fused_qkv_class
from safetensors.torch import load_file
from test_conversion_load import FAMILIES, X, _attention_class, _checkpoint_tensors, _config, _save_plain
from transformers import AutoModelForCausalLM

from modelgraft import (
    ConversionOperation,
    IrreversibleConversionError,
    WeightConverter,
    patched,
    report,
)
from modelgraft.conversion import rules


@pytest.fixture(autouse=True)
def _clean_conversions():
    before = dict(rules._registry)
    yield
    rules._registry.clear()
    rules._registry.update(before)


def _graft(family: str, extra_mapping=None, conversions=None):
    attn = _attention_class(family)
    mapping = {attn.__name__: fused_qkv_class(attn), **(extra_mapping or {})}
    return patched(mapping, conversions={family: conversions or [QKV]})


def _assert_bit_identical(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_save_writes_the_original_layout_exactly_with_gqa(family, tmp_path):
    _save_plain(family, tmp_path / "src")
    with _graft(family):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "src")
    cfg = model.config
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # q, k and v differ in size
    model.save_pretrained(tmp_path / "out")
    written = _checkpoint_tensors(tmp_path / "out")
    _assert_bit_identical(written, _checkpoint_tensors(tmp_path / "src"))
    # And a plain transformers load of the result takes every key with no warning-level surprises.
    plain, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert torch.equal(
        plain.model.layers[1].self_attn.k_proj.weight, written["model.layers.1.self_attn.k_proj.weight"]
    )


def test_save_from_shards_to_shards_is_exact(tmp_path):
    _save_plain("llama", tmp_path / "src", max_shard_size="20KB")
    mapping = {"LlamaMLP": FusedGateUpLlamaMLP}
    with _graft("llama", mapping, [QKV, GATE_UP]):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "src")
    model.save_pretrained(tmp_path / "out", max_shard_size="20KB")
    assert len(list((tmp_path / "out").glob("*.safetensors"))) > 1
    _assert_bit_identical(_checkpoint_tensors(tmp_path / "out"), _checkpoint_tensors(tmp_path / "src"))


def test_grafted_layout_saves_on_request_and_loads_back_without_conversion(tmp_path):
    plain = _save_plain("llama", tmp_path / "src")
    with _graft("llama"):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "src")
    model.save_pretrained(tmp_path / "fused", save_original_format=False)
    fused = load_file(tmp_path / "fused" / "model.safetensors")
    assert "model.layers.0.self_attn.qkv_proj.weight" in fused
    assert not any("q_proj" in k for k in fused)

    with _graft("llama"):
        again, info = AutoModelForCausalLM.from_pretrained(tmp_path / "fused", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not report(again).conversions  # nothing needed converting
    torch.testing.assert_close(again.eval()(X).logits, plain(X).logits, atol=1e-5, rtol=0)

    # A model loaded from the grafted layout still saves the original layout by default.
    again.save_pretrained(tmp_path / "orig")
    _assert_bit_identical(_checkpoint_tensors(tmp_path / "orig"), _checkpoint_tensors(tmp_path / "src"))


def test_from_config_grafted_model_saves_the_original_layout(tmp_path):
    with _graft("llama", {"LlamaMLP": FusedGateUpLlamaMLP}, [QKV, GATE_UP]):
        model = AutoModelForCausalLM.from_config(_config("llama"))
    attn = model.model.layers[0].self_attn
    assert hasattr(attn, "qkv_proj")
    # Saved after the scope ended: the model remembers its conversions.
    model.save_pretrained(tmp_path)
    written = load_file(tmp_path / "model.safetensors")
    q, k, v = (written[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    assert (tuple(q.shape), tuple(k.shape), tuple(v.shape)) == ((32, 32), (16, 32), (16, 32))
    assert torch.equal(torch.cat([q, k, v]), attn.qkv_proj.weight.detach())
    gate = written["model.layers.1.mlp.gate_proj.weight"]
    assert torch.equal(gate, model.model.layers[1].mlp.gate_up_proj.weight.detach()[:64])
    plain, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    torch.testing.assert_close(plain.eval()(X).logits, model.eval()(X).logits, atol=1e-5, rtol=0)


class _NoReverse(ConversionOperation):
    def convert(self, tensors, context):
        return [[torch.cat([g[0] for g in tensors])]]


def test_user_operation_without_reverse_cannot_save_the_original_layout(tmp_path):
    _save_plain("llama", tmp_path / "src")
    irreversible = WeightConverter(["q_proj", "k_proj", "v_proj"], ["qkv_proj"], [_NoReverse()])
    with _graft("llama", conversions=[irreversible]):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "src")
    with pytest.raises(
        IrreversibleConversionError,
        match=r"cannot write the original layout of `model\.layers\.\d\.self_attn\.qkv_proj\.\w+`: operation "
        r"`_NoReverse` has no `reverse`.*save_original_format=False",
    ):
        model.save_pretrained(tmp_path / "out")
    model.save_pretrained(tmp_path / "fused", save_original_format=False)
    assert "model.layers.0.self_attn.qkv_proj.weight" in load_file(
        Path(tmp_path / "fused") / "model.safetensors"
    )
