"""transformers' conversion API, for code ported by changing one import line per module.

The names users import from ``transformers.core_model_loading`` and
``transformers.conversion_mapping`` live here and behave as transformers' do, on modelgraft's
engine:

- :class:`WeightConverter`, :class:`WeightRenaming`, :class:`PrefixChange`,
  :class:`GroupWeightRename` hold their patterns in lists (``source_patterns``,
  ``target_patterns``) and match keys with transformers' semantics;
- the operations (:class:`Concatenate`, :class:`Chunk`, :class:`MergeModulelist`,
  :class:`SplitModulelist`, :class:`Transpose`, :class:`Interleave`, :class:`Split`,
  :class:`PermuteForRope`, ...) take transformers' constructor arguments, run with
  transformers' ``convert(input_dict, source_patterns=..., target_patterns=..., **kwargs)``
  protocol when called that way, and have ``reverse_op``;
- :func:`register_checkpoint_conversion_mapping`, :func:`get_checkpoint_conversion_mapping`,
  :func:`get_model_conversion_mapping`, :func:`rename_source_key`,
  :func:`revert_weight_conversion` and :func:`convert_and_load_state_dict_in_model` take
  transformers' arguments and return what transformers returns.

Nothing here is a second engine: each name translates onto modelgraft's own API
(:mod:`modelgraft`), which stays as it is. What differs from transformers, and why, is listed in
docs/porting.md.

Example:
    >>> from modelgraft.porting import MergeModulelist, WeightConverter
    >>> conv = WeightConverter(["experts.*.w1.weight"], ["experts.gate_proj"], operations=[MergeModulelist(dim=0)])
    >>> conv.source_patterns == ["experts.*.w1.weight"]
    True
    >>> import torch
    >>> out = MergeModulelist(dim=0).convert(
    ...     {"experts.*.w1.weight": [torch.ones(2, 3)] * 4},
    ...     source_patterns=["experts.*.w1.weight"], target_patterns=["experts.gate_proj"])
    >>> {k: tuple(v.shape) for k, v in out.items()}
    {'experts.gate_proj': (4, 2, 3)}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from modelgraft._porting_load import convert_and_load_state_dict_in_model
from modelgraft._porting_mapping import (
    get_model_conversion_mapping,
    rename_source_key,
    revert_weight_conversion,
)
from modelgraft.conversion import ops as _ops
from modelgraft.conversion import rules as _rules
from modelgraft.conversion.builtin_ops import (
    Conv3dToLinear,
    ConversionOps,
    ErnieFuseAndSplitTextVisionExperts,
    ErnieSplitAndDecoupleTextVisionExperts,
    LinearToConv3d,
    PermuteForRope,
    VisionFuseAndPermuteForRope,
    VisionUnfuseAndPermuteForRope,
)
from modelgraft.conversion.builtin_rules import GroupWeightRename as _GroupWeightRename
from modelgraft.conversion.builtin_rules import IndexOffsetRenaming as _IndexOffsetRenaming
from modelgraft.conversion.builtin_rules import LayerPairCollapse as _LayerPairCollapse
from modelgraft.conversion.builtin_rules import PrefixChange as _PrefixChange
from modelgraft.conversion.rules import (
    get_checkpoint_conversion_mapping,
    register_checkpoint_conversion_mapping,
    unregister_checkpoint_conversion_mapping,
)

__all__ = [
    "Chunk",
    "Concatenate",
    "Conv3dToLinear",
    "ConversionOps",
    "ErnieFuseAndSplitTextVisionExperts",
    "ErnieSplitAndDecoupleTextVisionExperts",
    "GroupWeightRename",
    "Inkling2IndexOffsetWeightRename",
    "Interleave",
    "LayerPairCollapse",
    "LinearToConv3d",
    "MergeModulelist",
    "PermuteForRope",
    "PrefixChange",
    "Split",
    "SplitModulelist",
    "Transpose",
    "VisionFuseAndPermuteForRope",
    "VisionUnfuseAndPermuteForRope",
    "WeightConverter",
    "WeightRenaming",
    "convert_and_load_state_dict_in_model",
    "get_checkpoint_conversion_mapping",
    "get_model_conversion_mapping",
    "register_checkpoint_conversion_mapping",
    "rename_source_key",
    "revert_weight_conversion",
    "unregister_checkpoint_conversion_mapping",
]


class _ListPatterns:
    """``source_patterns`` and ``target_patterns`` as lists, as transformers holds them.

    Every transform of this module matches keys as transformers does, also when its patterns
    are plain dotted names: renamings chain, then at most one converter applies.
    """

    __slots__ = ()
    always_transformers_semantics = True

    @property
    def source_patterns(self) -> list[str]:
        return list(self._source_patterns)  # type: ignore[attr-defined]

    @property
    def target_patterns(self) -> list[str]:
        return list(self._target_patterns)  # type: ignore[attr-defined]


class WeightConverter(_ListPatterns, _rules.WeightConverter):
    """transformers' ``WeightConverter``: modelgraft's, with list-valued patterns.

    Example:
        >>> WeightConverter("q", ["q_proj"]).target_patterns
        ['q_proj']
    """

    __slots__ = ()

    def __init__(
        self,
        source_patterns: str | Sequence[str],
        target_patterns: str | Sequence[str],
        operations: Sequence[Any] = (),
    ) -> None:
        super().__init__(source_patterns, target_patterns, list(operations))


class WeightRenaming(_ListPatterns, _rules.WeightRenaming):
    """transformers' ``WeightRenaming``: modelgraft's, with list-valued patterns.

    Example:
        >>> WeightRenaming(".block_sparse_moe.gate", ".mlp.gate").source_patterns
        ['.block_sparse_moe.gate']
    """

    __slots__ = ()


class PrefixChange(_PrefixChange, WeightRenaming):
    """transformers' ``PrefixChange`` (a :class:`WeightRenaming`), with list-valued patterns."""

    __slots__ = ()


class GroupWeightRename(_GroupWeightRename, WeightRenaming):
    """transformers' ``GroupWeightRename`` (a :class:`WeightRenaming`), with list-valued patterns."""

    __slots__ = ()


class LayerPairCollapse(_LayerPairCollapse, WeightRenaming):
    """transformers' ``LayerPairCollapse``: two blocks per decoder layer folded into one layer.

    Unlike transformers (which keeps the folded names on save), a save writes the two-block
    checkpoint names back, as every modelgraft conversion does.
    """

    __slots__ = ()


class Inkling2IndexOffsetWeightRename(_IndexOffsetRenaming, WeightRenaming):
    """transformers' ``Inkling2IndexOffsetWeightRename``: a renaming that shifts its captured index."""

    __slots__ = ()


def _target_shapes(
    targets: Sequence[str], kwargs: Mapping[str, Any], dim_needed: bool
) -> list[list[torch.Size]] | None:
    """The model parameters' shapes for ``targets``, as transformers finds them (``model`` + layer name)."""
    model, layer = kwargs.get("model"), kwargs.get("full_layer_name")
    if model is None or not layer or not targets:
        return None
    shapes = []
    for target in targets:
        name = layer.replace(targets[0], target) if dim_needed else layer
        try:
            shapes.append([model.get_parameter(name).shape])
        except AttributeError:
            return None
    return shapes


def _run_protocol(
    op: _ops.ConversionOperation,
    input_dict: Mapping[str, Any],
    source_patterns: Sequence[str] | None,
    target_patterns: Sequence[str] | None,
    kwargs: Mapping[str, Any],
) -> dict[str, Any]:
    """Run a modelgraft operation with transformers' ``convert(input_dict, ...)`` protocol."""
    keys = list(input_dict)
    groups = [list(v) if isinstance(v, (list, tuple)) else [v] for v in input_dict.values()]
    targets = list(target_patterns or [])
    per_target = isinstance(op, (Split, Chunk))
    context = _ops.ConversionContext(
        num_targets=len(targets) or 1,
        target_shapes=_target_shapes(targets, kwargs, per_target),
        config=kwargs.get("config"),
    )
    out = op.convert(groups, context)
    if len(out) == len(targets) and (len(targets) == 1 or len(out) != len(keys) or per_target):
        names = targets
    elif len(out) == len(keys):
        names = keys
    else:
        names = targets if len(out) == len(targets) else [str(i) for i in range(len(out))]
    return {name: group[0] if len(group) == 1 else group for name, group in zip(names, out)}


class _Protocol:
    """Both protocols: modelgraft's ``convert(groups, context)`` and transformers' ``convert(dict, ...)``."""

    def convert(self, tensors: Any, context: Any = None, *args: Any, **kwargs: Any) -> Any:
        if isinstance(tensors, Mapping):
            sources = kwargs.pop("source_patterns", context)
            targets = kwargs.pop("target_patterns", args[0] if args else None)
            assert isinstance(self, _ops.ConversionOperation)
            return _run_protocol(self, tensors, sources, targets, kwargs)
        return super().convert(tensors, context)  # type: ignore[misc]

    @property
    def reverse_op(self) -> _ops.ConversionOperation:
        raise NotImplementedError


class Concatenate(_Protocol, _ops.Concatenate):
    """transformers' ``Concatenate(dim, num_shards_attribute)``; its ``reverse_op`` is :class:`Chunk`."""

    def __init__(self, dim: int = 0, num_shards_attribute: str | None = None) -> None:
        super().__init__(dim=dim)
        object.__setattr__(self, "num_shards_attribute", num_shards_attribute)

    @property
    def reverse_op(self) -> _ops.ConversionOperation:
        return Chunk(self.dim, getattr(self, "num_shards_attribute", None))


class Chunk(_Protocol, _ops.Chunk):
    """transformers' ``Chunk(dim, num_shards_attribute)``; its ``reverse_op`` is :class:`Concatenate`."""

    def __init__(self, dim: int = 0, num_shards_attribute: str | None = None) -> None:
        super().__init__(dim=dim)
        object.__setattr__(self, "num_shards_attribute", num_shards_attribute)

    @property
    def reverse_op(self) -> _ops.ConversionOperation:
        return Concatenate(self.dim, getattr(self, "num_shards_attribute", None))


class MergeModulelist(_Protocol, _ops.MergeModulelist):
    """transformers' ``MergeModulelist(dim)``; its ``reverse_op`` is :class:`SplitModulelist`."""

    @property
    def reverse_op(self) -> _ops.ConversionOperation:
        return SplitModulelist(self.dim)


class SplitModulelist(_Protocol, _ops.SplitModulelist):
    """transformers' ``SplitModulelist(dim)``; its ``reverse_op`` is :class:`MergeModulelist`."""

    @property
    def reverse_op(self) -> _ops.ConversionOperation:
        return MergeModulelist(self.dim)


class Transpose(_Protocol, _ops.Transpose):
    """transformers' ``Transpose(dim0, dim1, check_dims)``; its ``reverse_op`` swaps the dims back."""

    @property
    def reverse_op(self) -> _ops.ConversionOperation:
        return Transpose(self.dim1, self.dim0, self.check_dims)


class Interleave(_Protocol, _ops.Interleave):
    """transformers' ``Interleave(dim, inverse)``; its ``reverse_op`` is the other direction."""

    @property
    def reverse_op(self) -> _ops.ConversionOperation:
        return Interleave(self.dim, not self.inverse)


class Split(_Protocol, _ops.Split):
    """transformers' ``Split(dim)``: parts sized like the target parameters; ``reverse_op`` concatenates."""

    @property
    def reverse_op(self) -> _ops.ConversionOperation:
        return Concatenate(self.dim)
