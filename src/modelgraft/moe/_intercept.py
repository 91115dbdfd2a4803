"""Catch the expert-selection ``topk`` of one MoE layer while its forward runs.

While the hooked module's forward runs, a ``TorchFunctionMode`` sees every torch call. The final
expert selection is the ``topk`` whose ``k`` is the layer's top-k over a last dimension of
``num_experts``; in record mode its indices are kept, in replay mode it returns the forced indices
with values gathered from the very tensor the family passed in, so softmax, renormalisation, bias
and scaling around it run exactly as the family wrote them and gradients flow as usual.

Group-limited routers (DeepSeek-V3 style) first pick ``topk_group`` of ``n_group`` groups. In
replay that pick is steered so the groups holding the forced experts always win (ties broken by
the live scores), which keeps the forced experts unmasked even after the router weights moved.

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

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from modelgraft.errors import RoutingError
from modelgraft.moe._discovery import MoELayer

_TOPK = {torch.topk, torch.Tensor.topk}


class _Site:
    """Record/replay state of one MoE layer; lives as long as one record or replay block."""

    def __init__(self, layer: MoELayer) -> None:
        self.layer = layer
        self.forced: torch.Tensor | None = None  # replay: (num_tokens, top_k) long
        self.recorded: list[torch.Tensor] | None = None  # record: one tensor per forward call
        self.consumed = False
        self.selected = False  # set per forward call
        self.previous_forward: Any = None  # an instance-level forward found when hooking


class _SelectionMode(TorchFunctionMode):
    """Intercepts ``topk`` for one site during one forward call of its scope module."""

    def __init__(self, site: _Site) -> None:
        super().__init__()
        self.site = site

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _TOPK and not self.site.selected:
            return self._topk(func, args, kwargs)
        return func(*args, **kwargs)

    def _topk(self, func: Any, args: tuple, kwargs: dict) -> Any:
        inp, k, dim, largest = _topk_args(args, kwargs)
        layer = self.site.layer
        last = dim in (-1, inp.dim() - 1)
        if not (last and largest):
            return func(*args, **kwargs)
        size = inp.shape[-1]
        rows = inp.numel() // max(size, 1)
        forced = self.site.forced
        if k == layer.top_k and size == layer.num_experts:
            self.site.selected = True
            if forced is None:
                out = func(*args, **kwargs)
                if self.site.recorded is not None and not _in_backward():
                    self.site.recorded.append(out.indices.detach().reshape(-1, k).clone())
                return out
            if forced.shape[0] != rows:
                raise RoutingError(
                    f"MoE layer `{layer.name}` routed {rows} tokens but its routing data has "
                    f"{forced.shape[0]} rows; replay the batch the routing was recorded on (same "
                    "batch size, sequence length and padding)."
                )
            self.site.consumed = True
            index = forced.to(inp.device).reshape(*inp.shape[:-1], k)
            return torch.return_types.topk((inp.gather(-1, index), index))
        if forced is not None and 1 < size < layer.num_experts and layer.num_experts % size == 0:
            if rows == forced.shape[0] and k < size:
                return _steer_groups(inp, k, forced, layer.num_experts // size)
        return func(*args, **kwargs)


def _topk_args(args: tuple, kwargs: dict) -> tuple[torch.Tensor, int, int, bool]:
    names = ("input", "k", "dim", "largest", "sorted")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound["input"], int(bound["k"]), int(bound.get("dim", -1)), bool(bound.get("largest", True))


def _steer_groups(scores: torch.Tensor, k: int, forced: torch.Tensor, group_size: int) -> Any:
    """Top-``k`` groups where groups holding a forced expert always rank first."""
    flat = scores.reshape(-1, scores.shape[-1])
    groups = forced.to(scores.device) // group_size
    wanted = torch.zeros_like(flat, dtype=torch.bool).scatter_(1, groups, True)
    # Rank by live score, then lift the wanted groups above every other group.
    rank = flat.detach().argsort(dim=-1).argsort(dim=-1)
    key = rank + wanted.to(rank.dtype) * flat.shape[-1]
    index = key.topk(k, dim=-1).indices
    values = flat.gather(-1, index)
    shape = (*scores.shape[:-1], k)
    return torch.return_types.topk((values.reshape(shape), index.reshape(shape)))


def _in_backward() -> bool:
    """True while autograd recomputes a checkpointed forward (do not record twice)."""
    return torch._C._current_graph_task_id() != -1


def hook_scope(site: _Site) -> None:
    """Make ``site``'s scope module run its forward under a selection mode.

    An instance-level ``forward`` already there (accelerate hooks put one) is wrapped and put back by
    :func:`unhook_scope`; only a second record/replay on the same module is refused.
    """
    scope = site.layer.scope
    existing = scope.__dict__.get("forward")
    if getattr(existing, "_modelgraft_moe_site", None) is not None:
        raise RoutingError(
            f"MoE layer `{site.layer.name}` is already being recorded or replayed; nested "
            "record/replay blocks on one model are not supported."
        )
    original = scope.forward

    @torch.compiler.disable
    def forward(*args: Any, **kwargs: Any) -> Any:
        site.selected = False
        with _SelectionMode(site):
            out = original(*args, **kwargs)
        if not site.selected:
            raise RoutingError(
                f"MoE layer `{site.layer.name}` ({type(site.layer.router).__name__}) ran without a top-k "
                f"over its {site.layer.num_experts} experts with k={site.layer.top_k}; this family "
                "selects experts another way and cannot be recorded or replayed."
            )
        return out

    forward._modelgraft_moe_site = site  # type: ignore[attr-defined]
    site.previous_forward = existing
    scope.forward = forward


def unhook_scope(site: _Site) -> None:
    """Undo :func:`hook_scope` (safe to call twice, and for a site never hooked)."""
    scope = site.layer.scope
    current = scope.__dict__.get("forward")
    if getattr(current, "_modelgraft_moe_site", None) is not site:
        return
    if site.previous_forward is None:
        del scope.__dict__["forward"]
    else:
        scope.forward = site.previous_forward
