"""The registry of replacement classes and checkpoint conversions: layers, snapshots, scopes.

One mechanism backs both kinds of entries:

* **Layers.** The global registry is one immutable :class:`_Layer` (its classes and its
  conversions); every write replaces it whole, under a lock. ``scoped(...)`` (``patched``) pushes
  a layer of its own onto a ContextVar stack, so it is visible only in the current thread or
  asyncio task; ``isolated()`` (``unpatched``) pushes a barrier that hides what lies below it.
* **Snapshots.** :func:`snapshot` turns the global layer plus the current stack into an immutable
  :class:`Snapshot` carrying classes, conversions and strictness together. A load takes one when
  it starts and pins it (:func:`pinned`) for its whole duration, nested sub-model loads
  included: everything in the load reads :func:`current`, never the live registry, so a
  registration made meanwhile (by a hook, or by another thread) applies from the next load on.

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

import itertools
import os
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from modelgraft import _safe_regex
from modelgraft._forksafe import ForkSafeLock
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

CLASSES, CONVERSIONS = "classes", "conversions"
_KINDS = (CLASSES, CONVERSIONS)
_serials = itertools.count(1)
_VERSIONS_MAX = 1024


def is_exact_key(key: str) -> bool:
    """Return True when ``key`` is an exact class name rather than a regular expression.

    Example:
        >>> is_exact_key("T5Attention"), is_exact_key(".*Attention"), is_exact_key("^T5Attention$")
        (True, False, False)
    """
    return key.isidentifier()


@dataclass(frozen=True)
class _Entry:
    key: str
    value: Any  # a replacement class, or a tuple of converters
    matcher: _safe_regex.Matcher | None  # for pattern keys of the class registry
    source: str  # "global" or "scoped"


class _Table:
    """An immutable sequence of entries that is cheap to extend.

    Successive global tables share one list: a table sees the first ``n`` items, and extending the
    newest table appends to the list (older tables keep seeing their prefix). Registering keys one
    by one is therefore linear in total; only overwriting or removing keys copies.
    """

    __slots__ = ("_items", "_n")

    def __init__(self, items: list[_Entry] | None = None) -> None:
        self._items = items if items is not None else []
        self._n = len(self._items)

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[_Entry]:
        items = self._items
        return (items[i] for i in range(self._n))

    def extended(self, entries: Iterable[_Entry]) -> _Table:
        items = self._items
        if not self._n:  # never grow the list of an empty table (``_EMPTY`` is shared)
            items = []
        elif len(items) != self._n:  # the shared list already holds entries beyond this table
            items = items[: self._n]
        items.extend(entries)
        return _Table(items)

    def replaced(self, position: int, entry: _Entry) -> _Table:
        items = list(self)
        items[position] = entry
        return _Table(items)

    def without(self, keys: set[str]) -> _Table:
        return _Table([e for e in self if e.key not in keys])


_EMPTY = _Table()


class _Layer:
    """One set of entries: the global registry, one ``scoped`` block, or an ``isolated`` barrier.

    ``hides`` names the kinds a barrier hides below it. The last snapshot computed with this
    layer innermost is cached on it, so it goes away with the layer.
    """

    __slots__ = ("_snap", "classes", "conversions", "hides", "serial", "source", "strict")

    def __init__(
        self,
        classes: _Table = _EMPTY,
        conversions: _Table = _EMPTY,
        source: str = "global",
        strict: bool = False,
        hides: frozenset[str] = frozenset(),
    ) -> None:
        self.classes = classes
        self.conversions = conversions
        self.source = source
        self.strict = strict
        self.hides = hides
        self.serial = next(_serials)
        self._snap: tuple[tuple[int, ...], Snapshot] | None = None

    def table(self, kind: str) -> _Table:
        return self.classes if kind == CLASSES else self.conversions


# ---- class identities and snapshot versions (no strong reference to any class) ----------------
_class_serials: dict[int, tuple[int, weakref.ref[Any]]] = {}
_versions: dict[tuple[tuple[str, int], ...], int] = {}


def _class_serial(cls: type) -> int:
    """A number that identifies ``cls`` for as long as it lives and is never reused afterwards."""
    found = _class_serials.get(id(cls))
    if found is not None and found[1]() is cls:
        return found[0]
    ident = id(cls)

    def forget(_ref: weakref.ref[Any], ident: int = ident) -> None:
        entry = _class_serials.get(ident)
        if entry is not None and entry[1] is _ref:
            del _class_serials[ident]

    serial = next(_serials)
    _class_serials[ident] = (serial, weakref.ref(cls, forget))
    return serial


def _version(content: tuple[tuple[str, int], ...]) -> int:
    """The same number for the same effective class mapping, so plans derived from it are reused."""
    version = _versions.get(content)
    if version is None:
        if len(_versions) >= _VERSIONS_MAX:
            _versions.clear()  # forgetting only costs a re-plan
        version = _versions[content] = next(_serials)
    return version


class Snapshot:
    """An immutable view of the effective registry (scoped layers over the global one).

    It carries the replacement classes (:meth:`find`, ``mapping``, ``sources``), the conversions
    (``conversions``, :meth:`lookup_conversions`) and ``strict`` (whether an enclosing
    ``patched(..., strict=True)`` asks for strict loads). The truth value is whether any class is
    replaced. ``version`` identifies the class mapping: equal versions mean equal mappings, so
    plans derived from a snapshot are cached by version.
    """

    __slots__ = (
        "__weakref__",
        "_by_key",
        "_exact",
        "_memo",
        "_patterns",
        "conversions",
        "mapping",
        "sources",
        "strict",
        "version",
    )

    def __init__(self, layers: tuple[_Layer, ...]) -> None:
        exact: dict[str, _Entry] = {}
        patterns: list[_Entry] = []
        seen: set[str] = set()
        conversions: dict[str, tuple[Any, ...]] = {}
        hidden: set[str] = set()
        strict = False
        # Innermost layer first: scoped entries hide outer ones with the same key.
        for layer in reversed(layers):
            if layer.hides:
                hidden |= layer.hides
                if CLASSES in layer.hides:
                    hidden.add("strict")  # `unpatched()` also ends an enclosing strict block
                continue
            if "strict" not in hidden:
                strict = strict or layer.strict
            if CLASSES not in hidden:
                for entry in layer.classes:
                    if entry.key in seen:
                        continue
                    seen.add(entry.key)
                    if entry.matcher is None:
                        exact[entry.key] = entry
                    else:
                        patterns.append(entry)
            if CONVERSIONS not in hidden:
                for entry in layer.conversions:
                    conversions.setdefault(entry.key, entry.value)
        self._exact = exact
        self._patterns = tuple(patterns)
        self._memo: dict[str, _Entry | None] = {}
        ordered = [*exact.values(), *patterns]
        self._by_key = {e.key: e for e in ordered}
        self.mapping: Mapping[str, type] = MappingProxyType({e.key: e.value for e in ordered})
        self.sources: Mapping[str, str] = MappingProxyType({e.key: e.source for e in ordered})
        self.conversions: Mapping[str, tuple[Any, ...]] = MappingProxyType(conversions)
        self.strict = strict
        self.version = _version(tuple((e.key, _class_serial(e.value)) for e in ordered))

    def __bool__(self) -> bool:
        return bool(self.mapping)

    def __len__(self) -> int:
        return len(self.mapping)

    def __repr__(self) -> str:
        return f"Snapshot(version={self.version}, keys={list(self.mapping)}, conversions={list(self.conversions)})"

    def find(self, class_name: str) -> tuple[str, type] | None:
        """Return ``(key, replacement)`` for ``class_name``, or None when no key matches."""
        try:
            entry = self._memo[class_name]
        except KeyError:
            entry = self._exact.get(class_name)
            if entry is None:
                entry = next((e for e in self._patterns if e.matcher.matches(class_name)), None)  # type: ignore[union-attr]
            self._memo[class_name] = entry
        return None if entry is None else (entry.key, entry.value)

    def matches(self, key: str, class_name: str) -> bool:
        """Whether the registered ``key`` matches ``class_name`` (exact name, or ``re.search``)."""
        matcher = self._by_key[key].matcher
        return key == class_name if matcher is None else matcher.matches(class_name)

    def lookup_conversions(
        self, class_name: str, model_type: str | None
    ) -> tuple[str, tuple[Any, ...]] | None:
        """Return ``(key, converters)`` for a (sub)model: its class name first, then ``model_type``."""
        for key in (class_name, model_type):
            if key and key in self.conversions:
                return key, self.conversions[key]
        return None


@dataclass(frozen=True)
class Candidate:
    """One registry key considered by :func:`explain`."""

    key: str
    kind: str  # "exact" or "pattern"
    source: str  # "global" or "scoped"
    replacement: str  # qualified name of the replacement class
    matches: bool
    reason: str


@dataclass(frozen=True)
class Explanation:
    """Why a class name is (or is not) replaced under a snapshot."""

    class_name: str
    winner: str | None  # the winning key
    replacement: type | None
    candidates: tuple[Candidate, ...]


# ---- global state ------------------------------------------------------------------------------
_write_lock = ForkSafeLock()
_global = _Layer()
# key -> position in the global table of that kind; only read and written under _write_lock.
_positions: dict[str, dict[str, int]] = {CLASSES: {}, CONVERSIONS: {}}
_overlays: ContextVar[tuple[_Layer, ...]] = ContextVar("modelgraft_overlays", default=())
_pinned: ContextVar[Snapshot | None] = ContextVar("modelgraft_pinned_snapshot", default=None)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def validate_classes(mapping: object, source: str) -> list[_Entry]:
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
        entries.append(_Entry(key, replacement, matcher, source))
    return entries


def _conversion_entries(conversions: Mapping[str, tuple[Any, ...]], source: str) -> list[_Entry]:
    """Entries for conversions already validated by :mod:`modelgraft.conversion.rules`."""
    return [_Entry(key, tuple(value), None, source) for key, value in conversions.items()]


# ---- global writes: one lock, one new global layer per write -----------------------------------
@dataclass(frozen=True)
class _Additions:
    """Entries to add to the global table of one kind, and the error for a key already there."""

    entries: list[_Entry]
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
        tables = {kind: _global.table(kind) for kind in _KINDS}
        new_positions = {}
        for kind, batch in batches.items():
            positions = dict(_positions[kind]) if len(batches) > 1 else _positions[kind]
            table = tables[kind]
            new: dict[str, _Entry] = {}
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
        _global = _Layer(tables[CLASSES], tables[CONVERSIONS])
        _positions.update(new_positions)


def _remove(batches: Mapping[str, _Removals]) -> None:
    """Remove keys of one or both kinds from the global registry in one step, all or nothing."""
    global _global
    with _write_lock:
        for kind, batch in batches.items():
            missing = [k for k in batch.keys if k not in _positions[kind]]
            if missing:
                raise batch.unknown(missing, sorted(_positions[kind]))
        tables = {kind: _global.table(kind) for kind in _KINDS}
        for kind, batch in batches.items():
            tables[kind] = tables[kind].without(set(batch.keys))
        _global = _Layer(tables[CLASSES], tables[CONVERSIONS])
        for kind in batches:
            _positions[kind] = {e.key: i for i, e in enumerate(tables[kind])}


def _clear(kind: str) -> None:
    global _global
    with _write_lock:
        _positions[kind] = {}
        tables = {k: _global.table(k) for k in _KINDS}
        tables[kind] = _EMPTY
        _global = _Layer(tables[CLASSES], tables[CONVERSIONS])


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
            for kind in _KINDS:
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
def _pushed(layer: _Layer) -> Iterator[None]:
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
    layer = _Layer(
        _Table(validate_classes(mapping if mapping is not None else {}, "scoped")),
        _Table(_conversion_entries(conversions or {}, "scoped")),
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
    with _pushed(_Layer(source="barrier", hides=hides)):
        yield


# ---- fork: the child starts with a usable registry -------------------------------------------
def _after_fork_in_child() -> None:
    """A thread that was writing when the process forked does not exist in the child: rebuild the
    writer's index from the global layer actually published (its lock is renewed by ``_forksafe``)."""
    for kind in _KINDS:
        _positions[kind] = {e.key: i for i, e in enumerate(_global.table(kind))}


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
