"""Routing replay under every schedule a trainer uses (issue 19, points 1, 3, 4, 5 and the property test).

* point 1: ``micro_batch(sample_ids, attention_mask=...)`` with any order, subset or repetition of
  sample ids, with the rollout batch's mask or the micro-batch's own, replays exactly the trace's rows
  of those sequences (a mask that could be either, read two ways, is refused);
* point 3: ``backward()`` after the ``replay_routing`` block, with gradient checkpointing (reentrant
  or not), recomputes with the routes of the forward;
* point 4: a forward of the same model in another thread during a block is plain (replay) and not
  recorded (record);
* point 5: ``micro_batch`` after the block refuses.

The hypothesis test drives sessions with random micro-batch orders, subsets, repetitions, masks,
packed and padded layouts, recompute on and off, backward inside, after, or after the block, and a
plain forward from a second thread; every run is exact (experts' inputs, logits and gradients bit for
bit against each micro-batch replayed in a block of its own) or a clear ``RoutingError``.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from moe_helpers import ExpertInputs
from torch import nn

from engine_payloads import qwen3_moe
from modelgraft import RoutingError
from modelgraft.moe import RoutingTrace, pack_routes, pack_sequences, record_routing, replay_routing

HANG_GUARD_S = 300  # only a guard against a deadlock hanging the suite, never a speed limit


def _random_trace(model: nn.Module, batch: int, seq: int, seed: int) -> RoutingTrace:
    """Distinct random experts per token (not what the live router picks), with the batch layout."""
    with torch.no_grad(), record_routing(model) as trace:
        model(input_ids=torch.ones(batch, seq, dtype=torch.long), use_cache=False)
    generator = torch.Generator().manual_seed(seed)
    layers = [
        torch.rand(t.shape[0], 8, generator=generator).argsort(-1)[:, : t.shape[1]].to(t.dtype)
        for t in trace.layers
    ]
    return trace._copy(layers, batch)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _same_grads(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[n], b[n]) and bool(torch.isfinite(a[n]).all()) for n in a
    )


def _got(seen: ExpertInputs, name: str, call: Any, expected: torch.Tensor) -> bool:
    """Whether the experts got ``expected`` in ``call`` (ids in order on 5.x, the tokens' rows on 4.57)."""
    if call.ids is not None:
        return torch.equal(call.ids, expected.long())
    routed = torch.zeros(expected.shape[0], seen.expert_count[name], dtype=torch.bool)
    return torch.equal(seen.membership(name, call), routed.scatter_(1, expected.long(), True))


def _distinct_tokens(batch: int, seq: int, seed: int) -> torch.Tensor:
    """Token ids, all different (padding too): 4.57's experts are read by the rows they get, and two
    padding positions of one token would give equal rows."""
    return (torch.randperm(127, generator=torch.Generator().manual_seed(seed))[: batch * seq] + 1).reshape(
        batch, seq
    )


@pytest.fixture(scope="module")
def rollout() -> tuple[nn.Module, torch.Tensor, torch.Tensor, RoutingTrace]:
    """A policy, a left-padded rollout batch (3 sequences of 5, 2 and 4 tokens), its random trace."""
    model = qwen3_moe(num_hidden_layers=2, dense=()).train()
    ids = _distinct_tokens(3, 5, seed=3)
    mask = (torch.arange(5) >= 5 - torch.tensor([5, 2, 4])[:, None]).long()
    return model, ids, mask, _random_trace(model, 3, 5, seed=4)  # distinct tokens on padding too


# ---- point 1: micro-batch ids in any order, with either mask ---------------------------------------
@pytest.mark.parametrize("sample_ids", [[1, 0, 2], [2, 1, 0], [2, 0], [1, 1], [2]])
@pytest.mark.parametrize("mask_kind", ["rollout", "micro_batch"])
def test_a_packed_micro_batch_replays_the_rows_of_its_sequences_in_any_order(
    rollout, sample_ids: list[int], mask_kind: str
) -> None:
    model, ids, mask, trace = rollout
    given_mask = mask if mask_kind == "rollout" else mask[sample_ids]
    expected = pack_routes(trace.select(sample_ids), mask[sample_ids])
    packed = pack_sequences(ids[sample_ids], mask[sample_ids])
    with torch.no_grad(), ExpertInputs(model) as seen, replay_routing(model, trace) as session:
        with session.micro_batch(sample_ids, attention_mask=given_mask, mask_of=mask_kind) as part:
            model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False)
        assert all(torch.equal(a, b) for a, b in zip(part.layers, expected.layers, strict=True))
        for layer, rows in zip(seen.layers, expected):
            (call,) = seen.calls[layer.name]
            assert _got(seen, layer.name, call, rows), layer.name
        with session.micro_batch([0, 1, 2]):  # the rest of the batch, so the block ends cleanly
            model(input_ids=ids, attention_mask=mask, use_cache=False)


def test_the_rollout_mask_is_reindexed_when_the_micro_batch_reorders_the_whole_batch(rollout) -> None:
    """The issue's case: ``[1, 0]`` of a 2-sequence rollout, given the rollout mask, by default."""
    model, ids, mask, _ = rollout
    ids, mask = ids[1:], mask[1:]  # 2 and 4 tokens
    trace = _random_trace(model, 2, 5, seed=5)
    expected = pack_routes(trace.select([1, 0]), mask[[1, 0]])
    with torch.no_grad(), replay_routing(model, trace) as session:
        with pytest.raises(
            RoutingError, match=r"can be the rollout batch's mask .* Pass `mask_of='rollout'`"
        ):
            with session.micro_batch([1, 0], attention_mask=mask):
                pass
        with session.micro_batch([1, 0], attention_mask=mask, mask_of="rollout") as part:
            packed = pack_sequences(ids[[1, 0]], mask[[1, 0]])
            model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False)
    assert all(torch.equal(a, b) for a, b in zip(part.layers, expected.layers, strict=True))
    # A mask both readings agree on needs no `mask_of`.
    same = torch.ones(2, 5, dtype=torch.long)
    with torch.no_grad(), replay_routing(model, trace) as session:
        with session.micro_batch([1, 0], attention_mask=same) as part:
            model(input_ids=ids[[1, 0]].reshape(1, -1), use_cache=False)
    assert all(torch.equal(a, b) for a, b in zip(part.layers, trace.select([1, 0]).layers, strict=True))


def test_micro_batch_masks_and_ids_of_the_wrong_kind_are_refused(rollout) -> None:
    model, _, mask, trace = rollout
    with replay_routing(model, trace) as session:
        with pytest.raises(RoutingError, match=r"`attention_mask` has 3 rows but the micro-batch holds 2"):
            with session.micro_batch([0, 1], attention_mask=mask, mask_of="micro_batch"):
                pass
        with pytest.raises(RoutingError, match=r"`mask_of` must be 'auto', 'rollout' or 'micro_batch'"):
            with session.micro_batch([0, 1], attention_mask=mask, mask_of="padded"):
                pass
        with pytest.raises(RoutingError, match=r"`sample_ids` must be a 1-D sequence of integers"):
            with session.micro_batch(torch.tensor([0.0, 1.0])):
                pass
        with session.micro_batch(range(3)):
            model(input_ids=torch.ones(3, 5, dtype=torch.long), use_cache=False)


def test_numpy_integer_sample_ids_are_accepted(rollout) -> None:
    np = pytest.importorskip("numpy")
    model, ids, mask, trace = rollout
    order = np.array([2, 0, 1])
    assert all(torch.equal(a, b) for a, b in zip(trace.select(order).layers, trace.select([2, 0, 1]).layers))
    with torch.no_grad(), replay_routing(model, trace) as session:
        with session.micro_batch(list(order), attention_mask=mask, mask_of="rollout") as part:
            packed = pack_sequences(ids[[2, 0, 1]], mask[[2, 0, 1]])
            model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False)
    expected = pack_routes(trace.select([2, 0, 1]), mask[[2, 0, 1]])
    assert all(torch.equal(a, b) for a, b in zip(part.layers, expected.layers, strict=True))


# ---- point 5: micro_batch after the block --------------------------------------------------------------
def test_micro_batch_after_the_block_ended_is_refused(rollout) -> None:
    model, ids, mask, trace = rollout
    with torch.no_grad(), replay_routing(model, trace) as session:
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    with pytest.raises(RoutingError, match=r"`replay_routing` block that has ended"):
        with session.micro_batch([0]):
            model(input_ids=ids[:1], use_cache=False)


# ---- point 3: backward after the block, under gradient checkpointing ---------------------------------
def _checkpointing(model: nn.Module, reentrant: bool | None) -> None:
    """transformers' checkpointing (``activation_checkpointing_*`` on 5.x, ``gradient_checkpointing_*`` on 4.57)."""
    if reentrant is None:
        disable = (
            getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
        )
        disable()
        return
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("micro_batches", [False, True], ids=["whole-trace", "micro-batches"])
def test_backward_after_the_block_recomputes_with_the_forced_routes(
    rollout, reentrant: bool, micro_batches: bool
) -> None:
    model, ids, mask, trace = rollout
    parts = [[2, 0], [1]] if micro_batches else [[0, 1, 2]]
    model.zero_grad(set_to_none=True)
    for part in parts:  # reference: each part forward and backward in a block of its own, no recompute
        with replay_routing(model, trace.select(part)):
            model(
                input_ids=ids[part], attention_mask=mask[part], labels=ids[part], use_cache=False
            ).loss.backward()
    reference = _grads(model)
    try:
        _checkpointing(model, reentrant)
        model.zero_grad(set_to_none=True)
        losses = []
        with ExpertInputs(model) as seen:
            with replay_routing(model, trace) as session:
                for part in parts:
                    if micro_batches:
                        with session.micro_batch(part):
                            inputs = {
                                "input_ids": ids[part],
                                "attention_mask": mask[part],
                                "labels": ids[part],
                            }
                            losses.append(model(**inputs, use_cache=False).loss)
                    else:
                        losses.append(
                            model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False).loss
                        )
            for loss in losses:  # every recompute runs after the block ended
                loss.backward()
    finally:
        _checkpointing(model, None)
    assert _same_grads(_grads(model), reference)
    for layer, rows in zip(seen.layers, trace):
        per_part = [rows.reshape(3, 5, -1)[p].reshape(-1, rows.shape[1]) for p in parts]
        calls = seen.calls[layer.name]  # the forwards, then their recomputes in backward order
        assert len(calls) == 2 * len(parts), layer.name
        expected = per_part + per_part
        assert all(_got(seen, layer.name, c, e) for c, e in zip(calls, expected)), layer.name


# ---- point 4: threads ---------------------------------------------------------------------------------
def _in_thread(work: Any) -> Any:
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = work()
        except BaseException as error:  # handed to the test's thread
            result["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(HANG_GUARD_S)
    assert not thread.is_alive()
    if "error" in result:
        raise result["error"]
    return result["value"]


def test_a_forward_in_another_thread_during_a_replay_block_is_plain(rollout) -> None:
    model, ids, mask, trace = rollout
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        with replay_routing(model, trace):
            replayed = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            other = _in_thread(lambda: model(input_ids=ids, attention_mask=mask, use_cache=False).logits)
    assert not torch.equal(replayed, plain)  # the trace is not the live routing
    assert torch.equal(other, plain) and other.dtype == plain.dtype and bool(torch.isfinite(other).all())


def test_record_in_one_thread_does_not_record_another_threads_forward(rollout) -> None:
    model, ids, mask, _ = rollout
    with torch.no_grad(), record_routing(model) as alone:
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    entered, other_done = threading.Event(), threading.Event()

    def other() -> None:
        assert entered.wait(HANG_GUARD_S)
        with torch.no_grad():
            model(input_ids=ids[:2, :3], use_cache=False)
        other_done.set()

    thread = threading.Thread(target=other)
    thread.start()
    with torch.no_grad(), record_routing(model) as trace:
        entered.set()
        assert other_done.wait(HANG_GUARD_S)
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    thread.join(HANG_GUARD_S)
    assert trace.batch_size == 3 and trace.num_tokens == 15
    assert all(torch.equal(a, b) for a, b in zip(trace.layers, alone.layers, strict=True))


def test_two_threads_replay_their_own_traces_on_one_model(rollout) -> None:
    model, ids, mask, trace = rollout
    other_trace = _random_trace(model, 3, 5, seed=9)
    with torch.no_grad():
        with replay_routing(model, other_trace):
            expected_other = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        with replay_routing(model, trace):
            expected = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    inside = threading.Barrier(2, timeout=HANG_GUARD_S)

    def replay(routes: RoutingTrace) -> torch.Tensor:
        with torch.no_grad(), replay_routing(model, routes):
            inside.wait()  # both blocks are open on the same model now
            return model(input_ids=ids, attention_mask=mask, use_cache=False).logits

    thread_result: dict[str, torch.Tensor] = {}
    thread = threading.Thread(target=lambda: thread_result.update(out=replay(other_trace)))
    thread.start()
    mine = replay(trace)
    thread.join(HANG_GUARD_S)
    assert torch.equal(mine, expected) and torch.equal(thread_result["out"], expected_other)


def test_hand_written_checkpointing_recomputed_in_another_thread_during_a_replay_is_refused(rollout) -> None:
    """A recompute modelgraft cannot bind to its forward, outside the block's thread, while a replay
    forces the layer: refused (it cannot tell whether that forward was replayed)."""
    model, ids, _, trace = rollout
    checkpointed = model.model.layers[0]
    forward = checkpointed.forward
    checkpointed.forward = lambda *a, **k: torch.utils.checkpoint.checkpoint(
        forward, *a, use_reentrant=False, **k
    )
    try:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        with replay_routing(model, trace):
            with pytest.raises(
                RoutingError, match=r"recomputed during backward .* in a thread or task that is not"
            ):
                _in_thread(loss.backward)
            model(input_ids=ids, use_cache=False)
    finally:
        del checkpointed.forward
    model.zero_grad(set_to_none=True)


# ---- the property test ------------------------------------------------------------------------------
_MODEL: list[nn.Module] = []


def _policy() -> nn.Module:
    if not _MODEL:
        _MODEL.append(qwen3_moe(num_hidden_layers=2, dense=(), seed=7).train())
    return _MODEL[0]


@st.composite
def _schedules(draw: st.DrawFn) -> dict[str, Any]:
    batch = draw(st.integers(2, 4))
    seq = draw(st.integers(2, 5))
    lengths = draw(st.lists(st.integers(1, seq), min_size=batch, max_size=batch))
    left = draw(st.booleans())
    kind = draw(st.sampled_from(["permutation", "subset", "repeats"]))
    if kind == "permutation":
        order = draw(st.permutations(range(batch)))
    elif kind == "subset":
        order = draw(st.lists(st.integers(0, batch - 1), min_size=1, max_size=batch, unique=True))
    else:
        order = draw(st.lists(st.integers(0, batch - 1), min_size=1, max_size=batch + 2))
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(order) - 1)), max_size=2)))
    parts = [list(order[a:b]) for a, b in zip([0, *cuts], [*cuts, len(order)]) if order[a:b]]
    return {
        "batch": batch,
        "seq": seq,
        "lengths": lengths,
        "left": left,
        "parts": parts,
        "packed": draw(st.booleans()),
        "mask_of": draw(st.sampled_from(["auto", "rollout", "micro_batch"])),
        "recompute": draw(st.sampled_from([None, True, False])),
        "backward": draw(st.sampled_from(["inside", "after-forwards", "after-block"])),
        "thread": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


def _inputs(model: nn.Module, case: dict[str, Any], part: list[int], ids: torch.Tensor, mask: torch.Tensor):
    if case["packed"]:
        packed = pack_sequences(ids[part], mask[part])
        labels = packed["input_ids"]
        return {"input_ids": labels, "position_ids": packed["position_ids"], "labels": labels}
    return {"input_ids": ids[part], "attention_mask": mask[part], "labels": ids[part]}


def _expected_routes(
    case: dict[str, Any], trace: RoutingTrace, part: list[int], mask: torch.Tensor
) -> RoutingTrace:
    selected = trace.select(part)
    return pack_routes(selected, mask[part]) if case["packed"] else selected


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_schedules())
def test_replay_sessions_are_exact_or_refused_under_random_schedules(case: dict[str, Any]) -> None:
    model = _policy()
    batch, seq, parts = case["batch"], case["seq"], case["parts"]
    positions = torch.arange(seq)
    lengths = torch.tensor(case["lengths"])[:, None]
    mask = (positions >= seq - lengths if case["left"] else positions < lengths).long()
    ids = _distinct_tokens(batch, seq, case["seed"])
    trace = _random_trace(model, batch, seq, case["seed"])
    plain_ids = ids[:1]
    with torch.no_grad():
        plain = model(input_ids=plain_ids, use_cache=False).logits

    # Reference: each micro-batch replayed alone, forward then backward, no recompute.
    model.zero_grad(set_to_none=True)
    reference_logits = []
    for part in parts:
        routes = _expected_routes(case, trace, part, mask)
        with replay_routing(model, routes):
            out = model(**_inputs(model, case, part, ids, mask), use_cache=False)
            out.loss.backward()
        reference_logits.append(out.logits.detach())
    reference = _grads(model)

    used = {i for part in parts for i in part}
    ambiguous = (
        case["packed"]
        and case["mask_of"] == "auto"
        and any(len(part) == batch and not torch.equal(mask[part], mask) for part in parts)
    )
    model.zero_grad(set_to_none=True)
    try:
        _checkpointing(model, case["recompute"])
        losses, logits, others = [], [], []
        with ExpertInputs(model) as seen:
            try:
                with replay_routing(model, trace) as session:
                    for part in parts:
                        options: dict[str, Any] = {}
                        if case["packed"]:
                            kind = case["mask_of"]
                            given_mask = mask if kind in ("auto", "rollout") else mask[part]
                            options = {"attention_mask": given_mask, "mask_of": kind}
                        with session.micro_batch(part, **options):
                            out = model(**_inputs(model, case, part, ids, mask), use_cache=False)
                            if case["thread"]:
                                before = {name: len(calls) for name, calls in seen.calls.items()}
                                with torch.no_grad():
                                    others.append(
                                        _in_thread(lambda: model(input_ids=plain_ids, use_cache=False).logits)
                                    )
                                for name, calls in seen.calls.items():
                                    del calls[before[name] :]
                            losses.append(out.loss)
                            logits.append(out.logits.detach())
                            if case["backward"] == "inside":
                                out.loss.backward()
                    if case["backward"] == "after-forwards":
                        for loss in losses:
                            loss.backward()
            except RoutingError as error:
                message = str(error)
                if ambiguous:
                    assert "Pass `mask_of='rollout'` or `mask_of='micro_batch'`" in message
                    return
                assert used != set(range(batch)), message
                assert "was never used: no `micro_batch` block ran them" in message
                missing = sorted(set(range(batch)) - used)
                assert str(missing[:8])[1:-1] in message
            else:
                assert not ambiguous and used == set(range(batch))
            if case["backward"] == "after-block":
                for loss in losses:
                    loss.backward()
    finally:
        _checkpointing(model, None)

    assert all(torch.equal(a, b) for a, b in zip(logits, reference_logits, strict=True))
    assert _same_grads(_grads(model), reference)
    assert all(torch.equal(o, plain) for o in others)
    recomputes = case["recompute"] is not None
    for layer in seen.layers:
        calls = seen.calls[layer.name]
        expected = [_expected_routes(case, trace, part, mask)[seen.layers.index(layer)] for part in parts]
        if recomputes:
            if case["backward"] == "inside":  # forward 1, recompute 1, forward 2, ...
                expected = [e for e in expected for _ in range(2)]
            else:
                expected = expected + expected
        assert len(calls) == len(expected), (layer.name, len(calls), len(expected))
        assert all(_got(seen, layer.name, c, e) for c, e in zip(calls, expected)), layer.name
