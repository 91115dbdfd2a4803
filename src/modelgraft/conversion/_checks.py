"""Check a group's checkpoint tensors against what the original model expects, before any is read.

A fused target only checks the *sum* of its sources: q, k and v whose row counts are wrong but add
up to the fused size would concatenate into a tensor of the right shape, holding wrong numbers. So
each source is checked on its own, from the header shapes, against what the original (un-grafted)
model expects there:

* a source key that is a parameter of the original model must have that parameter's shape
  (``q_proj`` of a Llama: ``(heads * head_dim, hidden)``);
* where the original model holds the *target* itself with the same shape (transformers' own expert
  merges: the original ``experts.gate_up_proj`` is built from per-expert ``gate_proj`` and
  ``up_proj`` keys), each source must be the part of it that transformers' own reverse writes:
  ``Concatenate`` parts of equal size, one ``MergeModulelist`` entry per expert;
* otherwise (keys of another layout, operations of your own) nothing says what a source should
  be, and the target's shape is the only check.

An expectation that the operations do not turn into the target's shape (a quantized or otherwise
reshaped target) is dropped rather than turned into a false error. Independently of expectations,
the sources of a group must share one dtype and their ``*`` indices must run from 0 without a gap.

Example:
    >>> import torch
    >>> from modelgraft.conversion import Concatenate, WeightConverter
    >>> from modelgraft.conversion._plan import plan_groups
    >>> conv = WeightConverter(["q_proj", "k_proj"], "qk_proj", [Concatenate(dim=0)])
    >>> S = torch.Size
    >>> [group] = plan_groups([conv], ["qk_proj.weight"], {"q_proj.weight": S((3, 4)), "k_proj.weight": S((1, 4))}).groups
    >>> original = {"q_proj.weight": S((2, 4)), "k_proj.weight": S((2, 4))}
    >>> [original_group] = plan_groups([conv], ["qk_proj.weight"], original).groups
    >>> expected = expected_sources(group, original_group, original, [[S((4, 4))]], "`Tiny`")
    >>> expected.shapes
    [[torch.Size([2, 4])], [torch.Size([2, 4])]]
    >>> try:
    ...     check_sources(group, group.source_shapes, [[torch.float32]] * 2, expected)
    ... except ValueError as e:
    ...     print(str(e)[:59])
    Checkpoint key `q_proj.weight` has shape (3, 4), but conver
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from modelgraft.conversion._plan import Group
from modelgraft.conversion.keys import Pattern, PatternMatch
from modelgraft.conversion.ops import (
    Chunk,
    Concatenate,
    ConversionContext,
    MergeModulelist,
    ShapeGroups,
    SplitModulelist,
    Transpose,
)
from modelgraft.errors import ConversionShapeError

if TYPE_CHECKING:  # only named in annotations
    from modelgraft.conversion._hf_patterns import HFPattern

__all__ = ["Expected", "check_sources", "expected_sources", "shapes_text"]

Shape = tuple[int, ...]
ShapeLists = list[list[Shape]]


@dataclass(frozen=True)
class Expected:
    """The source shapes a group should have (per source pattern, per ``*`` index), and why."""

    shapes: ShapeGroups
    basis: str


def shapes_text(shapes: Sequence[torch.Size | Sequence[int]]) -> str:
    """``(2, 3), (4,)``: shapes as tuples, for messages."""
    return ", ".join(str(tuple(s)) for s in shapes)


def _runs_to(ops: Sequence[object], sources: ShapeGroups, targets: ShapeGroups) -> bool:
    """Whether the operations turn tensors of ``sources`` into tensors of ``targets`` (on meta)."""
    key = (
        tuple(ops),
        tuple(tuple(tuple(s) for s in group) for group in sources),
        tuple(tuple(tuple(s) for s in group) for group in targets),
    )
    try:
        return _runs_to_cached(*key)
    except TypeError:  # an operation that cannot be hashed: run it every time
        return _runs_to_uncached(*key)


# Every layer of a model asks the same question; running the operations on meta tensors costs
# about a millisecond, so the answer is kept (operations are immutable values).
@functools.lru_cache(maxsize=256)
def _runs_to_cached(ops: tuple[Any, ...], sources: tuple[Any, ...], targets: tuple[Any, ...]) -> bool:
    return _runs_to_uncached(ops, sources, targets)


def _runs_to_uncached(ops: tuple[Any, ...], sources: tuple[Any, ...], targets: tuple[Any, ...]) -> bool:
    tensors = [[torch.empty(s, device="meta") for s in group] for group in sources]
    target_shapes = [[torch.Size(s) for s in group] for group in targets]
    try:
        for i, op in enumerate(ops):
            last = i == len(ops) - 1
            ctx = ConversionContext(num_targets=len(targets), target_shapes=target_shapes if last else None)
            tensors = op.convert(tensors, ctx)
    except Exception:  # an operation that cannot run on these shapes: no expectation to hold
        return False
    got = [[tuple(t.shape) for t in group] for group in tensors]
    return got == [[tuple(s) for s in group] for group in targets]


def _groups_entering(ops: Sequence[object], num_sources: int, num_targets: int) -> list[int] | None:
    """How many groups each operation receives on load (``None`` for an operation of your own)."""
    entering = []
    count = num_sources
    for op in ops:
        entering.append(count)
        if isinstance(op, Concatenate):
            count = 1
        elif isinstance(op, Chunk):
            count = op.chunks or num_targets
        elif not isinstance(op, (MergeModulelist, SplitModulelist, Transpose)):
            return None
    return entering


def _dim(shape: Shape, dim: int) -> int | None:
    return dim % len(shape) if -len(shape) <= dim < len(shape) else None


def _equal_parts(ops: Sequence[object], targets: ShapeGroups, num_sources: int) -> ShapeGroups | None:
    """Source shapes that the operations' reverse writes from ``targets`` when every ``Concatenate``
    is split into equal parts (as transformers' own reverse, ``Chunk``, splits its merges)."""
    entering = _groups_entering(ops, num_sources, len(targets))
    if entering is None:
        return None
    shapes: ShapeLists = [[tuple(s) for s in group] for group in targets]
    for op, count in zip(reversed(ops), reversed(entering)):
        # `_groups_entering` accepted every operation, so each has its step.
        step = next(step for kind, step in _REVERSE_SHAPES if isinstance(op, kind))
        given = step(op, shapes, count)
        if given is None:
            return None
        shapes = given
    if len(shapes) != num_sources:
        return None
    return [[torch.Size(s) for s in group] for group in shapes]


# Each step below maps the shapes an operation produced on load to the shapes it was given, as the
# operation's reverse writes them; ``None`` when the shapes say nothing (a dim out of range, parts
# that do not divide evenly). ``count`` is how many groups entered the operation on load.


def _split_concatenated(op: Any, shapes: ShapeLists, count: int) -> ShapeLists | None:
    """``Concatenate``'s reverse: the one group cut into ``count`` equal parts along ``op.dim``."""
    if len(shapes) != 1:
        return None
    parts: ShapeLists = [[] for _ in range(count)]
    for shape in shapes[0]:
        d = _dim(shape, op.dim)
        if d is None or shape[d] % count:
            return None
        for part in parts:
            part.append((*shape[:d], shape[d] // count, *shape[d + 1 :]))
    return parts


def _join_chunks(op: Any, shapes: ShapeLists, count: int) -> ShapeLists | None:
    """``Chunk``'s reverse: the chunks of each position joined back along ``op.dim``."""
    lengths = {len(group) for group in shapes}
    if len(lengths) != 1 or not shapes:
        return None
    joined = []
    for j in range(lengths.pop()):
        first = shapes[0][j]
        d = _dim(first, op.dim)
        if d is None:
            return None
        joined.append((*first[:d], sum(group[j][d] for group in shapes), *first[d + 1 :]))
    return [joined]


def _unstack(op: Any, shapes: ShapeLists, count: int) -> ShapeLists | None:
    """``MergeModulelist``'s reverse: each stacked tensor back into one entry per expert."""
    if any(len(group) != 1 for group in shapes):
        return None
    unstacked = []
    for (shape,) in shapes:
        d = _dim(shape, op.dim)
        if d is None:
            return None
        unstacked.append([(*shape[:d], *shape[d + 1 :])] * shape[d])
    return unstacked


def _stack(op: Any, shapes: ShapeLists, count: int) -> ShapeLists | None:
    """``SplitModulelist``'s reverse: the equal entries of each group stacked along ``op.dim``."""
    stacked = []
    for group in shapes:
        if not group or len(set(group)) != 1:
            return None
        d = op.dim % (len(group[0]) + 1)
        stacked.append([(*group[0][:d], len(group), *group[0][d:])])
    return stacked


def _swap_back(op: Any, shapes: ShapeLists, count: int) -> ShapeLists | None:
    """``Transpose``'s reverse: the same two dims swapped back."""
    swapped = []
    for group in shapes:
        out = []
        for shape in group:
            a, b = _dim(shape, op.dim0), _dim(shape, op.dim1)
            if a is None or b is None:
                return None
            s = list(shape)
            s[a], s[b] = s[b], s[a]
            out.append(tuple(s))
        swapped.append(out)
    return swapped


#: The operations ``_groups_entering`` accepts, each with its reverse step on shapes.
_REVERSE_SHAPES: tuple[tuple[type, Callable[[Any, ShapeLists, int], ShapeLists | None]], ...] = (
    (Concatenate, _split_concatenated),
    (Chunk, _join_chunks),
    (MergeModulelist, _unstack),
    (SplitModulelist, _stack),
    (Transpose, _swap_back),
)


def expected_sources(
    group: Group,
    original_group: Group | None,
    original: Mapping[str, torch.Size],
    target_shapes: ShapeGroups,
    model_name: str,
) -> Expected | None:
    """What the sources of ``group`` should be, from the original (un-grafted) model.

    Args:
        group: the planned :class:`~modelgraft.conversion._plan.Group` (model-side keys).
        original_group: the same converter planned over the original model's own keys for the same
            targets, or ``None`` when the original model holds none of the sources.
        original: the original model's keys and shapes.
        target_shapes: the grafted model's target parameter shapes.
        model_name: how messages name the original model (```LlamaForCausalLM```).

    Returns:
        The expectation, or ``None`` when the original model says nothing about these sources.
    """
    ops = group.converter.operations
    if original_group is not None:
        shapes = [[torch.Size(original[k]) for k in keys] for keys in original_group.sources]
        if _runs_to(ops, shapes, target_shapes):
            return Expected(shapes, f"its shape in the original {model_name}")
        return None
    targets = group.flat_targets
    flat_shapes = [s for g in target_shapes for s in g]
    if not all(k in original and tuple(original[k]) == tuple(s) for k, s in zip(targets, flat_shapes)):
        return None
    parts = _equal_parts(ops, target_shapes, len(group.sources))
    if parts is None or not _runs_to(ops, parts, target_shapes):
        return None
    return Expected(
        parts,
        f"an equal part of `{targets[0]}` of the original {model_name}, as transformers' own conversion "
        "splits it when it saves",
    )


def _star_check(group: Group, name: Callable[[str], str]) -> None:
    """``*`` sources must run 0, 1, ... without a gap: they are handed to the operations by position."""
    conv = group.converter
    starred = [(p, keys) for p, keys in zip(conv._sources, group.sources) if p.has_star and keys]
    count = max((len(keys) for _, keys in starred), default=0)
    for pattern, keys in starred:
        matches = [_matched(pattern, k) for k in keys]
        indices = {m.index for m in matches if m.index is not None}
        # Indices run 0, 1, ... and every `*` pattern of the group has as many as the longest.
        gaps = sorted(set(range(max(count, max(indices, default=-1) + 1))) - indices)
        if gaps:
            m = matches[0]
            missing = pattern.build(m.prefix, m.suffix, gaps[0])
            raise ConversionShapeError(
                f"Converter {conv!r} found `{pattern.text}` under `{m.prefix}` for indices {sorted(indices)}"
                f"{f' (another source pattern has {count})' if len(indices) < count else ''}: `{name(missing)}` "
                "is missing from the checkpoint, so the tensors would be paired or stacked out of place. "
                "Every `*` index from 0 up must be present for every source pattern; check that the "
                "checkpoint is complete."
            )


def _dtype_check(
    group: Group, dtypes: Sequence[Sequence[torch.dtype | None]], name: Callable[[str], str]
) -> None:
    first_key: str = ""
    first: torch.dtype | None = None
    for keys, kinds in zip(group.sources, dtypes):
        for key, dtype in zip(keys, kinds):
            if dtype is None:
                continue
            if first is None:
                first_key, first = key, dtype
            elif dtype != first:
                raise ConversionShapeError(
                    f"Converter {group.converter!r} joins checkpoint tensors of different dtypes: "
                    f"`{name(first_key)}` is {first} but `{name(key)}` is {dtype}. Operations would promote "
                    "them silently; re-save the checkpoint with one dtype for these tensors "
                    "(`tensor.to(dtype)`), then load with `dtype=` as usual."
                )


def _matched(pattern: Pattern | HFPattern, key: str) -> PatternMatch:
    """The match of a key the plan already paired with ``pattern`` (so it always matches)."""
    found = pattern.match(key)
    assert found is not None, (pattern.text, key)
    return found


def check_sources(
    group: Group,
    shapes: ShapeGroups,
    dtypes: Sequence[Sequence[torch.dtype | None]],
    expected: Expected | None,
    name: Callable[[str], str] = lambda key: key,
) -> None:
    """Raise :class:`~modelgraft.errors.ConversionShapeError` when the sources of ``group`` (with
    header ``shapes`` and ``dtypes``) do not fit ``expected``, mix dtypes or skip a ``*`` index.

    ``name`` maps a model-side key to the checkpoint key that messages show.
    """
    _star_check(group, name)
    _dtype_check(group, dtypes, name)
    if expected is None:
        return
    conv = group.converter
    for pattern, keys, found, want in zip(conv._sources, group.sources, shapes, expected.shapes):
        if len(found) != len(want):
            m = _matched(pattern, keys[0])
            present = {_matched(pattern, k).index for k in keys}
            absent = [i for i in range(len(want)) if i not in present]
            detail = (
                f"`{name(pattern.build(m.prefix, m.suffix, absent[0]))}` is missing"
                if absent
                else f"`{name(keys[-1])}` is one too many"
            )
            raise ConversionShapeError(
                f"Converter {conv!r} expects {len(want)} tensor(s) for source pattern `{pattern.text}` under "
                f"`{m.prefix}` ({expected.basis}), but the checkpoint holds {len(found)}: {detail}. Check "
                "that the checkpoint is complete and matches the config (`num_experts`, ...)."
            )
        for key, got, shape in zip(keys, found, want):
            if tuple(got) != tuple(shape):
                raise ConversionShapeError(
                    f"Checkpoint key `{name(key)}` has shape {tuple(got)}, but converter {conv!r} expects "
                    f"{tuple(shape)} there ({expected.basis}). Tensors that are wrong but still add up to the "
                    "converted size would load wrong numbers; check the checkpoint against the config "
                    "(head counts, `head_dim`, intermediate sizes) and the converter's source patterns."
                )
