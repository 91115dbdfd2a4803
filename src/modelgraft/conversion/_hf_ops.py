"""Run operations written for transformers' conversion API inside modelgraft converters.

transformers' operations take and return dicts: ``convert(input_dict, source_patterns=...,
target_patterns=..., **kwargs)`` gets ``{pattern: [tensor, ...]}`` and returns ``{pattern: tensor
or [tensors]}``; ``reverse_op`` is the operation that undoes it. modelgraft's operations take
positional tensor groups. :class:`TransformersOperation` wraps one such operation so it runs
unchanged, next to modelgraft's own operations in the same converter: the groups are keyed by
the converter's source patterns on the way in (its target patterns when there are as many groups
as targets), and the result is ordered by the patterns it is keyed by.

Example:
    >>> import torch
    >>> from modelgraft.conversion.ops import ConversionContext
    >>> class Double:
    ...     def convert(self, input_dict, source_patterns=None, target_patterns=None, **kwargs):
    ...         return {target_patterns[0]: 2 * next(iter(input_dict.values()))[0]}
    ...
    ...     @property
    ...     def reverse_op(self):
    ...         return Half()
    >>> class Half:
    ...     def convert(self, input_dict, source_patterns=None, target_patterns=None, **kwargs):
    ...         return {target_patterns[0]: next(iter(input_dict.values()))[0] / 2}
    >>> op = TransformersOperation(Double(), ("w_in",), ("w_out",))
    >>> op.convert([[torch.ones(2)]], ConversionContext())[0][0].tolist()
    [2.0, 2.0]
    >>> op.reverse([[torch.ones(2)]], ConversionContext())[0][0].tolist()
    [0.5, 0.5]
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

from modelgraft.conversion.ops import ConversionContext, ConversionOperation, ShapeGroups, TensorGroups
from modelgraft.errors import ConversionError, IrreversibleConversionError, OperationModelError

__all__ = ["TransformersOperation", "adapt_operations", "is_transformers_operation"]


def is_transformers_operation(op: object) -> bool:
    """Whether ``op`` follows transformers' protocol (a ``convert`` method, not a modelgraft op)."""
    return not isinstance(op, ConversionOperation) and callable(getattr(op, "convert", None))


def adapt_operations(
    ops: Sequence[object], sources: Sequence[str], targets: Sequence[str]
) -> tuple[object, ...]:
    """``ops`` with every transformers-protocol operation wrapped for this converter's patterns."""
    return tuple(
        TransformersOperation(op, tuple(sources), tuple(targets)) if is_transformers_operation(op) else op
        for op in ops
    )


def _keys_for(count: int, first: Sequence[str], second: Sequence[str]) -> list[str]:
    if count == len(first):
        return list(first)
    if count == len(second):
        return list(second)
    return [str(i) for i in range(count)]


def _as_groups(out: object, op: object, first: Sequence[str], second: Sequence[str]) -> TensorGroups:
    if not isinstance(out, dict):
        raise ConversionError(
            f"Operation `{type(op).__name__}` returned a {type(out).__name__}; an operation written for "
            "transformers must return a dict of pattern -> tensor (or list of tensors)."
        )
    keys = list(out)
    for order in (first, second):
        if keys and set(keys) <= set(order):
            keys = [k for k in order if k in out]
            break
        expanded = _by_index(out, order)
        if expanded is not None:
            return expanded
    groups: TensorGroups = []
    for k in keys:
        value = out[k]
        groups.append(list(value) if isinstance(value, (list, tuple)) else [value])
    return groups


def _by_index(out: dict[Any, Any], patterns: Sequence[str]) -> TensorGroups | None:
    """Groups for outputs named by ``*`` patterns with the index filled in (``experts.3.w1``), if so."""
    starred = [(p, re.compile(re.escape(p).replace(r"\*", r"(\d+)") + "$")) for p in patterns if "*" in p]
    if not starred:
        return None
    slots: dict[str, list[tuple[int, torch.Tensor]]] = {p: [] for p, _ in starred}
    for key, value in out.items():
        hit = next(((p, m) for p, rx in starred if (m := rx.match(key))), None)
        if hit is None or isinstance(value, (list, tuple)):
            return None
        slots[hit[0]].append((int(hit[1].group(1)), value))
    return [[t for _, t in sorted(items, key=lambda x: x[0])] for items in slots.values() if items]


# transformers' operations that `modelgraft.porting` has under the same name (kept in step with its
# `__all__` by the tests); porting sits above this layer, so the names are listed, not imported.
PORTED_OPERATIONS = (
    "Chunk",
    "Concatenate",
    "Conv3dToLinear",
    "Interleave",
    "LinearToConv3d",
    "MergeModulelist",
    "PermuteForRope",
    "Split",
    "SplitModulelist",
    "Transpose",
)


def _hint(op: object) -> str:
    """modelgraft's own operation of that name, when there is one (it sizes from the engine's shapes)."""
    name = type(op).__name__
    if name in PORTED_OPERATIONS and not type(op).__module__.startswith("modelgraft."):
        return f" Use `modelgraft.porting.{name}` instead: it takes the same arguments and runs on modelgraft's engine."
    return ""


class _Shape:
    """A target parameter as an operation may see it here: its shape, nothing else."""

    __slots__ = ("_name", "_op", "shape")

    def __init__(self, op: object, name: str, shape: torch.Size) -> None:
        self._op, self._name, self.shape = op, name, shape

    def __getattr__(self, attr: str) -> Any:
        raise OperationModelError(
            f"Operation `{type(self._op).__name__}` reads `.{attr}` of the model parameter `{self._name}`; modelgraft "
            "hands operations written for transformers only the target parameters' shapes (on load, to a converter's "
            f"last operation), not the model.{_hint(self._op)}"
        )


class _TargetParameters:
    """The ``model`` a transformers operation gets: ``get_parameter`` answers the converter's target
    patterns with their shapes where the engine knows them (on load, for the last operation)."""

    __slots__ = ("_op", "_shapes", "_targets")

    def __init__(self, op: object, targets: Sequence[str], shapes: ShapeGroups | None) -> None:
        self._op, self._targets, self._shapes = op, list(targets), shapes

    def get_parameter(self, name: str) -> _Shape:
        if self._shapes is not None and name in self._targets:
            group = self._shapes[self._targets.index(name)]
            if len(group) == 1:
                return _Shape(self._op, name, torch.Size(group[0]))
        where = (
            "here: the engine knows the target parameters' shapes only on load, for a converter's last operation"
            if self._shapes is None
            else f"for `{name}`, which is not one of the converter's targets {self._targets}"
        )
        raise OperationModelError(
            f"Operation `{type(self._op).__name__}` reads `model.get_parameter({name!r})`, which modelgraft cannot "
            f"answer {where}.{_hint(self._op)}"
        )

    def __getattr__(self, attr: str) -> Any:
        raise OperationModelError(
            f"Operation `{type(self._op).__name__}` reads `model.{attr}`; modelgraft does not hand operations written "
            "for transformers the model, only `model.get_parameter(target)` for the target parameters' shapes (on "
            f"load, for a converter's last operation).{_hint(self._op)}"
        )


class TransformersOperation(ConversionOperation):
    """One transformers-protocol operation, bound to its converter's source and target patterns."""

    __slots__ = ("op", "sources", "targets")

    def __init__(self, op: Any, sources: tuple[str, ...], targets: tuple[str, ...]) -> None:
        self.op = op
        self.sources = sources
        self.targets = targets

    def __repr__(self) -> str:
        return repr(self.op)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TransformersOperation) and other.op is self.op

    def __hash__(self) -> int:
        return id(self.op)

    @staticmethod
    def _run(
        op: Any,
        tensors: TensorGroups,
        sources: Sequence[str],
        targets: Sequence[str],
        config: Any = None,
        shapes: ShapeGroups | None = None,
    ) -> TensorGroups:
        keys = _keys_for(len(tensors), sources, targets)
        # transformers hands its operations the model and the first target's key; here the first
        # target pattern stands for the key, and the model answers only with the targets' shapes
        # (an operation that reads more is refused naming itself, not with `None` has no attribute).
        out = op.convert(
            dict(zip(keys, [list(g) for g in tensors])),
            source_patterns=list(sources),
            target_patterns=list(targets),
            full_layer_name=targets[0] if targets else None,
            model=_TargetParameters(op, targets, shapes),
            config=config,
            missing_keys=None,
        )
        return _as_groups(out, op, targets, sources)

    def convert(self, tensors: TensorGroups, context: ConversionContext) -> TensorGroups:
        return self._run(self.op, tensors, self.sources, self.targets, context.config, context.target_shapes)

    def _reverse_op(self) -> Any:
        try:
            return self.op.reverse_op
        except (NotImplementedError, AttributeError):
            return None

    @property
    def is_reversible(self) -> bool:
        return self._reverse_op() is not None

    def reverse(self, tensors: TensorGroups, context: ConversionContext) -> TensorGroups:
        rev = self._reverse_op()
        if rev is None:
            raise IrreversibleConversionError(
                f"Operation `{type(self.op).__name__}` has no `reverse_op`, so the original checkpoint layout "
                "cannot be written. Give it a `reverse_op`, or save the grafted layout with "
                "`model.save_pretrained(path, save_original_format=False)`."
            )
        groups = self._run(rev, tensors, self.targets, self.sources, context.config)
        return [[t.contiguous() if isinstance(t, torch.Tensor) else t for t in g] for g in groups]
