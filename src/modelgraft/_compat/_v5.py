"""transformers 5.x behind :mod:`modelgraft._compat`: its :class:`~modelgraft._compat.line.TransformersLine`
(imported only on 5.x; bound as :data:`modelgraft._compat.TRANSFORMERS`).

Output recorders: 5.x keeps ``_can_record_outputs`` in ``_CAN_RECORD_REGISTRY``
(``transformers.utils.output_capturing``), a ``dict`` subclass keyed by class name whose
``get(model)`` receives the model instance, so a lookup that looks at the instance first is
enough to make recorders per instance.

Construction: ``from_pretrained`` and ``_from_config`` enter transformers' own ``apply_patches()``
(a global of ``transformers.modeling_utils``) right around ``cls(config)``.

The wrappers made here are those of the ``construction`` and ``recorders`` sites of
:mod:`modelgraft._compat.wraps`; the ``conversion`` ones come from
:mod:`modelgraft._compat._conversion_v5`.

Example:
    >>> sorted(construction_wrappers(step=None)), sorted(recorder_wrappers())
    (['apply_patches'], ['get'])
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn

from modelgraft._compat._conversion_v5 import conversion_wrappers
from modelgraft._compat.wraps import Makers

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

_ATTR = "_can_record_outputs"


def _wrap_registry_get(class_get: Callable[..., dict[Any, Any]]) -> Callable[..., dict[Any, Any]]:
    def get(model: Any, *args: Any) -> dict[Any, Any]:
        own = getattr(model, "__dict__", {}).get(_ATTR) if not args else None
        return own if own is not None else class_get(model, *args)

    return get


def recorder_wrappers() -> Makers:
    """See :meth:`~modelgraft._compat.line.TransformersLine.recorder_wrappers`.

    The registry is a ``dict`` subclass whose ``get(model)`` receives the instance; shadowing the
    bound ``get`` on that one object (an instance attribute) changes no class and is easy to undo.
    """
    return {"get": _wrap_registry_get}


def track_instance_recorders(model: nn.Module) -> None:
    """Nothing to do: the 5.x lookup receives the instance."""


def construction_wrappers(step: Callable[[], AbstractContextManager[Any]]) -> Makers:
    """See :meth:`~modelgraft._compat.line.TransformersLine.construction_wrappers`.

    ``from_pretrained`` (through ``get_init_context``) and ``_from_config`` call the module global
    ``apply_patches()`` of ``transformers.modeling_utils`` right around ``cls(config)``; replacing
    that global puts ``step()`` exactly there, with transformers' own context still entered inside.
    """

    def wrap(builtin: Callable[..., AbstractContextManager[Any]]) -> Callable[..., Any]:
        @contextmanager
        def construction_site(*args: Any, **kwargs: Any) -> Iterator[None]:
            with step(), builtin(*args, **kwargs):
                yield

        return construction_site

    return {"apply_patches": wrap}


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
