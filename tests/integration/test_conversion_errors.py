"""Conversion errors at load time, with their messages pinned."""

from __future__ import annotations

import pytest
import torch
from conversion_helpers import QKV, fused_qkv_class
from safetensors.torch import load_file, save_file
from test_conversion_load import _attention_class, _config, _save_plain
from transformers import AutoModelForCausalLM

from modelgraft import (
    Concatenate,
    ConversionShapeError,
    MissingSourceKeyError,
    StrictModeError,
    WeightConverter,
    patched,
    report,
)

FUSED = {"LlamaAttention": fused_qkv_class(_attention_class("llama"))}


class _ThreeEqualParts(FUSED["LlamaAttention"]):
    """Sized like the seed's attention (3 x heads x head_dim), which ignores grouped-query attention."""

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.qkv_proj = torch.nn.Linear(config.hidden_size, 3 * config.num_attention_heads * self.head_dim)


def test_missing_source_key_names_the_converter_and_the_key(tmp_path):
    _save_plain("llama", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with (
        patched(FUSED, conversions={"llama": [QKV]}),
        pytest.raises(
            MissingSourceKeyError,
            match=r"Converter WeightConverter\(\['q_proj', 'k_proj', 'v_proj'\].*needs checkpoint key "
            r"`model\.layers\.1\.self_attn\.v_proj\.weight` to build `model\.layers\.1\.self_attn\.qkv_proj\.weight`",
        ),
    ):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_shape_that_does_not_fit_the_target_names_both_shapes(tmp_path):
    # (3q, hidden) cannot take q, k and v of grouped-query attention, (q + 2 kv, hidden).
    config = _config("llama")
    q, kv = (n * config.head_dim for n in (config.num_attention_heads, config.num_key_value_heads))
    assert kv < q  # grouped-query attention
    _save_plain("llama", tmp_path)
    with (
        patched({"LlamaAttention": _ThreeEqualParts}, conversions={"llama": [QKV]}),
        pytest.raises(
            ConversionShapeError,
            match=rf"produced shape \({q + 2 * kv},\) for `model\.layers\.0\.self_attn\.qkv_proj\.bias`, but "
            rf"the model parameter has shape \({3 * q},\)",
        ),
    ):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    # The failed load left no patch behind.
    from transformers.models.llama import modeling_llama

    assert modeling_llama.LlamaAttention.__name__ == "LlamaAttention"


def test_target_no_converter_produced_is_reported_and_strict_raises(tmp_path):
    _save_plain("llama", tmp_path)
    wrong = WeightConverter(["wq", "wk", "wv"], ["qkv_proj"], [Concatenate(dim=0)])
    with patched(FUSED, conversions={"llama": [wrong]}):
        model = AutoModelForCausalLM.from_pretrained(tmp_path)
    rep = report(model)
    assert "model.layers.0.self_attn.qkv_proj.weight" in rep.unloaded_parameters
    assert any(
        "`model.layers.0.self_attn.qkv_proj.weight` was produced by no converter" in p
        and "['wq', 'wk', 'wv']" in p
        for p in rep.problems
    )
    with (
        patched(FUSED, conversions={"llama": [wrong]}, strict=True),
        pytest.raises(StrictModeError, match=r"qkv_proj"),
    ):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_a_non_safetensors_checkpoint_is_reported(tmp_path):
    import shutil

    _save_plain("llama", tmp_path / "st")
    (tmp_path / "bin").mkdir()
    shutil.copy(tmp_path / "st" / "config.json", tmp_path / "bin" / "config.json")
    torch.save(load_file(tmp_path / "st" / "model.safetensors"), tmp_path / "bin" / "pytorch_model.bin")
    with patched(FUSED, conversions={"llama": [QKV]}):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "bin")
    assert any(
        "from safetensors files only" in p and "pytorch_model.bin" in p for p in report(model).problems
    )
    assert "model.layers.0.self_attn.qkv_proj.weight" in report(model).unloaded_parameters
