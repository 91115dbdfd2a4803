"""The patch registry: keys, matching rules, precedence, snapshots and scoped overlays.

Matching rules:

* A key made only of identifier characters (``LlamaAttention``) is an *exact* class name and
  matches only a class bound under exactly that name.
* Any other key is a regular expression matched with :func:`re.search`.
* Exact keys win over patterns; among patterns the one registered first wins.

:func:`scoped` (used by :func:`modelgraft.patched`) layers a mapping over the global registry for
the current thread or asyncio task only. The effective view (:func:`snapshot`) looks up exact keys
innermost-first (scoped, then global), then patterns innermost-first, each layer in its own
registration order. A scoped key equal to a global key hides the global entry.

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
import re
import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from modelgraft.errors import PatchRegistrationError, ReplacementTypeError

__all__ = [
    "Candidate",
    "Explanation",
    "Snapshot",
    "clear_patch_mapping",
    "explain",
    "find_replacement",
    "get_patch_mapping",
    "is_exact_key",
    "isolated",
    "register_patch_mapping",
    "scoped",
    "snapshot",
    "unregister_patch_mapping",
]

_serial = itertools.count(1)
_SNAPSHOT_CACHE_SIZE = 64
_layer_serials: dict[tuple[tuple[str, type, str], ...], int] = {}


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
    replacement: type
    pattern: re.Pattern[str] | None  # None for exact keys
    source: str  # "global" or "scoped"


@dataclass(frozen=True)
class _Layer:
    """One immutable set of entries (the global registry, or one ``scoped`` block).

    Layers with the same content share a serial, so entering ``patched(same mapping)`` again
    finds the snapshot, and the swap plans derived from it, already cached.
    """

    entries: tuple[_Entry, ...]
    serial: int = field(init=False)

    def __post_init__(self) -> None:
        content = tuple((e.key, e.replacement, e.source) for e in self.entries)
        serial = _layer_serials.get(content)
        if serial is None:
            if len(_layer_serials) >= _SNAPSHOT_CACHE_SIZE * 4:
                _layer_serials.clear()  # bounded: it keeps replacement classes alive
            serial = _layer_serials[content] = next(_serial)
        object.__setattr__(self, "serial", serial)


class Snapshot:
    """An immutable view of the effective mapping (scoped overlays over the global registry).

    ``version`` identifies the content: two snapshots with the same version hold the same
    entries, so results derived from a snapshot can be cached by version. Lookups are memoised.
    """

    __slots__ = ("_exact", "_memo", "_patterns", "mapping", "sources", "version")

    def __init__(self, layers: tuple[_Layer, ...], version: int) -> None:
        exact: dict[str, _Entry] = {}
        patterns: list[_Entry] = []
        seen: set[str] = set()
        # Innermost layer first, so scoped entries hide global ones with the same key.
        for layer in reversed(layers):
            for entry in layer.entries:
                if entry.key in seen:
                    continue
                seen.add(entry.key)
                if entry.pattern is None:
                    exact[entry.key] = entry
                else:
                    patterns.append(entry)
        self._exact = exact
        self._patterns = tuple(patterns)
        self._memo: dict[str, _Entry | None] = {}
        ordered = [*exact.values(), *patterns]
        self.mapping: Mapping[str, type] = MappingProxyType({e.key: e.replacement for e in ordered})
        self.sources: Mapping[str, str] = MappingProxyType({e.key: e.source for e in ordered})
        self.version = version

    def __bool__(self) -> bool:
        return bool(self.mapping)

    def __len__(self) -> int:
        return len(self.mapping)

    def __repr__(self) -> str:
        return f"Snapshot(version={self.version}, keys={list(self.mapping)})"

    def find(self, class_name: str) -> tuple[str, type] | None:
        """Return ``(key, replacement)`` for ``class_name``, or None when no key matches."""
        try:
            entry = self._memo[class_name]
        except KeyError:
            entry = self._exact.get(class_name)
            if entry is None:
                entry = next((e for e in self._patterns if e.pattern.search(class_name)), None)
            self._memo[class_name] = entry
        return None if entry is None else (entry.key, entry.replacement)


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
_write_lock = threading.Lock()
_global = _Layer(())
_overlays: ContextVar[tuple[_Layer, ...]] = ContextVar("modelgraft_overlays", default=())
_global_hidden: ContextVar[bool] = ContextVar("modelgraft_global_hidden", default=False)
_snapshot_cache: dict[tuple[int, ...], Snapshot] = {}


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _validate(mapping: object, source: str) -> list[_Entry]:
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
        pattern = None
        if not is_exact_key(key):
            try:
                pattern = re.compile(key)
            except re.error as exc:
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
        entries.append(_Entry(key, replacement, pattern, source))
    return entries


def register_patch_mapping(mapping: Mapping[str, type[torch.nn.Module]], overwrite: bool = False) -> None:
    """Register replacement classes globally, all or nothing.

    Args:
        mapping: class names or regular expressions to replacement ``nn.Module`` subclasses.
        overwrite: replace the class of a key that is already registered (it keeps its position
            among the patterns).

    Raises:
        PatchRegistrationError: a key is not a non-empty string, is an invalid regular expression,
            or is already registered while ``overwrite`` is False.
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
    global _global
    entries = _validate(mapping, "global")
    with _write_lock:
        current = {e.key: e for e in _global.entries}
        duplicates = [e.key for e in entries if e.key in current]
        if duplicates and not overwrite:
            raise PatchRegistrationError(
                f"Patch key `{duplicates[0]}` is already registered (to "
                f"`{current[duplicates[0]].replacement.__qualname__}`). Pass `overwrite=True` to replace it, "
                "or unregister it first."
            )
        for entry in entries:
            current[entry.key] = entry  # dict assignment keeps an overwritten key in place
        _global = _Layer(tuple(current.values()))


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
    global _global
    wanted = [keys] if isinstance(keys, str) else list(keys)
    with _write_lock:
        current = {e.key: e for e in _global.entries}
        unknown = [k for k in wanted if k not in current]
        if unknown:
            raise PatchRegistrationError(
                f"Cannot unregister `{unknown[0]}`: the key is not registered (not found in the patch mapping). "
                f"Registered keys: {sorted(current)}. Use the exact string given at registration."
            )
        _global = _Layer(tuple(e for k, e in current.items() if k not in set(wanted)))


def clear_patch_mapping() -> None:
    """Remove every globally registered patch (scoped ``patched`` blocks are not affected).

    Example:
        >>> clear_patch_mapping()
        >>> get_patch_mapping()
        {}
    """
    global _global
    with _write_lock:
        _global = _Layer(())


def get_patch_mapping() -> dict[str, type]:
    """Return a copy of the effective mapping: the global registry plus any active scoped overlays.

    Exact keys come first, then patterns in the order they are tried.

    Example:
        >>> clear_patch_mapping()
        >>> get_patch_mapping()
        {}
    """
    return dict(snapshot().mapping)


def snapshot() -> Snapshot:
    """Return the effective mapping for this thread/task as an immutable :class:`Snapshot`.

    Example:
        >>> clear_patch_mapping()
        >>> snap = snapshot()
        >>> bool(snap), snap is snapshot()
        (False, True)
    """
    hidden = _global_hidden.get()
    layers = (*(() if hidden else (_global,)), *_overlays.get())
    cache_key = (hidden, *(layer.serial for layer in layers))
    snap = _snapshot_cache.get(cache_key)
    if snap is None:
        snap = Snapshot(layers, next(_serial))
        if len(_snapshot_cache) >= _SNAPSHOT_CACHE_SIZE:
            _snapshot_cache.clear()
        _snapshot_cache[cache_key] = snap
    return snap


def find_replacement(class_name: str, snap: Snapshot | None = None) -> tuple[str, type] | None:
    """Return ``(winning key, replacement class)`` for ``class_name``, or None.

    Example:
        >>> import torch
        >>> with scoped({"T5Attention": torch.nn.Identity}):
        ...     find_replacement("T5Attention")[0], find_replacement("MT5Attention")
        ('T5Attention', None)
    """
    return (snap or snapshot()).find(class_name)


def explain(class_name: str, snap: Snapshot | None = None) -> Explanation:
    """Say which keys were considered for ``class_name`` and why the winner won.

    Example:
        >>> import torch
        >>> with scoped({".*Attention": torch.nn.Identity, "LlamaAttention": torch.nn.ReLU}):
        ...     result = explain("LlamaAttention")
        >>> result.winner, [c.matches for c in result.candidates]
        ('LlamaAttention', [True, True])
    """
    snap = snap or snapshot()
    found = snap.find(class_name)
    winner = found[0] if found else None
    candidates = []
    for key, replacement in snap.mapping.items():
        exact = is_exact_key(key)
        matches = key == class_name if exact else re.search(key, class_name) is not None
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


@contextmanager
def scoped(mapping: Mapping[str, type[torch.nn.Module]]) -> Iterator[Snapshot]:
    """Layer ``mapping`` over the registry for this thread/task only, inside the ``with`` block.

    Validated like :func:`register_patch_mapping`; blocks nest (the inner one wins on equal keys).
    Yields the effective snapshot.

    Example:
        >>> import torch
        >>> clear_patch_mapping()
        >>> with scoped({"LlamaMLP": torch.nn.Identity}):
        ...     sorted(get_patch_mapping())
        ['LlamaMLP']
        >>> get_patch_mapping()
        {}
    """
    layer = _Layer(tuple(_validate(mapping, "scoped")))
    token = _overlays.set((*_overlays.get(), layer))
    try:
        yield snapshot()
    finally:
        _overlays.reset(token)


@contextmanager
def isolated() -> Iterator[None]:
    """Hide the global registry and every enclosing ``scoped`` block, in this thread/task only.

    ``scoped`` blocks opened inside apply as usual.

    Example:
        >>> import torch
        >>> with scoped({"LlamaMLP": torch.nn.Identity}):
        ...     with isolated():
        ...         get_patch_mapping()
        ...     sorted(get_patch_mapping())
        {}
        ['LlamaMLP']
    """
    hidden, overlays = _global_hidden.set(True), _overlays.set(())
    try:
        yield
    finally:
        _overlays.reset(overlays)
        _global_hidden.reset(hidden)
