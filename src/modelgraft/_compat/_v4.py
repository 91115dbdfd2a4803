"""transformers 4.57 behind :mod:`modelgraft._compat`: its :class:`~modelgraft._compat.line.TransformersLine`
(imported only on 4.x; bound as :data:`modelgraft._compat.TRANSFORMERS`).

Output recorders (a registry read by class name) and construction (the contexts of
``get_init_context``) are bound by feature, in :mod:`._recorders` and :mod:`._construction`,
and re-exported here: 5.0 to 5.2 share them with 4.57.

MoE: in 4.57 the router of Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE (and others) is an
``nn.Linear`` named ``gate`` inside the sparse-MoE block, whose forward does the softmax and
top-k; the experts are an ``nn.ModuleList`` of per-expert MLPs.

The wrappers made here are those of the ``construction`` and ``recorders`` sites of
:mod:`modelgraft._compat.wraps`; the ``conversion`` ones come from
:mod:`modelgraft._compat._conversion_v4`.

Example:
    >>> block = "self.gate = nn.Linear(h, e); self.experts = nn.ModuleList([])"
    >>> defines_layout_moe(block), defines_layout_moe("class MixtralExperts(nn.Module): ...")
    (True, False)
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any, cast

import torch
from torch import nn

from modelgraft._compat._construction import construction_wrappers
from modelgraft._compat._conversion_v4 import conversion_wrappers
from modelgraft._compat._recorders import recorder_wrappers, track_instance_recorders

__all__ = [
    "construction_wrappers",
    "conversion_wrappers",
    "defines_layout_moe",
    "meta_device",
    "moe_router_candidates",
    "rebind_class_tables",
    "recorder_wrappers",
    "track_instance_recorders",
]

_ROUTER_NAMES = ("gate", "router")
_ROUTER_CLASS = re.compile(r"(Router|Gate|Gating)$")


def moe_router_candidates(modules: Mapping[str, nn.Module]) -> Iterator[tuple[str, nn.Module, nn.Module]]:
    """The gates of 4.57's per-expert MoE blocks (see
    :meth:`~modelgraft._compat.line.TransformersLine.moe_router_candidates`).

    A candidate is a child named ``gate`` or ``router`` next to an ``experts`` ``ModuleList``: an
    ``nn.Linear``-like gate with a 2D ``weight`` of one row per expert, or a router class
    (``*Router``/``*Gate``/``*Gating``) whose experts are plain MLPs (not found by class name).
    """
    for name, module in modules.items():
        parent_name, _, leaf = name.rpartition(".")
        if leaf not in _ROUTER_NAMES:
            continue
        parent = modules.get(parent_name)
        if parent is None:
            continue
        experts = getattr(parent, "experts", None)
        if not isinstance(experts, nn.ModuleList):
            continue
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[0] == len(experts):
            yield name, module, parent
        elif _ROUTER_CLASS.search(type(module).__name__):
            yield name, module, parent


def rebind_class_tables(
    module: Any, swapped: Mapping[type, type]
) -> list[tuple[dict[Any, Any], Any, type, type]]:
    """See :meth:`~modelgraft._compat.line.TransformersLine.rebind_class_tables`."""
    log: list[tuple[dict[Any, Any], Any, type, type]] = []
    if not swapped:
        return log
    for name, table in list(vars(module).items()):
        if not (name.endswith("_CLASSES") and isinstance(table, dict)):
            continue
        for key, cls in list(table.items()):
            if not isinstance(cls, type):
                continue
            # The class itself, else the nearest swapped base (sdpa/flash variants follow their base).
            new = next((swapped[c] for c in cls.__mro__ if c in swapped), None)
            if new is not None and new is not cls:
                table[key] = new
                log.append((table, key, cls, new))
    return log


_EXPERT_LIST_SRC = re.compile(r"self\.experts\s*=\s*nn\.ModuleList\(")
_ROUTER_SRC = re.compile(r"self\.(gate|router)\s*=\s*nn\.Linear\(|^class \w+(Router|Gate|Gating)\(", re.M)


def defines_layout_moe(source: str) -> bool:
    """A ``ModuleList`` of experts next to an ``nn.Linear`` gate or a router class."""
    return bool(_EXPERT_LIST_SRC.search(source) and _ROUTER_SRC.search(source))


def meta_device() -> AbstractContextManager[Any]:
    """transformers' ``init_empty_weights``, parameters only (see
    :meth:`~modelgraft._compat.line.TransformersLine.meta_device`)."""
    # 4.x only; the 5.x line no longer has it (`unused-ignore`: type-checked on both lines)
    from transformers.integrations.accelerate import (  # type: ignore[attr-defined, unused-ignore]
        init_empty_weights,
    )

    # Parameters only: with buffers included it enters `torch.device("meta")` as well, and a
    # buffer read while constructing (xIELU's `.item()`) would fail again. Buffers are small.
    return cast(AbstractContextManager[Any], init_empty_weights(include_buffers=False))
