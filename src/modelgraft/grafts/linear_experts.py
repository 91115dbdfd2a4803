"""Per-expert ``nn.Linear`` experts for the fused-expert MoE families of transformers 5.

transformers 5 stores the experts of Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3, ... as two
3D parameters: ``gate_up_proj`` of shape ``(num_experts, 2 * intermediate, hidden)`` (gate rows
first, then up rows) and ``down_proj`` of shape ``(num_experts, hidden, intermediate)``. A
quantizer that only handles ``nn.Linear`` cannot touch them. :func:`linear_experts_class` builds a
replacement that is an ``nn.ModuleList`` of :class:`LinearExpert` modules, one per expert, each with
three ``nn.Linear`` layers, and the same forward signature
``(hidden_states, top_k_index, top_k_weights)``.

The per-expert layers are named as in the family's checkpoints (``gate_proj``/``up_proj``/
``down_proj``; ``w1``/``w3``/``w2`` for Mixtral-style checkpoints). Where transformers 5 still
writes experts per expert, loading needs no tensor conversion at all: the graft's conversions are
transformers' own for that model type minus its expert merges (renamings such as
``block_sparse_moe`` -> ``mlp`` stay). Families whose checkpoints hold the fused tensors, and
layouts other than the standard one (transposed, interleaved, biased, Llama 4's dense call; see
:mod:`modelgraft.grafts._expert_layouts`), get exactly reversible converters instead. DBRX keeps
its experts as 2D ``(E * I, H)`` stacks in a child ``mlp``: that child becomes the per-expert list
(``mlp.<i>.w1``/``v1``/``w2``), and the experts module keeps the plain call. The modules
themselves, and what experts must be to become them, are in :mod:`modelgraft.grafts._expert_modules`;
this module is the graft: which families, the classes per experts class, the conversions.

The experts run by transformers' ``experts_implementation`` (:mod:`modelgraft.grafts._grouped_experts`):
``grouped_mm`` and ``eager`` are honoured (biases and a family's own gate included), anything
else is refused. Experts whose plain class has no kernel choice (Llama 4's dense call; every
family on transformers 4.57) run as the plain ones do whatever the config says.

Example:
    >>> from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeExperts
    >>> from modelgraft.testing import tiny_config
    >>> experts = linear_experts_class(Qwen2MoeExperts)(tiny_config("qwen2_moe"))
    >>> len(experts), experts[0].gate_proj
    (4, Linear(in_features=64, out_features=32, bias=False))
"""

from __future__ import annotations

import functools
from typing import cast

from torch import nn

from modelgraft import _compat
from modelgraft._families import LINEAR_EXPERTS, covered_by
from modelgraft._forksafe import ForkSafeLock
from modelgraft.grafts._common import (
    Graft,
    UnsupportedFamilyError,
    _Part,
    builtin_expert_names,
    find_modules,
    meta_model,
    original_class,
)
from modelgraft.grafts._expert_layouts import (
    STACKED_LAYOUTS,
    ExpertLayout,
    fused_checkpoint_converters,
    layout_of,
    stacked_checkpoint_converters,
)
from modelgraft.grafts._expert_modules import (
    DEFAULT_NAMES,
    FamilyGate,
    LinearExpert,
    LinearExpertsBase,
    LinearStackedExpertsBase,
    StackedExpertListBase,
    layout_problem,
    stacked_problem,
)
from modelgraft.grafts._grouped_experts import ExpertsImplementationError
from modelgraft.grafts._peft import ExpertsAdapterError
from modelgraft.grafts._pickling import RECIPE_ATTR, GraftedClass

__all__ = [
    "LINEAR_EXPERTS_FAMILIES",
    "ExpertsAdapterError",
    "ExpertsImplementationError",
    "FamilyGate",
    "LinearExpert",
    "linear_experts",
    "linear_experts_class",
]

#: Model types :func:`linear_experts` covers by default on the installed transformers (each one
#: tested): the family table's rows for this graft. Families checkpointed per expert or fused, in
#: the standard layout or one declared in :mod:`modelgraft.grafts._expert_layouts`; on
#: transformers 4.57 only those whose experts are per expert already or still fused there.
LINEAR_EXPERTS_FAMILIES: tuple[str, ...] = covered_by(LINEAR_EXPERTS)


def stacked_expert_list_class(experts_class: type[nn.Module]) -> type[nn.Module]:
    """The per-expert list class of the 2D-stacked ``experts_class`` (cached; see :class:`StackedLayout`)."""
    experts_class = original_class(experts_class)
    return _cached_class(
        (experts_class, "list"),
        f"Linear{experts_class.__name__}List",
        StackedExpertListBase,
        experts_class,
        {
            "_expert_names": STACKED_LAYOUTS[experts_class.__name__].names,
            RECIPE_ATTR: (stacked_expert_list_class, (experts_class,)),
        },
    )


_CLASSES: dict[tuple[type, object], type[nn.Module]] = {}
_CLASSES_LOCK = ForkSafeLock()


def linear_experts_class(
    experts_class: type[nn.Module], *, names: tuple[str, str, str] = DEFAULT_NAMES
) -> type[nn.Module]:
    """Return the per-expert ``nn.Linear`` replacement of ``experts_class`` (cached).

    Args:
        experts_class: a fused-experts class such as ``Qwen2MoeExperts`` or ``MixtralExperts``.
        names: names of each expert's gate, up and down layers (as in the family's checkpoints).
    """
    experts_class = original_class(experts_class)
    if experts_class.__name__ in STACKED_LAYOUTS:
        # 2D stacks in a child (DBRX): the experts keep their module, the child becomes the list
        return _cached_class(
            (experts_class, "stacked"),
            f"Linear{experts_class.__name__}",
            LinearStackedExpertsBase,
            experts_class,
            {
                "_list_class": stacked_expert_list_class(experts_class),
                RECIPE_ATTR: (functools.partial(linear_experts_class, names=names), (experts_class,)),
            },
        )
    return _cached_class(
        (experts_class, tuple(names)),
        f"Linear{experts_class.__name__}",
        LinearExpertsBase,
        experts_class,
        {
            "_expert_names": tuple(names),
            RECIPE_ATTR: (functools.partial(linear_experts_class, names=names), (experts_class,)),
        },
    )


def _cached_class(
    key: tuple[type, object], name: str, base: type, experts_class: type[nn.Module], attrs: dict[str, object]
) -> type[nn.Module]:
    """The one class ``name`` (subclass of ``base``, replacing ``experts_class``) of this process."""
    with _CLASSES_LOCK:
        found = _CLASSES.get(key)
        if found is None:
            found = cast(
                "type[nn.Module]",
                GraftedClass(
                    name,
                    (base,),
                    {
                        "__qualname__": name,
                        "__doc__": f"`{experts_class.__name__}` with per-expert `nn.Linear` layers.",
                        "_modelgraft_original": experts_class,
                        **attrs,
                    },
                ),
            )
            _CLASSES[key] = found
        return found


def _is_expert_list(module: nn.Module) -> bool:
    return isinstance(getattr(module, "experts", None), nn.ModuleList)


def _is_fused_experts(module: nn.Module) -> bool:
    return isinstance(getattr(module, "gate_up_proj", None), nn.Parameter) and layout_problem(module) is None


def _is_stacked_experts(module: nn.Module) -> bool:
    layout = STACKED_LAYOUTS.get(type(module).__name__)
    return layout is not None and stacked_problem(module, layout) is None


def _part(model_type: str) -> _Part:
    stacked = find_modules(model_type, _is_stacked_experts)
    if stacked:
        # transformers (5 and 4.57) reads and writes these stacks as they are: split them on load
        mapping = {cls.__name__: linear_experts_class(cls) for cls in stacked}
        return _Part(mapping, stacked_checkpoint_converters(model_type, stacked))
    if not _compat.FUSED_MOE_EXPERTS and find_modules(model_type, _is_expert_list):
        # transformers 4.57 already builds per-expert `nn.Linear` experts: nothing to replace.
        return _Part({})
    found = find_modules(model_type, _is_fused_experts)
    if not found:
        raise UnsupportedFamilyError(
            f"`{model_type}` has no fused experts that are sets of gated linear layers; the per-expert graft "
            f"cannot apply{_why_not(model_type)}. Families known to work: {', '.join(LINEAR_EXPERTS_FAMILIES)}."
        )
    names = builtin_expert_names(model_type)
    if names is None:
        # transformers writes these experts fused: convert the 3D tensors on load, back on save.
        mapping = {cls.__name__: linear_experts_class(cls) for cls in found}
        return _Part(mapping, fused_checkpoint_converters(model_type, found))
    nonstandard = sorted(
        {
            type(m).__name__
            for m in meta_model(model_type).modules()
            if original_class(type(m)) in found and layout_of(m) != ExpertLayout()
        }
    )
    if nonstandard:
        raise UnsupportedFamilyError(
            f"`{model_type}` checkpoints are merged per expert by transformers into the standard layout, but "
            f"{', '.join(f'`{n}`' for n in nonstandard)} store another one; expected (E, 2I, H) without bias."
        )
    mapping = {cls.__name__: linear_experts_class(cls, names=names) for cls in found}
    return _Part(mapping, (), drop_expert_merges=True)


def _why_not(model_type: str) -> str:
    """Why ``model_type``'s experts are refused, as a clause (its experts modules first)."""
    modules = list(meta_model(model_type).modules())
    if find_modules(model_type, _is_expert_list):
        return " (its experts are already a `ModuleList` of per-expert layers: nothing to replace)"
    modules.sort(key=lambda m: "Expert" not in type(m).__name__)
    for module in modules:
        if any(p.dim() == 3 for p in module.parameters(recurse=False)):
            problem = layout_problem(module)
            if problem is not None:
                return f" (`{type(module).__name__}`: {problem})"
    for module in modules:
        # Experts fused another way (each weight an (E * I, H) stack, undeclared): name what they hold.
        params = list(module.named_parameters())
        if (
            type(module).__name__.endswith("Experts")
            and params
            and all(p.dim() == 2 for _, p in params)
            and not any(isinstance(m, nn.Linear) for m in module.modules())
        ):
            shapes = ", ".join(f"`{n}` {tuple(p.shape)}" for n, p in params)
            return (
                f" (no module holds 3D expert parameters: `{type(module).__name__}` stacks its experts in 2D "
                f"parameters {shapes}, a storage no layout in `modelgraft.grafts._expert_layouts` declares)"
            )
    return " (no module holds 3D expert parameters)"


def linear_experts(*model_types: str) -> Graft:
    """The per-expert ``nn.Linear`` graft for ``model_types`` (default: :data:`LINEAR_EXPERTS_FAMILIES`).

    Example:
        >>> graft = linear_experts("mixtral")
        >>> graft.mapping["MixtralExperts"].__name__, graft.conversions["mixtral"]
        ('LinearMixtralExperts', [WeightRenaming(['block_sparse_moe'] -> ['mlp'])])
    """
    return Graft.of("per-expert linear experts", model_types, LINEAR_EXPERTS_FAMILIES, _part)
