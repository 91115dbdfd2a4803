"""compare_routing: per MoE layer, the share of tokens whose expert set differs, and where (issue 20, point 7)."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from modelgraft.errors import RoutingError
from modelgraft.moe import RoutingTrace, compare_routing


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
