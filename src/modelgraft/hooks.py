"""Apply patches automatically when transformers builds a model, and the context managers users call.

:func:`install` (run by ``import modelgraft``; idempotent; undone by :func:`uninstall`) installs
the four groups of wrappers of :mod:`modelgraft._compat.wraps`, in its order (construction step,
loaders, recorder lookup, conversion wiring):

* wraps ``PreTrainedModel.from_pretrained`` and ``PreTrainedModel._from_config`` (which
  ``AutoModel*.from_pretrained``/``from_config`` and composite models go through). Each load
  holds :data:`modelgraft.swap.LOCK` from start to end, *also when no patch is active*, so a
  plain load never observes another thread's swap. The load takes one snapshot of the registry
  (classes, conversions, strictness) when it starts and pins it (``registry.pinned``): its
  construction, its conversions and its nested loads (sub-models built inside the outer one,
  which join its swap) read only that snapshot, whatever is registered meanwhile.
* makes the construction step of those loads (transformers' ``apply_patches()`` call sites) bind
  the replacements, so the swap is live while modules are constructed and not while weights are
  loaded and initialised. transformers' own ``apply_patches`` still runs inside.
* binds the original classes back while weights are initialised during construction
  (``PreTrainedModel.initialize_weights``): modeling code chooses its init by ``isinstance``
  against its module globals, which must name the originals then.
* after the load: per-instance output recorders, the graft report, then strict mode.

Example:
    >>> from modelgraft import hooks
    >>> hooks.install(); hooks.installed()
    True
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch

from modelgraft import _compat, conversion, recorders, registry, swap
from modelgraft.graft import Graft, scope
from modelgraft.registry import Snapshot
from modelgraft.report import check_strict, diagnose_load, report_for, strict_requested

__all__ = ["apply_patches", "install", "installed", "patched", "uninstall", "unpatched"]


class _Load:
    """State of one top-level load: its snapshot and the swap shared by nested loads."""

    __slots__ = ("problems", "scoped_keys", "snap", "swap")

    def __init__(self, cls: type, snap: Snapshot) -> None:
        self.snap = snap
        self.swap = swap.Swap(snap, (cls,))
        self.scoped_keys = tuple(k for k, src in snap.sources.items() if src == "scoped")
        self.problems: list[str] = []

    @property
    def grafting(self) -> bool:
        """Whether modelgraft takes part in this load (a class to replace or a conversion)."""
        return bool(self.snap) or bool(self.snap.conversions)


_active_load: ContextVar[_Load | None] = ContextVar("modelgraft_active_load", default=None)


# ---- public context managers --------------------------------------------------------------------
@contextmanager
def apply_patches() -> Iterator[Snapshot]:
    """Build models manually (``Model(config)``) from the registered replacements inside the block.

    Holds the construction lock for the block (other threads' loads wait), restores every
    binding on exit, exceptions included; blocks nest. Yields the snapshot in effect.

    Example:
        >>> from transformers.models.llama import modeling_llama
        >>> from modelgraft import patched
        >>> class MyMLP(modeling_llama.LlamaMLP):
        ...     pass
        >>> with patched({"LlamaMLP": MyMLP}), apply_patches():
        ...     modeling_llama.LlamaMLP is MyMLP
        True
        >>> modeling_llama.LlamaMLP is MyMLP
        False
    """
    snap = registry.snapshot()
    with swap.LOCK, swap.Swap(snap):
        yield snap


@contextmanager
def patched(
    mapping: Graft | Mapping[str, type[torch.nn.Module]],
    conversions: Mapping[str, list[Any]] | None = None,
    *,
    strict: bool = False,
) -> Iterator[Snapshot]:
    """Use a graft (or ``mapping`` and ``conversions``) for loads in this thread/task, inside the block only.

    Nothing global changes: other threads and tasks keep seeing the global registry. Scoped keys
    hide global keys with the same name and scoped patterns are tried before global ones; exact
    keys still win over patterns. With ``strict=True`` a load inside the block raises
    :class:`~modelgraft.StrictModeError` instead of returning a model with problems (and a scoped
    key that matched nothing is a problem). Blocks nest, and each one removes exactly what it
    added when it exits, even when nested blocks are exited out of order.

    Args:
        mapping: a :class:`~modelgraft.Graft` (classes and conversions), or class names or
            patterns to replacement classes, as for ``register_patch_mapping``.
        conversions: ``{model_type_or_class_name: [WeightConverter | WeightRenaming, ...]}``
            (added to the graft's).
        strict: raise on problems found while loading.

    Example:
        >>> import torch
        >>> from modelgraft import get_patch_mapping
        >>> with patched({"LlamaMLP": torch.nn.Identity}):
        ...     list(get_patch_mapping())
        ['LlamaMLP']
        >>> get_patch_mapping()
        {}
    """
    with scope(mapping, conversions, strict=strict) as snap:
        yield snap


@contextmanager
def unpatched() -> Iterator[None]:
    """Load plain transformers models inside the block, whatever is registered or scoped outside it.

    Global registrations and enclosing ``patched(...)`` blocks (patches and conversions) are
    invisible to loads in this thread/task until the block ends; other threads are unaffected,
    and a ``patched(...)`` block opened inside applies as usual. Use it for a plain reference
    model while grafts are registered globally. An ``apply_patches()`` block entered outside
    keeps its classes bound: construct models inside ``unpatched()`` outside such blocks.

    Example:
        >>> import torch
        >>> from modelgraft import get_patch_mapping
        >>> with patched({"LlamaMLP": torch.nn.Identity}), unpatched():
        ...     get_patch_mapping()
        {}
    """
    with registry.isolated():
        yield


# ---- the wrapped loaders ------------------------------------------------------------------------
def _run_load(cls: type, call: Callable[[type, bool], Any], wants_info: bool) -> Any:
    """Run one load (``call(class, output_loading_info)``) under the current patches; see the module doc."""
    outer = _active_load.get()
    if outer is not None:  # a sub-model of a load in progress: join its swap and its snapshot
        cls = _loaded_class(cls, outer)
        outer.swap.add_class(cls)
        return call(cls, wants_info)
    load = _Load(cls, registry.snapshot())
    cls = _loaded_class(cls, load)
    load.swap.add_class(cls)
    # Loading info is needed for the report only when modelgraft takes part in the load.
    asks_info = wants_info or load.grafting
    with swap.LOCK, registry.pinned(load.snap):
        token = _active_load.set(load)
        try:
            result = call(cls, asks_info)
        finally:
            _active_load.reset(token)
    model, info = result if asks_info and isinstance(result, tuple) else (result, None)
    if load.grafting and isinstance(model, torch.nn.Module):
        _after_load(model, load, info if isinstance(info, dict) else None)
    if isinstance(model, torch.nn.Module) and (load.snap.strict or strict_requested()):
        check_strict(model)
    return (model, info) if wants_info else model


def _loaded_class(cls: type, load: _Load) -> type:
    """The class to load: ``cls``, or the replacement the snapshot gives for ``cls`` itself.

    ``AutoModel*`` resolves the model class before the load starts, so the swap of module globals
    never reaches it; a key that names the loaded class (``chunked_lm_loss()`` replaces
    ``*ForCausalLM``) is honoured here. A replacement that is not a subclass of ``cls`` cannot be
    loaded through ``cls.from_pretrained``: the load stays plain and the report says why.
    """
    found = load.snap.find(cls.__name__)
    if found is None or found[1] is cls:
        return cls
    key, replacement = found
    if isinstance(replacement, type) and issubclass(replacement, cls):
        return replacement
    load.problems.append(
        f"Patch key `{key}` matches the class being loaded, `{cls.__name__}`, but its replacement "
        f"`{replacement.__qualname__}` is not a subclass of it, so `{cls.__name__}` was loaded unchanged. "
        f"Derive the replacement from `{cls.__name__}`, or anchor the key so that it does not match it."
    )
    return cls


def _after_load(model: torch.nn.Module, load: _Load, info: dict[Any, Any] | None) -> None:
    replaced = swap.replaced_modules(model, load.swap)
    recorders.patch_output_recorders(model, replacements=load.swap.replacements())
    rep = report_for(model)
    rep.problems.extend(p for p in load.problems if p not in rep.problems)
    rep.replaced.extend(replaced)
    used = {key for r in replaced for key in r.key.split(" | ")}
    rep.unmatched_keys.extend(k for k in load.snap.mapping if k not in used)
    diagnose_load(model, rep, info, load.scoped_keys)


def _wrap_from_pretrained(original: Callable[..., Any]) -> Callable[..., Any]:
    def from_pretrained(cls: type, *args: Any, **kwargs: Any) -> Any:
        wants_info = bool(kwargs.pop("output_loading_info", False))
        return _run_load(
            cls, lambda klass, info: original(klass, *args, output_loading_info=info, **kwargs), wants_info
        )

    return from_pretrained


def _wrap_from_config(original: Callable[..., Any]) -> Callable[..., Any]:
    def _from_config(cls: type, config: Any, **kwargs: Any) -> Any:
        return _run_load(cls, lambda klass, _info: original(klass, config, **kwargs), False)

    return _from_config


def _wrap_initialize_weights(original: Callable[..., Any]) -> Callable[..., Any]:
    def initialize_weights(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        with swap.suspended():
            return original(self, *args, **kwargs)

    return initialize_weights


@contextmanager
def _construction_step() -> Iterator[None]:
    """Entered by transformers right around construction (``_compat.TRANSFORMERS.construction_wrappers``)."""
    load = _active_load.get()
    with swap.LOCK:
        # Never a fresh snapshot inside a load: its construction uses the snapshot it started with.
        active = load.swap if load is not None else swap.Swap(registry.current())
        with active:
            yield


# ---- installation ----------------------------------------------------------------------------------
def installed() -> bool:
    """Whether the load hooks are in place."""
    return _compat.LOADERS.installed


def install() -> None:
    """Install every group of wrappers, in the order of ``_compat.wraps.GROUPS`` (idempotent)."""
    if not installed():
        # Before the loaders: on transformers 4.57 the step wraps `_from_config` underneath them.
        _compat.CONSTRUCTION.install(_compat.TRANSFORMERS.construction_wrappers(_construction_step))
        _compat.LOADERS.install(
            {
                "from_pretrained": _wrap_from_pretrained,
                "_from_config": _wrap_from_config,
                "initialize_weights": _wrap_initialize_weights,
            }
        )
    recorders.install_instance_lookup()
    conversion.install()


def uninstall() -> None:
    """Remove everything :func:`install` added, in reverse order (idempotent)."""
    conversion.uninstall()
    recorders.uninstall_instance_lookup()
    if installed():
        _compat.LOADERS.uninstall()
        _compat.CONSTRUCTION.uninstall()
