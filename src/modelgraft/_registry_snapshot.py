"""The registry's values: entries, the tables and layers that hold them, and :class:`Snapshot`.

Every value here is immutable once published (a :class:`Layer`'s cached snapshot aside): the
global registry and each ``scoped`` block is one :class:`Layer` of two :class:`Table` s (classes
and conversions), and a :class:`Snapshot` is what a stack of layers means, with the matching rules
of :mod:`modelgraft.registry` applied. The writes, the scopes and the reads that build these live
in :mod:`modelgraft.registry`.

Example:
    >>> import torch
    >>> layer = Layer(Table([Entry("LlamaMLP", torch.nn.Identity, None, "global")]))
    >>> snap = Snapshot((layer,))
    >>> snap.find("LlamaMLP")[0], snap.find("LlamaAttention"), snap.sources["LlamaMLP"]
    ('LlamaMLP', None, 'global')
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from modelgraft import _safe_regex

__all__ = [
    "CLASSES",
    "CONVERSIONS",
    "EMPTY",
    "KINDS",
    "Candidate",
    "Entry",
    "Explanation",
    "Layer",
    "Snapshot",
    "Table",
    "is_exact_key",
]

CLASSES, CONVERSIONS = "classes", "conversions"
KINDS = (CLASSES, CONVERSIONS)
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
class Entry:
    """One registered key with its value, how it matches, and where it was registered."""

    key: str
    value: Any  # a replacement class, or a tuple of converters
    matcher: _safe_regex.Matcher | None  # for pattern keys of the class registry
    source: str  # "global" or "scoped"


class Table:
    """An immutable sequence of entries that is cheap to extend.

    Successive global tables share one list: a table sees the first ``n`` items, and extending the
    newest table appends to the list (older tables keep seeing their prefix). Registering keys one
    by one is therefore linear in total; only overwriting or removing keys copies.
    """

    __slots__ = ("_items", "_n")

    def __init__(self, items: list[Entry] | None = None) -> None:
        self._items = items if items is not None else []
        self._n = len(self._items)

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[Entry]:
        items = self._items
        return (items[i] for i in range(self._n))

    def extended(self, entries: Iterable[Entry]) -> Table:
        items = self._items
        if not self._n:  # never grow the list of an empty table (``EMPTY`` is shared)
            items = []
        elif len(items) != self._n:  # the shared list already holds entries beyond this table
            items = items[: self._n]
        items.extend(entries)
        return Table(items)

    def replaced(self, position: int, entry: Entry) -> Table:
        items = list(self)
        items[position] = entry
        return Table(items)

    def without(self, keys: set[str]) -> Table:
        return Table([e for e in self if e.key not in keys])


EMPTY = Table()


class Layer:
    """One set of entries: the global registry, one ``scoped`` block, or an ``isolated`` barrier.

    ``hides`` names the kinds a barrier hides below it. The last snapshot computed with this
    layer innermost is cached on it, so it goes away with the layer.
    """

    __slots__ = ("_snap", "classes", "conversions", "hides", "serial", "source", "strict")

    def __init__(
        self,
        classes: Table = EMPTY,
        conversions: Table = EMPTY,
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

    def table(self, kind: str) -> Table:
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

    def __init__(self, layers: tuple[Layer, ...]) -> None:
        exact: dict[str, Entry] = {}
        patterns: list[Entry] = []
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
        self._memo: dict[str, Entry | None] = {}
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
