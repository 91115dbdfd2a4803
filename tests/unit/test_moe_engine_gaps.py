"""Engine capture holes (issue 20 point 3): an all-zero row of a captured MoE layer.

An engine's capture buffer holds 0 where it did not write a token's routes (a token it did not
capture). With top-k > 1 such a row names expert 0 k times, which no router selects; with top-1 it
is indistinguishable from a real choice of expert 0. ``from_vllm``/``from_sglang`` refuse those rows
by default, saying it looks like a capture gap; ``zero_rows="live"`` lets the trainer's router choose
them (as ``missing="live"`` does for ``-1`` rows) and the trace's summary reports them;
``zero_rows="accept"`` takes them as expert 0 (top-1 only).
"""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from modelgraft import RoutingError
from modelgraft.moe import from_sglang, from_vllm, replay_routing
from moe_families import build_tiny

LENGTHS = [5, 4]  # tokens per request; each request has n - 1 routed rows


@pytest.fixture(scope="module")
def top2() -> torch.nn.Module:
    return build_tiny("qwen3_moe", num_hidden_layers=3, mlp_only_layers=[0])


@pytest.fixture(scope="module")
def top1() -> torch.nn.Module:
    return build_tiny("qwen3_moe", num_hidden_layers=3, mlp_only_layers=[0], num_experts_per_tok=1)


def _engine(top_k: int, seed: int = 0) -> list[np.ndarray]:
    """vLLM-style rows (tokens - 1, 3 layers, top_k), layer 0 dense (zeros), no expert 0 anywhere."""
    rng = np.random.default_rng(seed)
    out = []
    for n in LENGTHS:
        routes = np.zeros((n - 1, 3, top_k), dtype=np.int32)
        for row in range(n - 1):
            for layer in (1, 2):
                routes[row, layer] = rng.choice(np.arange(1, 8), size=top_k, replace=False)
        out.append(routes)
    return out


def _with_gap(top_k: int) -> list[np.ndarray]:
    engine = _engine(top_k)
    engine[1][2, 2] = 0  # request 1, token 2, decoder layer 2: not captured
    return engine


def _sglang(engine: list[np.ndarray]) -> list[str]:
    return [base64.b64encode(np.ascontiguousarray(e, "<i4").tobytes()).decode() for e in engine]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_single_zero_row_is_refused_as_a_capture_gap(top2: torch.nn.Module, engine: str) -> None:
    routes = _with_gap(2)
    build = from_vllm if engine == "vllm" else from_sglang
    given = routes if engine == "vllm" else _sglang(routes)
    with pytest.raises(
        RoutingError, match=r"Request 1 routes token 2 of decoder layer `2` to \[0, 0\]"
    ) as caught:
        build(given, top2, input_lengths=LENGTHS)
    message = str(caught.value)
    assert "capture gap" in message and "zero_rows='live'" in message
    assert "top-2" in message and "distinct" in message  # why it cannot be a real choice
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_zero_rows_live_routes_them_like_missing_rows(top2: torch.nn.Module, engine: str) -> None:
    routes = _with_gap(2)
    build = from_vllm if engine == "vllm" else from_sglang
    given = routes if engine == "vllm" else _sglang(routes)
    trace = build(given, top2, input_lengths=LENGTHS, zero_rows="live")
    # The same trace as an engine that marked the token -1 (no route) under missing="live".
    marked = _engine(2)
    marked[1][2, 2] = -1
    expected = from_vllm(marked, top2, input_lengths=LENGTHS, missing="live")
    assert trace.missing == "live" == expected.missing
    for got, want in zip(trace.layers, expected.layers):
        assert got.dtype == want.dtype and torch.equal(got, want)
    seq = max(LENGTHS)
    assert trace[1][seq + 2].tolist() == [-1, -1] and int((trace[1] < 0).all(-1).sum()) == 1
    assert int((trace[0] < 0).all(-1).sum()) == 0
    summary = trace.summary()
    assert summary.splitlines()[0] == (
        "RoutingTrace: 2 MoE layers (decoder layers 1, 2), 10 rows each (2 sequences x 5 positions), "
        "top-2 of 8 experts, missing='live'"
    )
    assert "decoder layer `2`: 1 of 10 rows routed live (sequence 1 position 2)" in summary, summary
    assert "decoder layer `1`: all 10 rows forced" in summary, summary
    ids = torch.ones(2, seq, dtype=torch.long)
    with torch.no_grad(), replay_routing(top2, trace):
        logits = top2(input_ids=ids, use_cache=False).logits
    assert torch.isfinite(logits).all()


def test_without_gaps_the_trace_is_unchanged_by_zero_rows(top2: torch.nn.Module) -> None:
    plain = from_vllm(_engine(2), top2, input_lengths=LENGTHS)
    live = from_vllm(_engine(2), top2, input_lengths=LENGTHS, zero_rows="live")
    assert plain.missing == live.missing == "refuse"
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(plain.layers, live.layers))


def test_top1_zero_rows_are_ambiguous_and_need_the_callers_word(top1: torch.nn.Module) -> None:
    routes = _with_gap(1)
    with pytest.raises(RoutingError, match=r"top-1 routing.*expert 0 or a token the engine did not capture"):
        from_vllm(routes, top1, input_lengths=LENGTHS)
    with pytest.raises(RoutingError, match=r"zero_rows='accept'"):
        from_vllm(routes, top1, input_lengths=LENGTHS)
    accepted = from_vllm(routes, top1, input_lengths=LENGTHS, zero_rows="accept")
    seq = max(LENGTHS)
    assert accepted.missing == "refuse" and accepted[1][seq + 2].tolist() == [0]
    live = from_vllm(routes, top1, input_lengths=LENGTHS, zero_rows="live")
    assert live.missing == "live" and live[1][seq + 2].tolist() == [-1]
    with torch.no_grad(), replay_routing(top1, accepted):
        top1(input_ids=torch.ones(2, seq, dtype=torch.long), use_cache=False)


def test_accept_is_refused_where_a_zero_row_cannot_be_a_choice(top2: torch.nn.Module) -> None:
    with pytest.raises(RoutingError, match=r"zero_rows='accept'.*only top-1 routing.*top-2"):
        from_vllm(_with_gap(2), top2, input_lengths=LENGTHS, zero_rows="accept")


def test_zero_rows_must_be_a_known_policy(top2: torch.nn.Module) -> None:
    with pytest.raises(RoutingError, match=r"`zero_rows` must be 'refuse', 'live' or 'accept'; got 'yes'"):
        from_vllm(_engine(2), top2, input_lengths=LENGTHS, zero_rows="yes")


def test_a_whole_uncaptured_layer_is_still_the_layer_error(top2: torch.nn.Module) -> None:
    engine = _engine(2)
    for routes in engine:
        routes[:, 2] = 0
    with pytest.raises(RoutingError, match=r"Every routed expert id of MoE layer `2` is 0 in every request"):
        from_vllm(engine, top2, input_lengths=LENGTHS, zero_rows="live")


# ---- issue 28 point 3: gaps are looked for on the engine's own ids, before `expert_map` -------------
# Physical-to-logical map of an expert-parallel engine; physical 0 is logical 3, so a gap row of
# zeros would become [3, 3] (top-2: "duplicate ids" later) or [3] (top-1: silently replayed).
EXPERT_MAP = np.array([3, 0, 1, 2, 4, 5, 6, 7])


def _logical(engine: list[np.ndarray]) -> list[np.ndarray]:
    """What the engine's physical rows mean: every id through the map, -1 rows left as they are."""
    out = []
    for routes in engine:
        mapped = EXPERT_MAP[np.clip(routes, 0, None)]
        out.append(np.where(routes < 0, -1, mapped).astype(np.int32))
    return out


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_a_gap_is_refused_through_an_expert_map(
    top1: torch.nn.Module, top2: torch.nn.Module, engine: str, top_k: int
) -> None:
    model = top1 if top_k == 1 else top2
    routes = _with_gap(top_k)
    build = from_vllm if engine == "vllm" else from_sglang
    given = routes if engine == "vllm" else _sglang(routes)
    zeros = ", ".join(["0"] * top_k)
    with pytest.raises(
        RoutingError, match=rf"Request 1 routes token 2 of decoder layer `2` to \[{zeros}\]"
    ) as caught:
        build(given, model, input_lengths=LENGTHS, expert_map=EXPERT_MAP)
    assert "capture" in str(caught.value) and "zero_rows=" in str(caught.value)
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_zero_rows_live_through_an_expert_map_routes_the_gap_live(
    top1: torch.nn.Module, top2: torch.nn.Module, engine: str, top_k: int
) -> None:
    model = top1 if top_k == 1 else top2
    routes = _with_gap(top_k)
    build = from_vllm if engine == "vllm" else from_sglang
    given = routes if engine == "vllm" else _sglang(routes)
    trace = build(given, model, input_lengths=LENGTHS, expert_map=EXPERT_MAP, zero_rows="live")
    marked = _engine(top_k)
    marked[1][2, 2] = -1
    # Logical 0 is a real choice there (physical 1), so the reference takes zeros as expert 0.
    expected = from_vllm(_logical(marked), model, input_lengths=LENGTHS, missing="live", zero_rows="accept")
    assert trace.missing == "live" == expected.missing
    for got, want in zip(trace.layers, expected.layers):
        assert got.dtype == want.dtype and torch.equal(got, want)
    seq = max(LENGTHS)
    assert trace[1][seq + 2].tolist() == [-1] * top_k
    assert int((trace[1] < 0).all(-1).sum()) == 1 and int((trace[0] < 0).all(-1).sum()) == 0


def test_top1_accept_through_an_expert_map_maps_the_zero_as_a_real_choice(top1: torch.nn.Module) -> None:
    routes = _with_gap(1)
    accepted = from_vllm(routes, top1, input_lengths=LENGTHS, expert_map=EXPERT_MAP, zero_rows="accept")
    expected = from_vllm(_logical(routes), top1, input_lengths=LENGTHS, zero_rows="accept")
    assert accepted.missing == "refuse"
    assert accepted[1][max(LENGTHS) + 2].tolist() == [int(EXPERT_MAP[0])]
    for got, want in zip(accepted.layers, expected.layers):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_without_gaps_an_expert_map_gives_the_logical_trace(top2: torch.nn.Module) -> None:
    routes = _engine(2)
    mapped = from_vllm(routes, top2, input_lengths=LENGTHS, expert_map=EXPERT_MAP)
    expected = from_vllm(_logical(routes), top2, input_lengths=LENGTHS)
    for got, want in zip(mapped.layers, expected.layers):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_a_whole_uncaptured_layer_through_an_expert_map_is_the_layer_error(top2: torch.nn.Module) -> None:
    engine = _engine(2)
    for routes in engine:
        routes[:, 2] = 0
    with pytest.raises(RoutingError, match=r"Every routed expert id of MoE layer `2` is 0 in every request"):
        from_vllm(engine, top2, input_lengths=LENGTHS, expert_map=EXPERT_MAP, zero_rows="live")
