"""Saving a model grafted in place (``graft_model``): the original layout, exactly, whatever is
registered at save time; the grafted layout on request.

Each case starts from a plain model (loaded by plain transformers from a tiny checkpoint, or built
with ``from_config``), grafts it in place, saves it, and loads the result with plain transformers
(inside ``unpatched()``): every tensor must equal the original model's, bit for bit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conversion_helpers import QKV, FusedQKVLlamaAttention
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaMLP

import modelgraft
from _versions import requires_fused_experts
from families import Family, family
from modelgraft import (
    Concatenate,
    Transpose,
    WeightConverter,
    WeightRenaming,
    graft_model,
    patched,
    report,
    unpatched,
)
from modelgraft.grafts import (
    Graft,
    fused_gate_up,
    fused_qkv,
    linear_experts,
)


class _TransposedGateUpMLP(LlamaMLP):
    """A user replacement: gate and up fused and stored transposed, down renamed."""

    def __init__(self, config: object) -> None:
        super().__init__(config)
        hidden, inter = self.gate_proj.in_features, self.gate_proj.out_features
        del self.gate_proj, self.up_proj, self.down_proj
        self.w_in_t = nn.Parameter(torch.empty(hidden, 2 * inter))
        self.w_out = nn.Linear(inter, hidden, bias=False)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ self.w_in_t).chunk(2, dim=-1)
        return self.w_out(self.act(gate) * up)


def _user_graft(model_type: str) -> SimpleNamespace:
    """A user mapping with conversions, passed the way a ready-made graft is (mapping, conversions)."""
    assert model_type == "llama"
    fuse = WeightConverter(
        ["mlp.gate_proj.weight", "mlp.up_proj.weight"], "mlp.w_in_t", [Concatenate(dim=0), Transpose(0, 1)]
    )
    return SimpleNamespace(
        mapping={"LlamaMLP": _TransposedGateUpMLP},
        conversions={"llama": [fuse, WeightRenaming("mlp.down_proj", "mlp.w_out")]},
    )


# (graft factory, family, a different graft to register globally at save time)
CASES = [
    pytest.param(fused_qkv, "llama", fused_gate_up, id="fused_qkv-llama"),
    pytest.param(fused_qkv, "qwen2", fused_gate_up, id="fused_qkv-qwen2"),
    pytest.param(fused_qkv, "qwen2_moe", fused_gate_up, id="fused_qkv-qwen2_moe"),
    pytest.param(fused_qkv, "mixtral", linear_experts, id="fused_qkv-mixtral"),
    pytest.param(fused_gate_up, "llama", fused_qkv, id="fused_gate_up-llama"),
    pytest.param(fused_gate_up, "qwen2_moe", fused_qkv, id="fused_gate_up-qwen2_moe"),
    pytest.param(
        linear_experts, "qwen2_moe", fused_qkv, id="linear_experts-qwen2_moe", marks=requires_fused_experts
    ),
    pytest.param(
        linear_experts, "mixtral", fused_qkv, id="linear_experts-mixtral", marks=requires_fused_experts
    ),
    pytest.param(
        linear_experts, "phimoe", fused_qkv, id="linear_experts-phimoe", marks=requires_fused_experts
    ),
    pytest.param(_user_graft, "llama", fused_qkv, id="user_mapping-llama"),
]


def _family(model_type: str) -> Family:
    """The family's table entry; skipped, with the table's reason, where it cannot run here."""
    fam = family(model_type)
    if fam.skip:
        pytest.skip(fam.skip)
    return fam


def _assert_bit_identical(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(expected)
    for key, tensor in expected.items():
        assert got[key].dtype == tensor.dtype and got[key].shape == tensor.shape, key
        assert not torch.isnan(got[key]).any(), key
        assert torch.equal(got[key], tensor), key


def _plain_load(path: Path) -> nn.Module:
    with unpatched():
        model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model


@pytest.fixture
def plain_model(tmp_path: Path) -> Callable[[Family, str], nn.Module]:
    """``make(family, origin)``: a plain model, loaded by plain transformers or built from its config."""

    def make(fam: Family, origin: str) -> nn.Module:
        torch.manual_seed(0)
        with unpatched():
            model = fam.causal_lm().eval()
            if origin == "from_config":
                return model
            model.save_pretrained(tmp_path / "plain")
            return AutoModelForCausalLM.from_pretrained(tmp_path / "plain").eval()

    return make


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("origin", ["from_pretrained", "from_config"])
@pytest.mark.parametrize(("make_graft", "model_type", "other"), CASES)
def test_a_model_grafted_in_place_saves_the_original_layout_exactly(
    make_graft, model_type, other, origin, plain_model, tmp_path
) -> None:
    fam = _family(model_type)
    model = plain_model(fam, origin)
    original = _state(model)
    graft = make_graft(model_type)

    graft_model(model, graft)

    assert report(model).replaced, "nothing was grafted"
    model.save_pretrained(tmp_path / "out")
    _assert_bit_identical(_state(_plain_load(tmp_path / "out")), original)


@contextlib.contextmanager
def _other_graft_registered(other: Callable[[str], Graft], model_type: str) -> Iterator[None]:
    graft = other(model_type)
    graft.register(overwrite=True)
    try:
        yield
    finally:
        graft.unregister()


@contextlib.contextmanager
def _in_unpatched(other: Callable[[str], Graft], model_type: str) -> Iterator[None]:
    with _other_graft_registered(other, model_type), unpatched():
        yield


@pytest.mark.parametrize("at_save", ["other_graft_registered", "inside_unpatched"])
@pytest.mark.parametrize(("make_graft", "model_type", "other"), CASES)
def test_what_is_registered_at_save_time_does_not_matter(
    make_graft, model_type, other, at_save, plain_model, tmp_path
) -> None:
    fam = _family(model_type)
    model = plain_model(fam, "from_pretrained")
    original = _state(model)
    graft_model(model, make_graft(model_type))
    scope = _other_graft_registered if at_save == "other_graft_registered" else _in_unpatched
    with scope(other, model_type):
        model.save_pretrained(tmp_path / "out")
    _assert_bit_identical(_state(_plain_load(tmp_path / "out")), original)


@pytest.mark.parametrize(("make_graft", "model_type", "other"), CASES)
def test_registered_at_graft_time_and_cleared_before_save(
    make_graft, model_type, other, plain_model, tmp_path
):
    fam = _family(model_type)
    model = plain_model(fam, "from_pretrained")
    original = _state(model)
    graft = make_graft(model_type)
    modelgraft.register_patch_mapping(graft.mapping)
    for key, converters in graft.conversions.items():
        modelgraft.register_checkpoint_conversion_mapping(key, converters, overwrite=True)
    graft_model(model)  # what is registered
    modelgraft.clear_patch_mapping()
    modelgraft.unregister_checkpoint_conversion_mapping(list(graft.conversions))
    assert report(model).replaced
    model.save_pretrained(tmp_path / "out")
    _assert_bit_identical(_state(_plain_load(tmp_path / "out")), original)


@pytest.mark.parametrize(("make_graft", "model_type", "other"), CASES)
def test_the_grafted_layout_saves_on_request_and_loads_back_without_conversion(
    make_graft, model_type, other, plain_model, tmp_path
) -> None:
    fam = _family(model_type)
    model = plain_model(fam, "from_pretrained")
    graft = make_graft(model_type)
    graft_model(model, graft)
    grafted = _state(model)

    model.save_pretrained(tmp_path / "grafted", save_original_format=False)

    with patched(graft.mapping, conversions=graft.conversions):
        again, info = AutoModelForCausalLM.from_pretrained(tmp_path / "grafted", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert report(again).conversions == []  # nothing needed converting
    _assert_bit_identical(_state(again), grafted)


def test_a_load_time_graft_grafted_again_in_place_saves_the_original_layout(tiny_llama_dir, tmp_path):
    plain = _state(_plain_load(tiny_llama_dir))
    qkv = fused_qkv("llama")
    with qkv.applied():
        model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    graft_model(model, fused_gate_up("llama"))
    names = {k for k in model.state_dict()}
    assert (
        "model.layers.0.self_attn.qkv_proj.weight" in names
        and "model.layers.0.mlp.gate_up_proj.weight" in names
    )

    model.save_pretrained(tmp_path / "out")
    _assert_bit_identical(_state(_plain_load(tmp_path / "out")), plain)


class _TransposedLinear(nn.Module):
    """A linear layer that stores its weight transposed, as ``weight_t``."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(linear.weight.detach().T.clone())
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x @ self.weight_t
        return out + self.bias if self.bias is not None else out


class _TransposedQKVLlamaAttention(FusedQKVLlamaAttention):
    """Grafted over an already fused attention: ``qkv_proj`` keeps its weight transposed."""

    def __init__(self, config: object, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.qkv_proj = _TransposedLinear(self.qkv_proj)


def test_two_grafts_in_place_one_over_the_other_save_the_original_layout(tiny_llama_dir, tmp_path):
    """The second graft converts what the first one produced: the save undoes both, newest first."""
    model = _plain_load(tiny_llama_dir).eval()
    original = _state(model)
    ids = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        before = model(ids).logits
    graft_model(model, {"LlamaAttention": FusedQKVLlamaAttention}, conversions={"llama": [QKV]})
    graft_model(
        model,
        {"FusedQKVLlamaAttention": _TransposedQKVLlamaAttention},
        conversions={
            "llama": [
                WeightConverter("self_attn.qkv_proj.weight", "self_attn.qkv_proj.weight_t", [Transpose(0, 1)])
            ]
        },
    )
    assert "model.layers.0.self_attn.qkv_proj.weight_t" in model.state_dict()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, atol=1e-5, rtol=0)
    model.save_pretrained(tmp_path / "out")
    _assert_bit_identical(_state(_plain_load(tmp_path / "out")), original)


def test_a_vision_language_model_grafted_in_place_saves_the_original_layout(tmp_path):
    """Llava: the graft's conversions are per sub-model (llama, clip_vision_model); Llava's own
    transforms (its legacy checkpoint layout) still apply around them on save."""
    llava = _family("llava")
    torch.manual_seed(0)
    with unpatched():
        AutoModelForImageTextToText.from_config(llava.config()).save_pretrained(tmp_path / "plain")
        model = AutoModelForImageTextToText.from_pretrained(tmp_path / "plain").eval()
    original = _state(model)
    graft_model(model, fused_qkv("llava") + fused_gate_up("llava"))
    assert any(".vision_tower." in r.path for r in report(model).replaced)
    assert any(".language_model." in r.path for r in report(model).replaced)

    model.save_pretrained(tmp_path / "out")

    with unpatched():
        again, info = AutoModelForImageTextToText.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    _assert_bit_identical(_state(again), original)
