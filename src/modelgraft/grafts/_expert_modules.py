"""The per-expert ``nn.Linear`` modules that replace fused experts, and what experts must be to become them.

:class:`LinearExpert` is one expert (three ``nn.Linear`` layers); :class:`LinearExpertsBase` is the
experts module as a ``ModuleList`` of them, routed by transformers' ``experts_implementation``
(:mod:`modelgraft.grafts._grouped_experts`); :class:`LinearStackedExpertsBase` keeps 2D-stacked
experts (DBRX) and puts a :class:`StackedExpertListBase` in the place of the child holding the
stacks. :func:`layout_problem` and :func:`stacked_problem` say why an experts module cannot become
these (``None`` when it can). The graft that chooses families, builds the classes and their
checkpoint conversions is :mod:`modelgraft.grafts.linear_experts`.

Example:
    >>> import torch
    >>> expert = LinearExpert(4, 2, torch.nn.SiLU())
    >>> expert.gate_proj, expert(torch.ones(3, 4)).shape
    (Linear(in_features=4, out_features=2, bias=False), torch.Size([3, 4]))
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.nn.modules import module as _torch_module

from modelgraft import _compat
from modelgraft.errors import RoutingError, UnsupportedFamilyError
from modelgraft.grafts import _grouped_experts as _grouped
from modelgraft.grafts import _peft
from modelgraft.grafts._expert_layouts import (
    ACTIVATIONS,
    DEFAULT_NAMES,
    STACKED_LAYOUTS,
    ExpertLayout,
    StackedLayout,
    layout_of,
    split_fused,
)

__all__ = [
    "DEFAULT_NAMES",
    "FamilyGate",
    "LinearExpert",
    "LinearExpertsBase",
    "LinearStackedExpertsBase",
    "StackedExpertListBase",
    "layout_problem",
    "stacked_problem",
]


class LinearExpert(nn.Module):
    """One expert: ``down(act(gate(x)) * up(x))`` with three ``nn.Linear`` layers.

    Args:
        hidden: model width.
        intermediate: expert width.
        act_fn: the activation of the original experts (a module, or a function such as ``F.silu``).
        names: attribute names of the gate, up and down layers.
        bias: whether the three layers have biases (GPT-OSS).
        gate: the family's own gated activation (see :class:`FamilyGate`), used instead of
            ``act_fn(gate) * up`` when the family overrides ``_apply_gate``.
    """

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        act_fn: Callable[[torch.Tensor], torch.Tensor] | None,
        *,
        names: tuple[str, str, str] = DEFAULT_NAMES,
        bias: bool = False,
        gate: FamilyGate | None = None,
    ) -> None:
        super().__init__()
        gate_name, up, down = names
        setattr(self, gate_name, nn.Linear(hidden, intermediate, bias=bias))
        setattr(self, up, nn.Linear(hidden, intermediate, bias=bias))
        setattr(self, down, nn.Linear(intermediate, hidden, bias=bias))
        self.act_fn = act_fn
        self._names = names
        self._gate = gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self._names)
        out: torch.Tensor
        if self._gate is not None:
            out = down(self._gate(gate(x), up(x)))
        else:
            assert self.act_fn is not None  # built with either an activation or a family gate
            out = down(self.act_fn(gate(x)) * up(x))
        return out


class FamilyGate:
    """A family's own ``_apply_gate``, called on separate gate and up outputs.

    The outputs are laid out as the family's fused ``gate_up`` output (concatenated or
    interleaved, a pure copy) and handed to its ``_apply_gate`` with the scalar settings and
    parameter-free modules of the original experts (``alpha``, ``limit``, ``act_fn``), so the
    activation is the family's code, not a re-implementation.
    """

    def __init__(
        self,
        function: Callable[[Any, torch.Tensor], torch.Tensor],
        settings: dict[str, object],
        interleaved: bool,
    ) -> None:
        self.function = function
        self.settings = types.SimpleNamespace(**settings)
        self.interleaved = interleaved

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.interleaved:
            joined = torch.stack([gate, up], dim=-1).flatten(-2)
        else:
            joined = torch.cat([gate, up], dim=-1)
        return self.function(self.settings, joined)


def _default_apply_gate() -> object:
    return _compat.default_apply_gate()  # None on older transformers: only the default gate exists


def _family_gate(experts: nn.Module, layout: ExpertLayout) -> FamilyGate | None:
    """The family's own gated activation, or ``None`` where it is transformers' default."""
    default_gate = _default_apply_gate()
    function = getattr(type(experts), "_apply_gate", None)
    if function is None and layout.activation is not None:
        function = ACTIVATIONS[layout.activation]
    if function is None or function is default_gate:
        return None
    settings: dict[str, object] = {
        k: v for k, v in vars(experts).items() if not k.startswith("_") and not isinstance(v, torch.Tensor)
    }
    for name, child in experts.named_children():
        settings[name] = child
    return FamilyGate(function, settings, layout.interleaved)


#: Experts classes refused by name, whatever the release declares about their storage: the reason.
#: LongCat-Flash's router also picks zero (identity) experts beyond the routed ones, which its block
#: (5.25 on) or its experts module (earlier) handles itself; per-expert layers are not proven for it.
_REFUSED_CLASSES = {
    "LongcatFlashExperts": "its router also selects zero (identity) experts past the routed ones, "
    "which the per-expert layers are not proven exact for",
}


def layout_problem(experts: nn.Module) -> str | None:
    """Why ``experts`` cannot become per-expert linear layers (``None`` when it can)."""
    refused = _REFUSED_CLASSES.get(type(experts).__name__)
    if refused is not None:
        return refused
    layout = layout_of(experts)
    gate_up = getattr(experts, "gate_up_proj", None)
    down = getattr(experts, "down_proj", None)
    if not isinstance(gate_up, nn.Parameter) or not isinstance(down, nn.Parameter):
        return "it has no 3D `gate_up_proj` and `down_proj` parameters"
    if gate_up.dim() != 3 or down.dim() != 3:
        return "its `gate_up_proj`/`down_proj` are not 3D"
    if layout is None:
        return (
            "its storage is not declared (no `use_experts_implementation` flags and no entry in "
            "`modelgraft.grafts._expert_layouts.LAYOUTS`)"
        )
    if not getattr(experts, "has_gate", True):
        return "`has_gate` is False (an expert is `down(act(up(x)))`, not a gated layer)"
    if getattr(experts, "has_post_expert_norm", False):
        return "`has_post_expert_norm` is True (each expert ends in a norm, not a linear layer)"
    if layout.bias:
        for name in ("gate_up_proj_bias", "down_proj_bias"):
            if not isinstance(getattr(experts, name, None), nn.Parameter):
                return f"it declares biases but has no `{name}` parameter"
    parts = split_fused(experts, layout)
    num, inter, hidden = parts["gate"].shape
    if tuple(parts["down"].shape) != (num, hidden, inter) or parts["up"].shape != parts["gate"].shape:
        return (
            f"shapes {tuple(gate_up.shape)} and {tuple(down.shape)} do not fit the declared layout "
            f"{layout} of (E, 2I, H) and (E, H, I)"
        )
    gate = _family_gate(experts, layout)
    if gate is None and not _is_activation(getattr(experts, "act_fn", None)):
        return "it has no `act_fn` (an activation module or function)"
    if gate is not None:
        try:
            with torch.device("meta"):
                probe = torch.empty(1, inter)
                gate(probe, probe)
        except Exception as exc:  # the family's activation reads something a copy cannot carry
            return f"its `_apply_gate` cannot run on separate gate/up outputs ({type(exc).__name__}: {exc})"
    return None


def _is_activation(act_fn: object) -> bool:
    """Whether ``act_fn`` is an activation the experts apply to the gate output.

    Most families keep a module (``ACT2FN[...]``); LFM2-MoE keeps the function ``F.silu``. Either is
    called the same way, so the per-expert layers share the very object the plain experts call.
    """
    return isinstance(act_fn, nn.Module) or isinstance(
        act_fn, (types.FunctionType, types.BuiltinFunctionType)
    )


class LinearExpertsBase(nn.ModuleList):
    """Experts as a ``ModuleList`` of :class:`LinearExpert`; subclassed per original class."""

    _modelgraft_original: type[nn.Module]
    _expert_names: tuple[str, str, str]

    def __init__(self, config: object, *args: object, **kwargs: object) -> None:
        super().__init__()
        original = self._modelgraft_original
        # The original class knows its sizes and activation; a meta instance costs no memory.
        with torch.device("meta"):
            probe = original(config, *args, **kwargs)
        problem = layout_problem(probe)
        if problem is not None:
            raise UnsupportedFamilyError(
                f"`{original.__name__}` cannot become per-expert `nn.Linear` layers: {problem}. Expected "
                "3D `gate_up_proj` and `down_proj` in the standard layout (E, 2I, H) and (E, H, I) or one "
                "declared in `modelgraft.grafts._expert_layouts`."
            )
        self._setup(probe)

    def _setup(self, probe: nn.Module) -> None:
        layout = layout_of(probe)
        assert layout is not None  # layout_problem refused experts without one before
        self._layout = layout  # PEFT's fused layout of these experts (grafts._peft_experts) reads it
        num, inter, hidden = split_fused(probe, layout)["gate"].shape
        gate = _family_gate(probe, layout)
        act_fn = getattr(probe, "act_fn", None) if gate is None else None
        # transformers' kernel choice lives on the config (`experts_implementation=`), as for the
        # fused experts: it is honoured or refused here, and again at every forward. Experts
        # without a config of their own (Llama 4, 4.57) have no kernel choice in transformers.
        self._build(num, inter, hidden, act_fn, gate, layout, probe.__dict__.get("config"))

    def _build(
        self,
        num: int,
        inter: int,
        hidden: int,
        act_fn: Callable[[torch.Tensor], torch.Tensor] | None,
        gate: FamilyGate | None,
        layout: ExpertLayout,
        config: object,
    ) -> None:
        """Fill the list with ``num`` experts ``hidden -> inter -> hidden``, run as ``layout`` says."""
        _peft.ensure_installed()  # PEFT must keep the expert names as module targets here
        self.num_experts = num
        self.hidden_dim = hidden
        self.intermediate_dim = inter
        self._dense_call = layout.call == "dense"
        self._weights_by_expert = layout.call == "routed_by_expert"
        self._bias = layout.bias
        self.config = config
        _grouped.check_implementation(self)
        for _ in range(num):
            self.append(
                LinearExpert(hidden, inter, act_fn, names=self._expert_names, bias=layout.bias, gate=gate)
            )

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor | None = None,
        top_k_weights: torch.Tensor | None = None,
        router_indices: torch.Tensor | None = None,
        routing_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Route each token to its ``top_k`` experts and sum their weighted outputs.

        Args:
            hidden_states: ``(num_tokens, hidden)``.
            top_k_index: ``(num_tokens, top_k)`` expert ids; ids outside ``[0, num_experts)``
                (the expert-parallel sentinel) are skipped, as in transformers.
            top_k_weights: ``(num_tokens, top_k)`` routing weights.

        ``router_indices``/``routing_weights`` are GPT-OSS's names for the same two (it passes them
        by keyword on transformers 4.57). Routed experts run by the configured
        ``experts_implementation`` (``eager``, or ``grouped_mm``: a grouped matmul where every
        expert layer is a plain ``nn.Linear``, else the sorted-token loop). Llama 4's experts take
        no routing: ``hidden_states`` is ``(num_experts * tokens, hidden)``, already scaled by the
        router, and expert ``e`` runs on block ``e``, as the plain experts do.

        Raises:
            RoutingError: a routed call without the router's ids or weights.
            ExpertsImplementationError: the config asks for a kernel per-expert layers cannot run.
        """
        if self._dense_call:
            blocks = hidden_states.view(self.num_experts, -1, self.hidden_dim)
            return torch.cat([expert(block) for expert, block in zip(self, blocks, strict=True)])
        top_k_index = router_indices if top_k_index is None else top_k_index
        top_k_weights = routing_weights if top_k_weights is None else top_k_weights
        if top_k_index is None or top_k_weights is None:
            raise RoutingError(
                f"`{type(self).__name__}.forward` needs `top_k_index` and `top_k_weights` (the router's "
                "choice); received `None`."
            )
        if self._weights_by_expert:
            # GPT-OSS on 4.57: (batch, seq, hidden) in and out, and the weights scattered to
            # (tokens, num_experts); each pair's weight is read back at its expert id (exactly).
            # An id outside [0, num_experts) (its masking index) reads a clamped place; every path
            # skips such a pair, so that weight is never used.
            shape = hidden_states.shape
            flat = hidden_states.reshape(-1, self.hidden_dim)
            ids = top_k_index.reshape(flat.shape[0], -1)
            weights = top_k_weights.reshape(flat.shape[0], -1).gather(1, ids.clamp(0, self.num_experts - 1))
            return self._route(flat, ids, weights).view(shape)
        return self._route(hidden_states, top_k_index, top_k_weights)

    def _route(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """The routed experts' output by the configured ``experts_implementation``."""
        implementation = _grouped.check_implementation(self)
        if implementation == "eager":
            return _grouped.eager_forward(
                self._run, self.num_experts, hidden_states, top_k_index, top_k_weights
            )
        layers = self._plain_layers()
        if layers is not None:
            first = self[0]
            assert isinstance(first, LinearExpert)  # _plain_layers checked every expert's type
            out = _grouped.grouped_linear_forward(
                layers, first.act_fn, hidden_states, top_k_index, top_k_weights, gate=first._gate
            )
            if out is not None:
                return out
        return _grouped.sorted_forward(self._run, self.num_experts, hidden_states, top_k_index, top_k_weights)

    def _run(self, expert_id: int, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self[expert_id](tokens)
        return out

    def _plain_layers(self) -> list[tuple[nn.Linear, nn.Linear, nn.Linear]] | None:
        """Each expert's (gate, up, down) when the grouped matmul computes exactly what their own
        forwards do, else ``None``.

        Stacking the weights bypasses every module call, so it is sound only for untouched layers:
        each expert exactly a :class:`LinearExpert` and each layer exactly an ``nn.Linear`` (see
        :func:`_plain_linear`), no module hooks anywhere (global, on the expert or on the layer), and
        one activation (``act_fn`` or the family's gate) and one dtype and device for every expert.
        Anything else (a LoRA wrapper, a quantizer's instance ``forward`` or tensor subclass, an
        observer's hook) is called as a module, so that its own computation runs.
        """
        if _global_hooks():
            return None
        if not len(self):
            return None
        first = self[0]
        if not isinstance(first, LinearExpert):
            return None
        act_fn, gate = first.act_fn, first._gate
        expected = frozenset(self._expert_names)
        reference: tuple[torch.dtype, torch.device] | None = None
        layers = []
        for expert in self:
            if (
                type(expert) is not LinearExpert
                or expert.act_fn is not act_fn
                or expert._gate is not gate
                or not _untouched(expert)
                or expert._parameters
                or expert._buffers
            ):
                return None
            found = tuple(expert._modules.get(name) for name in self._expert_names)
            if not all(_plain_linear(layer, self._bias) for layer in found):
                return None
            for layer in cast("tuple[nn.Linear, nn.Linear, nn.Linear]", found):
                for tensor in (layer.weight, layer.bias):
                    if tensor is None:
                        continue
                    if reference is None:
                        reference = (tensor.dtype, tensor.device)
                    elif (tensor.dtype, tensor.device) != reference:
                        return None  # stacking would promote or fail where each layer computes on its own
            # Children beyond the three layers and the activation are not called by the expert's
            # forward, but a changed expert is not the one the fast path was written for.
            if set(expert._modules) - expected - {"act_fn"}:
                return None
            layers.append(found)
        return layers  # type: ignore[return-value]


#: ``nn.Linear.forward`` as torch defines it, to notice a class-level replacement (a toolkit
#: patching ``nn.Linear`` itself): the grouped matmul computes only what this forward computes.
_LINEAR_FORWARD = nn.Linear.forward
#: The weight types whose ``F.linear`` is the plain matmul that ``torch.stack`` + ``grouped_mm``
#: reproduce; a tensor subclass (torchao's ``Int8Tensor``, a fake-quant wrapper) computes its own.
_PLAIN_TENSORS = (nn.Parameter, torch.Tensor)


def _global_hooks() -> bool:
    """Whether a hook registered for every module is active (it would see no expert layer call)."""
    return bool(
        _torch_module._global_forward_hooks
        or _torch_module._global_forward_pre_hooks
        or _torch_module._global_backward_hooks
        or _torch_module._global_backward_pre_hooks
    )


def _untouched(module: nn.Module) -> bool:
    """No instance ``forward`` and no forward or backward hooks of its own."""
    return not (
        "forward" in module.__dict__
        or module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
    )


def _plain_linear(layer: nn.Module | None, bias: bool) -> bool:
    """Whether ``layer`` computes exactly ``F.linear(x, weight, bias)`` with plain tensors.

    Exactly ``nn.Linear`` with torch's own ``forward`` (no subclass, no parametrization, no instance
    ``forward``, no hooks), no children, exactly the parameters ``weight`` (and ``bias`` as the
    experts were built) of exact type ``nn.Parameter``/``torch.Tensor``, and no buffers (a
    quantizer's scales or zero points live there).
    """
    if type(layer) is not nn.Linear or not _untouched(layer) or type(layer).forward is not _LINEAR_FORWARD:
        return False
    if layer._modules or layer._buffers:
        return False
    if set(layer._parameters) != {"weight", "bias"}:
        return False
    weight, layer_bias = layer._parameters["weight"], layer._parameters["bias"]
    if weight is None or type(weight) not in _PLAIN_TENSORS or weight.dim() != 2:
        return False
    if (layer_bias is not None) != bias:
        return False
    return layer_bias is None or (type(layer_bias) in _PLAIN_TENSORS and layer_bias.dim() == 1)


def stacked_problem(experts: nn.Module, layout: StackedLayout) -> str | None:
    """Why 2D-stacked ``experts`` cannot become per-expert linear layers (``None`` when they can)."""
    child = getattr(experts, layout.child, None)
    if not isinstance(child, nn.Module):
        return f"it has no child module `{layout.child}` holding the expert stacks"
    sizes = [getattr(child, name, None) for name in layout.sizes]
    if not all(isinstance(size, int) and size > 0 for size in sizes):
        return f"`{layout.child}` does not give its sizes as {', '.join(f'`{n}`' for n in layout.sizes)}"
    num, inter, hidden = cast("list[int]", sizes)
    for name in layout.names:
        stack = getattr(child, name, None)
        if not isinstance(stack, nn.Parameter) or tuple(stack.shape) != (num * inter, hidden):
            shape = tuple(stack.shape) if isinstance(stack, torch.Tensor) else None
            return (
                f"`{layout.child}.{name}` is {shape}, not the declared (E * I, H) = ({num * inter}, {hidden})"
            )
    if not _is_activation(getattr(child, layout.activation, None)):
        return f"`{layout.child}.{layout.activation}` is not an activation module or function"
    return None


class StackedExpertListBase(LinearExpertsBase):
    """The per-expert layers of 2D-stacked experts, in the place of the child holding the stacks.

    Named as the stacks (DBRX: ``mlp.3.w1``), so PEFT and the checkpoint conversion see the plain
    names with an expert index; it routes as :class:`LinearExpertsBase` does.
    """

    def __init__(  # the stacked experts build it from their probe, not from a config
        self,
        num: int,
        inter: int,
        hidden: int,
        act_fn: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        nn.ModuleList.__init__(self)
        # DBRX's experts have no config of their own, hence no kernel choice in transformers:
        # the grouped path runs (per-expert sums as exact as the plain loop's to fp32 rounding).
        self._build(num, inter, hidden, act_fn, None, ExpertLayout(), None)


class LinearStackedExpertsBase(nn.Module):
    """2D-stacked experts (:class:`StackedLayout`) with their child replaced by per-expert layers.

    The forward takes and returns what the plain experts do: ``(batch, seq, H)`` hidden states and
    the router's choice in the plain call's order (``layout.call``).
    """

    _modelgraft_original: type[nn.Module]
    #: The per-expert list class that takes the child's place (set by the class factory).
    _list_class: type[StackedExpertListBase]

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__()
        original = self._modelgraft_original
        layout = STACKED_LAYOUTS[original.__name__]
        with torch.device("meta"):
            probe = original(*args, **kwargs)
        problem = stacked_problem(probe, layout)
        if problem is not None:
            raise UnsupportedFamilyError(
                f"`{original.__name__}` cannot become per-expert `nn.Linear` layers: {problem}."
            )
        child = getattr(probe, layout.child)
        num, inter, hidden = (int(getattr(child, name)) for name in layout.sizes)
        self.num_experts, self.ffn_hidden_size, self.hidden_size = num, inter, hidden
        self._scores_first = layout.call == "scores_first"
        experts_list = self._list_class(num, inter, hidden, getattr(child, layout.activation))
        setattr(self, layout.child, experts_list)
        self._child = layout.child

    def forward(
        self, hidden_states: torch.Tensor, *routing: torch.Tensor, **named: torch.Tensor
    ) -> torch.Tensor:
        """The weighted sum of each token's top-k experts, shaped as ``hidden_states``.

        Called as the plain experts are: ``(hidden_states, top_k_index, top_k_weights)`` on
        transformers 5; ``(x, weights, top_weights, top_experts)`` on 4.57 (``weights``, the
        router's full scores, unused there as here).

        Raises:
            RoutingError: the router's ids or weights are missing.
        """
        params = (
            ("weights", "top_weights", "top_experts")
            if self._scores_first
            else ("top_k_index", "top_k_weights")
        )
        if len(routing) > len(params) or set(named) - set(params[len(routing) :]):
            raise RoutingError(
                f"`{type(self).__name__}.forward` takes `hidden_states` and {', '.join(f'`{p}`' for p in params)}; "
                f"received {len(routing)} more positional and {sorted(named)} by name."
            )
        given = {**dict(zip(params, routing, strict=False)), **named}
        ids = given.get("top_experts" if self._scores_first else "top_k_index")
        weights = given.get("top_weights" if self._scores_first else "top_k_weights")
        if ids is None or weights is None:
            raise RoutingError(
                f"`{type(self).__name__}.forward` needs the router's expert ids and weights; received `None`."
            )
        experts_list = getattr(self, self._child)
        assert isinstance(experts_list, StackedExpertListBase)  # built so in __init__
        flat = hidden_states.reshape(-1, self.hidden_size)
        out = experts_list._route(flat, ids.reshape(flat.shape[0], -1), weights.reshape(flat.shape[0], -1))
        return out.view(hidden_states.shape)
