"""Helpers of transformers' conversion API, for code ported by changing the import line.

- :func:`get_model_conversion_mapping`: the modelgraft conversion entries that apply to a model and
  each of its sub-models, as transformers lists them (class name before ``model_type``; sub-model
  entries carry their ``scope_prefix``).
- :func:`revert_weight_conversion`: a state dict of a converted model in the original checkpoint
  layout, exactly (what ``save_pretrained`` writes).
- :func:`rename_source_key`: one checkpoint key renamed as transformers renames it.

Example:
    >>> from modelgraft.porting import WeightRenaming, rename_source_key
    >>> rename_source_key("model.layers.0.block_sparse_moe.gate.weight",
    ...                   [WeightRenaming(".block_sparse_moe.gate", ".mlp.gate")], [])
    ('model.layers.0.mlp.gate.weight', None)
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from modelgraft import registry
from modelgraft.conversion._chain import scoped_copy
from modelgraft.conversion._hf_plan import _rename, rename_key
from modelgraft.conversion.rules import WeightConverter

__all__ = ["get_model_conversion_mapping", "rename_source_key", "revert_weight_conversion"]


def get_model_conversion_mapping(
    model: torch.nn.Module,
    key_mapping: Mapping[str, str] | None = None,
    hf_quantizer: Any = None,
    add_legacy: bool = True,
) -> list[WeightConverter]:
    """The modelgraft conversion entries for ``model`` and its sub-models, in transformers' order.

    Each ``PreTrainedModel`` sub-module is looked up by class name, then by ``model_type`` (the
    entries visible here: ``patched`` blocks, then global). A sub-model's entries come as copies
    with ``scope_prefix`` (its path without the base model prefix) and ``base_model_prefix`` set;
    a sub-model whose class name or ``model_type`` an ancestor already claimed is skipped.
    ``key_mapping`` entries come first, as renamings. transformers' own built-in and legacy
    entries are not listed: transformers applies those itself (``add_legacy`` and
    ``hf_quantizer`` are accepted for compatibility and unused).

    Example:
        >>> import torch
        >>> get_model_conversion_mapping(torch.nn.Linear(1, 1))
        []
    """
    from transformers import PreTrainedModel

    from modelgraft.conversion.rules import WeightRenaming

    out: list[WeightConverter] = [WeightRenaming(k, v) for k, v in (key_mapping or {}).items()]
    entries = registry.snapshot().conversions
    seen: dict[str, list[str]] = {}
    base = getattr(model, "base_model_prefix", "") or ""

    def claimed(name: str, path: str) -> bool:
        return any(s == "" or path.startswith(s + ".") for s in seen.get(name, []))

    for path, sub in model.named_modules():
        if not isinstance(sub, PreTrainedModel):
            continue
        cls_name, model_type = type(sub).__name__, getattr(sub.config, "model_type", None)
        if claimed(cls_name, path):
            continue
        found = entries.get(cls_name)
        by_class = found is not None
        if not by_class:
            if model_type and claimed(model_type, path):
                continue
            found = entries.get(model_type) if model_type else None
        if found is None:
            continue
        if path:
            scope = path.removeprefix(base).removeprefix(".")
            out.extend(scoped_copy(c, scope, base) for c in found)
        else:
            out.extend(found)
        seen.setdefault(cls_name, []).append(path)
        if not by_class and model_type:
            seen.setdefault(model_type, []).append(path)
    return out


def revert_weight_conversion(
    model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``state_dict`` of ``model`` with modelgraft's conversions undone: the original checkpoint layout.

    Exactly what ``model.save_pretrained`` writes for the converted keys (unequal splits come back
    exactly); keys no conversion covers are kept. A model no entry applies to gets ``state_dict``
    back as a new dict.

    Example:
        >>> import torch
        >>> revert_weight_conversion(torch.nn.Linear(1, 1), {"weight": torch.ones(1, 1)})["weight"].tolist()
        [[1.0]]
    """
    from modelgraft.conversion.save import reverse_state_dict

    reversed_ = reverse_state_dict(model, state_dict)
    if reversed_ is None:
        return dict(state_dict)
    out = {k: state_dict[k] for k in reversed_.untouched}
    out.update(reversed_.converted)
    return out


def rename_source_key(
    source_key: str,
    weight_renamings: Sequence[WeightConverter],
    weight_converters: Sequence[WeightConverter],
    base_model_prefix: str | None = None,
    meta_state_dict: Mapping[str, Any] | None = None,
    reverse: bool = False,
) -> tuple[str, str | None]:
    """Rename a checkpoint key: every renaming in turn, then at most one converter.

    With ``reverse=True`` the converter comes first (pass the transforms of the save direction).
    With ``base_model_prefix`` and ``meta_state_dict`` (the model's keys), the prefix is then
    added or removed where that names a model key. Returns the new key and the source pattern of
    the converter that matched (``None`` if none did).

    Example:
        >>> from modelgraft import MergeModulelist, WeightConverter
        >>> conv = WeightConverter("experts.*.w1.weight", "experts.gate_proj", [MergeModulelist(dim=0)])
        >>> rename_source_key("layers.0.experts.7.w1.weight", [], [conv])
        ('layers.0.experts.gate_proj', 'experts.*.w1.weight')
    """

    if reverse:
        key, conv, found = source_key, None, None
        for c in weight_converters:  # the save direction: converter first, then the renamings
            found = _rename(c, key)
            if found is not None:
                key, conv = found[0], c
                break
        key = rename_key(key, weight_renamings, [])[0]
    else:  # the loader's own rule: every renaming in turn, then at most one converter
        key, conv, found, _fired = rename_key(source_key, weight_renamings, weight_converters)
    pattern = conv.source_patterns[found[1]] if conv is not None and found is not None else None
    if base_model_prefix and meta_state_dict is not None:
        stripped = re.sub(f"^{re.escape(base_model_prefix)}\\.", "", key, count=1)
        # As transformers: a key of the meta state dict counts when its value is not None.
        if (
            key.startswith(base_model_prefix)
            and stripped != key
            and meta_state_dict.get(stripped) is not None
        ):
            key = stripped
        elif meta_state_dict.get(f"{base_model_prefix}.{key}") is not None:
            key = f"{base_model_prefix}.{key}"
    return key, pattern
