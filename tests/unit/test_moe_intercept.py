"""The top-k interception on its own: final selection, group-limited steering, pass-through."""

from __future__ import annotations

import torch
from torch import nn

from modelgraft.moe._discovery import MoELayer
from modelgraft.moe._intercept import _SelectionMode, _Site


def _site(top_k: int = 2, num_experts: int = 8) -> _Site:
    return _Site(MoELayer("gate", 0, nn.Identity(), nn.Identity(), top_k=top_k, num_experts=num_experts))


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
    assert len(site.recorded) == 1 and torch.equal(site.recorded[0], idx)


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
    assert not site.selected and not site.consumed
