"""Ready-made grafts on every family they claim: equal logits, and an exact save round trip.

For each (graft, family): a tiny checkpoint saved by plain transformers is loaded with
``from_pretrained`` inside ``graft.applied()``; the grafted model's logits equal the plain model's
(fp32, atol 1e-5), its parameters are in the grafted layout, and ``save_pretrained`` followed by a
plain transformers load gives the original checkpoint bit for bit.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText

from _versions import requires_fused_experts, requires_fused_experts_unless_fused_on_both_lines
from families import family
from modelgraft import graft_model, report
from modelgraft.grafts import (
    FUSED_GATE_UP_FAMILIES,
    FUSED_QKV_FAMILIES,
    LINEAR_EXPERTS_FAMILIES,
    Graft,
    fused_gate_up,
    fused_qkv,
    linear_experts,
)

ATOL = 1e-5

# What each graft must leave in the state dict (grafted layout) and must remove from it.
LAYOUT = {
    "fused_qkv": ("self_attn.qkv_proj.weight", "self_attn.q_proj.weight"),
    "fused_gate_up": (".gate_up_proj.weight", "mlp.gate_proj.weight"),
    "linear_experts": ("experts.0.", ".experts.gate_up_proj"),  # not `shared_experts.gate_up_proj`
}
#: Families whose grafted layers sit elsewhere: DBRX's per-expert layers replace the 2D stacks of
#: its experts' child `mlp`, named as those stacks.
LAYOUT_BY_TYPE = {("linear_experts", "dbrx"): ("experts.mlp.0.w1.weight", "experts.mlp.w1")}

CASES = [
    *[pytest.param(fused_qkv, t, id=f"fused_qkv-{t}") for t in FUSED_QKV_FAMILIES],
    *[pytest.param(fused_gate_up, t, id=f"fused_gate_up-{t}") for t in FUSED_GATE_UP_FAMILIES],
    *[
        # GPT-OSS, Llama 4 and DBRX keep fused experts on 4.57 too; the others are per expert there.
        pytest.param(
            linear_experts,
            t,
            id=f"linear_experts-{t}",
            marks=requires_fused_experts_unless_fused_on_both_lines(t),
        )
        for t in LINEAR_EXPERTS_FAMILIES
    ],
]


def _logits(model: torch.nn.Module, model_type: str) -> torch.Tensor:
    """Logits, or the last hidden state of a text tower that has no LM head of its own."""
    fam = family(model_type)
    with torch.no_grad():
        out = model(**fam.inputs(model.config))
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def _auto(path: Path) -> type:
    """The auto class that loads ``path``: causal LM where transformers has one for it."""
    config = AutoConfig.from_pretrained(path)
    try:
        AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        return AutoModel
    return AutoModelForCausalLM


def _load_grafted(graft: Graft, path: Path) -> torch.nn.Module:
    with graft.applied(strict=True):
        return _auto(path).from_pretrained(path).eval()


def _check_layout(name: str, model: torch.nn.Module, model_type: str) -> None:
    present, absent = LAYOUT_BY_TYPE.get((name, model_type), LAYOUT[name])
    keys = list(model.state_dict())
    assert any(present in k for k in keys), f"no `{present}` parameter in the grafted model"
    assert not any(absent in k for k in keys), f"`{absent}` still in the grafted model"


@pytest.mark.parametrize(("make_graft", "model_type"), CASES)
def test_loaded_graft_matches_plain_logits_and_saves_the_original_checkpoint_bit_for_bit(
    make_graft, model_type: str, plain_checkpoint, tmp_path: Path
) -> None:
    path, plain = plain_checkpoint(model_type)
    graft = make_graft(model_type)
    grafted = _load_grafted(graft, path)
    replacements = tuple(graft.mapping.values())
    assert any(isinstance(m, replacements) for m in grafted.modules())
    _check_layout(make_graft.__name__, grafted, model_type)
    torch.testing.assert_close(_logits(grafted, model_type), _logits(plain, model_type), atol=ATOL, rtol=0)

    grafted.save_pretrained(tmp_path)
    original = load_file(path / "model.safetensors")
    saved = load_file(tmp_path / "model.safetensors")
    assert sorted(saved) == sorted(original)
    for key, tensor in original.items():
        assert torch.equal(saved[key], tensor), key
    # and plain transformers loads it back, parameter for parameter
    reloaded = _auto(tmp_path).from_pretrained(tmp_path)
    expected = plain.state_dict()
    assert sorted(reloaded.state_dict()) == sorted(expected)
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


@pytest.mark.parametrize(("make_graft", "model_type"), CASES)
def test_grafting_a_built_model_in_place_keeps_its_logits(
    make_graft, model_type: str, plain_checkpoint
) -> None:
    _, plain = plain_checkpoint(model_type)
    grafted = graft_model(copy.deepcopy(plain), make_graft(model_type))
    assert len(report(grafted).replaced) >= 1
    _check_layout(make_graft.__name__, grafted, model_type)
    torch.testing.assert_close(_logits(grafted, model_type), _logits(plain, model_type), atol=ATOL, rtol=0)


@requires_fused_experts
@pytest.mark.parametrize(
    "model_type", ["qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3", "phimoe", "glm4_moe"]
)
def test_all_three_grafts_together_on_moe_families(model_type: str, plain_checkpoint, tmp_path: Path) -> None:
    """The seed's complete example, generalised: fused attention, fused MLPs, per-expert experts."""
    path, plain = plain_checkpoint(model_type)
    graft = linear_experts(model_type)
    if model_type in FUSED_QKV_FAMILIES:
        graft = graft + fused_qkv(model_type)
    if model_type in FUSED_GATE_UP_FAMILIES:
        graft = graft + fused_gate_up(model_type)
    grafted = _load_grafted(graft, path)
    assert len(graft.mapping) >= 2
    torch.testing.assert_close(_logits(grafted, model_type), _logits(plain, model_type), atol=ATOL, rtol=0)
    grafted.save_pretrained(tmp_path)
    original = load_file(path / "model.safetensors")
    saved = load_file(tmp_path / "model.safetensors")
    assert sorted(saved) == sorted(original)
    assert all(torch.equal(saved[k], v) for k, v in original.items())


def test_grafts_claim_at_least_ten_families_together() -> None:
    claimed = set(FUSED_QKV_FAMILIES) | set(FUSED_GATE_UP_FAMILIES) | set(LINEAR_EXPERTS_FAMILIES)
    assert len(claimed) >= 10


@pytest.mark.parametrize("model_type", ["llama", "qwen2_moe", "mixtral"])
def test_a_grafted_model_built_from_config_saves_the_original_layout(model_type: str, tmp_path: Path) -> None:
    graft = (
        fused_qkv(model_type) + linear_experts(model_type) if model_type != "llama" else fused_qkv("llama")
    )
    if model_type in FUSED_GATE_UP_FAMILIES:
        graft = graft + fused_gate_up(model_type)
    config = family(model_type).config()
    with graft.applied():
        grafted = AutoModelForCausalLM.from_config(config).eval()
    assert any(isinstance(m, tuple(graft.mapping.values())) for m in grafted.modules())
    grafted.save_pretrained(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert sorted(plain.state_dict()) == sorted(AutoModelForCausalLM.from_config(config).state_dict())
    torch.testing.assert_close(_logits(plain, model_type), _logits(grafted, model_type), atol=ATOL, rtol=0)


#: Composite models: each graft applies inside every sub-model that has the layers it fuses.
COMPOSITE_CASES = [
    pytest.param(lambda t: fused_qkv(t), {"language_model", "vision_tower"}, id="fused_qkv"),
    pytest.param(lambda t: fused_gate_up(t), {"language_model"}, id="fused_gate_up"),
    pytest.param(lambda t: fused_qkv(t) + fused_gate_up(t), {"language_model", "vision_tower"}, id="both"),
]


@pytest.mark.parametrize(("make_graft", "grafted_parts"), COMPOSITE_CASES)
def test_grafts_on_a_vision_language_model_per_sub_model(make_graft, grafted_parts, tmp_path: Path) -> None:
    """Llava: the text model (llama) and the vision tower (CLIP) get conversion entries of their
    own model types, so Llava's own (legacy-layout) conversions keep applying around them."""
    llava = family("llava")
    torch.manual_seed(0)
    plain = AutoModelForImageTextToText.from_config(llava.config()).eval()
    plain.save_pretrained(tmp_path / "ckpt")
    graft = make_graft("llava")
    assert "llava" not in graft.conversions
    with graft.applied(strict=True):
        grafted = AutoModelForImageTextToText.from_pretrained(tmp_path / "ckpt").eval()
    replaced = {r.path.split(".")[1] for r in report(grafted).replaced}
    assert replaced == grafted_parts
    inputs = llava.inputs(plain.config)
    with torch.no_grad():
        torch.testing.assert_close(grafted(**inputs).logits, plain(**inputs).logits, atol=ATOL, rtol=0)
    grafted.save_pretrained(tmp_path / "out")
    original = load_file(tmp_path / "ckpt" / "model.safetensors")
    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(saved) == sorted(original)
    assert all(torch.equal(saved[k], v) for k, v in original.items())
