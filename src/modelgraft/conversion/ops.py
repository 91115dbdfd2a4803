"""Tensor operations of checkpoint conversions, each with an exact reverse.

Every operation works on *tensor groups*: a list with one entry per pattern (the converter's
source patterns on the way in; intermediate results in between; its target patterns on the way
out), where each entry is a list of tensors, one per ``*`` index (a single tensor when the
pattern has no ``*``). ``q_proj``, ``k_proj``, ``v_proj`` therefore arrive as
``[[q], [k], [v]]`` and per-expert weights ``mlp.experts.*.gate_proj.weight`` as
``[[e0, e1, ...]]``.

``convert`` goes from the checkpoint layout to the grafted layout; ``reverse`` undoes it and is
given, through :class:`ConversionContext`, the exact shapes ``convert`` received, so unequal
splits (grouped-query attention: q, k and v of different sizes) reverse exactly. An operation
that only moves whole byte ranges also declares its byte-layout fast path
(:meth:`ConversionOperation.convert_layouts`), so the loader can map its result straight from the
checkpoint file; a new operation is one class here (or in user code), nothing else.

Example:
    >>> import torch
    >>> from modelgraft.conversion.ops import Concatenate, ConversionContext
    >>> q, k, v = torch.ones(4, 2), torch.zeros(2, 2), torch.zeros(2, 2)
    >>> [[qkv]] = Concatenate(dim=0).convert([[q], [k], [v]], ConversionContext(num_targets=1))
    >>> qkv.shape
    torch.Size([8, 2])
    >>> ctx = ConversionContext(num_targets=3, source_shapes=[[q.shape], [k.shape], [v.shape]])
    >>> [t[0].shape[0] for t in Concatenate(dim=0).reverse([[qkv]], ctx)]
    [4, 2, 2]
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

from modelgraft.conversion._layout import LayoutGroups, concatenate, stack
from modelgraft.errors import ConversionError, IrreversibleConversionError

__all__ = [
    "Chunk",
    "Concatenate",
    "ConversionContext",
    "ConversionOperation",
    "Interleave",
    "MergeModulelist",
    "Split",
    "SplitModulelist",
    "TensorGroups",
    "Transpose",
    "model_config",
]

TensorGroups = list[list[torch.Tensor]]
ShapeGroups = list[list[torch.Size]]


_MODEL_CONFIG: ContextVar[Any] = ContextVar("modelgraft_conversion_model_config", default=None)


@contextmanager
def model_config(config: Any) -> Iterator[None]:
    """Hand ``config`` to every :class:`ConversionContext` made in this block (a load, save or graft).

    The engine runs operations deep inside planned groups; the config of the model being loaded
    or saved reaches them this way instead of through every call in between.
    """
    token = _MODEL_CONFIG.set(config)
    try:
        yield
    finally:
        _MODEL_CONFIG.reset(token)


@dataclass(frozen=True, kw_only=True)
class ConversionContext:
    """What the engine knows when it runs one operation of a converter.

    Attributes:
        num_targets: number of target patterns of the converter (how many groups the last
            operation must produce).
        target_shapes: on load, for the last operation only, the shapes of the model
            parameters the result goes into (one list per target pattern); ``None`` otherwise.
        source_shapes: on save (``reverse``), the shapes this operation's ``convert`` received,
            one list per input group: what ``reverse`` must give back.
        config: the config of the model being loaded, saved or grafted, for operations that need
            it (transformers' ``PermuteForRope`` reads the head count there, as transformers
            hands it the model's config); ``None`` when the engine runs without a model.
    """

    num_targets: int = 1
    target_shapes: ShapeGroups | None = None
    source_shapes: ShapeGroups | None = None
    config: Any = field(default_factory=_MODEL_CONFIG.get)


class ConversionOperation:
    """Base class of conversion operations; subclass it for your own.

    Implement :meth:`convert` (checkpoint layout to grafted layout) and, so that
    ``save_pretrained`` can write the original layout, :meth:`reverse`. Both receive and return
    tensor groups (see the module docstring). ``convert`` must also work on tensors on the
    ``meta`` device: the engine runs it on meta tensors to learn intermediate shapes for saving.

    Example:
        >>> import torch
        >>> class Scale(ConversionOperation):
        ...     def convert(self, tensors, context):
        ...         return [[t * 2 for t in group] for group in tensors]
        ...
        ...     def reverse(self, tensors, context):
        ...         return [[t / 2 for t in group] for group in tensors]
        >>> Scale().convert([[torch.ones(1)]], ConversionContext())[0][0].item()
        2.0
        >>> Scale().is_reversible
        True
    """

    def convert(self, tensors: TensorGroups, context: ConversionContext) -> TensorGroups:
        """Map ``tensors`` from the checkpoint layout towards the grafted layout."""
        raise NotImplementedError(f"`{type(self).__name__}` must implement `convert(tensors, context)`.")

    def reverse(self, tensors: TensorGroups, context: ConversionContext) -> TensorGroups:
        """Undo :meth:`convert`; ``context.source_shapes`` holds the shapes to give back."""
        raise IrreversibleConversionError(
            f"Operation `{type(self).__name__}` has no `reverse`, so the original checkpoint layout cannot be "
            "written. Implement `reverse(tensors, context)` on it, or save the grafted layout with "
            "`model.save_pretrained(path, save_original_format=False)`."
        )

    def convert_layouts(self, layouts: LayoutGroups) -> LayoutGroups | None:
        """The byte-layout fast path: :meth:`convert` run on descriptions of where each source's
        bytes lie in the checkpoint files (:class:`~modelgraft.conversion._layout.ByteLayout`).

        An operation that only moves whole byte ranges (no arithmetic) overrides this, so that the
        loader maps or reads its result straight from the file. The default, ``None``, means the
        operation computes: its sources are read and :meth:`convert` runs on them.

        Example:
            >>> Transpose(dim0=0, dim1=1).convert_layouts([]) is None
            True
        """
        return None

    @property
    def is_reversible(self) -> bool:
        """Whether this operation overrides :meth:`reverse`."""
        return type(self).reverse is not ConversionOperation.reverse


def _single_inner_length(tensors: TensorGroups, op: str) -> int:
    lengths = {len(group) for group in tensors}
    if len(lengths) != 1:
        raise ConversionError(
            f"`{op}` needs every pattern to hold the same number of tensors (one per `*` index); "
            f"received {[len(g) for g in tensors]}. Check that the source patterns match the same experts."
        )
    return lengths.pop()


def _join_parts(tensors: TensorGroups, dim: int, op: str) -> TensorGroups:
    """The reverse of splitting one group into parts (``Chunk``, ``Split``): per ``*`` index, the
    parts concatenated along ``dim`` back into one group."""
    n = _single_inner_length(tensors, op)
    return [[torch.cat([group[j] for group in tensors], dim=dim) for j in range(n)]]


def _check_dim(tensor: torch.Tensor, dim: int, op: str) -> None:
    if not -tensor.dim() <= dim < max(tensor.dim(), 1):
        raise ConversionError(
            f"`{op}` uses dim={dim}, but received a tensor of shape {tuple(tensor.shape)} "
            f"({tensor.dim()} dims). Pass a dim that exists in the checkpoint tensors."
        )


@dataclass(frozen=True)
class Concatenate(ConversionOperation):
    """Concatenate the groups along ``dim`` into one group (per ``*`` index).

    ``[[q], [k], [v]] -> [[cat(q, k, v)]]``. The reverse splits by the exact sizes ``convert``
    received, so unequal parts come back unchanged.

    Example:
        >>> import torch
        >>> out = Concatenate(dim=1).convert([[torch.ones(2, 1)], [torch.ones(2, 3)]], ConversionContext())
        >>> tuple(out[0][0].shape)
        (2, 4)
    """

    dim: int = 0

    def convert(self, tensors: TensorGroups, context: ConversionContext) -> TensorGroups:
        n = _single_inner_length(tensors, "Concatenate")
        for group in tensors:
            for t in group:
                _check_dim(t, self.dim, "Concatenate")
        return [[torch.cat([group[j] for group in tensors], dim=self.dim) for j in range(n)]]

    def convert_layouts(self, layouts: LayoutGroups) -> LayoutGroups | None:
        """The groups joined range by range (``None`` when their lengths or shapes disagree)."""
        lengths = {len(group) for group in layouts}
        if len(lengths) != 1:
            return None
        joined = [concatenate([group[j] for group in layouts], self.dim) for j in range(lengths.pop())]
        return None if any(layout is None for layout in joined) else [joined]  # type: ignore[list-item]

    def reverse(self, tensors: TensorGroups, context: ConversionContext) -> TensorGroups:
        if context.source_shapes is None:
            raise ConversionError(
                "`Concatenate.reverse` needs `context.source_shapes` (the sizes it joined)."
            )
        if len(tensors) != 1:
            raise ConversionError(f"`Concatenate.reverse` expects one group, received {len(tensors)}.")
        shapes = context.source_shapes
        out: TensorGroups = [[] for _ in shapes]
        for j, joined in enumerate(tensors[0]):
            sizes = [group[j][self.dim] for group in shapes]
            for i, part in enumerate(torch.split(joined, sizes, dim=self.dim)):
                out[i].append(part)
        return out


@dataclass(frozen=True)
class Chunk(ConversionOperation):
    """Split one group along ``dim`` into several groups (per ``*`` index).

    With ``chunks=None`` it makes one part per target pattern; the part sizes are the target
    parameters' sizes when the engine knows them (so fused grouped-query QKV splits exactly),
    and equal otherwise. The reverse concatenates.

    Example:
        >>> import torch
        >>> parts = Chunk(dim=0).convert([[torch.arange(6.0)]], ConversionContext(num_targets=2))
        >>> [p[0].tolist() for p in parts]
        [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    """

    dim: int = 0
    chunks: int | None = None

    def convert(self, tensors: TensorGroups, context: ConversionContext) -> TensorGroups:
        if len(tensors) != 1:
            raise ConversionError(
                f"`Chunk` splits one source; received {len(tensors)} groups. Put `Concatenate` or "
                "`MergeModulelist` before it, or use one converter per source pattern."
            )
        count = self.chunks or context.num_targets
        out: TensorGroups = [[] for _ in range(count)]
        for j, t in enumerate(tensors[0]):
            _check_dim(t, self.dim, "Chunk")
            total = t.shape[self.dim]
            shapes = context.target_shapes
            if shapes is not None and len(shapes) == count and all(len(s) > j for s in shapes):
                sizes = [s[j][self.dim] if len(s[j]) > 0 else 0 for s in shapes]
            elif total % count == 0:
                sizes = [total // count] * count
            else:
                raise ConversionError(
                    f"`Chunk(dim={self.dim})` cannot split size {total} into {count} equal parts; "
                    "the target parameters' shapes were not available to size the parts."
                )
            if sum(sizes) != total:
                raise ConversionError(
                    f"`Chunk(dim={self.dim})`: the target sizes {sizes} add up to {sum(sizes)}, "
                    f"but the source has size {total} along dim {self.dim}."
                )
            for i, part in enumerate(torch.split(t, sizes, dim=self.dim)):
                out[i].append(part)
        return out

    def reverse(self, tensors: TensorGroups, context: ConversionContext) -> TensorGroups:
        return _join_parts(tensors, self.dim, "Chunk.reverse")


@dataclass(frozen=True)
class MergeModulelist(ConversionOperation):
    """Stack each group's per-index tensors along ``dim``: ``[[e0, e1, ...]] -> [[stack]]``.

    This turns per-expert weights (``experts.*.gate_proj.weight``) into one fused tensor.

    Example:
        >>> import torch
        >>> out = MergeModulelist(dim=0).convert([[torch.ones(2, 3)] * 4], ConversionContext())
        >>> tuple(out[0][0].shape)
        (4, 2, 3)
    """

    dim: int = 0

    def convert(self, tensors: TensorGroups, context: ConversionContext) -> TensorGroups:
        return [[torch.stack(group, dim=self.dim)] for group in tensors]

    def convert_layouts(self, layouts: LayoutGroups) -> LayoutGroups | None:
        """Along dim 0 each group's sources one after another; other dims interleave: ``None``."""
        if self.dim != 0:
            return None
        stacked = [stack(group) if group else None for group in layouts]
        whole = [layout for layout in stacked if layout is not None]
        return None if len(whole) != len(stacked) else [[layout] for layout in whole]

    def reverse(self, tensors: TensorGroups, context: ConversionContext) -> TensorGroups:
        return SplitModulelist(self.dim).convert(tensors, context)


@dataclass(frozen=True)
class SplitModulelist(ConversionOperation):
    """Unstack each group's single tensor along ``dim`` into per-index tensors (``*`` targets).

    Example:
        >>> import torch
        >>> out = SplitModulelist(dim=0).convert([[torch.ones(4, 2, 3)]], ConversionContext())
        >>> len(out[0]), tuple(out[0][0].shape)
        (4, (2, 3))
    """

    dim: int = 0

    def convert(self, tensors: TensorGroups, context: ConversionContext) -> TensorGroups:
        out: TensorGroups = []
        for group in tensors:
            if len(group) != 1:
                raise ConversionError(
                    f"`SplitModulelist` splits one tensor per pattern; received {len(group)}. "
                    "Put `MergeModulelist` before it or drop the `*` from the source pattern."
                )
            _check_dim(group[0], self.dim, "SplitModulelist")
            out.append(list(torch.unbind(group[0], dim=self.dim)))
        return out

    def reverse(self, tensors: TensorGroups, context: ConversionContext) -> TensorGroups:
        return [[torch.stack(group, dim=self.dim)] for group in tensors]


@dataclass(frozen=True)
class Transpose(ConversionOperation):
    """Swap ``dim0`` and ``dim1`` of every tensor; its own reverse.

    With ``check_dims=True`` a tensor that already has the target parameter's shape is left as
    it is (checkpoints of one family exist in both layouts); the reverse then transposes only what
    ``convert`` transposed, so the save gives back the layout that was loaded.

    Example:
        >>> import torch
        >>> tuple(Transpose(0, 1).convert([[torch.ones(2, 3)]], ConversionContext())[0][0].shape)
        (3, 2)
        >>> ctx = ConversionContext(target_shapes=[[torch.Size([2, 3])]])
        >>> tuple(Transpose(0, 1, check_dims=True).convert([[torch.ones(2, 3)]], ctx)[0][0].shape)
        (2, 3)
    """

    dim0: int = 0
    dim1: int = 1
    check_dims: bool = False

    def _keep(self, t: torch.Tensor, shape: Sequence[int] | None) -> bool:
        return self.check_dims and shape is not None and tuple(t.shape) == tuple(shape)

    def convert(self, tensors: TensorGroups, context: ConversionContext) -> TensorGroups:
        for group in tensors:
            for t in group:
                _check_dim(t, self.dim0, "Transpose")
                _check_dim(t, self.dim1, "Transpose")
        if self.check_dims and context.target_shapes is None:
            raise ConversionError(
                "`Transpose(check_dims=True)` compares each tensor with the model parameter it becomes, so it "
                "must be the last operation of its converter (the engine knows target shapes only there)."
            )
        shapes = context.target_shapes
        return [
            [
                t
                if self._keep(t, shapes[i][j] if shapes is not None else None)
                else t.transpose(self.dim0, self.dim1)
                for j, t in enumerate(group)
            ]
            for i, group in enumerate(tensors)
        ]

    def reverse(self, tensors: TensorGroups, context: ConversionContext) -> TensorGroups:
        shapes = context.source_shapes
        return [
            [
                t
                if self._keep(t, shapes[i][j] if shapes is not None else None)
                else t.transpose(self.dim0, self.dim1)
                for j, t in enumerate(group)
            ]
            for i, group in enumerate(tensors)
        ]


@dataclass(frozen=True)
class Interleave(ConversionOperation):
    """De-interleave rows along ``dim``: ``[g0, u0, g1, u1, ...] -> [g0, g1, ..., u0, u1, ...]``.

    Checkpoints that store a fused gate/up projection with gate and up rows alternating become
    the halves-after-halves layout; ``inverse=True`` interleaves instead. The reverse is the
    other direction, so a save writes the alternating rows back exactly.

    Example:
        >>> import torch
        >>> Interleave(dim=0).convert([[torch.arange(6.0)]], ConversionContext())[0][0].tolist()
        [0.0, 2.0, 4.0, 1.0, 3.0, 5.0]
    """

    dim: int = 0
    inverse: bool = False

    def _apply(self, t: torch.Tensor, inverse: bool) -> torch.Tensor:
        _check_dim(t, self.dim, "Interleave")
        dim = self.dim % t.dim()
        size = t.shape[dim]
        if size % 2:
            raise ConversionError(
                f"`Interleave(dim={self.dim})` needs an even size along dim {self.dim}; received shape "
                f"{tuple(t.shape)}."
            )
        split = [2, size // 2] if inverse else [size // 2, 2]
        shape = [*t.shape[:dim], *split, *t.shape[dim + 1 :]]
        return t.reshape(shape).transpose(dim, dim + 1).reshape(t.shape)

    def convert(self, tensors: TensorGroups, context: ConversionContext) -> TensorGroups:
        return [[self._apply(t, self.inverse) for t in group] for group in tensors]

    def reverse(self, tensors: TensorGroups, context: ConversionContext) -> TensorGroups:
        return [[self._apply(t, not self.inverse) for t in group] for group in tensors]


@dataclass(frozen=True)
class Split(ConversionOperation):
    """Split one tensor along ``dim`` into one part per target, each sized like its model parameter.

    Unlike :class:`Chunk`, the sizes always come from the target parameters (fused QKV with
    grouped-query heads, a fused projection of four unequal parts), so ``Split`` must be the last
    operation of its converter. The reverse concatenates.

    Example:
        >>> import torch
        >>> ctx = ConversionContext(num_targets=2, target_shapes=[[torch.Size([1])], [torch.Size([3])]])
        >>> [p[0].tolist() for p in Split(dim=0).convert([[torch.arange(4.0)]], ctx)]
        [[0.0], [1.0, 2.0, 3.0]]
    """

    dim: int = 0

    def convert(self, tensors: TensorGroups, context: ConversionContext) -> TensorGroups:
        shapes = context.target_shapes
        if len(tensors) != 1:
            raise ConversionError(f"`Split` splits one source; received {len(tensors)} groups.")
        if shapes is None:
            raise ConversionError(
                "`Split` sizes its parts like the model parameters they become, so it must be the last "
                "operation of its converter (the engine knows target shapes only there)."
            )
        out: TensorGroups = [[] for _ in shapes]
        for j, t in enumerate(tensors[0]):
            _check_dim(t, self.dim, "Split")
            sizes = [s[j][self.dim] for s in shapes]
            if sum(sizes) != t.shape[self.dim]:
                raise ConversionError(
                    f"`Split(dim={self.dim})`: the target sizes {sizes} add up to {sum(sizes)}, but the source "
                    f"has size {t.shape[self.dim]} along dim {self.dim} (shape {tuple(t.shape)})."
                )
            for i, part in enumerate(torch.split(t, sizes, dim=self.dim)):
                out[i].append(part)
        return out

    def reverse(self, tensors: TensorGroups, context: ConversionContext) -> TensorGroups:
        return _join_parts(tensors, self.dim, "Split.reverse")
