"""``modelgraft.original_state_dict``: the weights of a grafted model, streamed in the original
checkpoint layout and names, equal the plain model's bit for bit, one group alive at a time
(issue 11, point 9).

For each (graft, family) of the ready-made graft table, grafted at load time and in place
(``graft_model``): every yielded tensor equals what ``save_pretrained`` of the plain model wrote
under that name (same dtype, shape, ``torch.equal``), every saved key is yielded once, and where
transformers does not convert the family itself the stream is the plain ``state_dict()``, in its
order. Streaming is checked structurally (weak references to converted tensors), never by time
or absolute memory.
"""

from __future__ import annotations

import copy
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from weight_sync_helpers import assert_matches_plain

from _versions import requires_fused_experts_unless_fused_on_both_lines
from families import auto_class, family
from modelgraft import (
    ConversionError,
    ConversionOperation,
    IrreversibleConversionError,
    WeightConverter,
    graft_model,
    original_state_dict,
    patched,
)
from modelgraft.grafts import (
    FUSED_GATE_UP_FAMILIES,
    FUSED_QKV_FAMILIES,
    LINEAR_EXPERTS_FAMILIES,
    Graft,
    fused_gate_up,
    fused_qkv,
    linear_experts,
)

CASES = [
    *[pytest.param(fused_qkv, t, id=f"fused_qkv-{t}") for t in FUSED_QKV_FAMILIES],
    *[pytest.param(fused_gate_up, t, id=f"fused_gate_up-{t}") for t in FUSED_GATE_UP_FAMILIES],
    *[
        pytest.param(
            linear_experts,
            t,
            id=f"linear_experts-{t}",
            marks=requires_fused_experts_unless_fused_on_both_lines(t),
        )
        for t in LINEAR_EXPERTS_FAMILIES
    ],
]


def _grafted(how: str, graft: Graft, path: Path, plain: torch.nn.Module) -> torch.nn.Module:
    if how == "load":
        with graft.applied(strict=True):
            return auto_class(plain.config).from_pretrained(path).eval()
    model = copy.deepcopy(plain)
    graft_model(model, graft)
    assert any(isinstance(m, tuple(graft.mapping.values())) for m in model.modules())
    return model


@pytest.mark.parametrize("how", ["load", "in_place"])
@pytest.mark.parametrize(("make_graft", "model_type"), CASES)
def test_original_state_dict_is_the_plain_checkpoint_bit_for_bit(
    make_graft, model_type: str, how: str, plain_checkpoint
) -> None:
    path, plain = plain_checkpoint(model_type)
    grafted = _grafted(how, make_graft(model_type), path, plain)
    assert list(grafted.state_dict()) != list(plain.state_dict())  # the layouts differ to begin with
    assert_matches_plain(list(original_state_dict(grafted)), path, plain, grafted)


@pytest.mark.parametrize("how", ["load", "in_place"])
@pytest.mark.parametrize(("make_graft", "model_type"), CASES)
def test_names_and_tensors_are_what_save_pretrained_of_the_grafted_model_writes(
    make_graft, model_type: str, how: str, plain_checkpoint, tmp_path: Path
) -> None:
    path, plain = plain_checkpoint(model_type)
    grafted = _grafted(how, make_graft(model_type), path, plain)
    grafted.save_pretrained(tmp_path)
    written = load_file(tmp_path / "model.safetensors")
    original = load_file(path / "model.safetensors")
    assert sorted(written) == sorted(original), (
        sorted(set(written) - set(original))[:3],
        sorted(set(original) - set(written))[:3],
    )
    stream = dict(original_state_dict(grafted))
    tied = set(stream) - set(written)
    state = plain.state_dict()
    assert all(name in state for name in tied), sorted(tied)[:3]  # only tied weights are extra
    for name, tensor in written.items():
        assert torch.equal(stream[name], tensor), name


@pytest.mark.parametrize("model_type", ["llama", "qwen2_moe"])
def test_plain_model_streams_its_checkpoint(model_type: str, plain_checkpoint) -> None:
    path, plain = plain_checkpoint(model_type)
    assert_matches_plain(list(original_state_dict(plain)), path, plain)


def test_untouched_weights_are_the_parameters_themselves(plain_checkpoint) -> None:
    path, plain = plain_checkpoint("llama")
    grafted = _grafted("load", fused_qkv("llama"), path, plain)
    params = dict(grafted.named_parameters())
    shared = [n for n, t in original_state_dict(grafted) if n in params]
    assert "model.embed_tokens.weight" in shared and "model.layers.0.mlp.down_proj.weight" in shared
    for name, tensor in original_state_dict(grafted):
        if name in params:
            assert tensor.data_ptr() == params[name].data_ptr(), f"`{name}` was copied"


def _max_alive_converted(model: torch.nn.Module) -> tuple[int, int]:
    """Iterate like a consumer that keeps nothing; the most converted tensors alive at one step,
    and how many converted tensors were yielded in all."""

    def ident(t: torch.Tensor) -> tuple:
        return (t.data_ptr(), tuple(t.shape), t.stride())

    own = {ident(p) for p in model.state_dict().values()}
    refs: list[weakref.ref] = []
    most = 0
    for _name, tensor in original_state_dict(model):
        if ident(tensor) not in own:
            refs.append(weakref.ref(tensor))
        del tensor
        most = max(most, sum(r() is not None for r in refs))
    return most, len(refs)


def test_fused_groups_are_released_one_at_a_time(plain_checkpoint) -> None:
    path, _ = plain_checkpoint("llama")
    with fused_gate_up("llama").applied(strict=True):
        grafted = AutoModelForCausalLM.from_pretrained(path)
    graft_model(grafted, fused_qkv("llama"))
    most, total = _max_alive_converted(grafted)
    layers = grafted.config.num_hidden_layers
    assert total == layers * 5  # q, k, v, gate, up per layer
    assert most <= 3, f"{most} converted tensors alive at once; one group (q, k, v) is at most 3"


class _NoReverse(ConversionOperation):
    def convert(self, tensors, context):
        return tensors


def test_copies_made_by_a_reverse_are_released_group_by_group(plain_checkpoint) -> None:
    path, plain = plain_checkpoint("llama")
    with fused_qkv("llama").applied(strict=True):
        grafted = AutoModelForCausalLM.from_pretrained(path)
    # an in-place graft on top: its undo builds new tensors, which must not pile up either
    graft_model(grafted, fused_gate_up("llama"))
    most, total = _max_alive_converted(grafted)
    assert total == grafted.config.num_hidden_layers * 5
    assert most <= 3
    assert_matches_plain(list(original_state_dict(grafted)), path, plain, grafted)


def test_an_operation_without_reverse_is_refused_before_anything_is_yielded(tmp_path: Path) -> None:
    torch.manual_seed(0)
    family("llama").causal_lm().save_pretrained(tmp_path)
    conv = WeightConverter(["mlp.down_proj"], ["mlp.down_proj"], [_NoReverse()])
    with patched({}, conversions={"llama": [conv]}):
        model = AutoModelForCausalLM.from_pretrained(tmp_path)
        with pytest.raises(
            IrreversibleConversionError, match=r"`_NoReverse` has no `reverse`.*original_state_dict"
        ):
            original_state_dict(model)


class _RenamedMLP(torch.nn.Module):
    """A replacement that names its weights differently and registers no conversion."""

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__()
        self.w_in = torch.nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w_out = torch.nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_out(torch.nn.functional.silu(self.w_in(x)))


def test_a_replacement_without_a_way_back_is_refused_before_anything_is_yielded(plain_checkpoint) -> None:
    path, _ = plain_checkpoint("llama")
    with patched({"LlamaMLP": _RenamedMLP}):
        model = AutoModelForCausalLM.from_pretrained(path)
    with pytest.raises(
        ConversionError,
        match=r"cannot give the original layout of `LlamaForCausalLM`: 4 weight\(s\) such as "
        r"`model.layers.0.mlp.w_in.weight` are not in the original checkpoint.*"
        r"`model.layers.0.mlp.down_proj.weight`.*Register a `WeightConverter`",
    ):
        original_state_dict(model)


def test_not_a_module_is_refused() -> None:
    with pytest.raises(ConversionError, match=r"expects a `torch.nn.Module`, received `dict`"):
        original_state_dict({"weight": torch.zeros(1)})


def test_a_vllm_style_load_weights_consumer_rebuilds_the_plain_model(plain_checkpoint) -> None:
    """vLLM's ``load_weights(weights)`` looks each name up in its own (original-layout) parameters
    and copies the tensor in, one item at a time; a plain model with stale weights stands in for
    the engine."""
    path, plain = plain_checkpoint("llama")
    with fused_qkv("llama").applied(strict=True):
        grafted = AutoModelForCausalLM.from_pretrained(path)
    graft_model(grafted, fused_gate_up("llama"))
    engine = copy.deepcopy(plain)
    with torch.no_grad():
        for p in engine.parameters():
            p.add_(1.0)  # stale weights, to be overwritten by the sync
    params = dict(engine.named_parameters())

    def load_weights(weights) -> set[str]:
        loaded = set()
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor)  # vLLM's default_weight_loader
                loaded.add(name)
        return loaded

    assert load_weights(original_state_dict(grafted)) == set(plain.state_dict())
    for name, tensor in plain.state_dict().items():
        assert torch.equal(engine.state_dict()[name], tensor), name
