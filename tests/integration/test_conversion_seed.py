"""The seed's complete example (qwen2_moe, fused QKV + per-expert ModuleList experts), offline."""

from __future__ import annotations

import pytest
import torch
from conversion_helpers import FusedQKVAttention, ModuleListExperts, tiny_qwen2_moe_config
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from _versions import requires_builtin_conversion, requires_fused_experts
from modelgraft import (
    Concatenate,
    ConversionError,
    MergeModulelist,
    WeightConverter,
    patched,
    register_checkpoint_conversion_mapping,
    register_patch_mapping,
    report,
    unregister_checkpoint_conversion_mapping,
)


@pytest.fixture(scope="module")
def qwen2_moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen2-moe")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen2_moe_config()).eval()
    model.save_pretrained(path)
    return path


X = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(3))
_CONFIG = tiny_qwen2_moe_config()
#: transformers' fused experts: (experts, gate and up stacked, hidden)
_FUSED_GATE_UP = (_CONFIG.num_experts, 2 * _CONFIG.moe_intermediate_size, _CONFIG.hidden_size)


@requires_builtin_conversion
def test_seed_complete_example_logits_match_the_plain_model(qwen2_moe_dir):
    plain = AutoModelForCausalLM.from_pretrained(qwen2_moe_dir).eval()
    saved = load_file(qwen2_moe_dir / "model.safetensors")
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in saved  # transformers saves per-expert keys

    # As in the seed, with the import lines changed to modelgraft.
    register_patch_mapping(
        mapping={"Qwen2MoeExperts": ModuleListExperts, "Qwen2MoeAttention": FusedQKVAttention}
    )
    with pytest.raises(ConversionError, match=r"`qwen2_moe` already exists in the installed transformers"):
        register_checkpoint_conversion_mapping(
            "qwen2_moe", [WeightConverter(["q_proj", "k_proj", "v_proj"], ["qkv_proj"], [Concatenate(dim=0)])]
        )
    register_checkpoint_conversion_mapping(
        model_type_or_class_name="qwen2_moe",
        mapping=[
            WeightConverter(
                source_patterns=["q_proj", "k_proj", "v_proj"],
                target_patterns=["qkv_proj"],
                operations=[Concatenate(dim=0)],
            ),
        ],
        overwrite=True,
    )
    model, info = AutoModelForCausalLM.from_pretrained(qwen2_moe_dir, output_loading_info=True)
    model.eval()

    layer = model.model.layers[0]
    assert isinstance(layer.mlp.experts, ModuleListExperts) and isinstance(layer.self_attn, FusedQKVAttention)
    # The built-in expert merge was replaced: the per-expert keys loaded as they are.
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert torch.equal(
        layer.mlp.experts[1].up_proj.weight, saved["model.layers.0.mlp.experts.1.up_proj.weight"]
    )
    torch.testing.assert_close(model(X).logits, plain(X).logits, atol=1e-5, rtol=0)
    assert len(report(model).conversions) == 4


def test_seed_graft_saves_the_original_layout_bit_identically(qwen2_moe_dir, tmp_path):
    seed = WeightConverter(["q_proj", "k_proj", "v_proj"], ["qkv_proj"], [Concatenate(dim=0)])
    mapping = {"Qwen2MoeExperts": ModuleListExperts, "Qwen2MoeAttention": FusedQKVAttention}
    with patched(mapping, conversions={"qwen2_moe": [seed]}):
        model = AutoModelForCausalLM.from_pretrained(qwen2_moe_dir)
    model.save_pretrained(tmp_path)
    original = load_file(qwen2_moe_dir / "model.safetensors")
    written = load_file(tmp_path / "model.safetensors")
    assert sorted(written) == sorted(original)
    assert all(torch.equal(written[k], original[k]) for k in original)


@requires_fused_experts
def test_fused_experts_through_modelgraft_converters_round_trip(qwen2_moe_dir, tmp_path):
    """Per-expert checkpoint keys merged into the stock fused experts by modelgraft's own ops."""
    conversions = [
        WeightConverter(["q_proj", "k_proj", "v_proj"], ["qkv_proj"], [Concatenate(dim=0)]),
        WeightConverter(
            ["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"],
            "mlp.experts.gate_up_proj",
            [MergeModulelist(dim=0), Concatenate(dim=1)],
        ),
        WeightConverter("mlp.experts.*.down_proj.weight", "mlp.experts.down_proj", [MergeModulelist(dim=0)]),
    ]
    plain = AutoModelForCausalLM.from_pretrained(qwen2_moe_dir).eval()
    with patched({"Qwen2MoeAttention": FusedQKVAttention}, conversions={"qwen2_moe": conversions}):
        model, info = AutoModelForCausalLM.from_pretrained(qwen2_moe_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert tuple(model.model.layers[0].mlp.experts.gate_up_proj.shape) == _FUSED_GATE_UP
    torch.testing.assert_close(model.eval()(X).logits, plain(X).logits, atol=1e-5, rtol=0)
    merged = [
        r for r in report(model).conversions if r.target_keys == ("model.layers.1.mlp.experts.gate_up_proj",)
    ]
    assert len(merged) == 1 and len(merged[0].source_keys) == 8  # 4 experts x (gate, up)

    model.save_pretrained(tmp_path)
    original = load_file(qwen2_moe_dir / "model.safetensors")
    written = load_file(tmp_path / "model.safetensors")
    assert sorted(written) == sorted(original)
    assert all(torch.equal(written[k], original[k]) for k in original)


@requires_builtin_conversion
def test_unregistering_restores_the_builtin_conversion(qwen2_moe_dir):
    register_checkpoint_conversion_mapping("qwen2_moe", [], overwrite=True)
    unregister_checkpoint_conversion_mapping("qwen2_moe")
    model, info = AutoModelForCausalLM.from_pretrained(qwen2_moe_dir, output_loading_info=True)
    assert not info["missing_keys"]
    assert tuple(model.model.layers[0].mlp.experts.gate_up_proj.shape) == _FUSED_GATE_UP


@requires_fused_experts
def test_fused_expert_checkpoint_splits_into_per_expert_linears_and_back(qwen2_moe_dir, tmp_path):
    """A checkpoint with fused 3D experts loads into the seed's per-expert experts (Chunk + SplitModulelist)."""
    from modelgraft import Chunk, SplitModulelist

    qkv = WeightConverter(["q_proj", "k_proj", "v_proj"], ["qkv_proj"], [Concatenate(dim=0)])
    merge = [
        WeightConverter(
            ["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"],
            "mlp.experts.gate_up_proj",
            [MergeModulelist(dim=0), Concatenate(dim=1)],
        ),
        WeightConverter("mlp.experts.*.down_proj.weight", "mlp.experts.down_proj", [MergeModulelist(dim=0)]),
    ]
    with patched({"Qwen2MoeAttention": FusedQKVAttention}, conversions={"qwen2_moe": [qkv, *merge]}):
        fused_model = AutoModelForCausalLM.from_pretrained(qwen2_moe_dir)
    fused_model.save_pretrained(tmp_path / "fused", save_original_format=False)
    fused = load_file(tmp_path / "fused" / "model.safetensors")
    assert tuple(fused["model.layers.0.mlp.experts.gate_up_proj"].shape) == _FUSED_GATE_UP

    split = [
        WeightConverter(
            "mlp.experts.gate_up_proj",
            ["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"],
            [Chunk(dim=1), SplitModulelist(dim=0)],
        ),
        WeightConverter("mlp.experts.down_proj", "mlp.experts.*.down_proj.weight", [SplitModulelist(dim=0)]),
    ]
    mapping = {"Qwen2MoeExperts": ModuleListExperts, "Qwen2MoeAttention": FusedQKVAttention}
    with patched(mapping, conversions={"qwen2_moe": split}):
        model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "fused", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    original = load_file(qwen2_moe_dir / "model.safetensors")
    expert = model.model.layers[1].mlp.experts[3]
    assert torch.equal(expert.up_proj.weight, original["model.layers.1.mlp.experts.3.up_proj.weight"])
    assert torch.equal(expert.down_proj.weight, original["model.layers.1.mlp.experts.3.down_proj.weight"])
    plain = AutoModelForCausalLM.from_pretrained(qwen2_moe_dir).eval()
    torch.testing.assert_close(model.eval()(X).logits, plain(X).logits, atol=1e-5, rtol=0)

    # Its original layout is the fused checkpoint it was loaded from, bit for bit.
    model.save_pretrained(tmp_path / "again")
    again = load_file(tmp_path / "again" / "model.safetensors")
    assert sorted(again) == sorted(fused)
    assert all(torch.equal(again[k], fused[k]) for k in fused)
