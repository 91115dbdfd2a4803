"""Where each byte of a converted tensor comes from, when conversion only rearranges whole rows.

``Concatenate`` and ``MergeModulelist`` (stacking along dim 0) of contiguous tensors do no
arithmetic: the result, in row-major order, is the sources' bytes in a new order. Fused QKV
(``Concatenate(dim=0)``) is the sources one after another; transformers' MoE expert merge
(``MergeModulelist(dim=0)`` then ``Concatenate(dim=1)``) is, per expert, its gate rows then its up
rows. :func:`convert_layouts` runs a group's operations on :class:`ByteLayout` descriptions instead
of tensors, so the loader can map or read the result straight from the checkpoint file. Any other
operation, or a layout too fragmented to be worth it, gives ``None``: the tensors are then read and
the operations run as usual.

Example:
    >>> from modelgraft.conversion.ops import Concatenate, MergeModulelist
    >>> def rows(name, offset):  # a 2x2 fp32 tensor stored at ``offset`` of file ``name``
    ...     return ByteLayout((2, 2), 4, ((name, offset, 16),))
    >>> experts = [[rows("f", 0), rows("f", 100)], [rows("f", 200), rows("f", 300)]]  # gate, up
    >>> out = convert_layouts([MergeModulelist(dim=0), Concatenate(dim=1)], experts, min_average_range=0)
    >>> out[0][0].shape, out[0][0].ranges  # expert 0: gate then up; expert 1: gate then up
    ((2, 4, 2), (('f', 0, 16), ('f', 200, 16), ('f', 100, 16), ('f', 300, 16)))
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = ["ByteLayout", "LayoutGroups", "LayoutOperation", "concatenate", "convert_layouts", "stack"]

Range = tuple[str, int, int]  # (path, byte offset, number of bytes)
# Below this many bytes per range on average, mapping or reading range by range costs more than
# reading the sources and concatenating them in memory.
_MIN_AVERAGE_RANGE = 64 * 1024


@dataclass(frozen=True)
class ByteLayout:
    """A contiguous tensor of ``shape`` (elements of ``itemsize`` bytes) stored as ``ranges``."""

    shape: tuple[int, ...]
    itemsize: int
    ranges: tuple[Range, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @functools.cached_property
    def _starts(self) -> list[int]:
        return list(itertools.accumulate((n for _, _, n in self.ranges), initial=0))

    def span(self, start: int, length: int) -> list[Range]:
        """The ranges holding bytes ``[start, start + length)`` of the tensor."""
        starts = self._starts
        out: list[Range] = []
        # Expert merges ask for one block per expert: find the first range by bisection, so a
        # layer of E experts costs O(E log E), not O(E^2).
        i = bisect.bisect_right(starts, start) - 1
        while i < len(self.ranges) and starts[i] < start + length:
            path, offset, n = self.ranges[i]
            lo, hi = max(start, starts[i]), min(start + length, starts[i] + n)
            if lo < hi:
                out.append((path, offset + lo - starts[i], hi - lo))
            i += 1
        return out


def _joined(ranges: list[Range]) -> tuple[Range, ...]:
    """Merge ranges that continue each other in the same file."""
    out: list[Range] = []
    for path, offset, n in ranges:
        if out and out[-1][0] == path and out[-1][1] + out[-1][2] == offset:
            out[-1] = (path, out[-1][1], out[-1][2] + n)
        else:
            out.append((path, offset, n))
    return tuple(out)


def concatenate(layouts: Sequence[ByteLayout], dim: int) -> ByteLayout | None:
    """The layout of ``torch.cat`` of ``layouts`` along ``dim`` (``None`` when shapes disagree)."""
    first = layouts[0]
    ndim = len(first.shape)
    if not -ndim <= dim < ndim:
        return None
    dim %= ndim
    if any(
        len(t.shape) != ndim or t.itemsize != first.itemsize or t.shape[:dim] != first.shape[:dim]
        for t in layouts
    ) or any(t.shape[dim + 1 :] != first.shape[dim + 1 :] for t in layouts):
        return None
    outer = math.prod(first.shape[:dim])
    blocks = [math.prod(t.shape[dim:]) * t.itemsize for t in layouts]
    ranges: list[Range] = []
    for i in range(outer):
        for layout, block in zip(layouts, blocks):
            ranges.extend(layout.span(i * block, block))
    shape = (*first.shape[:dim], sum(t.shape[dim] for t in layouts), *first.shape[dim + 1 :])
    return ByteLayout(shape, first.itemsize, _joined(ranges))


def stack(layouts: Sequence[ByteLayout]) -> ByteLayout | None:
    """The layout of ``torch.stack`` of ``layouts`` along dim 0 (``None`` when shapes disagree)."""
    first = layouts[0]
    if any(t.shape != first.shape or t.itemsize != first.itemsize for t in layouts):
        return None
    ranges = [r for t in layouts for r in t.ranges]
    return ByteLayout((len(layouts), *first.shape), first.itemsize, _joined(ranges))


#: Layouts in the nesting of tensor groups: ``[group][index]``.
LayoutGroups = list[list["ByteLayout"]]


class LayoutOperation(Protocol):
    """What :func:`convert_layouts` needs of an operation (every ``ConversionOperation`` has it)."""

    def convert_layouts(self, layouts: LayoutGroups) -> LayoutGroups | None: ...


def convert_layouts(
    operations: Sequence[LayoutOperation],
    groups: list[list[ByteLayout]],
    min_average_range: int = _MIN_AVERAGE_RANGE,
) -> list[list[ByteLayout]] | None:
    """Run ``operations`` on layouts, as ``run_convert`` runs them on tensors; ``None`` when one of
    them has no byte-layout fast path (its ``convert_layouts`` gives ``None``), or a result has more than a few ranges averaging
    under ``min_average_range`` bytes (column-wise concatenation of 2D weights, for example)."""
    for op in operations:
        # Each operation declares its own fast path (`ConversionOperation.convert_layouts`).
        converted = op.convert_layouts(groups)
        if converted is None:
            return None
        groups = converted
    for group in groups:
        for layout in group:
            if len(layout.ranges) > 4 and layout.nbytes < len(layout.ranges) * min_average_range:
                return None
    return groups
