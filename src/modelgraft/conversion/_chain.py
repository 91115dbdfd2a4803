"""One ordered transform list for a model whose root entry matches as transformers does.

transformers renames every checkpoint key through *one* list: the root model's transforms, then
each sub-model's (scoped to its prefix), renamings chained in that order, then at most one
converter. When modelgraft's entry for the root uses transformers' semantics (ported code), the
engine must see that same list, or keys that a root renaming moves into a sub-model (Mistral
Large 4's ``layers.`` becoming ``model.language_model.layers.``) never meet the sub-model's
converters. :func:`chained_entry` builds it: modelgraft's entries where a (sub)model has one,
transformers' own entries (translated, operations kept as they are) elsewhere, found and scoped
exactly as transformers finds and scopes them.

Example:
    >>> import torch
    >>> chained_entry(torch.nn.Linear(1, 1)) is None
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from modelgraft import _compat, registry
from modelgraft.conversion.builtin_rules import (
    GroupWeightRename,
    IndexOffsetRenaming,
    LayerPairCollapse,
    PrefixChange,
    TransformersConverter,
    TransformersRenaming,
)
from modelgraft.conversion.rules import WeightConverter

__all__ = ["Chain", "chained_entry", "from_transformers", "scoped_copy"]

#: ``(converters, sub-model paths whose entries the list absorbed)``.
Chain = tuple[tuple[WeightConverter, ...], tuple[str, ...]]


def from_transformers(transform: Any) -> WeightConverter | None:
    """modelgraft's transform for one of transformers' (same patterns, same operations), or ``None``
    for a transform class modelgraft does not know (its behaviour is code of its own)."""
    name = type(transform).__name__
    sources = list(getattr(transform, "_original_source_patterns", None) or [])
    targets = list(getattr(transform, "_original_target_patterns", None) or [])
    ours: WeightConverter
    if name == "PrefixChange":
        ours = PrefixChange(
            transform.prefix_to_add, transform.prefix_to_remove, transform.model_prefix or None
        )
    elif name == "GroupWeightRename":
        ours = GroupWeightRename(sources, targets)
    elif name == "WeightConverter":
        ours = TransformersConverter(sources, targets, list(transform.operations))
    elif name == "WeightRenaming":
        ours = TransformersRenaming(sources, targets)
    elif name == "LayerPairCollapse":
        ours = LayerPairCollapse()
    elif name == "Inkling2IndexOffsetWeightRename":
        ours = IndexOffsetRenaming(sources, targets, offset=transform.offset)
    else:
        return None
    return ours


def scoped_copy(conv: WeightConverter, scope: str, base: str | None) -> WeightConverter:
    """A copy of ``conv`` restricted to a sub-model: ``scope_prefix`` and ``base_model_prefix`` set."""
    rebuild, args = conv.__reduce__()
    copy: WeightConverter = rebuild(*args)
    copy.scope_prefix = scope
    copy.base_model_prefix = base
    return copy


def _lookup(snapshot: registry.Snapshot) -> Callable[[str], tuple[WeightConverter, ...] | None]:
    """modelgraft's entry for a key, else transformers' own (``None`` if either cannot be had)."""

    def find(key: str) -> tuple[WeightConverter, ...] | None:
        if key in snapshot.conversions:
            return tuple(snapshot.conversions[key])
        builtin = (
            _compat.builtin_checkpoint_conversions(key) if _compat.builtin_conversion_exists(key) else []
        )
        if not builtin:
            return None
        translated = [from_transformers(t) for t in builtin]
        if any(t is None for t in translated):
            raise LookupError(key)
        return tuple(t for t in translated if t is not None)

    return find


def chained_entry(model: torch.nn.Module, snapshot: registry.Snapshot | None = None) -> Chain | None:
    """The whole ordered transform list transformers would build for ``model``, with modelgraft's
    entries in place of transformers' where a key has one; ``None`` unless the root's entry is
    modelgraft's and matches as transformers does, or when a needed entry of transformers' has a
    transform modelgraft cannot express (then the two engines share the work as before)."""
    snap = snapshot if snapshot is not None else registry.current()
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "base_model_prefix"):
        return None
    root = snap.lookup_conversions(type(model).__name__, getattr(config, "model_type", None))
    if root is None or not any(getattr(c, "_hf", False) for c in root[1]):
        return None
    find = _lookup(snap)
    base: str = getattr(model, "base_model_prefix", "") or ""
    seen: dict[str, list[str]] = {}
    out: list[WeightConverter] = []
    absorbed: list[str] = []

    def claimed(name: str, path: str) -> bool:
        return any(s == "" or path.startswith(s + ".") for s in seen.get(name, []))

    try:
        for path, sub in model.named_modules():
            sub_config = getattr(sub, "config", None)
            if sub_config is None or not hasattr(sub, "base_model_prefix"):
                continue
            class_name, model_type = type(sub).__name__, getattr(sub_config, "model_type", None)
            is_custom = getattr(sub, "is_custom_code", None)
            if callable(is_custom) and is_custom() and class_name not in snap.conversions:
                if not model_type or model_type not in snap.conversions:
                    continue
            if claimed(class_name, path):
                continue
            found = find(class_name)
            by_class = found is not None
            if not by_class:
                if model_type and claimed(model_type, path):
                    continue
                found = find(model_type) if model_type else None
            if found is None:
                continue
            if path:
                scope = path.removeprefix(base).removeprefix(".")
                out.extend(scoped_copy(c, scope, base) for c in found)
                absorbed.append(path)
            else:
                out.extend(found)
            seen.setdefault(class_name, []).append(path)
            if not by_class and model_type:
                seen.setdefault(model_type, []).append(path)
    except LookupError:
        return None
    return tuple(out), tuple(absorbed)
