"""PEFT (LoRA) on grafted models behaves as on the plain model.

A LoRA config or adapter written for the plain model works on a ``fused_qkv``/``fused_gate_up``
model with the plain model's outputs; an adapter trained on a grafted model saves under the plain
model's names and loads on the plain model with the same outputs; merging writes the adapter into
the fused layer, and the merged grafted model saves the plain model's merged checkpoint. LoRA on
``linear_experts`` experts wraps each expert's layers, merges and saves, in the standard layout
and in declared ones (biased and interleaved GPT-OSS experts, Llama 4's dense call, a family's
own gate).

Every comparison is against the plain model on shapes, dtypes, finiteness and fp32 values.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from _versions import TRANSFORMERS_VERSION, requires_fused_experts
from families import family
from modelgraft.grafts import (
    LINEAR_EXPERTS_FAMILIES,
    ExpertsAdapterError,
    FusionError,
    Graft,
    fused_gate_up,
    fused_qkv,
    linear_experts,
)

peft = pytest.importorskip("peft", reason=f"peft is not installed (transformers {TRANSFORMERS_VERSION})")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

ATOL = 1e-5
FUSED = {
    "fused_qkv": (fused_qkv, ["q_proj", "v_proj"]),
    "fused_gate_up": (fused_gate_up, ["gate_proj", "up_proj"]),
    "both": (
        lambda t: fused_qkv(t) + fused_gate_up(t),
        ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"],
    ),
}
FUSED_FAMILIES = ("llama", "qwen2")  # qwen2: q/k/v biases


@pytest.fixture
def checkpoint(tiny_checkpoint: Callable[[str], Path]) -> Callable[[str], Path]:
    """The session's tiny causal-LM checkpoints (tests/conftest.py), read only here."""
    return tiny_checkpoint


def _load(path: Path, graft: Graft | None = None) -> torch.nn.Module:
    if graft is None:
        return AutoModelForCausalLM.from_pretrained(path).eval()
    with graft.applied(strict=True):
        return AutoModelForCausalLM.from_pretrained(path).eval()


def _logits(model: torch.nn.Module, model_type: str) -> torch.Tensor:
    with torch.no_grad():
        return model(**family(model_type).inputs(model.config)).logits


def _same(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert torch.isfinite(got).all() and torch.isfinite(expected).all()
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def _randomize_lora(model: torch.nn.Module, seed: int = 1) -> None:
    """Non-zero LoRA weights (``lora_B`` starts at zero, which would hide a dropped adapter)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)


def _lora(targets: list[str] | str) -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights=False)


def _adapter_keys(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "adapter_model.safetensors")


@pytest.mark.parametrize("model_type", FUSED_FAMILIES)
@pytest.mark.parametrize("graft_name", list(FUSED))
def test_adapter_saved_from_the_plain_model_loads_on_the_grafted_one_with_equal_outputs(
    graft_name: str, model_type: str, checkpoint, tmp_path: Path
) -> None:
    make_graft, targets = FUSED[graft_name]
    path = checkpoint(model_type)
    plain = get_peft_model(_load(path), _lora(targets))
    _randomize_lora(plain)
    plain.save_pretrained(tmp_path)
    expected = _logits(plain, model_type)
    assert not torch.allclose(expected, _logits(_load(path), model_type), atol=1e-3), (
        "the adapter changes nothing"
    )

    grafted = PeftModel.from_pretrained(_load(path, make_graft(model_type)), tmp_path).eval()
    assert any("qkv_proj" in n or "gate_up_proj" in n for n, _ in grafted.named_parameters())
    _same(_logits(grafted, model_type), expected)
    # and a config written for the plain model, with the plain model's adapter weights
    fresh = get_peft_model(_load(path, make_graft(model_type)), _lora(targets))
    state = {n: p for n, p in plain.named_parameters() if "lora_" in n}
    assert sorted(n for n, _ in fresh.named_parameters() if "lora_" in n) == sorted(state)
    with torch.no_grad():
        for name, param in fresh.named_parameters():
            if "lora_" in name:
                param.copy_(state[name])
    _same(_logits(fresh, model_type), expected)


@pytest.mark.parametrize("model_type", FUSED_FAMILIES)
@pytest.mark.parametrize("graft_name", list(FUSED))
def test_adapter_trained_on_the_grafted_model_saves_plain_names_and_loads_on_the_plain_model(
    graft_name: str, model_type: str, checkpoint, tmp_path: Path
) -> None:
    make_graft, targets = FUSED[graft_name]
    path = checkpoint(model_type)
    grafted = get_peft_model(_load(path, make_graft(model_type)), _lora(targets))
    _train_step(grafted, model_type)
    grafted.eval()
    grafted.save_pretrained(tmp_path / "grafted")
    get_peft_model(_load(path), _lora(targets)).save_pretrained(tmp_path / "plain")
    saved = _adapter_keys(tmp_path / "grafted")
    assert sorted(saved) == sorted(_adapter_keys(tmp_path / "plain"))
    assert not any("qkv_proj" in k or "gate_up_proj" in k for k in saved)

    plain = PeftModel.from_pretrained(_load(path), tmp_path / "grafted").eval()
    _same(_logits(plain, model_type), _logits(grafted, model_type))


def _train_step(model: torch.nn.Module, model_type: str) -> None:
    """One SGD step on the LoRA weights (``init_lora_weights=False`` makes them non-zero already)."""
    model.train()
    inputs = family(model_type).inputs(model.config)
    loss = model(**inputs, labels=inputs["input_ids"]).loss
    loss.backward()
    trained = [p for p in model.parameters() if p.requires_grad]
    assert trained and all(p.grad is not None and torch.isfinite(p.grad).all() for p in trained)
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    with torch.no_grad():
        for p in trained:
            p -= 0.1 * p.grad


@pytest.mark.parametrize("model_type", FUSED_FAMILIES)
def test_all_linear_targets_the_plain_models_layers(model_type: str, checkpoint, tmp_path: Path) -> None:
    path = checkpoint(model_type)
    graft = fused_qkv(model_type) + fused_gate_up(model_type)
    grafted = get_peft_model(_load(path, graft), _lora("all-linear"))
    plain = get_peft_model(_load(path), _lora("all-linear"))
    assert sorted(grafted.peft_config["default"].target_modules) == sorted(
        plain.peft_config["default"].target_modules
    )
    lora = sorted(n for n, _ in grafted.named_parameters() if "lora_" in n)
    assert lora == sorted(n for n, _ in plain.named_parameters() if "lora_" in n)
    grafted.save_pretrained(tmp_path)
    reloaded = PeftModel.from_pretrained(_load(path), tmp_path).eval()
    _same(_logits(reloaded, model_type), _logits(grafted.eval(), model_type))


@pytest.mark.parametrize("model_type", FUSED_FAMILIES)
def test_merge_and_unload_writes_into_the_fused_layer_and_saves_the_plain_merged_checkpoint(
    model_type: str, checkpoint, tmp_path: Path
) -> None:
    path = checkpoint(model_type)
    graft = fused_qkv(model_type) + fused_gate_up(model_type)
    targets = FUSED["both"][1]
    plain = get_peft_model(_load(path), _lora(targets))
    _randomize_lora(plain)
    plain.save_pretrained(tmp_path / "adapter")
    grafted = PeftModel.from_pretrained(_load(path, graft), tmp_path / "adapter").eval()
    expected = _logits(plain, model_type)

    merged = grafted.merge_and_unload()
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    assert any(n.endswith("qkv_proj.weight") for n, _ in merged.named_parameters())
    _same(_logits(merged, model_type), expected)
    plain_merged = plain.merge_and_unload()
    merged.save_pretrained(tmp_path / "grafted")
    plain_merged.save_pretrained(tmp_path / "plain")
    saved, reference = (
        load_file(tmp_path / "grafted/model.safetensors"),
        load_file(tmp_path / "plain/model.safetensors"),
    )
    assert sorted(saved) == sorted(reference)
    for key, tensor in reference.items():
        torch.testing.assert_close(saved[key], tensor, atol=1e-6, rtol=0, msg=key)
    _same(_logits(_load(tmp_path / "grafted"), model_type), expected)


def test_an_adapter_on_the_fused_layer_itself_is_refused(checkpoint) -> None:
    path = checkpoint("llama")
    model = get_peft_model(_load(path, fused_qkv("llama")), _lora(["qkv_proj"]))
    with pytest.raises(
        FusionError, match=r"`FusedQKVLlamaAttention.qkv_proj` is wrapped by the PEFT module .*q_proj"
    ):
        _logits(model, "llama")


def test_modules_to_save_on_a_fused_part_is_refused(checkpoint) -> None:
    path = checkpoint("llama")
    config = LoraConfig(r=4, target_modules=["o_proj"], modules_to_save=["q_proj"])
    with pytest.raises(
        FusionError, match=r"`FusedQKVLlamaAttention.q_proj` is a slice of the fused `qkv_proj`"
    ):
        get_peft_model(_load(path, fused_qkv("llama")), config)


def _expert_params() -> list[object]:
    """The standard layout (fused on 5.x only), and declared layouts fused on both lines where
    transformers has them: GPT-OSS (transposed, interleaved, biased, clamped gate; fused
    checkpoint), Llama 4 (dense call), MiniMax-M3 (its own ``_apply_gate``)."""
    params: list[object] = [pytest.param(t, marks=requires_fused_experts) for t in ("qwen3_moe", "mixtral")]
    for model_type in ("gpt_oss", "llama4_text", "minimax_m3_vl_text"):
        why = f"`linear_experts` does not cover `{model_type}` on transformers {TRANSFORMERS_VERSION}"
        skip = pytest.mark.skipif(model_type not in LINEAR_EXPERTS_FAMILIES, reason=why)
        params.append(pytest.param(model_type, marks=skip))
    return params


@pytest.mark.parametrize("model_type", _expert_params())
def test_lora_on_linear_experts_wraps_each_expert_merges_and_saves(
    model_type: str, checkpoint, tmp_path: Path
) -> None:
    path = checkpoint(model_type)
    graft = linear_experts(model_type)
    names = next(iter(graft.mapping.values()))._expert_names
    base = _load(path, graft)
    before = _logits(base, model_type)
    model = get_peft_model(base, _lora(list(names)))
    wrapped = {
        n.rsplit(".", 1)[-1]
        for n, m in model.named_modules()
        if n.endswith(tuple(f".experts.0.{x}" for x in names))
    }
    assert wrapped == set(names)
    assert all(
        type(m).__module__.startswith("peft.")
        for n, m in model.named_modules()
        if n.endswith(tuple(f".experts.0.{x}" for x in names))
    )
    _randomize_lora(model)
    adapted = _logits(model, model_type)
    assert torch.isfinite(adapted).all() and not torch.allclose(adapted, before, atol=1e-3)
    model.save_pretrained(tmp_path / "adapter")
    # written in the plain model's layout: PEFT's LoRA of the fused 3D experts
    assert not any(".experts.0." in k for k in _adapter_keys(tmp_path / "adapter"))
    assert any(k.endswith("experts.lora_A.weight") for k in _adapter_keys(tmp_path / "adapter"))
    reloaded = PeftModel.from_pretrained(_load(path, graft), tmp_path / "adapter").eval()
    _same(_logits(reloaded, model_type), adapted)

    merged = model.merge_and_unload()
    _same(_logits(merged, model_type), adapted)
    merged.save_pretrained(tmp_path / "merged")
    _same(_logits(_load(tmp_path / "merged"), model_type), adapted)


@requires_fused_experts
def test_an_adapter_of_the_plain_fused_experts_loads_on_linear_experts(checkpoint, tmp_path: Path) -> None:
    path = checkpoint("qwen3_moe")
    config = _lora(["gate_proj", "up_proj", "down_proj"])
    plain = get_peft_model(_load(path), config)  # PEFT targets the 3D parameters here
    _randomize_lora(plain)
    expected = _logits(plain, "qwen3_moe")
    plain.save_pretrained(tmp_path)
    grafted = PeftModel.from_pretrained(_load(path, linear_experts("qwen3_moe")), tmp_path).eval()
    assert any(n.endswith("experts.0.gate_proj.lora_A.default.weight") for n, _ in grafted.named_parameters())
    _same(_logits(grafted, "qwen3_moe"), expected)


# ---- issue 19, point 2: an expert adapter of a grafted model, loaded on the plain model -------------
def test_an_expert_adapter_of_linear_experts_loads_on_the_plain_model_with_equal_outputs(
    checkpoint, tmp_path: Path
) -> None:
    """On 5.x the plain model holds fused 3D experts, where PEFT dropped 48 of the 60 tensors of the
    per-expert adapter quietly: the save now writes them in PEFT's fused layout. The shared expert
    (same layer names) keeps its own LoRA on both."""
    path = checkpoint("qwen2_moe")
    graft = linear_experts("qwen2_moe")
    model = get_peft_model(_load(path, graft), _lora(["gate_proj", "up_proj", "down_proj"]))
    _randomize_lora(model)
    adapted = _logits(model, "qwen2_moe")
    model.save_pretrained(tmp_path)
    assert any(".shared_expert.gate_proj.lora_A" in k for k in _adapter_keys(tmp_path))
    plain = _load(path)
    assert not torch.allclose(_logits(plain, "qwen2_moe"), adapted, atol=1e-3)
    _same(_logits(PeftModel.from_pretrained(plain, tmp_path).eval(), "qwen2_moe"), adapted)
    # The grafted model takes it back; merged there, the checkpoint loads on the plain model.
    reloaded = PeftModel.from_pretrained(_load(path, graft), tmp_path).eval()
    _same(_logits(reloaded, "qwen2_moe"), adapted)
    reloaded.merge_and_unload().save_pretrained(tmp_path / "merged")
    _same(_logits(_load(tmp_path / "merged"), "qwen2_moe"), adapted)


@requires_fused_experts
def test_a_per_expert_adapter_written_before_on_the_plain_model_is_refused_leaving_it_as_it_was(
    checkpoint, tmp_path: Path
) -> None:
    """An adapter in the per-expert layout (as modelgraft wrote them before, or transformers 4.57's
    per-expert Qwen2-MoE) on the plain 5.x model, which PEFT does not convert for this family."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    path = checkpoint("qwen2_moe")
    model = get_peft_model(
        _load(path, linear_experts("qwen2_moe")), _lora(["gate_proj", "up_proj", "down_proj"])
    )
    _randomize_lora(model)
    tmp_path.mkdir(exist_ok=True)
    save_file(
        get_peft_model_state_dict(model),
        str(tmp_path / "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    model.peft_config["default"].save_pretrained(str(tmp_path))
    plain = _load(path)
    before = _logits(plain, "qwen2_moe")
    with pytest.raises(
        ExpertsAdapterError, match=r"per-expert layers \(\d+ of its 60 tensors.*Load it on the grafted model"
    ):
        PeftModel.from_pretrained(plain, tmp_path)
    assert not [n for n, _ in plain.named_modules() if "lora_" in n]  # nothing half-applied
    _same(_logits(plain, "qwen2_moe"), before)
