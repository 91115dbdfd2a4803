"""transformers 5.x behind :mod:`modelgraft._compat`: its :class:`~modelgraft._compat.line.TransformersLine`
(imported only on 5.x; bound as :data:`modelgraft._compat.TRANSFORMERS`).

What every 5.x release shares is here: MoE routers have classes of their own, attention is
dispatched by name inside one class, meta-device builds are ``torch.device("meta")``, and the
conversion wiring is :mod:`modelgraft._compat._conversion_v5`. What differs *between* 5.x releases
(where recorders are registered, where a model is constructed) is bound by feature, in
:mod:`._recorders` and :mod:`._construction`, and re-exported here.

Example:
    >>> from modelgraft._compat.wraps import sites
    >>> sorted(recorder_wrappers()) == sorted({s.attribute for s in sites("recorders")})
    True
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from modelgraft._compat._construction import construction_wrappers
from modelgraft._compat._conversion_v5 import conversion_wrappers
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


def moe_router_candidates(modules: Mapping[str, nn.Module]) -> Iterator[tuple[str, nn.Module, nn.Module]]:
    """Nothing: every 5.x router has its own class, found by name in :mod:`modelgraft.moe`."""
    return iter(())


def rebind_class_tables(module: Any, swapped: Mapping[type, type]) -> list[Any]:
    """Nothing to do: 5.x dispatches attention by name inside one class."""
    return []


def defines_layout_moe(source: str) -> bool:
    """Never: no such layout on 5.x."""
    return False


def meta_device() -> AbstractContextManager[Any]:
    """``torch.device("meta")``: parameters and buffers on the meta device."""
    return torch.device("meta")
