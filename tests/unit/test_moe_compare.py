"""compare_routing: per MoE layer, the share of tokens whose expert set differs, and where (issue 20, point 7)."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from modelgraft.errors import RoutingError
from modelgraft.moe import RoutingTrace, compare_routing, from_vllm, record_routing
from moe_families import build_tiny


def _trace(*layers: list[list[int]], batch_size: int | None = None) -> RoutingTrace:
    return RoutingTrace([torch.tensor(rows) for rows in layers], num_experts=8, batch_size=batch_size)


def test_counts_rates_positions_and_order_within_a_row_does_not_matter() -> None:
    a = _trace([[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 1], [0, 1], [0, 1], [0, 1]], batch_size=2)
    b = _trace([[1, 0], [2, 4], [4, 5], [7, 5]], [[0, 1], [0, 1], [0, 1], [0, 2]], batch_size=2)
    result = compare_routing(a, b)
    assert result.compared == [4, 4]
    assert result.mismatched == [2, 1]
    assert result.rates == [0.5, 0.25]
    assert result.mismatch_rate == 3 / 8
    assert result.max_rate == 0.5
    assert [p.tolist() for p in result.positions] == [[1, 3], [3]]
    assert result.where(0) == [(0, 1), (1, 1)]  # (sequence, position) with 2 positions per sequence
    assert (result.tokens_compared, result.tokens_mismatched, result.token_rate) == (4, 2, 0.5)
    assert result.overlap == [pytest.approx((1 + 0.5 + 1 + 0.5) / 4), pytest.approx((1 + 1 + 1 + 0.5) / 4)]
    assert not result.exact
    assert compare_routing(a, a).exact and compare_routing(a, a).mismatch_rate == 0.0


def test_mask_and_rows_without_a_route_are_not_compared() -> None:
    a = RoutingTrace(
        [torch.tensor([[0, 1], [2, 3], [-1, -1]], dtype=torch.int16)], num_experts=8, missing="live"
    )
    b = RoutingTrace([torch.tensor([[0, 2], [2, 4], [4, 5]])], num_experts=8)
    result = compare_routing(a, b, mask=torch.tensor([1, 0, 1]))
    assert (result.compared, result.mismatched, result.positions[0].tolist()) == ([1], [1], [0])


def test_summary_and_json_name_the_layers_and_positions() -> None:
    a = RoutingTrace(
        [torch.tensor([[0, 1], [2, 3]])],
        num_experts=8,
        layer_ids=[3],
        layer_names=["model.layers.3.mlp.gate"],
        batch_size=1,
    )
    b = RoutingTrace([torch.tensor([[0, 1], [2, 5]])], num_experts=8, layer_ids=[3], batch_size=1)
    result = compare_routing(a, b)
    text = result.summary()
    assert text.splitlines()[0].startswith(
        "routing mismatch: 1 of 2 token routes differ (50.0%) over 1 MoE layer"
    )
    assert "layer 3 `model.layers.3.mlp.gate`: 1/2 differ (50.0%), overlap 0.750 at (0, 1)" in text
    data = result.to_dict()
    assert data["layers"][0] == {
        "layer_id": 3,
        "name": "model.layers.3.mlp.gate",
        "compared": 2,
        "mismatched": 1,
        "rate": 0.5,
        "overlap": 0.75,
        "positions": [1],
        "where": [[0, 1]],
    }
    assert data["mismatch_rate"] == 0.5 and data["exact"] is False


@pytest.mark.parametrize(
    ("b", "mask", "match"),
    [
        ([torch.zeros(2, 2, dtype=torch.long)] * 2, None, r"cover different MoE layers"),
        ([torch.zeros(3, 2, dtype=torch.long)], None, r"Layer `0`: `a` has \(2, 2\) .* but `b` has \(3, 2\)"),
        ([torch.zeros(2, 2)], None, r"Layer 0 of `b` must be a 2-D integer tensor"),
        ([torch.zeros(2, 2, dtype=torch.long)], torch.ones(3), r"`mask` has 3 entries .* 2 tokens per layer"),
    ],
)
def test_routings_of_other_tokens_are_refused(
    b: list[torch.Tensor], mask: torch.Tensor | None, match: str
) -> None:
    a = _trace([[0, 1], [2, 3]])
    with pytest.raises(RoutingError, match=match) as info:
        compare_routing(a, b, mask=mask)
    assert isinstance(info.value, ValueError)


def test_where_needs_the_batch_layout() -> None:
    result = compare_routing([torch.tensor([[0, 1]])], [torch.tensor([[0, 2]])])
    with pytest.raises(RoutingError, match=r"no batch layout"):
        result.where(0)


@st.composite
def _pairs(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, k = draw(st.integers(1, 12)), draw(st.integers(1, 3))
    rows = st.permutations(list(range(6))).map(lambda p: p[:k])
    a = torch.tensor(draw(st.lists(rows, min_size=tokens, max_size=tokens)))
    b = torch.tensor(draw(st.lists(rows, min_size=tokens, max_size=tokens)))
    return a, b


@settings(max_examples=60, deadline=None)
@given(_pairs())
def test_a_token_differs_exactly_when_its_expert_sets_differ(pair: tuple[torch.Tensor, torch.Tensor]) -> None:
    a, b = pair
    result = compare_routing([a], [b])
    naive = [i for i in range(a.shape[0]) if set(a[i].tolist()) != set(b[i].tolist())]
    assert result.positions[0].tolist() == naive
    assert result.mismatched == [len(naive)] and result.compared == [a.shape[0]]
    shared = [len(set(a[i].tolist()) & set(b[i].tolist())) / a.shape[1] for i in range(a.shape[0])]
    assert result.overlap[0] == pytest.approx(sum(shared) / len(shared))


# ---- issue 28 point 4: rows no model routed, masks of the wrong shape or dtype, nothing compared ---
LENGTHS = [5, 3]  # tokens per sequence, right-padded to 5


@pytest.fixture(scope="module")
def recorded() -> tuple[torch.nn.Module, RoutingTrace, torch.Tensor]:
    """A tiny MoE model, its own routing of a right-padded batch, and that batch's mask."""
    model = build_tiny("qwen3_moe", num_hidden_layers=3, mlp_only_layers=[0])
    width = max(LENGTHS)
    mask = torch.tensor([[1] * n + [0] * (width - n) for n in LENGTHS])
    ids = torch.arange(1, 1 + mask.numel()).reshape(mask.shape) % 50 + 1
    with torch.no_grad(), record_routing(model) as trace:
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    return model, trace, mask


def _engine_of(trace: RoutingTrace, mask: torch.Tensor) -> list[torch.Tensor]:
    """What vLLM returns for the same routing: per request its real rows but the last token's."""
    width = mask.shape[1]
    grids = [t.long().reshape(-1, width, t.shape[1]) for t in trace.layers]
    out = []
    for row, n in enumerate(mask.sum(-1).tolist()):
        out.append(torch.stack([grid[row, : n - 1] for grid in grids], dim=1))  # (n - 1, moe layers, k)
    return out


def test_identical_routings_are_exact_although_the_engine_trace_fills_rows(recorded) -> None:
    model, trainer, mask = recorded
    engine = from_vllm(_engine_of(trainer, mask), model, attention_mask=mask)
    # Rows a router chose: the real tokens but each request's last one (the engine never forwarded it).
    expected = mask.bool().clone()
    for row, n in enumerate(LENGTHS):
        expected[row, n - 1] = False
    assert engine.routed is not None and engine.routed.dtype == torch.bool
    assert torch.equal(engine.routed, expected.reshape(-1))
    for chosen in (mask, None, mask.bool()):
        result = compare_routing(engine, trainer, mask=chosen)
        assert result.exact and result.mismatched == [0, 0], result.summary()
        assert result.compared == [sum(LENGTHS) - len(LENGTHS)] * 2
        assert result.tokens_compared == sum(LENGTHS) - len(LENGTHS)
    # Either side: the same rows are skipped.
    assert compare_routing(trainer, engine, mask=mask).compared == [sum(LENGTHS) - len(LENGTHS)] * 2


def test_the_routed_rows_travel_with_the_trace(recorded, tmp_path) -> None:
    model, trainer, mask = recorded
    engine = from_vllm(_engine_of(trainer, mask), model, attention_mask=mask)
    routed = engine.routed
    assert routed is not None
    engine.save(tmp_path / "engine.safetensors")
    for copy in (
        RoutingTrace.load(tmp_path / "engine.safetensors"),
        RoutingTrace.from_bytes(engine.to_bytes()),
        engine.compact(),
        engine.select_layers(engine.layer_ids),
    ):
        assert copy.routed is not None and torch.equal(copy.routed, routed)
    width = mask.shape[1]
    assert torch.equal(engine.select([1]).routed, routed.reshape(-1, width)[1])
    appended = engine.append_positions(2).routed
    assert appended is not None
    assert torch.equal(appended.reshape(-1, width + 2)[:, :width], routed.reshape(-1, width))
    assert not bool(appended.reshape(-1, width + 2)[:, width:].any())
    packed = engine.pack(mask, row_length=sum(LENGTHS) + 2)
    want = torch.cat(
        [routed.reshape(-1, width)[i, :n] for i, n in enumerate(LENGTHS)] + [torch.zeros(2, dtype=torch.bool)]
    )
    assert packed.routed is not None and torch.equal(packed.routed, want)


def test_a_recorded_trace_says_every_row_was_routed(recorded) -> None:
    assert recorded[1].routed is None


def test_routed_must_be_one_bool_per_row() -> None:
    layers = [torch.tensor([[0, 1], [2, 3]])]
    with pytest.raises(RoutingError, match=r"`routed` must be a 1-D bool tensor of 2 entries"):
        RoutingTrace(layers, num_experts=8, routed=torch.tensor([1, 0]))
    with pytest.raises(RoutingError, match=r"`routed` must be a 1-D bool tensor of 2 entries"):
        RoutingTrace(layers, num_experts=8, routed=torch.tensor([True]))


def test_a_transposed_mask_is_refused() -> None:
    a = _trace([[0, 1], [2, 3], [4, 5], [6, 7], [0, 2], [1, 3]], batch_size=2)  # 2 sequences x 3 positions
    b = _trace([[0, 1], [2, 4], [4, 5], [6, 7], [0, 3], [1, 3]], batch_size=2)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert compare_routing(a, b, mask=mask).mismatched == [2]  # (0, 1) and (1, 1)
    with pytest.raises(
        RoutingError, match=r"`mask` has shape \(3, 2\) but the traces hold 2 sequences of 3"
    ) as info:
        compare_routing(a, b, mask=mask.T)
    assert isinstance(info.value, ValueError)


def test_a_two_dimensional_mask_needs_the_batch_layout() -> None:
    a, b = [torch.tensor([[0, 1], [2, 3]])], [torch.tensor([[0, 1], [2, 4]])]
    with pytest.raises(RoutingError, match=r"no batch layout"):
        compare_routing(a, b, mask=torch.ones(1, 2, dtype=torch.bool))
    assert compare_routing(a, b, mask=torch.tensor([1, 1])).mismatched == [1]


@pytest.mark.parametrize(
    ("mask", "match"),
    [
        (torch.tensor([1.0, 0.5, 1.0]), r"`mask` holds float32"),
        (torch.tensor([1, 2, 1]), r"`mask` must hold only 0 and 1; found 2"),
        (torch.tensor([1, -1, 1]), r"`mask` must hold only 0 and 1; found -1"),
    ],
)
def test_a_mask_that_is_not_zeros_and_ones_is_refused(mask: torch.Tensor, match: str) -> None:
    a = _trace([[0, 1], [2, 3], [4, 5]])
    b = _trace([[0, 1], [2, 4], [4, 5]])
    with pytest.raises(RoutingError, match=match) as info:
        compare_routing(a, b, mask=mask)
    assert isinstance(info.value, ValueError)


def test_nothing_compared_is_refused_not_exact() -> None:
    a = _trace([[0, 1], [2, 3]], [[0, 1], [2, 3]], batch_size=1)
    b = _trace([[0, 1], [2, 4]], [[0, 1], [2, 4]], batch_size=1)
    with pytest.raises(RoutingError, match=r"compared no token.*decoder layer `0`") as info:
        compare_routing(a, b, mask=torch.zeros(1, 2, dtype=torch.bool))
    assert isinstance(info.value, ValueError)
    live = RoutingTrace([torch.tensor([[-1, -1], [-1, -1]])], num_experts=8, missing="live")
    with pytest.raises(RoutingError, match=r"compared no token"):
        compare_routing(live, [torch.tensor([[0, 1], [2, 3]])])
    with pytest.raises(RoutingError, match=r"no MoE layer"):
        compare_routing([], [])
