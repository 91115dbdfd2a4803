"""Saving grafted models: original layout by default (exact), grafted layout on request."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conversion_helpers import GATE_UP, QKV, FusedGateUpLlamaMLP, fused_qkv_class
from safetensors.torch import load_file
from test_conversion_load import FAMILIES, X, _attention_class, _checkpoint_tensors, _config, _save_plain
from transformers import AutoModelForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from modelgraft import (
    ConversionOperation,
    IrreversibleConversionError,
    WeightConverter,
    apply_patches,
    patched,
    report,
)


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
    config = model.config
    head_dim, hidden = attn.head_dim, config.hidden_size
    kv_shape = (config.num_key_value_heads * head_dim, hidden)
    assert (tuple(q.shape), tuple(k.shape), tuple(v.shape)) == (
        (config.num_attention_heads * head_dim, hidden),
        kv_shape,
        kv_shape,
    )
    assert torch.equal(torch.cat([q, k, v]), attn.qkv_proj.weight.detach())
    gate = written["model.layers.1.mlp.gate_proj.weight"]
    gate_up = model.model.layers[1].mlp.gate_up_proj.weight.detach()
    assert torch.equal(gate, gate_up[: config.intermediate_size])
    plain, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    torch.testing.assert_close(plain.eval()(X).logits, model.eval()(X).logits, atol=1e-5, rtol=0)


def test_from_config_grafted_model_saved_inside_apply_patches_still_writes_the_original_layout(tmp_path):
    """Inside an ``apply_patches()`` block the modeling globals are the replacements; the original
    model built to learn the checkpoint's keys and shapes must still be the original one."""
    with _graft("llama"), apply_patches():
        model = AutoModelForCausalLM.from_config(_config("llama"))
        model.save_pretrained(tmp_path)
        assert modeling_llama.LlamaAttention is not LlamaAttention  # the replacement is still bound
    written = load_file(tmp_path / "model.safetensors")
    assert "model.layers.0.self_attn.qkv_proj.weight" not in written
    fused = model.model.layers[0].self_attn.qkv_proj.weight.detach()
    assert torch.equal(
        torch.cat([written[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv"]), fused
    )


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


class _RenamedTransposedAttention(LlamaAttention):
    """q/k/v under other names, and the output projection stored transposed as a raw parameter."""

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.wq, self.wk, self.wv = self.q_proj, self.k_proj, self.v_proj
        self.wo_t = torch.nn.Parameter(torch.empty(self.o_proj.in_features, self.o_proj.out_features))
        self.wo_bias = torch.nn.Parameter(torch.empty(self.o_proj.out_features))
        del self.q_proj, self.k_proj, self.v_proj, self.o_proj

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q, k, v = (w(hidden_states).view(shape).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        name = self.config._attn_implementation
        interface = eager_attention_forward if name == "eager" else ALL_ATTENTION_FUNCTIONS[name]
        out, weights = interface(self, q, k, v, attention_mask, scaling=self.scaling, **kwargs)
        return out.reshape(*hidden_states.shape[:-1], -1) @ self.wo_t + self.wo_bias, weights


def test_renaming_and_transpose_round_trip(tmp_path):
    from modelgraft import Transpose, WeightRenaming

    plain = _save_plain("llama", tmp_path / "src")
    conversions = [
        WeightRenaming(["q_proj", "k_proj", "v_proj"], ["wq", "wk", "wv"]),
        WeightConverter("o_proj.weight", "wo_t", [Transpose(0, 1)]),
        WeightRenaming("o_proj.bias", "wo_bias"),
    ]
    with patched({"LlamaAttention": _RenamedTransposedAttention}, conversions={"llama": conversions}):
        model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "src", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ckpt = _checkpoint_tensors(tmp_path / "src")
    attn = model.model.layers[0].self_attn
    assert torch.equal(attn.wo_t, ckpt["model.layers.0.self_attn.o_proj.weight"].T)
    assert torch.equal(attn.wk.bias, ckpt["model.layers.0.self_attn.k_proj.bias"])
    torch.testing.assert_close(model.eval()(X).logits, plain(X).logits, atol=1e-5, rtol=0)
    model.save_pretrained(tmp_path / "out")
    _assert_bit_identical(_checkpoint_tensors(tmp_path / "out"), ckpt)
