"""How each fused-experts family stores its experts, declared once per family.

transformers 5 keeps the experts of an MoE layer as 3D parameters, but not all in one layout:
most families store ``gate_up_proj`` as ``(E, 2I, H)`` with the gate rows first and
``down_proj`` as ``(E, H, I)`` (the *standard* layout, flagged by ``use_experts_implementation``);
GPT-OSS stores them transposed, with gate and up columns interleaved and with biases; Llama 4
stores them transposed and runs every expert on every token (its router scales the inputs).
An :class:`ExpertLayout` says which, so :mod:`modelgraft.grafts.linear_experts` can cut any of
them into per-expert ``nn.Linear`` layers and the checkpoint conversion can undo it bit for bit.

The activation is never re-implemented here: a family that overrides ``_apply_gate`` (GPT-OSS's
clamped SwiGLU with ``alpha``/``limit``, DeepSeek-V4's clamp) gets its own ``_apply_gate`` called
on the gate and up outputs laid out as the family expects them.

Example:
    >>> gpt_oss = layout_of(type("GptOssExperts", (), {}))  # its `call` depends on the transformers line
    >>> gpt_oss.transposed, gpt_oss.interleaved, gpt_oss.bias, gpt_oss.activation
    (True, True, True, 'clamped_swiglu')
    >>> layout_of(type("Qwen2MoeExperts", (), {"is_transposed": False}))
    ExpertLayout(transposed=False, interleaved=False, bias=False, call='routed', activation=None)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from modelgraft import _compat
from modelgraft.conversion.ops import (
    Chunk,
    ConversionContext,
    ConversionOperation,
    SplitModulelist,
    TensorGroups,
    Transpose,
)
from modelgraft.errors import ConversionError

if TYPE_CHECKING:
    from modelgraft.conversion import WeightConverter

__all__ = [
    "DEFAULT_NAMES",
    "LAYOUTS",
    "STACKED_LAYOUTS",
    "Deinterleave",
    "ExpertLayout",
    "SplitRows",
    "StackedLayout",
    "fused_checkpoint_converters",
    "fused_operations",
    "layout_of",
    "split_fused",
]

DEFAULT_NAMES = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ExpertLayout:
    """The storage of one family's fused experts.

    Attributes:
        transposed: ``gate_up_proj`` is ``(E, H, 2I)`` and ``down_proj`` ``(E, I, H)``.
        interleaved: gate and up alternate along the ``2I`` axis (gate, up, gate, up, ...)
            instead of all gate rows then all up rows.
        bias: ``gate_up_proj_bias`` ``(E, 2I)`` and ``down_proj_bias`` ``(E, H)`` exist.
        call: ``"routed"``: ``forward(hidden_states, top_k_index, top_k_weights)``;
            ``"dense"``: ``forward(hidden_states)`` with ``(E * tokens, H)`` inputs, each expert
            applied to its own block of tokens (Llama 4); ``"routed_by_expert"``: as routed,
            but the weights are ``(tokens, E)`` and indexed by expert id (GPT-OSS on 4.57).
        activation: where the class has no ``_apply_gate`` of its own, the name of the gated
            activation its forward computes inline (``"clamped_swiglu"``: GPT-OSS on 4.57);
            ``None`` for ``act_fn(gate) * up``.
    """

    transposed: bool = False
    interleaved: bool = False
    bias: bool = False
    call: str = "routed"
    activation: str | None = None


#: Families whose experts are not described by ``use_experts_implementation`` flags.
LAYOUTS: dict[str, ExpertLayout] = {
    "GptOssExperts": ExpertLayout(
        transposed=True,
        interleaved=True,
        bias=True,
        # transformers 4.57: the activation is inline in forward, the weights scattered per expert
        call="routed" if _compat.FUSED_MOE_EXPERTS else "routed_by_expert",
        activation="clamped_swiglu",
    ),
    "Llama4TextExperts": ExpertLayout(transposed=True, call="dense"),
}


@dataclass(frozen=True)
class StackedLayout:
    """Experts kept as one 2D ``(E * I, H)`` stack per role in a child module (DBRX's ``mlp``).

    Expert ``e`` owns rows ``e * I`` to ``(e + 1) * I`` of each stack. Its gate and up blocks are
    ``nn.Linear`` weights ``(I, H)`` as they stand; its down block is ``(I, H)`` too, the transpose
    of a down ``nn.Linear`` weight ``(H, I)`` (the plain forward multiplies by it untransposed).

    Attributes:
        child: the child module holding the stacks; the per-expert list takes its name.
        names: the gate, up and down stacks, in that order; the per-expert layers keep these names.
        sizes: the child's attributes holding the number of experts, ``I`` and ``H``.
        activation: the child's attribute holding the activation applied to the gate output.
        call: ``"routed"``: ``forward(hidden_states, top_k_index, top_k_weights)``;
            ``"scores_first"``: ``forward(x, weights, top_weights, top_experts)`` with the router's
            full scores first and unused (DBRX on transformers 4.57). Both on ``(batch, seq, H)``.
    """

    child: str
    names: tuple[str, str, str]
    sizes: tuple[str, str, str]
    activation: str
    call: str = "routed"


#: Families whose experts are 2D stacks in a child module (see :class:`StackedLayout`).
STACKED_LAYOUTS: dict[str, StackedLayout] = {
    "DbrxExperts": StackedLayout(
        child="mlp",
        names=("w1", "v1", "w2"),
        sizes=("moe_num_experts", "ffn_hidden_size", "hidden_size"),
        activation="activation_fn",
        # transformers 4.57 passes the router's full scores before the top-k weights and ids
        call="routed" if _compat.FUSED_MOE_EXPERTS else "scores_first",
    ),
}


@dataclass(frozen=True)
class SplitRows(ConversionOperation):
    """Cut dim 0 of every tensor into blocks of ``rows`` (``(E * I, H)`` -> ``(E, I, H)``); reverse joins them.

    Example:
        >>> import torch
        >>> out = SplitRows(rows=2).convert([[torch.arange(12.0).view(6, 2)]], ConversionContext())
        >>> tuple(out[0][0].shape)
        (3, 2, 2)
        >>> SplitRows(rows=2).reverse(out, ConversionContext())[0][0].shape
        torch.Size([6, 2])
    """

    rows: int

    def convert(self, tensors: TensorGroups, context: ConversionContext) -> TensorGroups:
        for group in tensors:
            for tensor in group:
                if tensor.dim() < 1 or self.rows < 1 or tensor.shape[0] % self.rows:
                    raise ConversionError(
                        f"`SplitRows(rows={self.rows})` needs a dim 0 that is a multiple of {self.rows}; received "
                        f"a tensor of shape {tuple(tensor.shape)}."
                    )
        return [[t.unflatten(0, (-1, self.rows)) for t in group] for group in tensors]  # type: ignore[no-untyped-call]

    def reverse(self, tensors: TensorGroups, context: ConversionContext) -> TensorGroups:
        return [[t.flatten(0, 1) for t in group] for group in tensors]


def stacked_checkpoint_converters(
    model_type: str, classes: dict[type[nn.Module], set[str]]
) -> tuple[WeightConverter, ...]:
    """Converters from 2D expert stacks (:class:`StackedLayout`) to per-expert ``nn.Linear`` weights.

    The plain model's keys are the checkpoint's (transformers renames nothing there), so each stack
    ``<place>.<child>.<name>`` becomes ``<place>.<child>.*.<name>.weight``, exactly reversibly.
    """
    from modelgraft.conversion import WeightConverter
    from modelgraft.grafts._common import meta_model, original_class

    places: dict[str, tuple[StackedLayout, int]] = {}
    for path, module in meta_model(model_type).named_modules():
        if original_class(type(module)) in classes:
            layout = STACKED_LAYOUTS[type(module).__name__]
            rows = int(getattr(getattr(module, layout.child), layout.sizes[1]))
            places[".".join(path.split(".")[-2:])] = (layout, rows)
    out = []
    for place, (layout, rows) in sorted(places.items()):
        for role, name in zip(("gate", "up", "down"), layout.names, strict=True):
            ops: list[ConversionOperation] = [SplitRows(rows)]
            if role == "down":
                ops.append(Transpose(1, 2))
            ops.append(SplitModulelist(dim=0))
            prefix = f"{place}.{layout.child}"
            out.append(WeightConverter(f"{prefix}.{name}", [f"{prefix}.*.{name}.weight"], ops))
    return tuple(out)


def clamped_swiglu(settings: Any, gate_up: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's gated activation on an interleaved ``gate_up`` output (as its 4.57 forward has it
    inline, with the experts' ``alpha`` and ``limit``)."""
    limit, alpha = float(settings.limit), float(settings.alpha)
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return (up + 1) * glu


#: Inline activations by name (see :attr:`ExpertLayout.activation`).
ACTIVATIONS = {"clamped_swiglu": clamped_swiglu}


def layout_of(experts_class: type | nn.Module) -> ExpertLayout | None:
    """The layout of ``experts_class`` (declared in :data:`LAYOUTS`, else read off its flags).

    ``None`` when the class has no flags and no entry: nothing says how its tensors are laid out.
    Instances carry the flags, so ``experts_class`` may also be a built module.
    """
    name = experts_class.__name__ if isinstance(experts_class, type) else type(experts_class).__name__
    if name in LAYOUTS:
        return LAYOUTS[name]
    if not hasattr(experts_class, "is_transposed"):
        return None
    return ExpertLayout(
        transposed=bool(experts_class.is_transposed),
        interleaved=not getattr(experts_class, "is_concatenated", True),
        bias=bool(getattr(experts_class, "has_bias", False)),
    )


def _halves(tensor: torch.Tensor, layout: ExpertLayout, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    if layout.interleaved:
        first, second = tensor.unflatten(dim, (-1, 2)).unbind(dim + 1)  # type: ignore[no-untyped-call]
        return first, second
    first, second = tensor.chunk(2, dim=dim)
    return first, second


def split_fused(experts: nn.Module, layout: ExpertLayout) -> dict[str, torch.Tensor]:
    """Per-role stacks of a built experts module, each ``(E, out, in)`` (biases ``(E, out)``).

    Keys: ``gate``, ``up``, ``down`` and, with biases, ``gate_bias``, ``up_bias``, ``down_bias``.
    """
    gate_up, down = _tensor(experts, "gate_up_proj"), _tensor(experts, "down_proj")
    if layout.transposed:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    gate, up = _halves(gate_up, layout, 1)
    out = {"gate": gate, "up": up, "down": down}
    if layout.bias:
        out["gate_bias"], out["up_bias"] = _halves(_tensor(experts, "gate_up_proj_bias"), layout, 1)
        out["down_bias"] = _tensor(experts, "down_proj_bias")
    return out


def _tensor(module: nn.Module, name: str) -> torch.Tensor:
    value = getattr(module, name)
    assert isinstance(value, torch.Tensor)  # the layout check found a tensor there before
    return value


@dataclass(frozen=True)
class Deinterleave(ConversionOperation):
    """Split one group along ``dim`` into its even and odd entries (two groups); reverse interleaves.

    GPT-OSS stores gate and up columns alternately: ``[g0, u0, g1, u1, ...]``.

    Example:
        >>> import torch
        >>> parts = Deinterleave(dim=0).convert([[torch.arange(6.0)]], ConversionContext(num_targets=2))
        >>> [p[0].tolist() for p in parts]
        [[0.0, 2.0, 4.0], [1.0, 3.0, 5.0]]
        >>> Deinterleave(dim=0).reverse(parts, ConversionContext())[0][0].tolist()
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    """

    dim: int = 0

    def convert(self, tensors: TensorGroups, context: ConversionContext) -> TensorGroups:
        if len(tensors) != 1:
            raise ConversionError(f"`Deinterleave` splits one source; received {len(tensors)} groups.")
        even: list[torch.Tensor] = []
        odd: list[torch.Tensor] = []
        for tensor in tensors[0]:
            if not -tensor.dim() <= self.dim < tensor.dim() or tensor.shape[self.dim] % 2:
                raise ConversionError(
                    f"`Deinterleave(dim={self.dim})` needs an even size along dim {self.dim}; received a tensor "
                    f"of shape {tuple(tensor.shape)}."
                )
            first, second = tensor.unflatten(self.dim, (-1, 2)).unbind(  # type: ignore[no-untyped-call]
                self.dim % tensor.dim() + 1
            )
            even.append(first)
            odd.append(second)
        return [even, odd]

    def reverse(self, tensors: TensorGroups, context: ConversionContext) -> TensorGroups:
        if len(tensors) != 2 or len(tensors[0]) != len(tensors[1]):
            raise ConversionError("`Deinterleave.reverse` expects two groups of the same length.")
        out = []
        for first, second in zip(*tensors, strict=True):
            dim = self.dim % first.dim()
            out.append(torch.stack([first, second], dim=dim + 1).flatten(dim, dim + 1))
        return [out]


def fused_operations(layout: ExpertLayout, role: str) -> list[ConversionOperation]:
    """Operations from a fused checkpoint tensor to per-expert tensors (``*`` targets).

    ``role`` is ``"gate_up"`` (two targets), ``"down"``, ``"gate_up_bias"`` (two targets) or
    ``"down_bias"``. Each operation has an exact reverse, so a save writes the fused tensor back.
    """
    ops: list[ConversionOperation] = []
    if layout.transposed and role in ("gate_up", "down"):
        ops.append(Transpose(1, 2))
    if role in ("gate_up", "gate_up_bias"):
        ops.append(Deinterleave(dim=1) if layout.interleaved else Chunk(dim=1, chunks=2))
    ops.append(SplitModulelist(dim=0))
    return ops


def _roles(layout: ExpertLayout, names: tuple[str, str, str]) -> list[tuple[str, list[str], str]]:
    """``(model-side fused name, per-expert target leaves, role)`` for each fused tensor."""
    gate, up, down = names
    roles = [
        ("gate_up_proj", [f"{gate}.weight", f"{up}.weight"], "gate_up"),
        ("down_proj", [f"{down}.weight"], "down"),
    ]
    if layout.bias:
        roles += [
            ("gate_up_proj_bias", [f"{gate}.bias", f"{up}.bias"], "gate_up_bias"),
            ("down_proj_bias", [f"{down}.bias"], "down_bias"),
        ]
    return roles


def _checkpoint_name(model_side: str, renamings: list[tuple[str, str]]) -> str:
    """The checkpoint key pattern transformers renames to ``model_side`` (GraniteMoE's
    ``block_sparse_moe.input_linear.weight`` for ``block_sparse_moe.experts.gate_up_proj``)."""
    from modelgraft.grafts._common import _contains

    name = model_side
    for old, new in renamings:
        if name == new or name.endswith("." + new):
            return name[: len(name) - len(new)] + old
        if _contains(name, new):
            name = name.replace(new, old, 1)
    return name


def fused_checkpoint_converters(
    model_type: str, classes: dict[type[nn.Module], set[str]], names: tuple[str, str, str] = DEFAULT_NAMES
) -> tuple[WeightConverter, ...]:
    """Converters from the fused experts transformers writes to per-expert ``nn.Linear`` weights.

    One converter per fused tensor of each place the experts sit (``mlp.experts``,
    ``feed_forward.experts``, ...), reading the checkpoint key transformers itself reads (through
    its renamings) and splitting it with exactly reversible operations.
    """
    from modelgraft.conversion import WeightConverter
    from modelgraft.grafts._common import _builtin_conversions, meta_model, original_class

    renamings = [
        (c.source_patterns[0], c.target_patterns[0])
        for c in _builtin_conversions(model_type)
        if type(c).__name__ == "WeightRenaming" and len(c.source_patterns) == len(c.target_patterns) == 1
    ]
    places: dict[str, ExpertLayout] = {}
    for path, module in meta_model(model_type).named_modules():
        if original_class(type(module)) in classes:
            layout = layout_of(module)
            assert layout is not None  # the graft's family gate refused classes without one
            places[".".join(path.split(".")[-2:])] = layout
    out = []
    for place, layout in sorted(places.items()):
        for fused, leaves, role in _roles(layout, names):
            source = _checkpoint_name(f"{place}.{fused}", renamings)
            targets = [f"{place}.*.{leaf}" for leaf in leaves]
            out.append(WeightConverter(source, targets, fused_operations(layout, role)))
    return tuple(out)
