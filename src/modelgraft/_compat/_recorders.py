"""Per-instance output recorders on every release: the ``recorders`` sites' wrappers.

``_can_record_outputs`` is class-level state in transformers, looked up in
``_CAN_RECORD_REGISTRY``. modelgraft gives a model instance its own recorders (a patched copy in
the instance's ``__dict__``) and makes the lookup find them; how depends on the registry the
release has (:attr:`~._features.Features.recorder_registry`):

* ``by_instance`` (5.23 on): a registry object whose ``get(model)`` receives the instance.
  Shadowing the bound ``get`` on that one object (an instance attribute) with a lookup that looks
  at the instance first is enough; no class changes and undoing is easy.
* ``by_class_name`` (4.57, 5.0 to 5.22): a plain ``dict`` keyed by ``str(model.__class__)``, read
  as ``registry.get(str(self.__class__))``: the instance never reaches it. The registry is
  replaced, in every module that binds it (:attr:`~._features.Features.recorder_holders`), by one
  ``dict`` subclass with the same items whose ``get`` consults the tracked models whose forward is
  running in this thread or task (a ``ContextVar`` stack pushed and popped by forward hooks on
  those instances only, added by :func:`track_instance_recorders`).

Example:
    >>> from modelgraft._compat.wraps import sites
    >>> sorted(recorder_wrappers()) == sorted({s.attribute for s in sites("recorders")})
    True
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn

from modelgraft._compat._features import FEATURES
from modelgraft._compat.wraps import Makers
from modelgraft._forksafe import ForkSafeLock

__all__ = ["recorder_wrappers", "track_instance_recorders"]

_ATTR = "_can_record_outputs"
_HOOKS_ATTR = "_modelgraft_recorder_hooks"
_LOCK = ForkSafeLock()

# Bound models whose forward is running, innermost last (per thread and per asyncio task).
_RUNNING: ContextVar[tuple[nn.Module, ...]] = ContextVar("modelgraft_running_models", default=())


# --- by instance: the lookup receives the model -------------------------------------------------


def _wrap_registry_get(class_get: Callable[..., dict[Any, Any]]) -> Callable[..., dict[Any, Any]]:
    def get(model: Any, *args: Any) -> dict[Any, Any]:
        own = getattr(model, "__dict__", {}).get(_ATTR) if not args else None
        return own if own is not None else class_get(model, *args)

    return get


# --- by class name: a plain dict, replaced by one that knows the running instance ---------------


class _InstanceAwareRegistry(dict[Any, Any]):
    """``_CAN_RECORD_REGISTRY`` whose ``get`` prefers the recorders of a running, tracked model."""

    def get(self, key: Any, default: Any = None) -> Any:
        if torch.compiler.is_compiling():  # dynamo cannot trace ContextVar; class recorders then
            return super().get(key, default)
        for model in reversed(_RUNNING.get()):
            own = model.__dict__.get(_ATTR)
            if own is not None and str(type(model)) == key:
                return own
        return super().get(key, default)


def _replace_registry() -> Makers:
    # One replacement object for every module that binds the registry; on removal one plain
    # `dict` with the items the replacement holds then (models built meanwhile registered theirs).
    shared: dict[str, dict[Any, Any]] = {}

    def replace(current: dict[Any, Any]) -> dict[Any, Any]:
        if "replacement" not in shared:
            shared["replacement"] = _InstanceAwareRegistry(current)
        return shared["replacement"]

    def restore(replacement: dict[Any, Any]) -> dict[Any, Any]:
        if "plain" not in shared:
            shared["plain"] = dict(replacement)
        return shared["plain"]

    return {"_CAN_RECORD_REGISTRY": (replace, restore)}


def _push(model: nn.Module, args: Any) -> None:
    if not torch.compiler.is_compiling():
        _RUNNING.set((*_RUNNING.get(), model))


def _pop(model: nn.Module, args: Any, output: Any) -> None:
    if torch.compiler.is_compiling():
        return
    running = _RUNNING.get()
    # Remove the innermost entry for this model; a forward that raised still comes through here.
    for i in range(len(running) - 1, -1, -1):
        if running[i] is model:
            _RUNNING.set(running[:i] + running[i + 1 :])
            return


def recorder_wrappers() -> Makers:
    """See :meth:`~modelgraft._compat.line.TransformersLine.recorder_wrappers`."""
    if FEATURES.recorder_registry == "by_instance":
        return {"get": _wrap_registry_get}
    return _replace_registry()


def track_instance_recorders(model: nn.Module) -> None:
    """See :meth:`~modelgraft._compat.line.TransformersLine.track_instance_recorders`: forward
    hooks marking ``model`` as running, where the registry is read by class name (idempotent)."""
    if FEATURES.recorder_registry == "by_instance":
        return
    with _LOCK:
        if _HOOKS_ATTR not in model.__dict__:
            model.__dict__[_HOOKS_ATTR] = (
                model.register_forward_pre_hook(_push),
                model.register_forward_hook(_pop, always_call=True),
            )
