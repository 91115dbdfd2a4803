"""Catch the expert-selection ``topk`` of one MoE layer while its forward runs.

While the hooked module's forward runs, a ``TorchFunctionMode`` sees every torch call. A *candidate*
is a ``topk`` whose ``k`` is the layer's top-k over a last dimension of ``num_experts``; the expert
selection is the **last** candidate of the forward call (the one whose result the experts get). In
record mode the last candidate's indices are kept; in replay mode every candidate returns the
forced indices, with values gathered from the very tensor the family passed in, so softmax,
renormalisation, bias and scaling around it run exactly as the family wrote them and gradients
flow as usual. Forcing each candidate is what makes the last one forced whatever the shapes are.

A forward with more than one candidate is accepted only where the earlier one cannot change the
selection: group-limited routers (DeepSeek-V3 style) with one group (their per-group ``topk(2)``
runs over all experts, and picking one group of one is trivial) or with one expert per group (the
group pick itself is a top-k over the experts, and forcing it keeps exactly the forced groups).
Any other forward with several candidates is refused with a :class:`RoutingError` naming the layer.

Group-limited routers first pick ``topk_group`` of ``n_group`` groups. In replay that pick is
steered so the groups holding the forced experts always win (ties broken by the live scores), which
keeps the forced experts unmasked even after the router weights moved. A token whose forced experts
lie in more groups than the router keeps gets the best of those groups by live score (what the
family itself does when it selects outside its groups, e.g. AXK2, whose mask is ``0.0``); a forced
expert left with a non-finite score (DeepSeek-V3 masks with ``-inf``) is refused, since the family
can never select it.

Example:
    >>> import torch
    >>> from modelgraft.moe._discovery import MoELayer
    >>> layer = MoELayer("gate", 0, torch.nn.Identity(), torch.nn.Identity(), top_k=1, num_experts=3)
    >>> site = _Site(layer)
    >>> site.forced = torch.tensor([[2], [0]])
    >>> with _SelectionMode(site):
    ...     torch.topk(torch.tensor([[0.1, 0.7, 0.2], [0.3, 0.3, 0.4]]), 1, dim=-1).indices.tolist()
    [[2], [0]]
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from modelgraft.errors import RoutingError
from modelgraft.moe._discovery import MoELayer

_TOPK = {torch.topk, torch.Tensor.topk}


class _Site:
    """Record/replay state of one MoE layer; lives as long as one record or replay block."""

    def __init__(self, layer: MoELayer) -> None:
        self.layer = layer
        self.forced: torch.Tensor | None = None  # replay: (num_tokens, top_k) integer ids
        self.live: torch.Tensor | None = None  # replay: (num_tokens,) bool, rows the router chooses
        self.batch_size: int | None = None  # replay: sequences in the trace, when its layout is known
        self.guard: Any = None  # replay: called before each forward call (a session's checks)
        self.recorded: list[torch.Tensor] | None = None  # record: one tensor per forward call
        self.consumed = False
        self.consumed_in_block = False  # replay: consumed inside the current micro-batch block
        self.candidates = 0  # per forward call: top-k calls shaped like the selection
        self.pending: torch.Tensor | None = None  # per forward call (record): the last candidate's indices
        self.groups: tuple[int, int, torch.Tensor] | None = None  # per call (replay): kept, groups, spread


class _SelectionMode(TorchFunctionMode):
    """Intercepts ``topk`` for one site during one forward call of its scope module."""

    def __init__(self, site: _Site) -> None:
        super().__init__()
        self.site = site

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[Any, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _TOPK:
            return self._topk(func, args, kwargs)
        return func(*args, **kwargs)

    def _topk(self, func: Any, args: tuple[Any, ...], kwargs: dict[Any, Any]) -> Any:
        inp, k, dim, largest = _topk_args(args, kwargs)
        site, layer = self.site, self.site.layer
        last = dim in (-1, inp.dim() - 1)
        if not (last and largest):
            return func(*args, **kwargs)
        size = inp.shape[-1]
        rows = inp.numel() // max(size, 1)
        forced = site.forced
        if k == layer.top_k and size == layer.num_experts:
            site.candidates += 1
            if forced is None:
                out = func(*args, **kwargs)
                site.pending = out.indices
                return out
            if forced.shape[0] != rows:
                raise RoutingError(_rows_message(site, rows))
            site.consumed = site.consumed_in_block = True
            index = forced.to(inp.device, torch.long).reshape(*inp.shape[:-1], k)
            if site.live is not None:  # rows without a route: the router's own choice
                native = func(*args, **kwargs).indices
                index = torch.where(site.live.to(inp.device).reshape(*inp.shape[:-1], 1), native, index)
            values = inp.gather(-1, index)
            if site.groups is not None:  # only a steered group pick can mask a forced expert
                _refuse_masked(layer, forced, site.groups, values.detach().reshape(-1, k), site.live)
            return torch.return_types.topk((values, index))
        if forced is not None and _is_group_pick(layer, size, k, rows, forced):
            return _steer_groups(inp, k, forced, site, lambda: func(*args, **kwargs).indices)
        return func(*args, **kwargs)


def _refuse_masked(
    layer: MoELayer,
    forced: torch.Tensor,
    groups: tuple[int, int, torch.Tensor],
    values: torch.Tensor,
    live: torch.Tensor | None,
) -> None:
    """A forced expert whose selection score is -inf/NaN: masked out of the kept groups."""
    bad = ~torch.isfinite(values)
    if live is not None:  # the router chose those rows itself
        bad &= ~live.to(bad.device).unsqueeze(1)
    if not bool(bad.any()):
        return
    token, slot = (int(i) for i in bad.nonzero()[0])
    kept, num_groups, spread = groups
    row = forced[token].tolist()
    if int(spread[token]) > kept:
        raise RoutingError(
            f"MoE layer `{layer.name}` sends token {token} to experts {row} in {int(spread[token])} groups, but its "
            f"router keeps topk_group={kept} of {num_groups} groups per token and scores expert {row[slot]} "
            f"{float(values[token, slot])} outside them, so the family never selects it; record the routing with "
            "this model's `n_group`/`topk_group`."
        )
    raise RoutingError(
        f"MoE layer `{layer.name}` scores forced expert {row[slot]} of token {token} {float(values[token, slot])} "
        "in its selection; a non-finite routing score cannot be replayed."
    )


def _rows_message(site: _Site, rows: int) -> str:
    layer, have = site.layer, site.forced.shape[0] if site.forced is not None else 0
    message = (
        f"MoE layer `{layer.name}` routed {rows} tokens but its routing data has {have} rows; replay the "
        "batch the routing was recorded on (same batch size, sequence length and padding)."
    )
    batch = site.batch_size
    if batch and rows > have and rows % batch == 0 and have % batch == 0:
        extra = (rows - have) // batch
        message += (
            f" The trace covers {batch} sequences of {have // batch} positions and this forward has "
            f"{rows // batch}: for a forward over all of `generate`'s `sequences` (generate never forwards "
            f"the last token), replay `trace.append_positions({extra})`."
        )
    return message


def _is_group_pick(layer: MoELayer, size: int, k: int, rows: int, forced: torch.Tensor) -> bool:
    """Whether a ``topk`` (not shaped like the selection) picks expert groups of a group-limited router."""
    if rows != forced.shape[0] or not 1 < size <= layer.num_experts or layer.num_experts % size or k >= size:
        return False
    if layer.n_group is not None:
        return size == layer.n_group
    return size < layer.num_experts  # a group count modelgraft cannot read: groups are fewer than experts


def extra_candidates_harmless(layer: MoELayer, candidates: int) -> bool:
    """Whether a forward with ``candidates`` selection-shaped top-k calls still selects exactly.

    Example:
        >>> layer = MoELayer("gate", 0, torch.nn.Identity(), torch.nn.Identity(), 2, 8, n_group=1, topk_group=1)
        >>> extra_candidates_harmless(layer, 2), extra_candidates_harmless(layer, 3)
        (True, False)
    """
    if candidates == 1:
        return True
    return candidates == 2 and layer.n_group in (1, layer.num_experts)


def _topk_args(args: tuple[Any, ...], kwargs: dict[Any, Any]) -> tuple[torch.Tensor, int, int, bool]:
    names = ("input", "k", "dim", "largest", "sorted")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound["input"], int(bound["k"]), int(bound.get("dim", -1)), bool(bound.get("largest", True))


def _steer_groups(scores: torch.Tensor, k: int, forced: torch.Tensor, site: _Site, native: Any) -> Any:
    """Top-``k`` groups where groups holding a forced expert rank first, then by live score.

    When a token's forced experts lie in more than ``k`` groups, the best ``k`` of those groups by
    live score are kept; the spread is kept on ``site`` so that the selection can refuse a forced
    expert the family then masks with a non-finite score. Rows the router chooses itself (``live``)
    get the family's own group pick (``native()``).
    """
    flat = scores.reshape(-1, scores.shape[-1])
    num_groups = flat.shape[-1]
    groups = forced.to(scores.device, torch.long).clamp(min=0) // (site.layer.num_experts // num_groups)
    wanted = torch.zeros_like(flat, dtype=torch.bool).scatter_(1, groups, True)
    site.groups = (k, num_groups, wanted.sum(-1))
    # Rank by live score, then lift the wanted groups above every other group.
    rank = flat.detach().argsort(dim=-1).argsort(dim=-1)
    key = rank + wanted.to(rank.dtype) * num_groups
    index = key.topk(k, dim=-1).indices
    if site.live is not None:
        live = site.live.to(scores.device).unsqueeze(1)
        index = torch.where(live, native().reshape(-1, k), index)
    values = flat.gather(-1, index)
    shape = (*scores.shape[:-1], k)
    return torch.return_types.topk((values.reshape(shape), index.reshape(shape)))


def in_backward() -> bool:
    """True while autograd recomputes a checkpointed forward (do not record twice)."""
    return torch._C._current_graph_task_id() != -1


# ---- which record/replay blocks a forward belongs to ------------------------------------------------
# The hooks act per block, not per model: a block activates its sites in the ContextVar of the thread
# or task that entered it, so a forward of the same model in another thread or task runs plainly (and
# is not recorded). A scope module gets one dispatching `forward` while any block (or a recompute bound
# to one) uses it; the dispatcher reads the caller's context to find the site, if any.
_ACTIVE: ContextVar[dict[int, _Site]] = ContextVar("modelgraft_moe_sites", default={})  # noqa: B039  # never mutated
_BOUND: ContextVar[bool] = ContextVar("modelgraft_moe_bound_recompute", default=False)
_LOCK = threading.Lock()


@dataclass
class _Users:
    """The blocks (and bound recomputes) using one scope module's dispatcher."""

    sites: list[_Site]
    previous: Any  # the instance-level forward found when installing (accelerate hooks put one), or None


_USERS: weakref.WeakKeyDictionary[nn.Module, _Users] = weakref.WeakKeyDictionary()


def active_sites() -> dict[int, _Site]:
    """The sites active in the caller's thread or task, by ``id`` of their scope module."""
    return _ACTIVE.get()


def _acquire(site: _Site) -> None:
    scope = site.layer.scope
    with _LOCK:
        users = _USERS.get(scope)
        if users is None:
            users = _USERS[scope] = _Users([], scope.__dict__.get("forward"))
            scope.forward = _dispatcher(scope, scope.forward)
        users.sites.append(site)


def _release(site: _Site) -> None:
    scope = site.layer.scope
    with _LOCK:
        users = _USERS.get(scope)
        if users is None or not any(s is site for s in users.sites):
            return
        users.sites.remove(next(s for s in users.sites if s is site))
        if users.sites:
            return
        del _USERS[scope]
        if getattr(scope.__dict__.get("forward"), "_modelgraft_moe_dispatch", False):
            if users.previous is None:
                del scope.__dict__["forward"]
            else:
                scope.forward = users.previous


def _dispatcher(scope: nn.Module, original: Any) -> Any:
    @torch.compiler.disable  # type: ignore[untyped-decorator]  # untyped in torch
    def forward(*args: Any, **kwargs: Any) -> Any:
        site = _ACTIVE.get().get(id(scope))
        if site is None:
            if in_backward() and not _BOUND.get():
                _refuse_unbound_recompute(scope)
            return original(*args, **kwargs)
        return _run(site, original, args, kwargs)

    forward._modelgraft_moe_dispatch = True
    return forward


def _refuse_unbound_recompute(scope: nn.Module) -> None:
    """A recompute outside every block's context while a replay block forces this layer elsewhere."""
    with _LOCK:
        users = _USERS.get(scope)
        replays = [s for s in users.sites if s.recorded is None] if users is not None else []
    if replays:
        raise RoutingError(
            f"MoE layer `{replays[0].layer.name}` is recomputed during backward (gradient checkpointing) in a "
            "thread or task that is not its `replay_routing` block's, by a checkpoint function modelgraft does "
            "not bind, so it cannot tell whether the forward being recomputed was replayed. Enable checkpointing "
            "with `model.gradient_checkpointing_enable()` (its recomputes keep the routes of their forward), or "
            "run the backward in the block's thread."
        )


def _run(site: _Site, original: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if site.guard is not None:
        site.guard(site)
    site.candidates, site.pending, site.groups = 0, None, None
    with _SelectionMode(site):
        out = original(*args, **kwargs)
    layer = site.layer
    if not site.candidates:
        raise RoutingError(
            f"MoE layer `{layer.name}` ({type(layer.router).__name__}) ran without a top-k "
            f"over its {layer.num_experts} experts with k={layer.top_k}; this family "
            "selects experts another way and cannot be recorded or replayed."
        )
    if not extra_candidates_harmless(layer, site.candidates):
        raise RoutingError(
            f"MoE layer `{layer.name}` ({type(layer.router).__name__}) ran {site.candidates} top-k calls "
            f"over its {layer.num_experts} experts with k={layer.top_k}; modelgraft cannot tell which one "
            "selects the experts, so it cannot record or replay this layer exactly."
        )
    if site.recorded is not None and site.pending is not None and not in_backward():
        site.recorded.append(site.pending.detach().reshape(-1, layer.top_k).clone())
    return out


def hook_scope(site: _Site) -> None:
    """Make ``site``'s scope module run its forward under a selection mode, in the caller's thread or task.

    Forwards of the module from another thread or task run plainly. Only a second record/replay of
    the same module in the same thread or task is refused.
    """
    scope = site.layer.scope
    active = _ACTIVE.get()
    if id(scope) in active:
        raise RoutingError(
            f"MoE layer `{site.layer.name}` is already being recorded or replayed; nested "
            "record/replay blocks on one model are not supported."
        )
    _acquire(site)
    _ACTIVE.set({**active, id(scope): site})


def unhook_scope(site: _Site) -> None:
    """Undo :func:`hook_scope` (safe to call twice, and for a site never hooked)."""
    scope = site.layer.scope
    active = _ACTIVE.get()
    if active.get(id(scope)) is site:
        _ACTIVE.set({key: value for key, value in active.items() if key != id(scope)})
    _release(site)


@contextmanager
def activated(sites: dict[int, _Site]) -> Iterator[None]:
    """Run with exactly ``sites`` active (a checkpointed forward's recompute: the sites of its forward).

    The scope modules keep their dispatcher while it runs, also after the blocks of those sites ended.
    """
    held = list(sites.values())
    for site in held:
        _acquire(site)
    previous, bound = _ACTIVE.get(), _BOUND.get()
    _ACTIVE.set(sites)
    _BOUND.set(True)
    try:
        yield
    finally:
        _ACTIVE.set(previous)
        _BOUND.set(bound)
        for site in held:
            _release(site)
