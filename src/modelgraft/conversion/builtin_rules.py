"""Renamings of transformers' conversion API that have no plain-pattern form.

:class:`PrefixChange` adds or removes a whole leading part of every key; :class:`GroupWeightRename`
renames several names that shift into each other (``norm0 -> norm1``, ``norm1 -> norm2``) only
when the checkpoint is in the old layout. Both match keys as transformers 5 does (see
:mod:`modelgraft.conversion._hf_patterns`) and are undone exactly on save: modelgraft records which
checkpoint keys a load renamed and writes those names back, so a checkpoint that was already in
the new layout is saved unchanged.

Example:
    >>> from modelgraft.conversion._hf_plan import rename_key
    >>> rename_key("bad.model.w", [PrefixChange(prefix_to_remove="bad")], [])[0]
    'model.w'
    >>> rename_key("w", [PrefixChange(prefix_to_add="model")], [])[0]
    'model.w'
    >>> rename_key("model.w", [PrefixChange(prefix_to_add="model")], [])[0]
    'model.w'
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from modelgraft.conversion.rules import WeightConverter, WeightRenaming
from modelgraft.errors import ConversionError

__all__ = [
    "GroupWeightRename",
    "IndexOffsetRenaming",
    "LayerPairCollapse",
    "PrefixChange",
    "TransformersConverter",
    "TransformersRenaming",
]


class TransformersRenaming(WeightRenaming):
    """A :class:`WeightRenaming` that matches as transformers does even with plain dotted patterns."""

    __slots__ = ()
    always_transformers_semantics = True


class TransformersConverter(WeightConverter):
    """A :class:`WeightConverter` that matches as transformers does even with plain dotted patterns."""

    __slots__ = ()
    always_transformers_semantics = True


class PrefixChange(WeightRenaming):
    """Add ``prefix_to_add`` to, or remove ``prefix_to_remove`` from, every key (after ``model_prefix``).

    A key that already has the prefix to add is left as it is.
    """

    __slots__ = ("model_prefix", "prefix_to_add", "prefix_to_remove")
    always_transformers_semantics = True

    prefix_to_add: str | None
    prefix_to_remove: str | None
    model_prefix: str

    def __init__(
        self,
        prefix_to_add: str | None = None,
        prefix_to_remove: str | None = None,
        model_prefix: str | None = None,
    ) -> None:
        if (prefix_to_add is None) == (prefix_to_remove is None):
            raise ConversionError(
                "`PrefixChange` needs exactly one of `prefix_to_add` and `prefix_to_remove`; received "
                f"prefix_to_add={prefix_to_add!r}, prefix_to_remove={prefix_to_remove!r}."
            )
        object.__setattr__(self, "prefix_to_add", prefix_to_add)
        object.__setattr__(self, "prefix_to_remove", prefix_to_remove)
        object.__setattr__(self, "model_prefix", model_prefix or "")
        lead = rf"{re.escape(model_prefix)}\." if model_prefix else ""
        kept = f"{model_prefix}." if model_prefix else ""
        if prefix_to_add is not None:
            added = re.escape(prefix_to_add)
            super().__init__(rf"^{lead}(?!{added}\.)(.+)", rf"{kept}{prefix_to_add}.\1")
        else:
            assert prefix_to_remove is not None  # exactly one of the two, checked above
            super().__init__(rf"^{lead}{re.escape(prefix_to_remove)}\.(.+)", rf"{kept}\1")

    def __repr__(self) -> str:
        what = (
            f"prefix_to_add={self.prefix_to_add!r}"
            if self.prefix_to_add is not None
            else f"prefix_to_remove={self.prefix_to_remove!r}"
        )
        where = f", model_prefix={self.model_prefix!r}" if self.model_prefix else ""
        return f"PrefixChange({what}{where})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild_prefix_change,
            (self.prefix_to_add, self.prefix_to_remove, self.model_prefix, self._scope(), type(self)),
        )


def _rebuild_prefix_change(
    add: str | None,
    remove: str | None,
    model_prefix: str,
    scope: tuple[str | None, str | None],
    cls: type[PrefixChange] | None = None,
) -> PrefixChange:
    change = (cls or PrefixChange)(add, remove, model_prefix or None)
    if scope != (None, None):
        change.scope_prefix, change.base_model_prefix = scope
    return change


class GroupWeightRename(WeightRenaming):
    """Rename the ``i``-th source pattern to the ``i``-th target, only if the first source is present.

    The first source pattern is the guard: it names what exists only in the old layout. Without
    it in the checkpoint (already converted), nothing is renamed. Unlike transformers, the guard
    need not sort before the other keys.
    """

    __slots__ = ()
    always_transformers_semantics = True
    guarded = True

    def __init__(self, source_patterns: Sequence[str], target_patterns: Sequence[str]) -> None:
        if (
            isinstance(source_patterns, str)
            or isinstance(target_patterns, str)
            or len(source_patterns) != len(target_patterns)
        ):
            raise ConversionError(
                "`GroupWeightRename` pairs source and target patterns: pass two lists of the same length; "
                f"received {source_patterns!r} and {target_patterns!r}."
            )
        super().__init__(list(source_patterns), list(target_patterns))


class LayerPairCollapse(TransformersRenaming):
    """Fold checkpoints that store each decoder layer as two blocks: ``layers.{2i}`` (attention) and
    ``layers.{2i+1}`` (MLP) become ``layers.{i}.self_attn`` and ``layers.{i}.mlp``, and the blocks'
    ``attn_alpha``/``mlp_alpha`` become ``layers.{i}.lambda_1``/``lambda_2`` (transformers' name).

    A save writes the two-block names back (modelgraft records what each load renamed).

    Example:
        >>> LayerPairCollapse().renamed("model.layers.3.mixer.up_proj.weight")
        'model.layers.1.mlp.up_proj.weight'
        >>> LayerPairCollapse().renamed("model.layers.2.attn_alpha")
        'model.layers.1.lambda_1'
    """

    __slots__ = ()
    _BLOCK = re.compile(r"layers\.(\d+)\.(mixer|attn_alpha|mlp_alpha)(?=\.|$)")

    def __init__(self) -> None:
        super().__init__(r"layers\.(\d+)", r"layers.\1")

    def renamed(self, key: str) -> str | None:
        """``key`` renamed, or ``None`` when it is not a two-block key."""
        found = self._BLOCK.search(key)
        if found is None:
            return None
        index, part = int(found[1]), found[2]
        name = {"attn_alpha": "lambda_1", "mlp_alpha": "lambda_2"}.get(part) or ("self_attn", "mlp")[
            index % 2
        ]
        return f"{key[: found.start()]}layers.{index // 2}.{name}{key[found.end() :]}"

    def __repr__(self) -> str:
        return "LayerPairCollapse()"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_simple, (type(self), (), self._scope()))


class IndexOffsetRenaming(TransformersRenaming):
    r"""A renaming whose captured index is shifted by ``offset`` (checkpoints whose per-layer list
    starts at another layer: ``attn_queries.{i}`` belongs to ``layers.{i + 1}``).

    Example:
        >>> IndexOffsetRenaming(r"attn_queries\.(\d+)", r"layers.\1.query", offset=1).renamed("m.attn_queries.4")
        'm.layers.5.query'
    """

    __slots__ = ("offset",)

    offset: int

    def __init__(
        self, source_patterns: str | Sequence[str], target_patterns: str | Sequence[str], offset: int
    ) -> None:
        if not isinstance(offset, int) or isinstance(offset, bool):
            raise ConversionError(f"`offset` must be an int; received {offset!r}.")
        object.__setattr__(self, "offset", offset)
        super().__init__(source_patterns, target_patterns)

    def renamed(self, key: str) -> str | None:
        """``key`` with its captured index shifted, or ``None`` when no source pattern matches."""
        matcher = self._matcher
        assert matcher is not None  # always transformers' semantics
        found = matcher.rename(key)
        if found is None or found.captured is None or not found.captured.isdigit():
            return None if found is None else found.key
        shifted = matcher.targets[0].fill(str(int(found.captured) + self.offset))
        return found.prefix + shifted + found.suffix

    def __repr__(self) -> str:
        return f"IndexOffsetRenaming({list(self.source_patterns)} -> {list(self.target_patterns)}, offset={self.offset})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild_simple,
            (
                type(self),
                (tuple(self.source_patterns), tuple(self.target_patterns), self.offset),
                self._scope(),
            ),
        )


def _rebuild_simple(
    cls: type[WeightRenaming], args: tuple[Any, ...], scope: tuple[str | None, str | None]
) -> WeightRenaming:
    renaming = cls(*args)
    if scope != (None, None):
        renaming.scope_prefix, renaming.base_model_prefix = scope
    return renaming
