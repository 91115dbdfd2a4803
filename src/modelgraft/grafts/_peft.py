"""Make PEFT's target choices on a grafted model those it makes on the plain model.

PEFT wraps the fused stand-ins (``q_proj``, ``gate_proj``: ``nn.Linear`` subclasses) and the
per-expert ``nn.Linear`` layers by itself. Two of its *policies* would still differ from the
plain model on a grafted one, and this module adjusts exactly those, only for models that hold
grafted modules (any other model sees PEFT unchanged):

* ``target_modules="all-linear"`` picks every ``nn.Linear``, so both ``q_proj`` and the fused
  ``qkv_proj``: the fused layers are left out, which leaves the plain model's set of layers.
* With transformers 5, PEFT rewrites a LoRA config written for per-expert layers
  (``target_modules=["gate_proj", "up_proj", "down_proj"]``, Mixtral's ``w1``/``w2``/``w3``) to
  target transformers' fused 3D expert parameters instead, and converts adapter files the same
  way. A model whose experts were grafted by :func:`~modelgraft.grafts.linear_experts` has
  per-expert layers again, named as in the checkpoints (and as in transformers 4.57): the
  expert names stay module targets, and adapter files load without the expert merges
  (renamings such as Mixtral's ``block_sparse_moe`` -> ``mlp`` still apply; so does the
  conversion of the router, which stays transformers 5's).

* An adapter trained on such a grafted model names per-expert layers (``experts.0.gate_proj``);
  on transformers 5 the plain model has none, and PEFT would drop those tensors without a word.
  Loading it on a model without grafted experts is refused (:class:`ExpertsAdapterError`), saying
  to load it on the grafted model, or to merge it there and save the merged checkpoint.

The adjustments are wrappers around six PEFT attributes, listed with what each does in
:data:`modelgraft._compat.peft.PEFT_SITES` and installed through its wrapper sets when PEFT's
modules are imported (or at once when they already are), from the first time a grafted module is
built or ``modelgraft.grafts`` is imported. Nothing imports PEFT.

Example:
    >>> ensure_installed()
    >>> installed()
    True
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import re
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import nn

from modelgraft._compat.peft import PEFT, PeftMaker
from modelgraft.errors import ExpertsAdapterError  # defined there with every error; this path kept
from modelgraft.grafts import _peft_expert_adapters as _experts

__all__ = ["ExpertsAdapterError", "ensure_installed", "installed", "uninstall"]


# ---- what a grafted model holds ------------------------------------------------------------------
def _fused_layer_names(model: nn.Module) -> set[str]:
    """Full names of the fused layers (``...self_attn.qkv_proj``) of fused stand-ins in ``model``.

    A stand-in (``modelgraft.grafts._fused.FusedSlice``) is recognised by its fusion group, not
    by its class: that module imports this one, and the import graph stays acyclic.
    """
    paths = {id(module): name for name, module in model.named_modules()}
    found: set[str] = set()
    for module in model.modules():
        group = module.__dict__.get("_group")
        fused_name = getattr(group, "fused_name", None)
        owner = paths.get(id(getattr(group, "owner", None)))
        if isinstance(fused_name, str) and owner is not None:
            found.add(f"{owner}.{fused_name}" if owner else fused_name)
    return found


def _grafted_expert_names(model: nn.Module) -> set[str]:
    """Layer names of the per-expert layers of grafted experts in ``model`` (empty if none).

    Grafted experts (``linear_experts``) are the ``ModuleList`` classes that name the original
    experts class they replace and their layers' names.
    """
    names: set[str] = set()
    for module in model.modules():
        cls = type(module)
        expert_names = getattr(cls, "_expert_names", None)
        if isinstance(module, nn.ModuleList) and getattr(cls, "_modelgraft_original", None) and expert_names:
            names.update(expert_names)
    return names


def _names_target(target: str, names: set[str]) -> bool:
    return any(target == name or target.endswith(f".{name}") for name in names)


# ---- the wrappers --------------------------------------------------------------------------------
def _all_linear(original: Callable[..., Any]) -> Callable[..., Any]:
    def _maybe_include_all_linear_layers(peft_config: Any, model: nn.Module) -> Any:
        was_all_linear = isinstance(getattr(peft_config, "target_modules", None), str)
        result = original(peft_config, model)
        targets = getattr(result, "target_modules", None)
        if was_all_linear and isinstance(targets, set):
            fused = _fused_layer_names(model)
            if fused & targets:
                # The plain model has q_proj, k_proj, v_proj, which the stand-ins provide: adapting
                # qkv_proj as well would add a second adapter the plain model does not have.
                result.target_modules = targets - fused
        return result

    return _maybe_include_all_linear_layers


def _moe_config(original: Callable[..., Any], module: ModuleType) -> Callable[..., Any]:
    def _convert_peft_config_moe(peft_config: Any, model: nn.Module) -> Any:
        names = _grafted_expert_names(model)
        if not names:
            return original(peft_config, model)
        _refuse_missing_parameters(peft_config, model, names)
        targets = peft_config.target_modules
        if isinstance(targets, str):
            # A regex or "all-linear" matches the per-expert layers as modules; of the rewrite keep
            # only the targets that are not expert layers here (the router's weight).
            probe = copy.deepcopy(peft_config)
            original(probe, model)
            before = set(peft_config.target_parameters or ())
            added = (
                set(probe.target_parameters or ()) - before - _fused_expert_parameters(module, model, names)
            )
            if added:
                peft_config.target_parameters = before | added
            return None
        protected = {t for t in targets or () if _names_target(t, names)}
        peft_config.target_modules = set(targets or ()) - protected
        try:
            return original(peft_config, model)
        finally:
            peft_config.target_modules = set(peft_config.target_modules or ()) | protected

    return _convert_peft_config_moe


def _refuse_missing_parameters(peft_config: Any, model: nn.Module, names: set[str]) -> None:
    """Refuse ``target_parameters`` the grafted model lacks: an adapter of the fused 3D experts.

    PEFT would otherwise stop with "no target modules" or, with other targets beside, load the
    adapter without its expert part.
    """
    targets = peft_config.target_parameters or ()
    if isinstance(targets, str):
        targets = (targets,)
    parameters = [name for name, _ in model.named_parameters()]
    missing = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in parameters)]
    if missing:
        layers = "/".join(sorted(names))
        raise ExpertsAdapterError(
            f"The adapter targets the parameters {missing}, which the model does not have: they are the fused "
            f"3D experts of transformers 5, and the `linear_experts` graft replaced them by per-expert "
            f"`nn.Linear` layers (`experts.<i>.{layers}`). An adapter of the fused experts cannot be "
            "split per expert exactly here. Load it on the model without the graft, or train the adapter on "
            f"the grafted model with `target_modules={sorted(names)}`."
        )


def _fused_expert_parameters(module: ModuleType, model: nn.Module, names: set[str]) -> set[str]:
    """What PEFT's rewrite maps the expert layer names to (``gate_up_proj``, ``down_proj``)."""
    pattern = getattr(module, "_MODEL_TO_CONVERSION_PATTERN", {}).get(
        getattr(model.config, "model_type", None)
    )
    mapping = getattr(module, "_MOE_TARGET_MODULE_MAPPING", {}).get(pattern, {})
    return {target for name, target in mapping.items() if name in names}


def _conversion_mapping(original: Callable[..., Any]) -> Callable[..., Any]:
    def get_model_conversion_mapping(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        conversions = original(model, *args, **kwargs)
        if not conversions or not _grafted_expert_names(model):
            return conversions
        # The grafted experts are per-expert layers: adapter keys for them load as they are.
        return [c for c in conversions if not _merges_experts(c)]

    return get_model_conversion_mapping


def _merges_experts(conversion: Any) -> bool:
    return any(type(op).__name__ == "MergeModulelist" for op in getattr(conversion, "operations", ()))


_EXPERT_KEY = re.compile(r"\.experts\.\d+\.[A-Za-z_]\w*\.lora_")


def _state_dict_check(original: Callable[..., Any]) -> Callable[..., Any]:
    def set_peft_model_state_dict(
        model: nn.Module, peft_model_state_dict: Any, *args: Any, **kwargs: Any
    ) -> Any:
        try:
            _refuse_dropped_expert_adapters(model, peft_model_state_dict)
            if isinstance(peft_model_state_dict, dict) and _grafted_expert_names(model):
                adapter = args[0] if args else kwargs.get("adapter_name", "default")
                peft_model_state_dict = _experts.split_state(peft_model_state_dict, _base_of(model), adapter)
        except ExpertsAdapterError:
            _remove_injected_adapters(model)  # PEFT put its layers in before loading: take them out
            raise
        return original(model, peft_model_state_dict, *args, **kwargs)

    return set_peft_model_state_dict


def _base_of(model: nn.Module) -> nn.Module:
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    assert isinstance(base, nn.Module)
    return base


def _config_split(original: Callable[..., Any]) -> Callable[..., Any]:
    def inject_adapter(self: Any, model: nn.Module, adapter_name: str, *args: Any, **kwargs: Any) -> Any:
        config = getattr(self, "peft_config", {}).get(adapter_name)
        if config is not None and _grafted_expert_names(model):
            # An adapter of the plain model's fused 3D experts: point it at the per-expert layers.
            _experts.split_config(config, model)
        return original(self, model, adapter_name, *args, **kwargs)

    return inject_adapter


# ---- saving an adapter of grafted experts in the plain model's layout ----------------------------
def _save_in_plain_layout(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    def save_pretrained(self: Any, save_directory: str, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, save_directory, *args, **kwargs)
        plans = _plans_for_save(self, bound.arguments.get("selected_adapters"))  # refuses before writing
        result = original(self, save_directory, *args, **kwargs)
        if plans and bound.arguments.get("is_main_process", True):
            for adapter, (site_plans, others) in plans.items():
                folder = save_directory if adapter == "default" else os.path.join(save_directory, adapter)
                _rewrite_saved(folder, site_plans, others)
        return result

    return save_pretrained


def _plans_for_save(
    peft_model: Any, selected: list[str] | None
) -> dict[str, tuple[list[_experts.SitePlan], list[str]]]:
    """Per adapter: the grafted expert sites to write fused, and the other adapted layers' names."""
    base = _base_of(peft_model)
    if not _grafted_expert_names(base):
        return {}
    plans = {}
    for adapter in selected or list(getattr(peft_model, "peft_config", {})):
        site_plans = _experts.plan_save(base, adapter)
        if not site_plans:
            continue
        others = _other_adapted_layers(base, adapter, site_plans)
        _refuse_layers_peft_would_convert(base, others)
        plans[adapter] = (site_plans, others)
    return plans


def _other_adapted_layers(base: nn.Module, adapter: str, plans: list[_experts.SitePlan]) -> list[str]:
    inside = tuple(f"{p.site.path}." for p in plans)
    found = []
    for name, module in base.named_modules():
        lora_a = getattr(module, "lora_A", None)
        if (
            name.startswith(inside)
            or hasattr(module, "parameter_name")
            or not isinstance(lora_a, nn.ModuleDict)
        ):
            continue
        if adapter in lora_a:
            found.append(name)
    return found


def _refuse_layers_peft_would_convert(base: nn.Module, others: list[str]) -> None:
    """PEFT, loading an adapter on the plain model of a family it converts (Qwen3-MoE, Mixtral,
    DeepSeek-V3, ...), turns every module target named like an expert layer (``gate_proj``, ``w1``)
    into the fused experts: an adapted shared expert of that name would be dropped there."""
    module = sys.modules.get("peft.utils.transformers_weight_conversion")
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    if module is None or model_type is None:
        return
    pattern = getattr(module, "_MODEL_TO_CONVERSION_PATTERN", {}).get(model_type)
    if pattern is None or module.get_checkpoint_conversion_mapping(model_type) is None:
        return
    converted = set(getattr(module, "_MOE_TARGET_MODULE_MAPPING", {}).get(pattern, {}))
    victims = [name for name in others if name.rsplit(".", 1)[-1] in converted]
    if victims:
        raise ExpertsAdapterError(
            f"The adapter adapts `{victims[0]}` ({len(victims)} such layers), outside the experts. PEFT, loading an "
            f"adapter on the plain `{model_type}` model, turns every target named {sorted(converted)} into the fused "
            "experts, so these layers' LoRA would be dropped there. Leave them out of the targets (for example "
            "`exclude_modules=[...shared expert layers...]`), or merge the adapter (`merge_and_unload()`) and save the "
            "merged checkpoint."
        )


def _rewrite_saved(folder: str, plans: list[_experts.SitePlan], others: list[str]) -> None:
    """Rewrite a saved adapter folder: grafted experts' pairs fused, config pointing at them."""
    from safetensors.torch import load_file, save_file

    config_path = os.path.join(folder, "adapter_config.json")
    with open(config_path) as handle:
        config = json.load(handle)
    safe = os.path.join(folder, "adapter_model.safetensors")
    if os.path.exists(safe):
        state = _experts.fuse_state(load_file(safe), plans)
        save_file(state, safe, metadata={"format": "pt"})
    else:
        weights = os.path.join(folder, "adapter_model.bin")
        state = _experts.fuse_state(torch.load(weights, weights_only=True), plans)
        torch.save(state, weights)
    with open(config_path, "w") as handle:
        json.dump(_experts.fuse_config(config, plans, others), handle, indent=2, sort_keys=True)


def _remove_injected_adapters(model: nn.Module) -> None:
    """Put the user's model back as it was before a refused adapter load: PEFT injects its LoRA
    layers into the base model in place before it loads their weights; ``unload`` takes them out
    again without merging anything."""
    tuner = getattr(model, "base_model", None)
    unload = getattr(tuner, "unload", None)
    if callable(unload):
        unload()


def _refuse_dropped_expert_adapters(model: nn.Module, state: Any) -> None:
    """Refuse an adapter of per-expert layers (``experts.<i>.gate_proj``) on a model that has none.

    Such an adapter was trained on a model grafted with ``linear_experts``; on transformers 5 the
    plain model holds fused 3D experts, and PEFT would drop every expert tensor without a word.
    """
    if not isinstance(state, dict) or _grafted_expert_names(model):
        return
    keys = [k for k in state if isinstance(k, str) and _EXPERT_KEY.search(k)]
    if not keys:
        return
    modules = {name for name, _ in model.named_modules()}
    missing = [
        k
        for k in keys
        if not any(m.endswith(k.split(".lora_")[0].removeprefix("base_model.model.")) for m in modules)
    ]
    if missing:
        raise ExpertsAdapterError(
            f"The adapter holds LoRA weights of per-expert layers ({len(missing)} of its {len(state)} tensors, e.g. "
            f"`{missing[0]}`) that this model does not have: it was trained on a model grafted with "
            "`linear_experts`, and this model keeps transformers 5's fused 3D experts, so PEFT would drop them "
            "without a word. Load it on the grafted model (`graft_model(model, linear_experts(model_type))`, or "
            "load under `linear_experts(model_type).applied()`), or merge it there (`merge_and_unload()`) and save "
            "the merged checkpoint, which loads on the plain model."
        )


_MAKERS: dict[str, PeftMaker] = {
    "set_peft_model_state_dict": lambda f, m: _state_dict_check(f),
    "PeftModel.save_pretrained": lambda f, m: _save_in_plain_layout(f),
    "_maybe_include_all_linear_layers": lambda f, m: _all_linear(f),
    "BaseTuner.inject_adapter": lambda f, m: _config_split(f),
    "_convert_peft_config_moe": _moe_config,
    "get_model_conversion_mapping": lambda f, m: _conversion_mapping(f),
}


def ensure_installed() -> None:
    """Wrap PEFT's functions now if PEFT is imported, else when it is (idempotent, cheap)."""
    if not PEFT.installed:
        PEFT.install(_MAKERS)


def installed() -> bool:
    """Whether the wrappers are in place (or will be, when PEFT is imported)."""
    return PEFT.installed


def uninstall() -> None:
    """Remove the wrappers and the import hook (for tests)."""
    PEFT.uninstall()
