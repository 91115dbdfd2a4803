"""transformers 4.57 behind :mod:`modelgraft._compat`: its :class:`~modelgraft._compat.line.TransformersLine`
(imported only on 4.x; bound as :data:`modelgraft._compat.TRANSFORMERS`).

Output recorders: 4.57 keeps ``_can_record_outputs`` in a plain ``dict``,
``transformers.utils.generic._CAN_RECORD_REGISTRY``, keyed by ``str(model.__class__)`` and read
by the ``check_model_inputs`` decorator as ``registry.get(str(self.__class__), {})``: the
instance never reaches the registry. To make recorders per instance, the registry is replaced
(in ``transformers.utils.generic`` and ``transformers.modeling_utils``, the two modules that
hold it) by a ``dict`` subclass with the same items whose ``get`` consults the tracked models
whose forward is running in this thread or task (a ``ContextVar`` stack pushed and popped by
forward hooks on those instances only).

Construction: 4.57 has no ``apply_patches``; ``from_pretrained`` builds the model inside the
contexts of ``get_init_context`` and ``_from_config`` calls ``cls(config)`` directly.

MoE: in 4.57 the router of Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE (and others) is an
``nn.Linear`` named ``gate`` inside the sparse-MoE block, whose forward does the softmax and
top-k; the experts are an ``nn.ModuleList`` of per-expert MLPs.

The wrappers made here are those of the ``construction`` and ``recorders`` sites of
:mod:`modelgraft._compat.wraps`; the ``conversion`` ones come from
:mod:`modelgraft._compat._conversion_v4`.

Example:
    >>> sorted(construction_wrappers(step=None)), sorted(recorder_wrappers())
    (['_from_config', 'get_init_context'], ['_CAN_RECORD_REGISTRY'])
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from contextvars import ContextVar
from typing import Any, cast

import torch
from torch import nn

from modelgraft._compat._conversion_v4 import conversion_wrappers
from modelgraft._compat.wraps import Makers
from modelgraft._forksafe import ForkSafeLock

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
_HOOKS_ATTR = "_modelgraft_recorder_hooks"
_ROUTER_NAMES = ("gate", "router")
_ROUTER_CLASS = re.compile(r"(Router|Gate|Gating)$")
_LOCK = ForkSafeLock()

# Bound models whose forward is running, innermost last (per thread and per asyncio task).
_RUNNING: ContextVar[tuple[nn.Module, ...]] = ContextVar("modelgraft_running_models", default=())


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


def recorder_wrappers() -> Makers:
    """See :meth:`~modelgraft._compat.line.TransformersLine.recorder_wrappers`.

    The registry is a plain ``dict`` (its class cannot change in place), so both modules that
    hold it (``transformers.utils.generic`` and ``transformers.modeling_utils``) get one
    replacement object with the same items. On removal both get one plain ``dict`` with the items
    the replacement holds then (models built meanwhile registered theirs in it).
    """
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


def track_instance_recorders(model: nn.Module) -> None:
    """Add forward hooks to ``model`` that mark it as running in this thread or task (idempotent)."""
    with _LOCK:
        if _HOOKS_ATTR not in model.__dict__:
            model.__dict__[_HOOKS_ATTR] = (
                model.register_forward_pre_hook(_push),
                model.register_forward_hook(_pop, always_call=True),
            )


def construction_wrappers(step: Callable[[], AbstractContextManager[Any]]) -> Makers:
    """See :meth:`~modelgraft._compat.line.TransformersLine.construction_wrappers`.

    4.57 ``from_pretrained`` enters the list returned by ``get_init_context`` right around
    ``cls(config)``, so ``step()`` is appended to it. 4.57 ``_from_config`` only sets the default
    dtype and calls ``cls(config)``, so ``step()`` wraps all of it: install these *before*
    wrapping ``_from_config`` yourself, so that they run inside your wrapper (and remove them after
    yours: each attribute is restored only where it still holds this wrapper).
    """

    def wrap_init_context(original: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
        def get_init_context(cls: type, *args: Any, **kwargs: Any) -> list[Any]:
            return [*original(cls, *args, **kwargs), step()]

        return get_init_context

    def wrap_from_config(original: Callable[..., Any]) -> Callable[..., Any]:
        def _from_config(cls: type, *args: Any, **kwargs: Any) -> Any:
            with step():
                return original(cls, *args, **kwargs)

        return _from_config

    return {"get_init_context": wrap_init_context, "_from_config": wrap_from_config}


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
