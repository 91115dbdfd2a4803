"""The top-k interception on its own: final selection, group-limited steering, pass-through.

Unit tests of ``modelgraft.moe._intercept`` (their own file): they import it directly, the one exception to
tests using public names only (issue 14); everything else comes from the public namespaces.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from modelgraft import RoutingError
from modelgraft.moe._discovery import MoELayer
from modelgraft.moe._intercept import _SelectionMode, _Site, hook_scope, unhook_scope


def _site(top_k: int = 2, num_experts: int = 8, **groups: int) -> _Site:
    return _Site(
        MoELayer("gate", 0, nn.Identity(), nn.Identity(), top_k=top_k, num_experts=num_experts, **groups)
    )


def _group_limited(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3-style selection: best 2 of 4 groups, then top-2 experts; weights from masked scores."""
    tokens = scores.shape[0]
    group_scores = scores.view(tokens, 4, 2).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=2, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    expert_mask = group_mask.unsqueeze(-1).expand(tokens, 4, 2).reshape(tokens, 8).bool()
    masked = scores.masked_fill(~expert_mask, 0.0)
    idx = torch.topk(masked, k=2, dim=-1, sorted=False)[1]
    return idx, masked.gather(1, idx)


def test_group_limited_replay_keeps_forced_experts_unmasked() -> None:
    scores = torch.tensor([[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.2, 0.1]])
    site = _site()
    site.forced = torch.tensor([[7, 6]])  # the worst group: masked out without steering
    with _SelectionMode(site):
        idx, weights = _group_limited(scores)
    assert idx.tolist() == [[7, 6]]
    assert torch.equal(weights, torch.tensor([[0.1, 0.2]]))
    assert site.consumed


def test_recording_keeps_the_final_selection_only() -> None:
    scores = torch.rand(3, 8, generator=torch.Generator().manual_seed(0))
    site = _site()
    site.recorded = []
    with _SelectionMode(site):
        idx, _ = _group_limited(scores)
    assert site.candidates == 1 and torch.equal(site.pending, idx)


def test_other_topk_calls_pass_through() -> None:
    x = torch.rand(4, 8, generator=torch.Generator().manual_seed(1))
    site = _site()
    site.forced = torch.zeros(4, 2, dtype=torch.long)
    with _SelectionMode(site):
        smallest = torch.topk(x, 2, largest=False).indices
        other_dim = x.topk(2, dim=0).indices
        other_k = x.topk(3).indices
    assert torch.equal(smallest, torch.topk(x, 2, largest=False).indices)
    assert torch.equal(other_dim, x.topk(2, dim=0).indices)
    assert torch.equal(other_k, x.topk(3).indices)
    assert not site.candidates and not site.consumed


class _V3Router(nn.Module):
    """DeepSeek-V3's selection (sigmoid scores, per-group top-2 sums, group pick, masked top-k)."""

    def __init__(self, n_group: int, topk_group: int, top_k: int, num_experts: int = 8) -> None:
        super().__init__()
        self.num_group, self.topk_group, self.top_k, self.num_experts = (
            n_group,
            topk_group,
            top_k,
            num_experts,
        )
        self.weight = nn.Parameter(torch.randn(num_experts, 4, generator=torch.Generator().manual_seed(0)))
        self.fill = float("-inf")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = (x @ self.weight.T).sigmoid()
        size = self.num_experts // self.num_group
        group_scores = scores.view(-1, self.num_group, size).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        keep = mask.unsqueeze(-1).expand(-1, self.num_group, size).reshape(-1, self.num_experts).bool()
        idx = torch.topk(scores.masked_fill(~keep, self.fill), k=self.top_k, dim=-1, sorted=False)[1]
        return idx, scores.gather(1, idx)


def _hooked_site(router: nn.Module, **groups: int) -> _Site:
    layer = MoELayer("gate", 0, router, router, router.top_k, router.num_experts, **groups)
    site = _Site(layer)
    hook_scope(site)
    return site


def test_one_group_top2_forces_the_final_selection_not_the_group_topk() -> None:
    """Issue 10, point 1: with n_group=1 the per-group topk(2) runs over all experts."""
    router = _V3Router(n_group=1, topk_group=1, top_k=2)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    native, _ = router(x)
    site = _hooked_site(router, n_group=1, topk_group=1)
    try:
        site.forced = (native + 1) % 8
        idx, weights = router(x)
    finally:
        unhook_scope(site)
    assert torch.equal(idx, site.forced)
    assert torch.equal(weights, (x @ router.weight.T).sigmoid().gather(1, site.forced))
    assert site.candidates == 2


def test_one_group_top2_records_the_final_selection() -> None:
    router = _V3Router(n_group=1, topk_group=1, top_k=2)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    native, _ = router(x)
    site = _hooked_site(router, n_group=1, topk_group=1)
    site.recorded = []
    try:
        router(x)
    finally:
        unhook_scope(site)
    assert len(site.recorded) == 1 and torch.equal(site.recorded[0], native)


def test_several_selection_shaped_topk_calls_without_groups_are_refused() -> None:
    class TwoTopK(nn.Module):
        top_k, num_experts = 2, 8

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            aux = x.topk(2, dim=-1).indices  # e.g. an auxiliary statistic shaped like the selection
            return x.topk(2, dim=-1).indices + 0 * aux

    router = TwoTopK()
    site = _hooked_site(router)
    site.recorded = []
    try:
        with pytest.raises(RoutingError, match=r"`gate` \(TwoTopK\) ran 2 top-k calls over its 8 experts"):
            router(torch.randn(3, 8))
    finally:
        unhook_scope(site)
    assert site.recorded == []


@pytest.mark.parametrize("mask", [float("-inf"), 0.0])
def test_forced_experts_outside_the_kept_groups(mask: float) -> None:
    """DeepSeek-V3 masks experts outside the kept groups with -inf: forcing one is refused. A family
    that masks with 0.0 (AXK2) selects such experts itself when scores are negative: forced exactly."""
    router = _V3Router(n_group=4, topk_group=1, top_k=2)
    router.fill = mask
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
    site = _hooked_site(router, n_group=4, topk_group=1)
    site.forced = torch.tensor([[6, 7], [1, 2], [0, 3]])  # token 1: groups 0 and 1, one group kept
    try:
        if mask == 0.0:
            idx, _ = router(x)
            assert torch.equal(idx, site.forced)
            return
        with pytest.raises(
            RoutingError,
            match=r"`gate` sends token 1 to experts \[1, 2\] in 2 groups, but its router keeps topk_group=1 of "
            r"4 groups per token and scores expert [12] -inf outside them",
        ):
            router(x)
    finally:
        unhook_scope(site)
