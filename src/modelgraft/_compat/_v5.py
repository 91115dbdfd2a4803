"""transformers 5.x specifics behind :mod:`modelgraft._compat` (imported only on 5.x).

Output recorders: 5.x keeps ``_can_record_outputs`` in ``_CAN_RECORD_REGISTRY``
(``transformers.utils.output_capturing``), a ``dict`` subclass keyed by class name whose
``get(model)`` receives the model instance, so a lookup that looks at the instance first is
enough to make recorders per instance.

Construction: ``from_pretrained`` and ``_from_config`` enter transformers' own ``apply_patches()``
(a global of ``transformers.modeling_utils``) right around ``cls(config)``.

The attributes replaced here are the ``construction`` and ``recorders`` sites of
:mod:`modelgraft._compat.wraps`.

Example:
    >>> from modelgraft import _compat
    >>> _compat.IS_V5 or True  # this module is only imported on 5.x
    True
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn

from modelgraft._compat.wraps import WrapGroup

_ATTR = "_can_record_outputs"
_lookup_wrappers = WrapGroup("recorders")
_step_wrappers = WrapGroup("construction")


def _wrap_registry_get(class_get: Callable[..., dict[Any, Any]]) -> Callable[..., dict[Any, Any]]:
    def get(model: Any, *args: Any) -> dict[Any, Any]:
        own = getattr(model, "__dict__", {}).get(_ATTR) if not args else None
        return own if own is not None else class_get(model, *args)

    return get


def install_recorder_lookup() -> None:
    """See :func:`modelgraft._compat.install_recorder_lookup`.

    The registry is a ``dict`` subclass whose ``get(model)`` receives the instance; shadowing the
    bound ``get`` on that one object (an instance attribute) changes no class and is easy to undo.
    """
    _lookup_wrappers.install({"get": _wrap_registry_get})


def uninstall_recorder_lookup() -> None:
    """See :func:`modelgraft._compat.uninstall_recorder_lookup`."""
    _lookup_wrappers.uninstall()


def track_instance_recorders(model: nn.Module) -> None:
    """Nothing to do: the 5.x lookup receives the instance."""


def construction_step_installed() -> bool:
    """See :func:`modelgraft._compat.construction_step_installed`."""
    return _step_wrappers.installed


def install_construction_step(step: Callable[[], AbstractContextManager[Any]]) -> None:
    """See :func:`modelgraft._compat.install_construction_step`.

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

    _step_wrappers.install({"apply_patches": wrap})


def uninstall_construction_step() -> None:
    """See :func:`modelgraft._compat.uninstall_construction_step`."""
    _step_wrappers.uninstall()


def moe_router_candidates(modules: Mapping[str, nn.Module]) -> Iterator[tuple[str, nn.Module, nn.Module]]:
    """See :func:`modelgraft._compat.moe_router_candidates`: every 5.x router has its own class."""
    return iter(())


def rebind_class_tables(module: Any, swapped: Mapping[type, type]) -> list[Any]:
    """See :func:`modelgraft._compat.rebind_class_tables`: nothing to do on 5.x."""
    return []


def defines_layout_moe(source: str) -> bool:
    """See :func:`modelgraft._compat.defines_layout_moe`: no such layout on 5.x."""
    return False


def meta_device() -> AbstractContextManager[Any]:
    """See :func:`modelgraft._compat.meta_device`."""
    return torch.device("meta")
