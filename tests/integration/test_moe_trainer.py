"""Trainer integration of routing replay (issue 11, points 6-8): micro-batches and gradient accumulation
with gradient checkpointing and interleaved schedules, packed (padding-free) batches, pipeline stages.

What the experts receive is read with ``ExpertInputs`` (every call, recomputes included), and gradients
are compared bit for bit with micro-batches replayed one by one in blocks of their own.
"""

from __future__ import annotations

import copy

import pytest
import torch
from moe_helpers import ExpertInputs
from torch import nn

from engine_payloads import qwen3_moe
from modelgraft import RoutingError
from modelgraft.moe import RoutingTrace, pack_routes, pack_sequences, record_routing, replay_routing

BATCH, SEQ = 4, 6
MICRO = ([0, 1], [2, 3])


@pytest.fixture
def setup() -> tuple[nn.Module, torch.Tensor, RoutingTrace]:
    """A policy, a rollout batch, its trace, and router weights that moved since the rollout."""
    model = qwen3_moe(num_hidden_layers=3, dense=(0,)).train()
    ids = torch.randint(1, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), record_routing(model) as trace:
        model(input_ids=ids, use_cache=False)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.add_(torch.randn_like(p))
    return model, ids, trace


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _reference(model: nn.Module, ids: torch.Tensor, trace: RoutingTrace) -> list[torch.Tensor]:
    """Each micro-batch replayed in a block of its own, forward then backward (no checkpointing)."""
    model.zero_grad(set_to_none=True)
    for mb in MICRO:
        with replay_routing(model, trace.select(mb)):
            model(input_ids=ids[mb], labels=ids[mb], use_cache=False).loss.backward()
    return _grads(model)


def _got(seen: ExpertInputs, name: str, call: object, expected: torch.Tensor) -> bool:
    """Whether the experts got ``expected`` in ``call``: the ids in order where the experts module takes
    ids (transformers 5.x), else which experts each token's rows went to (4.57's per-expert modules)."""
    if call.ids is not None:
        return torch.equal(call.ids, expected)
    routed = torch.zeros(expected.shape[0], seen.expert_count[name], dtype=torch.bool)
    return torch.equal(seen.membership(name, call), routed.scatter_(1, expected.long(), True))


def _checkpointing(model: nn.Module) -> None:
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()


def test_micro_batches_of_one_trace_consume_their_own_rows(setup) -> None:
    model, ids, trace = setup
    reference = _reference(model, ids, trace)
    model.zero_grad(set_to_none=True)
    with ExpertInputs(model) as seen, replay_routing(model, trace) as replay:
        for mb in MICRO:
            with replay.micro_batch(mb) as part:
                assert part.batch_size == 2 and part.num_tokens == 2 * SEQ
                model(input_ids=ids[mb], labels=ids[mb], use_cache=False).loss.backward()
    assert all(torch.equal(a, b) for a, b in zip(_grads(model), reference))
    for layer, rows in zip(seen.layers, trace):
        calls = seen.calls[layer.name]
        assert [
            _got(seen, layer.name, c, rows.reshape(BATCH, SEQ, -1)[mb].reshape(-1, 2))
            for c, mb in zip(calls, MICRO)
        ] == [
            True,
            True,
        ]


@pytest.mark.parametrize("schedule", ["interleaved", "backward-inside-the-next-block"])
def test_recompute_under_gradient_checkpointing_uses_the_rows_of_its_micro_batch(
    setup, schedule: str
) -> None:
    model, ids, trace = setup
    reference = _reference(model, ids, trace)
    _checkpointing(model)
    model.zero_grad(set_to_none=True)
    with ExpertInputs(model) as seen, replay_routing(model, trace) as replay:
        with replay.micro_batch(MICRO[0]):
            first = model(input_ids=ids[MICRO[0]], labels=ids[MICRO[0]], use_cache=False).loss
        with replay.micro_batch(MICRO[1]):
            second = model(input_ids=ids[MICRO[1]], labels=ids[MICRO[1]], use_cache=False).loss
            if schedule == "backward-inside-the-next-block":
                first.backward()  # micro-batch 1's recompute runs while micro-batch 2 is active
        if schedule == "interleaved":
            first.backward()  # forward 1, forward 2, backward 1, backward 2 (1F1B)
        second.backward()
    assert all(torch.equal(a, b) for a, b in zip(_grads(model), reference))
    for layer, rows in zip(seen.layers, trace):
        per_mb = [rows.reshape(BATCH, SEQ, -1)[mb].reshape(-1, 2) for mb in MICRO]
        calls = seen.calls[layer.name]  # forward 1, forward 2, recompute 1, recompute 2
        assert len(calls) == 4, layer.name
        assert [_got(seen, layer.name, c, per_mb[i]) for c, i in zip(calls, (0, 1, 0, 1))] == [True] * 4, (
            layer.name
        )


def _checkpoint_by_hand(model: nn.Module) -> None:
    """Checkpointing that is not transformers' (as FSDP's ``apply_activation_checkpointing`` does)."""
    for layer in model.model.layers:
        forward = layer.forward

        def checkpointed(*args, _forward=forward, **kwargs):
            return torch.utils.checkpoint.checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        layer.forward = checkpointed


def test_a_recompute_outside_every_micro_batch_with_other_checkpointing_is_refused(setup) -> None:
    model, ids, trace = setup
    _checkpoint_by_hand(model)
    with pytest.raises(RoutingError, match=r"is recomputed during backward .* outside every micro-batch"):
        with replay_routing(model, trace) as replay:
            losses = []
            for mb in MICRO:
                with replay.micro_batch(mb):
                    losses.append(model(input_ids=ids[mb], labels=ids[mb], use_cache=False).loss)
            losses[0].backward()
    # Backward inside each micro-batch's block is exact with any checkpoint function.
    reference = _reference(model, ids, trace)
    model.zero_grad(set_to_none=True)
    with replay_routing(model, trace) as replay:
        for mb in MICRO:
            with replay.micro_batch(mb):
                model(input_ids=ids[mb], labels=ids[mb], use_cache=False).loss.backward()
    assert all(torch.equal(a, b) for a, b in zip(_grads(model), reference))


def test_sequences_no_micro_batch_ran_are_an_error(setup) -> None:
    model, ids, trace = setup
    with pytest.raises(
        RoutingError, match=r"Routing of sequences \[2, 3\] was never used: no `micro_batch` block"
    ):
        with torch.no_grad(), replay_routing(model, trace) as replay:
            with replay.micro_batch([0, 1]):
                model(input_ids=ids[:2], use_cache=False)
    with pytest.raises(RoutingError, match=r"`micro_batch` block is already active"):
        with torch.no_grad(), replay_routing(model, trace) as replay:
            with replay.micro_batch([0]), replay.micro_batch([1]):
                pass
    with pytest.raises(RoutingError, match=r"Sample ids must be a non-empty list within 0..3"):
        with replay_routing(model, trace) as replay:
            with replay.micro_batch([4]):
                pass


# ---- point 7: packed (padding-free) batches
@pytest.fixture
def padded() -> tuple[nn.Module, torch.Tensor, torch.Tensor, RoutingTrace]:
    """A left-padded rollout batch of sequences of 5, 3, 6 and 2 tokens, and its trace."""
    model = qwen3_moe(num_hidden_layers=3, dense=(0,))
    lengths = [5, 3, 6, 2]
    ids = torch.randint(1, 128, (4, 6), generator=torch.Generator().manual_seed(2))
    mask = (torch.arange(6) >= 6 - torch.tensor(lengths)[:, None]).long()
    ids = ids * mask
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad(), record_routing(model) as trace:
        model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
    return model, ids, mask, trace


@pytest.mark.parametrize("packs", [None, [[2, 0], [1, 3]]], ids=["one-row", "two-rows"])
def test_replay_on_packed_inputs_forces_the_packed_trace(padded, packs) -> None:
    model, ids, mask, trace = padded
    packed = pack_sequences(ids, mask, packs)
    routes = pack_routes(trace, mask, packs, position_ids=packed["position_ids"])
    assert routes.batch_size == packed["input_ids"].shape[0]
    with torch.no_grad():
        reference = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            use_cache=False,
        ).logits
    with torch.no_grad(), ExpertInputs(model) as seen, replay_routing(model, routes):
        logits = model(
            input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False
        ).logits
    seen.assert_matches(routes)
    # The packed forward computes the padded batch's real tokens (same experts; attention within each sequence).
    rows = packed["packs"]
    for r, row in enumerate(rows):
        start = 0
        for sample in row:
            n = int(mask[sample].sum())
            got, want = logits[r, start : start + n], reference[sample, 6 - n :]
            assert torch.isfinite(got).all() and torch.allclose(got, want, atol=1e-5), (r, sample)
            start += n


def test_packed_micro_batches_replay_their_sequences(padded) -> None:
    model, ids, mask, trace = padded
    with torch.no_grad(), ExpertInputs(model) as seen, replay_routing(model, trace) as replay:
        for mb in ([3, 1], [0, 2]):
            packed = pack_sequences(ids[mb], mask[mb])
            with replay.micro_batch(mb, attention_mask=mask) as part:
                model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False)
            expected = pack_routes(trace.select(mb), mask[mb])
            assert all(torch.equal(a, b) for a, b in zip(part.layers, expected.layers))
    for layer, got_calls in ((layer, seen.calls[layer.name]) for layer in seen.layers):
        assert [c.hidden.shape[0] for c in got_calls] == [5, 11], layer.name


def test_packing_that_disagrees_with_the_position_ids_is_refused(padded) -> None:
    _, ids, mask, trace = padded
    packed = pack_sequences(ids, mask, [[1, 0]])
    with pytest.raises(RoutingError, match=r"Packed row 0 does not hold sequence 0 at tokens 0..4"):
        pack_routes(trace, mask, [[0, 1]], position_ids=packed["position_ids"])
    with pytest.raises(RoutingError, match=r"Sequence 1 is in `packs` twice"):
        pack_routes(trace, mask, [[0, 1], [1]])
    with pytest.raises(RoutingError, match=r"`row_length` is 4 but packed row 0 holds 8 tokens"):
        pack_routes(trace, mask, [[0, 1], [2], [3]], row_length=4)


# ---- point 8: pipeline stages
def _stage(model: nn.Module, first: int) -> nn.Module:
    """The stage that owns decoder layers ``first..``: a copy holding only those, renumbered from 0."""
    stage = copy.deepcopy(model)
    stage.model.layers = nn.ModuleList(list(stage.model.layers)[first:])
    stage.config.num_hidden_layers = len(stage.model.layers)
    return stage


def test_a_stage_replays_the_layers_it_owns(padded) -> None:
    _, ids, _, _ = padded
    model = qwen3_moe(num_hidden_layers=4, dense=(0,))
    with torch.no_grad(), record_routing(model) as trace:
        model(input_ids=ids, use_cache=False)
    assert trace.layer_ids == [1, 2, 3]
    stage = _stage(model, 2)
    part = trace.for_model(stage, layer_offset=2)
    assert part.layer_ids == [0, 1] and all(
        torch.equal(a, b) for a, b in zip(part, trace.select_layers([2, 3]))
    )
    with torch.no_grad(), ExpertInputs(stage) as seen, replay_routing(stage, part):
        stage(input_ids=ids, use_cache=False)
    seen.assert_matches(part)


def test_a_stage_layer_that_was_not_captured_is_refused(padded) -> None:
    _, _, _, trace = padded
    zeros = RoutingTrace(
        [trace.layers[0], torch.zeros_like(trace.layers[1])],
        [1, 2],
        top_k=2,
        num_experts=8,
        batch_size=trace.batch_size,
    )
    with pytest.raises(RoutingError, match=r"Every expert id of decoder layer `2` is 0 \(24 rows\)"):
        zeros.check_captured()
    with pytest.raises(
        RoutingError, match=r"The trace has no routing for decoder layer `3`; it holds layers \[1, 2\]"
    ):
        trace.select_layers([3])
    first, second = trace.select_layers([1]), trace.select_layers([2])
    joined = RoutingTrace.join_layers([second, first])
    assert joined.layer_ids == [1, 2] and all(torch.equal(a, b) for a, b in zip(joined.layers, trace.layers))
    with pytest.raises(RoutingError, match=r"Decoder layer `1` is in more than one of the traces to join"):
        RoutingTrace.join_layers([first, first])
