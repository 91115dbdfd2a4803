"""Validation errors of record/replay name the layer and say what was expected (issue 4, point 4)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from modelgraft import RoutingError
from modelgraft.moe import RoutingTrace, moe_layers, record_routing, replay_routing
from moe_families import build_tiny


@pytest.fixture(scope="module")
def model() -> nn.Module:
    model = build_tiny("qwen3_moe")
    with torch.no_grad():
        for layer in moe_layers(model):
            layer.router.weight.normal_(generator=torch.Generator().manual_seed(0))
    return model


@pytest.fixture(scope="module")
def trace(model: nn.Module) -> RoutingTrace:
    with torch.no_grad(), record_routing(model) as trace:
        model(input_ids=torch.ones(2, 4, dtype=torch.long), use_cache=False)
    return trace


def _run(model: nn.Module, seq: int = 4) -> None:
    with torch.no_grad():
        model(input_ids=torch.ones(2, seq, dtype=torch.long), use_cache=False)


def test_wrong_number_of_layers(model: nn.Module, trace: RoutingTrace) -> None:
    with pytest.raises(
        RoutingError, match=r"has 2 MoE layers \(`model.layers.0.mlp.gate`.*routing data has 1"
    ):
        with replay_routing(model, trace.layers[:1]):
            _run(model)


def test_wrong_token_count_names_the_layer(model: nn.Module, trace: RoutingTrace) -> None:
    with pytest.raises(RoutingError, match=r"`model.layers.0.mlp.gate` routed 6 tokens .* has 8 rows"):
        with replay_routing(model, trace):
            _run(model, seq=3)


def test_wrong_top_k(model: nn.Module, trace: RoutingTrace) -> None:
    bad = [t[:, :1] for t in trace]
    with pytest.raises(RoutingError, match=r"`model.layers.0.mlp.gate` has top_k=1 columns .* top_k=2"):
        with replay_routing(model, bad):
            _run(model)


@pytest.mark.parametrize("value", [8, -1])
def test_expert_id_out_of_range(model: nn.Module, trace: RoutingTrace, value: int) -> None:
    bad = [t.clone() for t in trace]
    bad[1][3, 0] = value
    with pytest.raises(
        RoutingError, match=rf"`model.layers.1.mlp.gate` holds expert id {value}, out of range"
    ):
        with replay_routing(model, bad):
            _run(model)


def test_unconsumed_routing_is_an_error(model: nn.Module, trace: RoutingTrace) -> None:
    with pytest.raises(
        RoutingError, match=r"`model.layers.0.mlp.gate`, `model.layers.1.mlp.gate` was never used"
    ):
        with replay_routing(model, trace):
            pass


def test_layer_ids_must_match_the_model(model: nn.Module, trace: RoutingTrace) -> None:
    shifted = RoutingTrace(trace.layers, layer_ids=[1, 2])
    with pytest.raises(
        RoutingError, match=r"entry 0 is for layer `1` but MoE layer `model.layers.0.mlp.gate`"
    ):
        with replay_routing(model, shifted):
            _run(model)


def test_float_or_bare_tensor_routing_is_rejected(model: nn.Module, trace: RoutingTrace) -> None:
    with pytest.raises(RoutingError, match=r"must be a RoutingTrace or a list"):
        with replay_routing(model, trace.layers[0]):
            pass
    with pytest.raises(RoutingError, match=r"`model.layers.0.mlp.gate` must be a 2-D integer tensor"):
        with replay_routing(model, [t.float() for t in trace]):
            pass


def test_hooks_are_removed_after_an_error_and_nesting_is_refused(
    model: nn.Module, trace: RoutingTrace
) -> None:
    with pytest.raises(RoutingError, match="routed 6 tokens"), replay_routing(model, trace):
        _run(model, seq=3)
    assert all("forward" not in layer.scope.__dict__ for layer in moe_layers(model))
    with pytest.raises(
        RoutingError, match=r"`model.layers.0.mlp.gate` is already being recorded or replayed"
    ):
        with record_routing(model), replay_routing(model, trace):
            pass
    assert all("forward" not in layer.scope.__dict__ for layer in moe_layers(model))


def test_model_without_moe_layers() -> None:
    with (
        pytest.raises(RoutingError, match=r"`Linear` has no MoE router module"),
        record_routing(nn.Linear(2, 2)),
    ):
        pass


def test_family_without_topk_selection_is_refused_with_reason() -> None:
    class PhimoeTopKRouter(nn.Linear):
        top_k, num_experts = 2, 4

    class PhimoeExperts(nn.Module):
        pass

    block = nn.Module()
    block.router, block.experts = PhimoeTopKRouter(4, 4), PhimoeExperts()
    with pytest.raises(RoutingError, match=r"`router` \(PhimoeTopKRouter\) cannot be recorded .*sparsemixer"):
        with record_routing(block):
            pass


def test_router_that_never_calls_topk_is_reported() -> None:
    class ArgmaxRouter(nn.Module):
        top_k, num_experts = 1, 4

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.argmax(-1)

    class TinyExperts(nn.Module):
        pass

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate, self.experts = ArgmaxRouter(), TinyExperts()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.gate(x)

    block = Block()
    with pytest.raises(RoutingError, match=r"`gate` \(ArgmaxRouter\) ran without a top-k over its 4 experts"):
        with record_routing(block):
            block(torch.zeros(3, 4))


def test_an_instance_level_forward_is_wrapped_and_put_back(model: nn.Module, trace: RoutingTrace) -> None:
    scope = moe_layers(model)[0].scope
    calls: list[int] = []
    original = scope.forward

    def accelerate_like_forward(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    scope.forward = accelerate_like_forward
    try:
        with replay_routing(model, trace):
            _run(model)
        assert calls == [1]
        assert scope.__dict__["forward"] is accelerate_like_forward
    finally:
        del scope.forward


# ---- issue 10, point 13: ids replay cannot honour, refused before any forward
def test_duplicate_expert_in_one_token_is_refused(model: nn.Module, trace: RoutingTrace) -> None:
    bad = [t.clone() for t in trace]
    bad[1][5] = torch.tensor([3, 3])
    with pytest.raises(
        RoutingError, match=r"`model.layers.1.mlp.gate` sends token 5 to expert 3 twice \(row \[3, 3\]\)"
    ):
        with replay_routing(model, bad):
            _run(model)
    assert all("forward" not in layer.scope.__dict__ for layer in moe_layers(model))


@pytest.fixture(scope="module")
def top1_model() -> nn.Module:
    model = build_tiny("qwen3_moe", num_experts_per_tok=1)
    with torch.no_grad():
        for layer in moe_layers(model):
            layer.router.weight.normal_(generator=torch.Generator().manual_seed(0))
    return model


def test_all_zero_layer_is_refused_unless_allowed(top1_model: nn.Module) -> None:
    with torch.no_grad(), record_routing(top1_model) as trace:
        top1_model(input_ids=torch.arange(1, 9).view(2, 4), use_cache=False)
    zero = [trace[0], torch.zeros_like(trace[1])]
    with pytest.raises(
        RoutingError,
        match=r"every expert id is 0 in MoE layer `model.layers.1.mlp.gate`.*uncaptured.*allow_all_zero=True",
    ):
        with replay_routing(top1_model, zero):
            _run(top1_model)
    with torch.no_grad():
        native = top1_model(input_ids=torch.arange(1, 9).view(2, 4), use_cache=False).logits
        with replay_routing(top1_model, zero, allow_all_zero=True):
            forced = top1_model(input_ids=torch.arange(1, 9).view(2, 4), use_cache=False).logits
    assert torch.isfinite(forced).all()
    assert not torch.equal(forced, native)  # layer 1 really ran expert 0 for every token


def test_all_zero_with_top_k_above_one_is_a_duplicate_even_when_allowed(
    model: nn.Module, trace: RoutingTrace
) -> None:
    zero = [trace[0], torch.zeros_like(trace[1])]
    with pytest.raises(RoutingError, match=r"every expert id is 0 in MoE layer `model.layers.1.mlp.gate`"):
        with replay_routing(model, zero):
            _run(model)
    with pytest.raises(RoutingError, match=r"`model.layers.1.mlp.gate` sends token 0 to expert 0 twice"):
        with replay_routing(model, zero, allow_all_zero=True):
            _run(model)


def test_bool_routing_is_rejected(model: nn.Module, trace: RoutingTrace) -> None:
    with pytest.raises(RoutingError, match=r"`model.layers.0.mlp.gate` must be a 2-D integer tensor"):
        with replay_routing(model, [t.bool() for t in trace]):
            pass
