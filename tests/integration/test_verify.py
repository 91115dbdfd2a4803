"""modelgraft.verify: one verdict per check, passing for sound grafts and failing for broken ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP

import modelgraft
from _versions import requires_fused_experts
from modelgraft import VerifyReport, verify
from modelgraft.grafts import fused_qkv, linear_experts
from modelgraft.testing import tiny_config

ALL = ["builds", "all_weights_loaded", "logits_match", "hidden_states_match", "save_roundtrip"]


def _verdicts(result: VerifyReport) -> dict[str, bool]:
    return {c.name: c.passed for c in result.checks}


def test_a_sound_graft_passes_every_check_on_a_model_type() -> None:
    result = verify("llama", graft=fused_qkv("llama"))
    assert [c.name for c in result.checks] == ALL
    assert result.passed, result.format_table()
    assert "2 modules replaced: LlamaAttention -> FusedQKVLlamaAttention x2" in result["builds"].detail
    assert "bit-identical" in result["save_roundtrip"].detail
    data = json.loads(json.dumps(result.to_dict()))
    assert data["passed"] is True and [c["name"] for c in data["checks"]] == ALL


@requires_fused_experts
def test_moe_experts_and_fused_attention_together() -> None:
    result = verify("qwen2_moe", graft=[fused_qkv("qwen2_moe"), linear_experts("qwen2_moe")])
    assert result.passed, result.format_table()
    assert "Qwen2MoeExperts -> LinearQwen2MoeExperts x2" in result["builds"].detail


class _ScaledAttention(LlamaAttention):
    """Changes the outputs (keeps every weight)."""

    def forward(self, *args: object, **kwargs: object) -> tuple:
        out, weights = super().forward(*args, **kwargs)
        return out * 1.5, weights


def test_changed_outputs_fail_the_output_checks_only() -> None:
    result = verify("llama", {"LlamaAttention": _ScaledAttention})
    assert _verdicts(result) == {
        "builds": True,
        "all_weights_loaded": True,
        "logits_match": False,
        "hidden_states_match": False,
        "save_roundtrip": True,
    }
    assert "max |diff|" in result["logits_match"].detail
    assert result.passed is False
    assert "FAILED: logits_match, hidden_states_match" in result.format_table()


class _MLPWithGate(LlamaMLP):
    """Adds a parameter that no checkpoint holds."""

    def __init__(self, config: object) -> None:
        super().__init__(config)
        self.extra_gate = nn.Linear(config.hidden_size, config.hidden_size, bias=False)


def test_parameters_left_at_random_init_are_caught() -> None:
    result = verify("llama", {"LlamaMLP": _MLPWithGate})
    verdicts = _verdicts(result)
    assert verdicts["builds"] is True
    assert verdicts["all_weights_loaded"] is False
    assert "extra_gate.weight" in result["all_weights_loaded"].detail
    assert verdicts["save_roundtrip"] is False  # the extra parameter is written as an unexpected key
    assert "unexpected" in result["save_roundtrip"].detail


def test_fused_layout_without_its_conversion_is_not_loaded() -> None:
    graft = fused_qkv("llama")
    result = verify("llama", graft.mapping)  # conversions forgotten
    assert result["all_weights_loaded"].passed is False
    assert "qkv_proj" in result["all_weights_loaded"].detail
    assert result["logits_match"].passed is False


def test_a_key_that_matches_nothing_fails_builds() -> None:
    result = verify("llama", {"MistralAttention": _ScaledAttention})
    assert result["builds"].passed is False
    assert "no module was replaced" in result["builds"].detail
    assert "`MistralAttention`" in result["builds"].detail


def test_registered_patches_are_verified_when_nothing_is_given() -> None:
    graft = fused_qkv("llama")
    graft.register()
    try:
        result = verify("llama")
    finally:
        graft.unregister()
    assert result.passed, result.format_table()


def test_a_local_checkpoint_folder(tmp_path: Path) -> None:
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(tiny_config("qwen2")).save_pretrained(tmp_path / "ckpt")
    result = verify(tmp_path / "ckpt", graft=fused_qkv("qwen2"), workdir=tmp_path / "work")
    assert result.passed, result.format_table()
    assert result.model_class == "Qwen2ForCausalLM"
    assert (tmp_path / "work" / "resaved").is_dir()


def test_a_checkpoint_folder_with_the_graft_registered_globally(tmp_path: Path) -> None:
    """The plain reference and the plain reload run unpatched, so a global graft is verified fully."""
    torch.manual_seed(4)
    AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(tmp_path / "ckpt")
    graft = fused_qkv("llama")
    graft.register()
    try:
        result = verify(tmp_path / "ckpt", workdir=tmp_path / "work")
    finally:
        graft.unregister()
    assert result.passed, result.format_table()
    assert (
        "plain reload equals the plain model" in {c.name: c for c in result.checks}["save_roundtrip"].detail
    )


def test_tolerance_is_applied() -> None:
    class TinyShift(LlamaAttention):
        def forward(self, *args: object, **kwargs: object) -> tuple:
            out, weights = super().forward(*args, **kwargs)
            return out + 1e-4, weights

    loose = verify("llama", {"LlamaAttention": TinyShift}, atol=1.0)
    strict = verify("llama", {"LlamaAttention": TinyShift}, atol=1e-6)
    assert loose["logits_match"].passed is True
    assert strict["logits_match"].passed is False


def test_unknown_target_is_a_clear_error() -> None:
    with pytest.raises(modelgraft.GraftError, match=r"`no_such_model`"):
        verify("no_such_model", {"LlamaAttention": _ScaledAttention})
    assert modelgraft.get_patch_mapping() == {}


@pytest.mark.parametrize(
    ("model_type", "class_path", "model_class"),
    [
        # (4.57 BERT picks its self-attention from BERT_SELF_ATTENTION_CLASSES; the swap follows it.)
        ("bert", "transformers.models.bert.modeling_bert:BertSelfAttention", "BertForMaskedLM"),
        ("t5", "transformers.models.t5.modeling_t5:T5LayerFF", "T5ForConditionalGeneration"),
        ("llava", "transformers.models.llama.modeling_llama:LlamaAttention", "LlavaForConditionalGeneration"),
    ],
    ids=["encoder", "seq2seq", "vision-language"],
)
def test_other_kinds_of_models(model_type: str, class_path: str, model_class: str) -> None:
    import importlib

    module, name = class_path.split(":")
    original = getattr(importlib.import_module(module), name)
    subclass = type(f"Traced{name}", (original,), {})
    result = verify(model_type, {name: subclass})
    assert result.model_class == model_class
    assert result.passed, result.format_table()
    assert f"{name} -> Traced{name}" in result["builds"].detail


def test_a_bf16_checkpoint_folder_round_trips_bit_for_bit(tmp_path: Path) -> None:
    torch.manual_seed(4)
    model = AutoModelForCausalLM.from_config(tiny_config("llama")).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    result = verify(tmp_path / "bf16", graft=fused_qkv("llama"))
    assert result.passed, result.format_table()
    assert "bit-identical" in result["save_roundtrip"].detail


def test_a_ready_made_graft_in_the_mapping_place() -> None:
    result = verify("llama", fused_qkv("llama"))
    assert result.passed, result.format_table()
