"""The registry of replacement classes and checkpoint conversions: layers, snapshots, scopes.

One mechanism backs both kinds of entries:

* **Layers.** The global registry is one immutable ``Layer`` (its classes and its
  conversions); every write replaces it whole, under a lock. ``scoped(...)`` (``patched``) pushes
  a layer of its own onto a ContextVar stack, so it is visible only in the current thread or
  asyncio task; ``isolated()`` (``unpatched``) pushes a barrier that hides what lies below it.
* **Snapshots.** :func:`snapshot` turns the global layer plus the current stack into an immutable
  :class:`Snapshot` carrying classes, conversions and strictness together. A load takes one when
  it starts and pins it (:func:`pinned`) for its whole duration, nested sub-model loads
  included: everything in the load reads :func:`current`, never the live registry, so a
  registration made meanwhile (by a hook, or by another thread) applies from the next load on.

The values (entries, tables, layers, :class:`Snapshot`) are in :mod:`modelgraft._registry_snapshot`;
this module holds the one global layer, writes it, pushes scoped layers and takes snapshots.

Matching rules for classes:

* A key made only of identifier characters (``LlamaAttention``) is an *exact* class name and
  matches only a class bound under exactly that name.
* Any other key is a regular expression searched for in the class name (like :func:`re.search`)
  by RE2, in time linear in the name, so no key can hang a load; what RE2 cannot express
  (backreferences, lookaround) is refused at registration (:mod:`modelgraft._safe_regex`), and a
  pattern is matched against each class name once.
* Exact keys win over patterns; among patterns the one registered first wins. Scoped layers are
  searched innermost first, then the global registry; a scoped key equal to an outer key hides
  it. For conversions the innermost entry for a key wins; a class-name key wins over the
  ``model_type`` key.

Example:
    >>> import torch
    >>> from modelgraft import registry
    >>> class MyAttention(torch.nn.Module):
    ...     pass
    >>> with registry.scoped({"LlamaAttention": MyAttention, ".*MLP$": MyAttention}):
    ...     registry.find_replacement("LlamaAttention")[0], registry.find_replacement("T5Attention")
    ('LlamaAttention', None)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from modelgraft import _safe_regex
from modelgraft._forksafe import ForkSafeLock
from modelgraft._registry_snapshot import (
    CLASSES,
    CONVERSIONS,
    EMPTY,
    KINDS,
    Candidate,
    Entry,
    Explanation,
    Layer,
    Snapshot,
    Table,
    is_exact_key,
)
from modelgraft.errors import PatchRegistrationError, ReplacementTypeError

__all__ = [
    "Candidate",
    "Explanation",
    "Snapshot",
    "clear_patch_mapping",
    "current",
    "explain",
    "find_replacement",
    "get_patch_mapping",
    "is_exact_key",
    "isolated",
    "pinned",
    "register",
    "register_patch_mapping",
    "restoring",
    "scoped",
    "snapshot",
    "unregister",
    "unregister_patch_mapping",
]

# ---- global state ------------------------------------------------------------------------------
_write_lock = ForkSafeLock()
_global = Layer()
# key -> position in the global table of that kind; only read and written under _write_lock.
_positions: dict[str, dict[str, int]] = {CLASSES: {}, CONVERSIONS: {}}
_overlays: ContextVar[tuple[Layer, ...]] = ContextVar("modelgraft_overlays", default=())
_pinned: ContextVar[Snapshot | None] = ContextVar("modelgraft_pinned_snapshot", default=None)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def validate_classes(mapping: object, source: str) -> list[Entry]:
    """Validate every entry of ``mapping`` and return them; raise before anything changes."""
    if not isinstance(mapping, Mapping):
        raise PatchRegistrationError(
            f"`mapping` must be a dict of class names or patterns to replacement classes; "
            f"received `{type(mapping).__name__}`. Pass e.g. `{{'LlamaAttention': MyAttention}}`."
        )
    entries = []
    for key, replacement in mapping.items():
        if not isinstance(key, str) or not key:
            raise PatchRegistrationError(
                f"Patch key `{key!r}` is invalid: expected a non-empty class name or regular expression string."
            )
        matcher = None
        if not is_exact_key(key):
            try:
                matcher = _safe_regex.matcher(key)
            except _safe_regex.UnsafePatternError as exc:
                raise PatchRegistrationError(
                    f"Patch key `{key}` is refused: {exc}. Rewrite it with what RE2 supports (alternation, "
                    "classes, repetition, anchors), or use exact class names; see docs/patching.md, 'Key "
                    "matching rules'."
                ) from None
            except Exception as exc:  # re.error, or a recursion error on absurd nesting
                raise PatchRegistrationError(
                    f"Patch key `{key}` is not a valid regular expression ({exc}). Fix the pattern, or use an "
                    "exact class name made of identifier characters only."
                ) from None
        if not isinstance(replacement, type):
            raise ReplacementTypeError(
                f"Replacement for key `{key}` must be a class (a subclass of nn.Module); received an instance "
                f"of `{type(replacement).__name__}`. Pass the class itself, not an object."
            )
        if not issubclass(replacement, torch.nn.Module):
            raise ReplacementTypeError(
                f"Replacement `{replacement.__qualname__}` for key `{key}` must be a subclass of nn.Module "
                "(`torch.nn.Module`). Derive it from the class it replaces or from `torch.nn.Module`."
            )
        entries.append(Entry(key, replacement, matcher, source))
    return entries


def _conversion_entries(conversions: Mapping[str, tuple[Any, ...]], source: str) -> list[Entry]:
    """Entries for conversions already validated by :mod:`modelgraft.conversion.rules`."""
    return [Entry(key, tuple(value), None, source) for key, value in conversions.items()]


# ---- global writes: one lock, one new global layer per write -----------------------------------
@dataclass(frozen=True)
class _Additions:
    """Entries to add to the global table of one kind, and the error for a key already there."""

    entries: list[Entry]
    overwrite: bool
    duplicate: Callable[[str, Any], Exception]  # (key, registered value) -> error


@dataclass(frozen=True)
class _Removals:
    """Keys to remove from the global table of one kind, and the error for keys not there."""

    keys: list[str]
    unknown: Callable[[list[str], list[str]], Exception]  # (missing keys, registered keys) -> error


def _add(batches: Mapping[str, _Additions]) -> None:
    """Add entries of one or both kinds to the global registry in one step, all or nothing.

    Every batch is checked before anything changes, and the new global layer is published once,
    so a load sees all of it or none of it. An overwritten key keeps its position.
    """
    global _global
    with _write_lock:
        for kind, batch in batches.items():
            if not batch.overwrite:
                positions = _positions[kind]
                for entry in batch.entries:
                    if entry.key in positions:
                        existing = list(_global.table(kind))[positions[entry.key]].value
                        raise batch.duplicate(entry.key, existing)
        tables = {kind: _global.table(kind) for kind in KINDS}
        new_positions = {}
        for kind, batch in batches.items():
            positions = dict(_positions[kind]) if len(batches) > 1 else _positions[kind]
            table = tables[kind]
            new: dict[str, Entry] = {}
            for entry in batch.entries:
                if entry.key in positions:
                    table = table.replaced(positions[entry.key], entry)
                else:
                    new[entry.key] = entry  # a key given twice in one mapping: the last one wins
            start = len(table)
            tables[kind] = table.extended(new.values())
            for i, key in enumerate(new, start):
                positions[key] = i
            new_positions[kind] = positions
        _global = Layer(tables[CLASSES], tables[CONVERSIONS])
        _positions.update(new_positions)


def _remove(batches: Mapping[str, _Removals]) -> None:
    """Remove keys of one or both kinds from the global registry in one step, all or nothing."""
    global _global
    with _write_lock:
        for kind, batch in batches.items():
            missing = [k for k in batch.keys if k not in _positions[kind]]
            if missing:
                raise batch.unknown(missing, sorted(_positions[kind]))
        tables = {kind: _global.table(kind) for kind in KINDS}
        for kind, batch in batches.items():
            tables[kind] = tables[kind].without(set(batch.keys))
        _global = Layer(tables[CLASSES], tables[CONVERSIONS])
        for kind in batches:
            _positions[kind] = {e.key: i for i, e in enumerate(tables[kind])}


def _clear(kind: str) -> None:
    global _global
    with _write_lock:
        _positions[kind] = {}
        tables = {k: _global.table(k) for k in KINDS}
        tables[kind] = EMPTY
        _global = Layer(tables[CLASSES], tables[CONVERSIONS])


def _global_entries(kind: str) -> dict[str, Any]:
    """The global registry of ``kind`` alone (no scoped layer), as a new dict."""
    return {e.key: e.value for e in _global.table(kind)}


def global_conversions() -> dict[str, tuple[Any, ...]]:
    """The globally registered conversion entries alone (no scoped block), as a new dict.

    Example:
        >>> global_conversions()
        {}
    """
    return _global_entries(CONVERSIONS)


def add_conversions(
    conversions: Mapping[str, tuple[Any, ...]],
    *,
    overwrite: bool,
    duplicate: Callable[[str, Any], Exception],
) -> None:
    """Register (already validated) conversion entries globally in one step, all or nothing.

    ``duplicate(key, registered)`` makes the error for a key already registered while
    ``overwrite`` is False; an overwritten key keeps its position.
    """
    _add({CONVERSIONS: _Additions(_conversion_entries(conversions, "global"), overwrite, duplicate)})


def remove_conversions(keys: Iterable[str], *, unknown: Callable[[list[str], list[str]], Exception]) -> None:
    """Remove global conversion entries in one step, all or nothing; ``unknown(missing, registered)``
    makes the error for keys that are not registered."""
    _remove({CONVERSIONS: _Removals(list(keys), unknown)})


def _duplicate_patch(key: str, existing: type) -> PatchRegistrationError:
    return PatchRegistrationError(
        f"Patch key `{key}` is already registered (to `{existing.__qualname__}`). Pass `overwrite=True` to "
        "replace it, or unregister it first."
    )


def _unknown_patch(missing: list[str], registered: list[str]) -> PatchRegistrationError:
    return PatchRegistrationError(
        f"Cannot unregister `{missing[0]}`: the key is not registered (not found in monkey patch mapping cache). "
        f"Registered keys: {registered}. Use the exact string given at registration."
    )


def register(
    mapping: Mapping[str, type[torch.nn.Module]],
    conversions: Mapping[str, tuple[Any, ...]],
    overwrite: bool,
    duplicate_conversion: Callable[[str, Any], Exception],
) -> None:
    """Register replacement classes and (already validated) conversions globally in one step.

    A load that starts meanwhile sees both or neither (``Graft.register`` uses this). Raises
    like :func:`register_patch_mapping` for the classes, and ``duplicate_conversion(key,
    registered)`` for a conversion key already registered while ``overwrite`` is False.
    """
    _add(
        {
            CLASSES: _Additions(validate_classes(mapping, "global"), overwrite, _duplicate_patch),
            CONVERSIONS: _Additions(
                _conversion_entries(conversions, "global"), overwrite, duplicate_conversion
            ),
        }
    )


def unregister(
    keys: Iterable[str],
    conversions: Iterable[str],
    unknown_conversions: Callable[[list[str], list[str]], Exception],
) -> None:
    """Remove patch keys and conversion keys globally in one step, all or nothing."""
    _remove(
        {
            CLASSES: _Removals(list(keys), _unknown_patch),
            CONVERSIONS: _Removals(list(conversions), unknown_conversions),
        }
    )


def register_patch_mapping(mapping: Mapping[str, type[torch.nn.Module]], overwrite: bool = False) -> None:
    """Register replacement classes globally, all or nothing.

    Args:
        mapping: class names or regular expressions to replacement ``nn.Module`` subclasses.
        overwrite: replace the class of a key that is already registered (it keeps its position
            among the patterns).

    Raises:
        PatchRegistrationError: a key is not a non-empty string, is an invalid regular expression
            or one RE2 cannot express (a backreference, lookaround), or is already registered while
            ``overwrite`` is False.
        ReplacementTypeError: a value is not a class, or not a subclass of ``torch.nn.Module``.

    Example:
        >>> import torch
        >>> class MyMLP(torch.nn.Module):
        ...     pass
        >>> register_patch_mapping({"LlamaMLP": MyMLP})
        >>> get_patch_mapping()["LlamaMLP"] is MyMLP
        True
        >>> clear_patch_mapping()
    """
    _add({CLASSES: _Additions(validate_classes(mapping, "global"), overwrite, _duplicate_patch)})


def unregister_patch_mapping(keys: Iterable[str] | str) -> None:
    """Remove keys from the global registry, all or nothing.

    Args:
        keys: the exact keys used at registration (class names or patterns). A single string is
            taken as one key.

    Raises:
        PatchRegistrationError: a key is not registered (nothing is removed then).

    Example:
        >>> import torch
        >>> register_patch_mapping({".*Attention": torch.nn.Identity})
        >>> unregister_patch_mapping([".*Attention"])
        >>> get_patch_mapping()
        {}
    """
    _remove({CLASSES: _Removals([keys] if isinstance(keys, str) else list(keys), _unknown_patch)})


def clear_patch_mapping() -> None:
    """Remove every globally registered patch (scoped ``patched`` blocks are not affected).

    Example:
        >>> clear_patch_mapping()
        >>> get_patch_mapping()
        {}
    """
    _clear(CLASSES)


def get_patch_mapping() -> dict[str, type]:
    """Return a copy of the effective mapping: the global registry plus any active scoped overlays.

    Exact keys come first, then patterns in the order they are tried.

    Example:
        >>> clear_patch_mapping()
        >>> get_patch_mapping()
        {}
    """
    return dict(snapshot().mapping)


@contextmanager
def restoring() -> Iterator[None]:
    """Put the global registry (classes and conversions) back as it is now when the block ends.

    One step for both kinds, for test fixtures that must leave the process as they found it.

    Example:
        >>> with restoring():
        ...     register_patch_mapping({"LlamaMLP": torch.nn.Identity})
        >>> get_patch_mapping()
        {}
    """
    global _global
    with _write_lock:
        saved = _global
    try:
        yield
    finally:
        with _write_lock:
            _global = saved
            for kind in KINDS:
                _positions[kind] = {e.key: i for i, e in enumerate(saved.table(kind))}


# ---- reading: snapshots ------------------------------------------------------------------------
def snapshot() -> Snapshot:
    """Return the effective registry for this thread/task now, as an immutable :class:`Snapshot`.

    Example:
        >>> clear_patch_mapping()
        >>> snap = snapshot()
        >>> bool(snap), snap is snapshot()
        (False, True)
    """
    layers = (_global, *_overlays.get())
    key = tuple(layer.serial for layer in layers)
    holder = layers[-1]
    cached = holder._snap
    if cached is not None and cached[0] == key:
        return cached[1]
    snap = Snapshot(layers)
    holder._snap = (key, snap)
    return snap


def current() -> Snapshot:
    """The snapshot of the load in progress in this thread/task (see :func:`pinned`), else :func:`snapshot`.

    Everything that runs inside a load reads the registry through this.

    Example:
        >>> clear_patch_mapping()
        >>> with pinned(snapshot()) as snap:
        ...     register_patch_mapping({"LlamaMLP": torch.nn.Identity})
        ...     current() is snap, list(current().mapping), list(snapshot().mapping)
        (True, [], ['LlamaMLP'])
        >>> clear_patch_mapping()
    """
    snap = _pinned.get()
    return snap if snap is not None else snapshot()


@contextmanager
def pinned(snap: Snapshot) -> Iterator[Snapshot]:
    """Make :func:`current` return ``snap`` in this thread/task inside the block (one load's view)."""
    token = _pinned.set(snap)
    try:
        yield snap
    finally:
        _pinned.reset(token)


def find_replacement(class_name: str, snap: Snapshot | None = None) -> tuple[str, type] | None:
    """Return ``(winning key, replacement class)`` for ``class_name``, or None.

    Example:
        >>> import torch
        >>> with scoped({"T5Attention": torch.nn.Identity}):
        ...     find_replacement("T5Attention")[0], find_replacement("MT5Attention")
        ('T5Attention', None)
    """
    return (snap if snap is not None else snapshot()).find(class_name)


def explain(class_name: str, snap: Snapshot | None = None) -> Explanation:
    """Say which keys were considered for ``class_name`` and why the winner won.

    Example:
        >>> import torch
        >>> with scoped({".*Attention": torch.nn.Identity, "LlamaAttention": torch.nn.ReLU}):
        ...     result = explain("LlamaAttention")
        >>> result.winner, [c.matches for c in result.candidates]
        ('LlamaAttention', [True, True])
    """
    snap = snap if snap is not None else snapshot()
    found = snap.find(class_name)
    winner = found[0] if found else None
    candidates = []
    for key, replacement in snap.mapping.items():
        exact = is_exact_key(key)
        matches = snap.matches(key, class_name)
        if not matches:
            reason = "exact name differs" if exact else "pattern does not match (re.search)"
        elif key == winner:
            reason = "exact match (exact keys win over patterns)" if exact else "first matching pattern"
        elif exact:  # pragma: no cover - at most one exact key can match
            reason = "exact match"
        elif winner is not None and is_exact_key(winner):
            reason = f"pattern matches but exact key `{winner}` wins"
        else:
            reason = f"pattern matches but `{winner}` is tried first"
        candidates.append(
            Candidate(
                key,
                "exact" if exact else "pattern",
                snap.sources[key],
                _qualname(replacement),
                matches,
                reason,
            )
        )
    return Explanation(class_name, winner, found[1] if found else None, tuple(candidates))


# ---- scoped layers -----------------------------------------------------------------------------
@contextmanager
def _pushed(layer: Layer) -> Iterator[None]:
    """Push ``layer`` for this thread/task; on exit remove exactly this layer.

    Removing by identity (not by resetting a token) keeps blocks exited out of order correct:
    the inner block that is still open keeps its layer, and the outer one leaves nothing behind.
    """
    _overlays.set((*_overlays.get(), layer))
    try:
        yield
    finally:
        stack = _overlays.get()
        if stack and stack[-1] is layer:
            _overlays.set(stack[:-1])
        elif any(item is layer for item in stack):
            _overlays.set(tuple(item for item in stack if item is not layer))


@contextmanager
def scoped(
    mapping: Mapping[str, type[torch.nn.Module]] | Any | None = None,
    *,
    conversions: Mapping[str, tuple[Any, ...]] | None = None,
    strict: bool = False,
) -> Iterator[Snapshot]:
    """Layer ``mapping`` (and ``conversions``) over the registry for this thread/task, inside the block.

    ``mapping`` is a dict of classes (``modelgraft.graft.scope`` hands a graft's classes and
    conversions in here together). Classes are validated like :func:`register_patch_mapping`; ``conversions`` must
    already be validated (``modelgraft.conversion.rules`` does it). Blocks nest (the inner one wins on equal
    keys) and may be exited in any order. ``strict`` makes loads inside the block strict. Yields
    the effective snapshot.

    Example:
        >>> import torch
        >>> clear_patch_mapping()
        >>> with scoped({"LlamaMLP": torch.nn.Identity}):
        ...     sorted(get_patch_mapping())
        ['LlamaMLP']
        >>> get_patch_mapping()
        {}
    """
    layer = Layer(
        Table(validate_classes(mapping if mapping is not None else {}, "scoped")),
        Table(_conversion_entries(conversions or {}, "scoped")),
        source="scoped",
        strict=strict,
    )
    with _pushed(layer):
        yield snapshot()


@contextmanager
def isolated(classes: bool = True, conversions: bool = True) -> Iterator[None]:
    """Hide the global registry and every enclosing ``scoped`` block, in this thread/task only.

    ``classes``/``conversions`` choose what is hidden (hiding classes also drops an enclosing
    ``strict``). ``scoped`` blocks opened inside apply as usual.

    Example:
        >>> import torch
        >>> with scoped({"LlamaMLP": torch.nn.Identity}):
        ...     with isolated():
        ...         get_patch_mapping()
        ...     sorted(get_patch_mapping())
        {}
        ['LlamaMLP']
    """
    hides = frozenset(k for k, on in ((CLASSES, classes), (CONVERSIONS, conversions)) if on)
    with _pushed(Layer(source="barrier", hides=hides)):
        yield


# ---- fork: the child starts with a usable registry -------------------------------------------
def _after_fork_in_child() -> None:
    """A thread that was writing when the process forked does not exist in the child: rebuild the
    writer's index from the global layer actually published (its lock is renewed by ``_forksafe``)."""
    for kind in KINDS:
        _positions[kind] = {e.key: i for i, e in enumerate(_global.table(kind))}


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
