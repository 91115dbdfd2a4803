"""Which modules of a built model route tokens to experts, and how to hook them.

Everything that knows how a transformers version lays out its MoE layers lives here, so that
supporting another layout (transformers 4.57 routes inside the sparse-MoE block with a plain
``nn.Linear`` gate) means changing this module only.

transformers 5.x gives each MoE family a router module (``*TopKRouter``, ``*TopkRouter``,
``*Router``, ``*Gate``, ``*Gating``) next to an experts module. The router either selects the
experts itself or returns logits that its parent block turns into a selection; in both cases the
selection is a ``topk`` over the experts dimension, so the *scope* we hook is the router when its
forward calls ``topk`` and the parent block otherwise.

Example:
    >>> import torch
    >>> class TinyRouter(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.weight = torch.nn.Parameter(torch.zeros(4, 8))
    ...         self.top_k, self.num_experts = 2, 4
    ...     def forward(self, x):
    ...         return torch.topk(x @ self.weight.T, self.top_k, dim=-1)
    >>> class TinyExperts(torch.nn.Module):
    ...     pass
    >>> block = torch.nn.Module()
    >>> block.gate, block.experts = TinyRouter(), TinyExperts()
    >>> [(layer.name, layer.top_k, layer.num_experts) for layer in find_moe_layers(block)]
    [('gate', 2, 4)]
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Hashable
from dataclasses import dataclass
from functools import cache
from typing import Any, cast

import torch
from torch import nn

from modelgraft import _compat

__all__ = ["MoELayer", "find_moe_layers", "unsupported_reason"]

_ROUTER_CLASS = re.compile(r"(Router|Gate|Gating)$")
_TOP_N_IN_NAME = re.compile(r"Top(\d+)Router$")
_TOPK_CALL = re.compile(r"\.topk\(|torch\.topk\b")
_TOP_K_ATTRS = (
    "top_k",
    "num_experts_per_tok",
    "top_k_experts",
    "moe_topk",
    "moe_top_k",  # DBRX's router on transformers 4.57 (its config's `top_k` is generation's 50)
    "moe_k",
    "num_selected_experts",
    "topk",
    "k",
)
# Expert counts by the names routers, blocks and configs give them (a router naming several: see
# `_num_experts`). `num_router_classes` first: where a block or config names several, ZAYA's counts
# its "skip" expert, which the selection is over.
_NUM_EXPERTS_ATTRS = (
    "num_router_classes",
    "num_experts",
    "n_routed_experts",
    "num_local_experts",
    "n_experts",
    "moe_num_experts",
)

# Group-limited routers (DeepSeek-V3 style) keep `topk_group` of `n_group` expert groups per token.
# Only the router and its block are read: a config may carry group fields its family ignores.
_N_GROUP_ATTRS = ("num_group", "n_group")

# Routers whose selection is not one top-k over the experts dimension: replaying them would
# need family-specific code, which this package deliberately does not carry.
_UNSUPPORTED = {
    "PhimoeTopKRouter": "selects with `sparsemixer` (two masked `max` passes, Gumbel sampling in "
    "training), not a top-k over the experts",
    # transformers 4.57: Phi-MoE selects inside its block (the router is a plain `nn.Linear` gate).
    "PhimoeSparseMoeBlock": "selects with `sparsemixer` (two masked `max` passes, Gumbel sampling in "
    "training), not a top-k over the experts",
    "DeepseekV4HashRouter": "routes by a fixed hash of the token id; there is no learned selection to replay",
    "SwitchTransformersTop1Router": "selects with `argmax` and token capacity dropping, not a top-k",
    "NllbMoeTop2Router": "selects with two `argmax` passes, random second-expert dropping and token "
    "capacity, not a top-k",
}


@dataclass
class MoELayer:
    """One routing site of a model.

    Attributes:
        name: qualified name of the router module inside the model.
        layer_id: index of the decoder layer holding it (first integer in ``name``), or the ordinal
            of the router among the model's routers when the name holds no integer.
        router: the router module.
        scope: the module whose forward performs the final expert selection (the router or its parent).
        top_k: experts selected per token.
        num_experts: experts to choose from.
        n_group: expert groups of a group-limited router (DeepSeek-V3 style), read from the router or
            its block (``num_group``/``n_group``); ``None`` for routers without groups.
        topk_group: groups such a router keeps per token (``topk_group``), else ``None``.
    """

    name: str
    layer_id: int
    router: nn.Module
    scope: nn.Module
    top_k: int
    num_experts: int
    n_group: int | None = None
    topk_group: int | None = None


def unsupported_reason(router: nn.Module) -> str | None:
    """Why ``router``'s family cannot be replayed, or ``None`` when it can.

    Example:
        >>> unsupported_reason(torch.nn.Linear(2, 2)) is None
        True
    """
    return _UNSUPPORTED.get(type(router).__name__)


def find_moe_layers(model: nn.Module) -> list[MoELayer]:
    """List the routing sites of ``model`` in module order.

    A module is a router when its class name ends with ``Router``, ``Gate`` or ``Gating`` and its
    parent also has a child whose class name mentions ``Expert``; the latter check keeps out
    unrelated "routers" (e.g. a vision density router) that select no experts.

    Args:
        model: any built transformers model (or a sub-module of one).

    Returns:
        One :class:`MoELayer` per router, in ``model.named_modules()`` order.
    """
    config = getattr(model, "config", None)
    found: list[MoELayer] = []
    modules = dict(model.named_modules())
    # Routers that only the installed layout has (4.57: an `nn.Linear` gate inside the MoE block).
    layout_routers = {name: parent for name, _, parent in _compat.TRANSFORMERS.moe_router_candidates(modules)}
    for name, module in modules.items():
        parent = layout_routers.get(name)
        if parent is None:
            if not _ROUTER_CLASS.search(type(module).__name__):
                continue
            parent_name = name.rpartition(".")[0]
            parent = modules.get(parent_name, model) if name else model
            if parent is module or not _holds_experts(parent, module):
                continue
        top_k = _top_k(module, parent, config)
        num_experts = _num_experts(module, parent, config)
        if top_k is None or num_experts is None:
            continue
        # a class is hashable; torch's stubs make `type[Module]` look otherwise to mypy
        scope = module if _calls_topk(cast(Hashable, type(module))) else parent
        numbers = re.findall(r"(?:^|\.)(\d+)(?:\.|$)", name)
        layer_id = int(numbers[0]) if numbers else len(found)
        n_group = _int_attr((module, parent), _N_GROUP_ATTRS)
        topk_group = _int_attr((module, parent), ("topk_group",)) if n_group is not None else None
        found.append(MoELayer(name, layer_id, module, scope, top_k, num_experts, n_group, topk_group))
    return found


def _holds_experts(parent: nn.Module, router: nn.Module) -> bool:
    # A direct sibling: a gate elsewhere in a decoder layer that merely contains an MoE block
    # (e.g. a learned residual gate) is not a router.
    return any(m is not router and "Expert" in type(m).__name__ for m in parent.children())


@cache
def _calls_topk(cls: type[nn.Module]) -> bool:
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return bool(_TOPK_CALL.search(source))


def _int_attr(objs: tuple[Any, ...], names: tuple[str, ...]) -> int | None:
    for obj in objs:
        if obj is None:
            continue
        for attr in names:
            value = getattr(obj, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _text_config(config: Any) -> Any:
    if config is None:
        return None
    get = getattr(config, "get_text_config", None)
    if not callable(get):
        return config
    try:
        return get(decoder=True)
    except TypeError:
        return get()


def _top_k(router: nn.Module, parent: nn.Module, config: Any) -> int | None:
    value = _int_attr((router, parent), _TOP_K_ATTRS)
    if value is not None:
        return value
    named = _TOP_N_IN_NAME.search(type(router).__name__)
    if named:
        return int(named.group(1))
    return _int_attr((_text_config(config), config), _TOP_K_ATTRS)


def _num_experts(router: nn.Module, parent: nn.Module, config: Any) -> int | None:
    # A router naming several counts selects over the largest: besides its experts it can pick
    # "skip"/"zero" experts (ZAYA's `num_router_classes`; LongCat-Flash's `n_routed_experts` counts
    # its zero experts, `num_experts` does not), and the selection is what is recorded.
    own = [_int_attr((router,), (attr,)) for attr in _NUM_EXPERTS_ATTRS]
    if any(own):
        return max(n for n in own if n is not None)
    value = _int_attr((parent,), _NUM_EXPERTS_ATTRS)
    if value is not None:
        return value
    weight = getattr(router, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[0])
    value = _int_attr((_text_config(config), config), _NUM_EXPERTS_ATTRS)
    if value is not None:
        return value
    # Last: the experts module next to the router. DBRX keeps its expert count only there and in a
    # nested `ffn_config` (its router wraps an `nn.Linear`, its block and top-level config name none).
    experts = [m for m in parent.children() if m is not router and "Expert" in type(m).__name__]
    return _int_attr(tuple(experts), _NUM_EXPERTS_ATTRS)
