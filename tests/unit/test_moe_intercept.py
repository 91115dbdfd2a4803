"""The top-k interception on its own: final selection, group-limited steering, pass-through; and what
each MoE family's code gets back from its selection under record/replay (the replay contract).

Unit tests of ``modelgraft.moe._intercept`` (their own file): they import it directly, the one exception to
tests using public names only (issue 14); everything else comes from the public namespaces.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from modelgraft import RoutingError
from modelgraft.moe import moe_layers, record_routing, replay_routing
from modelgraft.moe._discovery import MoELayer
from modelgraft.moe._intercept import _SelectionMode, _Site, hook_scope, unhook_scope
from moe_families import BATCH, SEQ, model_output, moe_model_types, plain_failure, routed_tokens, tiny_or_skip


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


# ---- the record/replay contract on every MoE family of the installed transformers (issue 4, points
# 1-2; moved from tests/integration/test_moe_families.py: its `selections` fixture spies on
# `_SelectionMode._topk`). Families are found at run time; one that cannot be built tiny, or whose
# router does not select with a top-k, is skipped with the reason.
FAMILIES = moe_model_types()


#: layer name -> the module holding its experts, filled by `_expert_inputs`.
holders: dict[str, torch.nn.Module] = {}


def _handed_to_experts(holder: torch.nn.Module, routes: torch.Tensor) -> torch.Tensor:
    """The ids a block hands its experts module for the selected ``routes``: the same ids, except
    that LongCat-Flash's block (transformers 5.25 on, where its experts module no longer has
    `total_experts`) sends its zero (identity) experts on as weight-0 dummy ids spread over the
    routed experts, and adds their identity output itself."""
    zero = getattr(holder, "zero_expert_num", 0) or 0
    routed = getattr(holder, "num_routed_experts", None)
    if zero and routed is not None and not hasattr(getattr(holder, "experts", None), "total_experts"):
        dummy = (routes - routed) * routed // zero
        return torch.where(routes >= routed, dummy, routes)
    return routes


def _expert_inputs(model: torch.nn.Module) -> tuple[list[tuple[str, torch.Tensor, torch.Tensor]], list]:
    """Hook each experts module to see the (indices, weights) it is given, where its call shows them."""
    seen: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    handles = []
    holders.clear()
    for layer in moe_layers(model):
        parent = layer.scope if layer.scope is not layer.router else None
        holder = parent if parent is not None else _parent_of(model, layer.name)
        experts = [
            m for n, m in holder.named_children() if "Expert" in type(m).__name__ and "Shared" not in n
        ]
        if not experts:
            continue

        holders[layer.name] = holder

        def hook(module, args, kwargs, k=layer.top_k, name=layer.name):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            idx = [t for t in tensors if not t.is_floating_point() and t.shape[-1:] == (k,)]
            wts = [t for t in tensors if t.is_floating_point() and idx and t.shape == idx[0].shape]
            if idx and wts:
                seen.append(
                    (name, idx[0].detach().reshape(-1, k).clone(), wts[0].detach().reshape(-1, k).clone())
                )

        handles.append(experts[0].register_forward_pre_hook(hook, with_kwargs=True))
    return seen, handles


def _skip_if_plain_forward_fails(model_type: str) -> None:
    reason = plain_failure(model_type)
    if reason:
        pytest.skip(f"{model_type}: {reason}")


def _parent_of(model: torch.nn.Module, name: str) -> torch.nn.Module:
    return model.get_submodule(name.rpartition(".")[0]) if "." in name else model


@pytest.fixture
def selections(monkeypatch: pytest.MonkeyPatch) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, (indices, scores) of its expert selection (the last selection-shaped top-k of the
    layer's forward), as the family's code received them."""
    captured: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    original = _SelectionMode._topk

    def spy(self, func, args, kwargs):
        before = self.site.candidates
        out = original(self, func, args, kwargs)
        if self.site.candidates > before:
            k = self.site.layer.top_k
            captured[self.site.layer.name] = (
                out.indices.detach().reshape(-1, k),
                out.values.detach().reshape(-1, k),
            )
        return out

    monkeypatch.setattr(_SelectionMode, "_topk", spy)
    return captured


@pytest.mark.parametrize("model_type", FAMILIES)
def test_replay_contract(model_type: str, selections: dict) -> None:
    model = tiny_or_skip(model_type)
    layers = moe_layers(model)
    ids = torch.randint(1, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))

    try:
        with record_routing(model) as trace, torch.no_grad():
            reference = model_output(model, ids)
    except RoutingError:
        raise
    except Exception as exc:
        _skip_if_plain_forward_fails(model_type)
        raise AssertionError(f"{model_type} runs plainly but fails while recording") from exc
    assert len(trace) == len(layers)
    for layer, routes in zip(layers, trace):
        assert layer.top_k < layer.num_experts, f"{layer.name}: a choice among experts is needed to test"
        assert routes.shape == (routed_tokens(model_type, layer.name, ids), layer.top_k), layer.name
        assert 0 <= int(routes.min()) and int(routes.max()) < layer.num_experts

    # Unchanged weights: bit-identical.
    seen, handles = _expert_inputs(model)
    selections.clear()
    with replay_routing(model, trace), torch.no_grad():
        replayed = model_output(model, ids)
    assert torch.equal(replayed, reference)
    before = list(seen)
    seen.clear()
    selected_before = dict(selections)
    selections.clear()

    # Perturbed router: same experts, different routing weights, and the router gets a gradient.
    routers = [layer.router for layer in layers]
    saved = [{k: v.clone() for k, v in r.state_dict().items()} for r in routers]
    try:
        with torch.no_grad():
            gen = torch.Generator().manual_seed(2)
            for router in routers:
                for p in router.parameters():
                    if p.is_floating_point():
                        p.add_(torch.randn(p.shape, generator=gen))
        model.zero_grad(set_to_none=True)
        with replay_routing(model, trace):
            out = model_output(model, ids)
            out.float().pow(2).mean().backward()
    finally:
        for handle in handles:
            handle.remove()
        for router, state in zip(routers, saved):
            router.load_state_dict(state)
    after = list(seen)
    assert not torch.equal(out.detach(), reference)
    # What the family's own code got back from its selection: the recorded experts, live scores.
    # (Keyed by layer: execution order may differ from module order, e.g. JetMoE's attention experts.)
    by_name_before, by_name_after = selected_before, selections
    assert len(selected_before) == len(selections) == len(layers)
    for layer, routes in zip(layers, trace):
        (idx_b, score_b), (idx_a, score_a) = by_name_before[layer.name], by_name_after[layer.name]
        assert torch.equal(idx_b, routes) and torch.equal(idx_a, routes), layer.name
        assert not torch.equal(score_a, score_b), layer.name
    if before:  # the family's experts module shows the indices and weights it receives
        routes_of = {
            layer.name: _handed_to_experts(holders[layer.name], routes)
            for layer, routes in zip(layers, trace)
        }
        weights_before = {name: w for name, _, w in before}
        assert len(after) == len(before)
        for (name, idx_b, _), (name_a, idx_a, w_a) in zip(before, after):
            assert name == name_a
            assert torch.equal(idx_b.long(), routes_of[name]) and torch.equal(idx_a.long(), routes_of[name])
            assert not torch.equal(w_a, weights_before[name]), name
    grads = [p.grad for r in routers for p in r.parameters() if p.requires_grad]
    assert any(g is not None and bool(g.abs().sum() > 0) for g in grads), "router weight got no gradient"
