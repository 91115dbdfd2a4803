"""One graft value: the classes to replace plus the checkpoint conversions that go with them.

A :class:`Graft` is what every entry point takes in place of a bare patch mapping:
``patched(graft)``, ``graft_model(model, graft)``, ``verify(target, graft)``,
:func:`register_graft` and the CLI's ``--graft``. The ready-made grafts of
:mod:`modelgraft.grafts` return one; users build one from a mapping and conversions, and grafts
add up with ``+``. This module is the one place where classes and conversions are joined: a
graft enters the registry in one step (:func:`register_graft`, :func:`scope`), so a load sees
all of it or none of it.

Example:
    >>> import torch
    >>> from modelgraft import Concatenate, WeightConverter, get_patch_mapping
    >>> class MyAttention(torch.nn.Module):
    ...     pass
    >>> fuse = WeightConverter(["q_proj", "k_proj", "v_proj"], "qkv_proj", [Concatenate(dim=0)])
    >>> graft = Graft({"LlamaAttention": MyAttention}, {"llama": [fuse]})
    >>> graft
    Graft(name='LlamaAttention', model_types=())
    >>> with scope(graft):
    ...     list(get_patch_mapping())
    ['LlamaAttention']
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from modelgraft import registry
from modelgraft.conversion.rules import WeightConverter, unknown_conversions, validate_conversions
from modelgraft.errors import ConversionError, GraftConflictError, PatchRegistrationError
from modelgraft.registry import Snapshot

__all__ = ["Graft", "Piece", "as_graft", "register_graft", "scope", "unregister_graft"]

ClassMapping = Mapping[str, type[torch.nn.Module]]
ConversionMapping = Mapping[str, Sequence[WeightConverter]]


@dataclass(frozen=True)
class Piece:
    """What one part of a graft contributes (ready-made grafts make one per model type).

    Attributes:
        mapping: patch keys to replacement classes.
        conversions: converters this piece adds, per conversion key (model type or class name).
        keeps: converters already in effect for a key that this piece keeps (transformers'
            built-in conversion, which a modelgraft entry would otherwise replace). Their
            converters go in front of the graft's own, their renamings (converters without
            operations) after them: a key the graft converts is then not claimed by a renaming first.
        drops: per key, converters of ``keeps`` to leave out (per-expert layers drop the expert
            merge); a drop applies to the whole graft the piece is part of.
    """

    mapping: ClassMapping = field(default_factory=dict)
    conversions: Mapping[str, tuple[WeightConverter, ...]] = field(default_factory=dict)
    keeps: Mapping[str, tuple[WeightConverter, ...]] = field(default_factory=dict)
    drops: Mapping[str, frozenset[WeightConverter]] = field(default_factory=dict)


class Graft:
    """Replacement classes and the checkpoint conversions that go with them, as one value.

    Args:
        mapping: class names or patterns to replacement ``nn.Module`` subclasses, as for
            ``register_patch_mapping``.
        conversions: ``{model_type_or_class_name: [WeightConverter | WeightRenaming, ...]}``; each
            entry is the whole conversion mapping for that (sub)model while the graft applies.
        name: a short description for reports and ``repr`` (default: the mapping's keys).

    Both are checked now (:class:`~modelgraft.PatchRegistrationError`,
    :class:`~modelgraft.ReplacementTypeError`, :class:`~modelgraft.ConversionError`). Grafts add
    up: ``a + b`` replaces the classes of both (:class:`~modelgraft.grafts.GraftConflictError` when
    they replace one key with different classes) and merges their conversions per key.

    Attributes:
        name: the description.
        model_types: the model types a ready-made graft was built for (empty for one built from
            a mapping).

    Example:
        >>> import torch
        >>> from modelgraft import WeightRenaming
        >>> a = Graft({"LlamaMLP": torch.nn.Identity}, {"llama": [WeightRenaming("w1", "gate_proj")]})
        >>> b = Graft({"LlamaAttention": torch.nn.Identity})
        >>> sorted((a + b).mapping), (a + b).conversions
        (['LlamaAttention', 'LlamaMLP'], {'llama': [WeightRenaming(['w1'] -> ['gate_proj'])]})
    """

    def __init__(
        self,
        mapping: ClassMapping | None = None,
        conversions: ConversionMapping | None = None,
        *,
        name: str | None = None,
    ) -> None:
        mapping = {} if mapping is None else mapping
        registry.validate_classes(mapping, "scoped")  # raises before anything exists
        piece = Piece(dict(mapping), validate_conversions(conversions))
        self.name = name if name is not None else " + ".join(piece.mapping) or "conversions"
        self.model_types: tuple[str, ...] = ()
        self._sources: tuple[Callable[[], Piece], ...] = (lambda: piece,)

    @classmethod
    def of(
        cls,
        name: str,
        requested: Sequence[str],
        default: Sequence[str],
        part: Callable[[str], Any],
    ) -> Graft:
        """A graft made per model type (how the ready-made grafts are built).

        ``part(model_type)`` returns a :class:`Piece`, or an object whose ``piece(model_type)``
        returns one. Model types the caller names (``requested``) are resolved now, so one the
        graft cannot handle is a clear error at once; the ``default`` set is resolved on first
        use, so making the graft costs nothing.

        Example:
            >>> import torch
            >>> graft = Graft.of("identity MLP", (), ("llama", "qwen2"),
            ...                  lambda t: Piece({f"{t.title()}MLP": torch.nn.Identity}))
            >>> graft.model_types, sorted(graft.mapping)
            (('llama', 'qwen2'), ['LlamaMLP', 'Qwen2MLP'])
        """
        types = tuple(requested) or tuple(default)
        sources = [functools.partial(_piece_of, part, t) for t in types]
        return cls._lazy(name, types, sources, resolve_now=bool(requested))

    @classmethod
    def _lazy(
        cls,
        name: str,
        model_types: Sequence[str],
        sources: Sequence[Callable[[], Piece]],
        resolve_now: bool = False,
    ) -> Graft:
        """A graft whose pieces are computed on first use (``resolve_now``: at once, to fail early)."""
        graft = cls.__new__(cls)
        graft.name = name
        graft.model_types = tuple(model_types)
        graft._sources = tuple(sources)
        if resolve_now:
            graft._pieces  # noqa: B018
        return graft

    @functools.cached_property
    def _pieces(self) -> tuple[Piece, ...]:
        return tuple(make() for make in self._sources)

    @functools.cached_property
    def _mapping(self) -> dict[str, type[torch.nn.Module]]:
        merged: dict[str, type[torch.nn.Module]] = {}
        for piece in self._pieces:
            for key, cls in piece.mapping.items():
                if merged.get(key, cls) is not cls:
                    raise GraftConflictError(
                        f"`{key}` is replaced by both `{merged[key].__qualname__}` and `{cls.__qualname__}`; "
                        "expected one replacement per class. Combine grafts that touch different classes."
                    )
                merged[key] = cls
        return merged

    @functools.cached_property
    def _conversions(self) -> dict[str, tuple[WeightConverter, ...]]:
        keys: dict[str, None] = {}
        drops: dict[str, set[WeightConverter]] = {}
        for piece in self._pieces:
            for key in (*piece.keeps, *piece.conversions):
                keys.setdefault(key)
            for key, dropped in piece.drops.items():
                drops.setdefault(key, set()).update(dropped)
        merged: dict[str, tuple[WeightConverter, ...]] = {}
        for key in keys:
            kept = [c for p in self._pieces for c in p.keeps.get(key, ()) if c not in drops.get(key, ())]
            own = [c for p in self._pieces for c in p.conversions.get(key, ())]
            # modelgraft gives each model key to the first converter that targets it: a kept
            # renaming (GraniteMoE's `block_sparse_moe` -> `mlp`) must not take the keys a graft's
            # converter builds from the checkpoint's own names.
            renamings = [c for c in kept if not c.operations]
            ordered = [*(c for c in kept if c.operations), *own, *renamings]
            merged[key] = tuple(dict.fromkeys(ordered))  # a graft added twice converts once
        return merged

    @property
    def mapping(self) -> dict[str, type[torch.nn.Module]]:
        """Patch key -> replacement class (a new dict)."""
        return dict(self._mapping)

    @property
    def conversions(self) -> dict[str, list[WeightConverter]]:
        """Conversion key -> the whole conversion mapping used for it (new lists)."""
        return {key: list(value) for key, value in self._conversions.items()}

    def __add__(self, other: Graft) -> Graft:
        if not isinstance(other, Graft):
            return NotImplemented
        types = self.model_types + tuple(t for t in other.model_types if t not in self.model_types)
        combined = Graft._lazy(f"{self.name} + {other.name}", types, self._sources + other._sources)
        combined._mapping  # noqa: B018  (fail now, not at load time, on conflicting replacements)
        return combined

    def __repr__(self) -> str:
        return f"Graft(name={self.name!r}, model_types={self.model_types!r})"

    def __reduce__(self) -> Any:
        # Ready-made pieces are closures; a graft pickles as what it resolves to.
        return (_rebuild, (self.name, self.model_types, tuple(_plain(p) for p in self._pieces)))

    # ---- convenience, same as the module functions -----------------------------------------
    def register(self, *, overwrite: bool = False) -> None:
        """Register globally; same as :func:`register_graft`."""
        register_graft(self, overwrite=overwrite)

    def unregister(self) -> None:
        """Remove what :meth:`register` added; same as :func:`unregister_graft`."""
        unregister_graft(self)

    @contextlib.contextmanager
    def applied(self, *, strict: bool = False) -> Iterator[Graft]:
        """Apply the graft in this thread or task for the ``with`` block; same as ``patched(graft)``."""
        with scope(self, strict=strict):
            yield self


def _piece_of(part: Callable[[str], Any], model_type: str) -> Piece:
    made = part(model_type)
    return made if isinstance(made, Piece) else made.piece(model_type)


def _plain(piece: Piece) -> Piece:
    """``piece`` with every mapping read into a dict (values computed on use included)."""
    return Piece(
        dict(piece.mapping),
        dict(piece.conversions),
        {key: piece.keeps[key] for key in piece.keeps},
        {key: piece.drops[key] for key in piece.drops},
    )


def _rebuild(name: str, model_types: tuple[str, ...], pieces: tuple[Piece, ...]) -> Graft:
    return Graft._lazy(name, model_types, [functools.partial(_same, p) for p in pieces])


def _same(piece: Piece) -> Piece:
    return piece


def as_graft(
    mapping: Graft | ClassMapping | Any | None, conversions: ConversionMapping | None = None
) -> Graft | None:
    """What an entry point was given (a graft, or a mapping and conversions) as one :class:`Graft`.

    ``None`` when both are ``None`` (then the registry as it stands applies). An object with
    ``.mapping`` and ``.conversions`` attributes counts as a graft. Conversions given next to a
    graft are added to it.

    Example:
        >>> import torch
        >>> as_graft({"LlamaMLP": torch.nn.Identity}).mapping
        {'LlamaMLP': <class 'torch.nn.modules.linear.Identity'>}
        >>> as_graft(None) is None
        True
    """
    if mapping is None and conversions is None:
        return None
    if not isinstance(mapping, Graft | Mapping | None) and hasattr(mapping, "mapping"):
        mapping = Graft(
            mapping.mapping, getattr(mapping, "conversions", None), name=getattr(mapping, "name", None)
        )
    if isinstance(mapping, Graft):
        return mapping if conversions is None else mapping + Graft(conversions=conversions)
    return Graft(mapping, conversions)


@contextlib.contextmanager
def scope(
    mapping: Graft | ClassMapping | None,
    conversions: ConversionMapping | None = None,
    *,
    strict: bool = False,
) -> Iterator[Snapshot]:
    """Layer a graft (or a mapping and conversions) over the registry in this thread/task, in the block.

    Classes and conversions go in as one scoped layer; yields the effective snapshot. This is
    ``modelgraft.patched``; ``graft_model``, ``verify`` and the CLI use it too.
    """
    if isinstance(mapping, Graft):
        graft = mapping if conversions is None else mapping + Graft(conversions=conversions)
        with registry.scoped(graft._mapping, conversions=graft._conversions, strict=strict) as snap:
            yield snap
        return
    # a plain mapping: validated once, by the registry itself
    with registry.scoped(mapping, conversions=validate_conversions(conversions), strict=strict) as snap:
        yield snap


def _required(graft: Graft | ClassMapping, caller: str) -> Graft:
    found = as_graft(graft)
    if found is None:
        raise PatchRegistrationError(f"`{caller}` needs a `Graft` (or a patch mapping); received `None`.")
    return found


def register_graft(graft: Graft, *, overwrite: bool = False) -> None:
    """Register a graft's classes and conversions globally, in one step (all or nothing).

    A load that starts meanwhile sees the whole graft or none of it. transformers' own
    conversions for the graft's keys are replaced (a ready-made graft's conversions already
    contain what it still needs of them).

    Args:
        graft: the :class:`Graft`.
        overwrite: replace patch keys and conversion entries already registered in modelgraft.

    Raises:
        PatchRegistrationError: a class is already patched and ``overwrite`` is false.
        ConversionError: a conversion key is already registered and ``overwrite`` is false.

    Example:
        >>> import torch
        >>> from modelgraft import get_patch_mapping
        >>> graft = Graft({"LlamaMLP": torch.nn.Identity})
        >>> register_graft(graft)
        >>> list(get_patch_mapping())
        ['LlamaMLP']
        >>> unregister_graft(graft)
        >>> get_patch_mapping()
        {}
    """
    graft = _required(graft, "register_graft")

    def taken(key: str, _registered: Any) -> ConversionError:
        return ConversionError(
            f"Cannot register graft `{graft.name}`: modelgraft already has conversions for `{key}`. "
            "Unregister them or pass `overwrite=True`."
        )

    registry.register(graft._mapping, graft._conversions, overwrite, taken)


def unregister_graft(graft: Graft) -> None:
    """Remove a graft's patch keys and conversion entries from the global registry, in one step.

    Raises:
        PatchRegistrationError: a patch key of the graft is not registered (nothing is removed).
        ConversionError: a conversion key of the graft is not registered (nothing is removed).
    """
    graft = _required(graft, "unregister_graft")
    registry.unregister(list(graft._mapping), list(graft._conversions), unknown_conversions)
