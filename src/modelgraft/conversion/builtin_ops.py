"""The special operations of transformers' conversion API, written for modelgraft.

They follow transformers' operation protocol (``convert(input_dict, source_patterns=...,
target_patterns=..., **kwargs)`` returning a dict, and ``reverse_op``), so code that imports them
from transformers works after changing the import line, and modelgraft converters run them like
any operation written for transformers (see :mod:`modelgraft.conversion._hf_ops`). Each has an
exact reverse.

Operations that need the model's head count (:class:`PermuteForRope` and the two vision ones)
take it as ``num_heads=``, from ``config=`` given to the operation, or, as in transformers, from
the config of the model being loaded or saved, which the engine hands to every operation (the
``subconfig_key`` sub-config where one is named).

Example:
    >>> import torch
    >>> op = PermuteForRope(num_heads=2)
    >>> w = torch.arange(8.0).reshape(8, 1)
    >>> out = op.convert({"q_proj": [w]}, ["q_proj"], ["q_proj"])["q_proj"]
    >>> out.flatten().tolist()
    [0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0]
    >>> op.reverse_op.convert({"q_proj": [out]}, ["q_proj"], ["q_proj"])["q_proj"].equal(w)
    True
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from modelgraft.errors import ConversionError

__all__ = [
    "Conv3dToLinear",
    "ConversionOps",
    "ErnieFuseAndSplitTextVisionExperts",
    "ErnieSplitAndDecoupleTextVisionExperts",
    "LinearToConv3d",
    "PermuteForRope",
    "VisionFuseAndPermuteForRope",
    "VisionUnfuseAndPermuteForRope",
]

TensorDict = dict[str, Any]


def _single(value: Any, op: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if len(value) != 1:
        raise ConversionError(f"`{op}` expects one tensor per pattern; received {len(value)}.")
    first: torch.Tensor = value[0]  # a caller's list of tensors (transformers' protocol is untyped)
    return first


def _output_key(key: str, sources: Sequence[str] | None, targets: Sequence[str] | None) -> str:
    """One input to one output: named by the only target, else it keeps its name."""
    if targets is not None and len(targets) == 1 and (sources is None or len(sources) == 1):
        return targets[0]
    return key


class ConversionOps:
    """Base class for operations written in transformers' protocol (the name transformers uses).

    Subclass it and implement ``convert(input_dict, source_patterns, target_patterns, **kwargs)``
    returning a dict, and ``reverse_op`` (a property returning the operation that undoes it) so
    the original layout can be saved. modelgraft's own base class with tensor groups is
    :class:`~modelgraft.ConversionOperation`; both run in a :class:`~modelgraft.WeightConverter`.

    Example:
        >>> class Negate(ConversionOps):
        ...     def convert(self, input_dict, source_patterns=None, target_patterns=None, **kwargs):
        ...         return {k: [-t for t in v] for k, v in input_dict.items()}
        ...
        ...     @property
        ...     def reverse_op(self):
        ...         return Negate()
        >>> Negate().convert({"w": [torch.ones(1)]})["w"][0].item()
        -1.0
    """

    def convert(
        self,
        input_dict: TensorDict,
        source_patterns: Sequence[str] | None = None,
        target_patterns: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> TensorDict:
        raise NotImplementedError(
            f"`{type(self).__name__}` must implement `convert(input_dict, source_patterns, ...)`."
        )

    @property
    def reverse_op(self) -> ConversionOps:
        raise NotImplementedError(f"`{type(self).__name__}` has no `reverse_op`.")


class _Op(ConversionOps):
    """Common parts: a readable repr and value equality (so converters compare by what they do)."""

    def _fields(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self._fields().items())})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash((type(self), repr(self)))


class Conv3dToLinear(_Op):
    """Flatten Conv3d weights ``(out, in, kt, kh, kw)`` into a Linear weight ``(out, in*kt*kh*kw)``.

    Example:
        >>> w = torch.randn(2, 3, 1, 2, 2)
        >>> Conv3dToLinear(3, (1, 2, 2)).convert({"proj": [w]}, ["proj"], ["proj"])["proj"].shape
        torch.Size([2, 12])
    """

    def __init__(self, in_channels: int, kernel_size: Sequence[int]) -> None:
        self.in_channels = in_channels
        self.kernel_size = tuple(kernel_size)

    def convert(
        self,
        input_dict: TensorDict,
        source_patterns: Sequence[str] | None = None,
        target_patterns: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> TensorDict:
        (key, value), *rest = input_dict.items()
        if rest:
            raise ConversionError(
                f"`Conv3dToLinear` converts one tensor; received {len(input_dict)} patterns."
            )
        t = _single(value, "Conv3dToLinear")
        if t.dim() == 5:
            t = t.reshape(t.shape[0], -1).contiguous()
        elif t.dim() != 2:
            raise ConversionError(
                f"`Conv3dToLinear` expects a 5D (or already 2D) tensor; received {t.dim()}D."
            )
        return {_output_key(key, source_patterns, target_patterns): t}

    @property
    def reverse_op(self) -> LinearToConv3d:
        return LinearToConv3d(self.in_channels, self.kernel_size)


class LinearToConv3d(_Op):
    """Reshape a Linear weight ``(out, in*kt*kh*kw)`` into Conv3d ``(out, in, kt, kh, kw)``.

    Example:
        >>> LinearToConv3d(3, (1, 2, 2)).convert({"p": [torch.zeros(2, 12)]}, ["p"], ["p"])["p"].shape
        torch.Size([2, 3, 1, 2, 2])
    """

    def __init__(self, in_channels: int, kernel_size: Sequence[int]) -> None:
        self.in_channels = in_channels
        self.kernel_size = tuple(kernel_size)

    def convert(
        self,
        input_dict: TensorDict,
        source_patterns: Sequence[str] | None = None,
        target_patterns: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> TensorDict:
        (key, value), *rest = input_dict.items()
        if rest:
            raise ConversionError(
                f"`LinearToConv3d` converts one tensor; received {len(input_dict)} patterns."
            )
        t = _single(value, "LinearToConv3d")
        shape = (t.shape[0], self.in_channels, *self.kernel_size)
        if t.numel() != math.prod(shape):
            raise ConversionError(
                f"`LinearToConv3d` cannot reshape a tensor of shape {tuple(t.shape)} into {shape}; check "
                "`in_channels` and `kernel_size` against the checkpoint."
            )
        return {_output_key(key, source_patterns, target_patterns): t.reshape(shape).contiguous()}

    @property
    def reverse_op(self) -> Conv3dToLinear:
        return Conv3dToLinear(self.in_channels, self.kernel_size)


def _heads(config: Any, subconfig_key: str | None, num_heads: int | None, op: str) -> int:
    if num_heads is not None:
        return num_heads
    if config is not None:
        if subconfig_key is not None:
            config = getattr(config, subconfig_key, config)
        heads: int | None = getattr(config, "num_attention_heads", None)
        if heads is not None:
            return heads
    raise ConversionError(
        f"`{op}` needs the number of attention heads: pass `num_heads=` or `config=`, or run it inside a "
        "load or save, which hands it the model's config (with `num_attention_heads`"
        + (f" in its `{subconfig_key}`" if subconfig_key else "")
        + ")."
    )


def permute_for_rope(tensor: torch.Tensor, num_heads: int, inverse: bool = False) -> torch.Tensor:
    """Interleaved (complex) RoPE rows to split-half rows per head (``inverse=True`` undoes it).

    Example:
        >>> permute_for_rope(torch.arange(4.0), 1).tolist()
        [0.0, 2.0, 1.0, 3.0]
    """
    rows = tensor.shape[0]
    if rows % (2 * num_heads):
        raise ConversionError(
            f"RoPE permutation: {rows} rows do not split into {num_heads} heads of an even size."
        )
    half = rows // num_heads // 2
    shape = (2, half) if inverse else (half, 2)
    rest = tuple(tensor.shape[1:])
    return tensor.reshape(num_heads, *shape, *rest).transpose(1, 2).reshape(rows, *rest)


class PermuteForRope(_Op):
    """Permute q/k rows from interleaved RoPE pairs to the split-half layout (``inverse`` undoes).

    ``permute_layer_names`` limits the permutation to patterns containing one of the names; the
    other tensors pass through. The head count comes from ``num_heads`` or ``config``.
    """

    def __init__(
        self,
        subconfig_key: str | None = None,
        permute_layer_names: list[str] | None = None,
        inverse: bool = False,
        num_heads: int | None = None,
        config: Any = None,
    ) -> None:
        self.subconfig_key = subconfig_key
        self.permute_layer_names = permute_layer_names
        self.inverse = inverse
        self.num_heads = num_heads
        self.config = config

    def _fields(self) -> dict[str, Any]:
        fields = super()._fields()
        fields.pop("config")
        return fields

    def _apply(self, tensor: torch.Tensor, config: Any = None) -> torch.Tensor:
        heads = _heads(
            self.config if self.config is not None else config,
            self.subconfig_key,
            self.num_heads,
            "PermuteForRope",
        )
        return permute_for_rope(tensor, heads, self.inverse)

    def convert(
        self,
        input_dict: TensorDict,
        source_patterns: Sequence[str] | None = None,
        target_patterns: Sequence[str] | None = None,
        config: Any = None,
        **kwargs: Any,
    ) -> TensorDict:
        out: TensorDict = {}
        for key, value in input_dict.items():
            names = self.permute_layer_names
            t = _single(value, "PermuteForRope")
            if names is None or any(n in key for n in names):
                t = self._apply(t, config)
            out[_output_key(key, source_patterns, target_patterns) if len(input_dict) == 1 else key] = t
        return out

    @property
    def reverse_op(self) -> PermuteForRope:
        return PermuteForRope(
            self.subconfig_key, self.permute_layer_names, not self.inverse, self.num_heads, self.config
        )


class VisionUnfuseAndPermuteForRope(PermuteForRope):
    """Split a fused vision QKV into equal parts (one per target), then permute the named ones.

    The head count is that of ``config.vision_config`` (or ``num_heads``).
    """

    def __init__(
        self,
        dim: int = 0,
        permute_layer_names: list[str] | None = None,
        inverse: bool = False,
        num_heads: int | None = None,
        config: Any = None,
    ) -> None:
        super().__init__("vision_config", permute_layer_names, inverse, num_heads, config)
        self.dim = dim

    def convert(
        self,
        input_dict: TensorDict,
        source_patterns: Sequence[str] | None = None,
        target_patterns: Sequence[str] | None = None,
        config: Any = None,
        **kwargs: Any,
    ) -> TensorDict:
        if len(input_dict) != 1 or not target_patterns or len(target_patterns) < 2:
            raise ConversionError(
                "`VisionUnfuseAndPermuteForRope` splits one fused tensor into several targets."
            )
        t = _single(next(iter(input_dict.values())), "VisionUnfuseAndPermuteForRope")
        if t.shape[self.dim] % len(target_patterns):
            raise ConversionError(
                f"`VisionUnfuseAndPermuteForRope` cannot split size {t.shape[self.dim]} into "
                f"{len(target_patterns)} equal parts."
            )
        parts = dict(zip(target_patterns, torch.chunk(t, len(target_patterns), dim=self.dim)))
        return PermuteForRope.convert(self, parts, config=config)

    @property
    def reverse_op(self) -> VisionFuseAndPermuteForRope:
        return VisionFuseAndPermuteForRope(
            self.dim, self.permute_layer_names, not self.inverse, self.num_heads, self.config
        )


class VisionFuseAndPermuteForRope(PermuteForRope):
    """Permute the named vision q/k tensors, then concatenate all sources along ``dim``."""

    def __init__(
        self,
        dim: int = 0,
        permute_layer_names: list[str] | None = None,
        inverse: bool = True,
        num_heads: int | None = None,
        config: Any = None,
    ) -> None:
        super().__init__("vision_config", permute_layer_names, inverse, num_heads, config)
        self.dim = dim

    def convert(
        self,
        input_dict: TensorDict,
        source_patterns: Sequence[str] | None = None,
        target_patterns: Sequence[str] | None = None,
        config: Any = None,
        **kwargs: Any,
    ) -> TensorDict:
        if not target_patterns or len(target_patterns) != 1:
            raise ConversionError("`VisionFuseAndPermuteForRope` fuses its sources into one target.")
        permuted = PermuteForRope.convert(self, input_dict, config=config)
        order = [k for k in (source_patterns or []) if k in permuted] or list(permuted)
        return {target_patterns[0]: torch.cat([permuted[k] for k in order], dim=self.dim)}

    @property
    def reverse_op(self) -> VisionUnfuseAndPermuteForRope:
        return VisionUnfuseAndPermuteForRope(
            self.dim, self.permute_layer_names, not self.inverse, self.num_heads, self.config
        )


class ErnieFuseAndSplitTextVisionExperts(_Op):
    """Per-expert lists (one per source) into one fused tensor per target (text, vision, ...).

    Each source's experts are cut into as many consecutive runs as there are targets, each run
    stacked along ``stack_dim``; target ``i`` is the ``i``-th runs of every source joined along
    ``concat_dim`` (gate and up of the text experts, then of the vision experts).

    Example:
        >>> e = [torch.full((1, 2), float(i)) for i in range(4)]
        >>> out = ErnieFuseAndSplitTextVisionExperts().convert({"g": e, "u": e}, ["g", "u"], ["text", "vision"])
        >>> out["text"].shape, out["vision"][:, 0, 0].tolist()
        (torch.Size([2, 2, 2]), [2.0, 3.0])
    """

    def __init__(self, stack_dim: int = 0, concat_dim: int = 1) -> None:
        self.stack_dim = stack_dim
        self.concat_dim = concat_dim

    def convert(
        self,
        input_dict: TensorDict,
        source_patterns: Sequence[str] | None = None,
        target_patterns: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> TensorDict:
        sources = list(source_patterns or input_dict)
        targets = list(target_patterns or [])
        missing = [k for k in sources if k not in input_dict]
        if missing or not targets:
            raise ConversionError(
                f"`ErnieFuseAndSplitTextVisionExperts` needs tensors for every source pattern {sources} and at "
                f"least one target; missing {missing}."
            )
        joined: dict[str, list[torch.Tensor]] = {t: [] for t in targets}
        for key in sources:
            experts = list(input_dict[key])
            if len(experts) % len(targets):
                raise ConversionError(
                    f"`ErnieFuseAndSplitTextVisionExperts`: {len(experts)} experts of `{key}` do not split "
                    f"evenly into {len(targets)} targets."
                )
            size = len(experts) // len(targets)
            for i, target in enumerate(targets):
                joined[target].append(torch.stack(experts[i * size : (i + 1) * size], dim=self.stack_dim))
        return {t: torch.cat(parts, dim=self.concat_dim) for t, parts in joined.items()}

    @property
    def reverse_op(self) -> ErnieSplitAndDecoupleTextVisionExperts:
        return ErnieSplitAndDecoupleTextVisionExperts(self.stack_dim, self.concat_dim)


class ErnieSplitAndDecoupleTextVisionExperts(_Op):
    """The reverse of :class:`ErnieFuseAndSplitTextVisionExperts`: fused targets back to per-expert lists."""

    def __init__(self, stack_dim: int = 0, concat_dim: int = 1) -> None:
        self.stack_dim = stack_dim
        self.concat_dim = concat_dim

    def convert(
        self,
        input_dict: TensorDict,
        source_patterns: Sequence[str] | None = None,
        target_patterns: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> TensorDict:
        fused_keys = list(source_patterns or input_dict)
        outputs = list(target_patterns or [])
        out: dict[str, list[torch.Tensor]] = {k: [] for k in outputs}
        for key in fused_keys:
            fused = _single(input_dict[key], "ErnieSplitAndDecoupleTextVisionExperts")
            if fused.shape[self.concat_dim] % len(outputs):
                raise ConversionError(
                    f"`ErnieSplitAndDecoupleTextVisionExperts` cannot split size {fused.shape[self.concat_dim]} "
                    f"of `{key}` into {len(outputs)} equal parts."
                )
            for name, part in zip(outputs, torch.chunk(fused, len(outputs), dim=self.concat_dim)):
                out[name].extend(torch.unbind(part, dim=self.stack_dim))
        return out

    @property
    def reverse_op(self) -> ErnieFuseAndSplitTextVisionExperts:
        return ErnieFuseAndSplitTextVisionExperts(self.stack_dim, self.concat_dim)
