"""Per-expert ``nn.Linear`` experts for the fused-expert MoE families of transformers 5.

transformers 5 stores the experts of Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3, ... as two
3D parameters: ``gate_up_proj`` of shape ``(num_experts, 2 * intermediate, hidden)`` (gate rows
first, then up rows) and ``down_proj`` of shape ``(num_experts, hidden, intermediate)``. A
quantizer that only handles ``nn.Linear`` cannot touch them. :func:`linear_experts_class` builds a
replacement that is an ``nn.ModuleList`` of :class:`LinearExpert` modules, one per expert, each with
three ``nn.Linear`` layers, and the same forward signature
``(hidden_states, top_k_index, top_k_weights)``.

The per-expert layers are named as in the family's checkpoints (``gate_proj``/``up_proj``/
``down_proj``; ``w1``/``w3``/``w2`` for Mixtral-style checkpoints), which transformers 5 still
writes per expert. Loading therefore needs no tensor conversion at all: the graft's conversions
are transformers' own for that model type minus its expert merges (renamings such as
``block_sparse_moe`` -> ``mlp`` stay).

Example:
    >>> from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeExperts
    >>> from modelgraft.testing import tiny_config
    >>> experts = linear_experts_class(Qwen2MoeExperts)(tiny_config("qwen2_moe"))
    >>> len(experts), experts[0].gate_proj
    (4, Linear(in_features=64, out_features=32, bias=False))
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn
from torch.nn.modules import module as _torch_module

from modelgraft import _compat
from modelgraft._families import LINEAR_EXPERTS, covered_by
from modelgraft._forksafe import ForkSafeLock
from modelgraft.grafts import _grouped_experts as _grouped
from modelgraft.grafts import _peft
from modelgraft.grafts._bundle import (
    Graft,
    UnsupportedFamilyError,
    _Part,
    builtin_expert_names,
    find_modules,
    original_class,
)
from modelgraft.grafts._grouped_experts import ExpertsImplementationError
from modelgraft.grafts._peft import ExpertsAdapterError
from modelgraft.grafts._pickling import RECIPE_ATTR, GraftedClass

__all__ = [
    "LINEAR_EXPERTS_FAMILIES",
    "ExpertsAdapterError",
    "ExpertsImplementationError",
    "LinearExpert",
    "linear_experts",
    "linear_experts_class",
]

DEFAULT_NAMES = ("gate_proj", "up_proj", "down_proj")

#: Model types :func:`linear_experts` covers by default (each one tested).
LINEAR_EXPERTS_FAMILIES: tuple[str, ...] = covered_by(LINEAR_EXPERTS)


class LinearExpert(nn.Module):
    """One expert: ``down(act(gate(x)) * up(x))`` with three bias-free ``nn.Linear`` layers.

    Args:
        hidden: model width.
        intermediate: expert width.
        act_fn: the activation module of the original experts.
        names: attribute names of the gate, up and down layers.
    """

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        act_fn: nn.Module,
        names: tuple[str, str, str] = DEFAULT_NAMES,
    ) -> None:
        super().__init__()
        gate, up, down = names
        setattr(self, gate, nn.Linear(hidden, intermediate, bias=False))
        setattr(self, up, nn.Linear(hidden, intermediate, bias=False))
        setattr(self, down, nn.Linear(intermediate, hidden, bias=False))
        self.act_fn = act_fn
        self._names = names

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self._names)
        out: torch.Tensor = down(self.act_fn(gate(x)) * up(x))
        return out


def _default_apply_gate() -> object:
    return _compat.default_apply_gate()  # None on older transformers: only the default gate exists


def _layout_problem(experts: nn.Module) -> str | None:
    """Why ``experts`` is not the standard fused layout (``None`` when it is)."""
    gate_up = getattr(experts, "gate_up_proj", None)
    down = getattr(experts, "down_proj", None)
    if not isinstance(gate_up, nn.Parameter) or not isinstance(down, nn.Parameter):
        return "it has no 3D `gate_up_proj` and `down_proj` parameters"
    if gate_up.dim() != 3 or down.dim() != 3:
        return "its `gate_up_proj`/`down_proj` are not 3D"
    for flag, standard in (
        ("has_gate", True),
        ("has_bias", False),
        ("is_transposed", False),
        ("is_concatenated", True),
        ("has_post_expert_norm", False),
    ):
        if getattr(experts, flag, standard) != standard:
            return f"`{flag}` is {not standard}"
    default_gate = _default_apply_gate()
    gate_fn = getattr(type(experts), "_apply_gate", default_gate)
    if default_gate is not None and gate_fn is not default_gate:
        return "it overrides `_apply_gate` (a custom gated activation)"
    num, two_inter, hidden = gate_up.shape
    if two_inter % 2 or tuple(down.shape) != (num, hidden, two_inter // 2):
        return f"shapes {tuple(gate_up.shape)} and {tuple(down.shape)} do not fit (E, 2I, H) and (E, H, I)"
    if not isinstance(getattr(experts, "act_fn", None), nn.Module):
        return "it has no `act_fn` module"
    return None


class _LinearExpertsBase(nn.ModuleList):
    """Experts as a ``ModuleList`` of :class:`LinearExpert`; subclassed per original class."""

    _modelgraft_original: type[nn.Module]
    _expert_names: tuple[str, str, str]

    def __init__(self, config: object, *args: object, **kwargs: object) -> None:
        super().__init__()
        original = self._modelgraft_original
        # The original class knows its sizes and activation; a meta instance costs no memory.
        with torch.device("meta"):
            probe = original(config, *args, **kwargs)
        problem = _layout_problem(probe)
        if problem is not None:
            raise UnsupportedFamilyError(
                f"`{original.__name__}` cannot become per-expert `nn.Linear` layers: {problem}. Expected "
                "the standard layout `gate_up_proj` (E, 2I, H) and `down_proj` (E, H, I) without bias."
            )
        self._setup(probe)

    def _setup(self, probe: nn.Module) -> None:
        _peft.ensure_installed()  # PEFT must keep the expert names as module targets here
        gate_up = probe.gate_up_proj
        assert isinstance(gate_up, torch.Tensor)  # _layout_problem checked it before
        num, two_inter, hidden = gate_up.shape
        self.num_experts = num
        self.hidden_dim = hidden
        self.intermediate_dim = two_inter // 2
        # transformers' kernel choice lives on the config (`experts_implementation=`), as for the
        # fused experts: it is honoured or refused here, and again at every forward.
        self.config = getattr(probe, "config", None)
        _grouped.check_implementation(self)
        act_fn = probe.act_fn
        assert isinstance(act_fn, nn.Module)  # _layout_problem checked it before
        for _ in range(num):
            self.append(LinearExpert(hidden, two_inter // 2, act_fn, self._expert_names))

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """Route each token to its ``top_k`` experts and sum their weighted outputs.

        Args:
            hidden_states: ``(num_tokens, hidden)``.
            top_k_index: ``(num_tokens, top_k)`` expert ids; ids outside ``[0, num_experts)``
                (the expert-parallel sentinel) are skipped, as in transformers.
            top_k_weights: ``(num_tokens, top_k)`` routing weights.
        """
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
                layers, first.act_fn, hidden_states, top_k_index, top_k_weights
            )
            if out is not None:
                return out
        return _grouped.sorted_forward(self._run, self.num_experts, hidden_states, top_k_index, top_k_weights)

    def _run(self, expert_id: int, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self[expert_id](tokens)
        return out

    def _plain_layers(self) -> list[tuple[nn.Linear, nn.Linear, nn.Linear]] | None:
        """Each expert's (gate, up, down) when all are untouched ``nn.Linear`` layers, else ``None``.

        Only then may their weights be stacked for a grouped matmul: a wrapped (LoRA), quantized
        or hooked layer must be called as a module, so that its own computation runs.
        """
        if _torch_module._global_forward_hooks or _torch_module._global_forward_pre_hooks:
            return None
        act_fn = self[0].act_fn if len(self) else None
        layers = []
        for expert in self:
            if type(expert) is not LinearExpert or expert.act_fn is not act_fn or _hooked(expert):
                return None
            found = tuple(expert._modules.get(name) for name in self._expert_names)
            if any(
                type(layer) is not nn.Linear or layer.bias is not None or _hooked(layer) for layer in found
            ):
                return None
            layers.append(found)
        return layers  # type: ignore[return-value]


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


_CLASSES: dict[tuple[type, tuple[str, ...]], type[nn.Module]] = {}
_CLASSES_LOCK = ForkSafeLock()


def linear_experts_class(
    experts_class: type[nn.Module], names: tuple[str, str, str] = DEFAULT_NAMES
) -> type[nn.Module]:
    """Return the per-expert ``nn.Linear`` replacement of ``experts_class`` (cached).

    Args:
        experts_class: a fused-experts class such as ``Qwen2MoeExperts`` or ``MixtralExperts``.
        names: names of each expert's gate, up and down layers (as in the family's checkpoints).
    """
    experts_class = original_class(experts_class)
    key = (experts_class, tuple(names))
    with _CLASSES_LOCK:
        found = _CLASSES.get(key)
        if found is None:
            name = f"Linear{experts_class.__name__}"
            found = cast(
                "type[nn.Module]",
                GraftedClass(
                    name,
                    (_LinearExpertsBase,),
                    {
                        "__qualname__": name,
                        "__doc__": f"`{experts_class.__name__}` as a `ModuleList` of per-expert `nn.Linear` layers.",
                        "_modelgraft_original": experts_class,
                        "_expert_names": tuple(names),
                        RECIPE_ATTR: (linear_experts_class, (experts_class, tuple(names))),
                    },
                ),
            )
            _CLASSES[key] = found
        return found


def _is_expert_list(module: nn.Module) -> bool:
    return isinstance(getattr(module, "experts", None), nn.ModuleList)


def _is_fused_experts(module: nn.Module) -> bool:
    return isinstance(getattr(module, "gate_up_proj", None), nn.Parameter) and _layout_problem(module) is None


def _part(model_type: str) -> _Part:
    if not _compat.FUSED_MOE_EXPERTS and find_modules(model_type, _is_expert_list):
        # transformers 4.57 already builds per-expert `nn.Linear` experts: nothing to replace.
        return _Part({})
    found = find_modules(model_type, _is_fused_experts)
    if not found:
        raise UnsupportedFamilyError(
            f"`{model_type}` has no experts with the standard fused layout; the per-expert graft cannot "
            f"apply. Families known to work: {', '.join(LINEAR_EXPERTS_FAMILIES)}."
        )
    names = builtin_expert_names(model_type)
    if names is None:
        raise UnsupportedFamilyError(
            f"`{model_type}` checkpoints are not stored per expert by transformers (no expert merge in its "
            "conversion mapping), so per-expert layers would not load from them."
        )
    mapping = {cls.__name__: linear_experts_class(cls, names) for cls in found}
    return _Part(mapping, (), drop_expert_merges=True)


def linear_experts(*model_types: str) -> Graft:
    """The per-expert ``nn.Linear`` graft for ``model_types`` (default: :data:`LINEAR_EXPERTS_FAMILIES`).

    Example:
        >>> graft = linear_experts("mixtral")
        >>> graft.mapping["MixtralExperts"].__name__, graft.conversions["mixtral"]
        ('LinearMixtralExperts', [WeightRenaming(['block_sparse_moe'] -> ['mlp'])])
    """
    return Graft.of("per-expert linear experts", model_types, LINEAR_EXPERTS_FAMILIES, _part)
