"""``convert_and_load_state_dict_in_model`` of :mod:`modelgraft.porting`, on modelgraft's engine.

transformers' function loads a state dict into a built model through a list of transforms
(``load_config.weight_mapping``) and returns ``(loading_info, disk_offload_index)``. Here the
transforms are registered, for this call only, as the model's conversion entry (transformers'
own objects are translated; operations written for transformers run as they are), and the same
engine that ``from_pretrained`` uses renames, converts and places the tensors. Keys that no
transform changes load under their own names. Every tensor is checked before any is placed:
a source of the wrong shape for a conversion raises ``ConversionShapeError`` and leaves the
model as it was; a key whose tensor does not fit its parameter is reported in
``mismatched_keys`` and not loaded, as transformers does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from modelgraft import _compat
from modelgraft.conversion._chain import from_transformers
from modelgraft.conversion.builtin_rules import TransformersConverter, TransformersRenaming
from modelgraft.conversion.load import apply_load_conversions
from modelgraft.conversion.rules import WeightConverter
from modelgraft.errors import ConversionError

__all__ = ["LoadStateDictInfo", "convert_and_load_state_dict_in_model"]


@dataclass
class LoadStateDictInfo:
    """What a load did, with transformers' fields (used where transformers has no class of its own)."""

    missing_keys: set[str] = field(default_factory=set)
    unexpected_keys: set[str] = field(default_factory=set)
    mismatched_keys: set[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=set)
    error_msgs: list[str] = field(default_factory=list)
    conversion_errors: dict[str, str] = field(default_factory=dict)
    skipped_pp_keys: set[str] = field(default_factory=set)

    def to_dict(self) -> dict[str, Any]:
        return {
            "missing_keys": self.missing_keys,
            "unexpected_keys": self.unexpected_keys,
            "mismatched_keys": self.mismatched_keys,
            "error_msgs": self.error_msgs,
        }


def _as_transformers_semantics(transform: Any) -> WeightConverter:
    """One transform of ``weight_mapping`` as modelgraft's, matching keys as transformers does."""
    if isinstance(transform, WeightConverter):
        if transform.uses_transformers_semantics:
            return transform
        twin: WeightConverter
        if transform.operations:
            twin = TransformersConverter(
                transform.source_patterns, transform.target_patterns, transform.operations
            )
        else:
            twin = TransformersRenaming(transform.source_patterns, transform.target_patterns)
        if transform.scope_prefix is not None:
            twin.scope_prefix, twin.base_model_prefix = transform.scope_prefix, transform.base_model_prefix
        return twin
    ours = from_transformers(transform)
    if ours is None:
        raise ConversionError(
            f"`convert_and_load_state_dict_in_model` cannot run transform {transform!r}: modelgraft has no "
            f"counterpart for `{type(transform).__name__}`. Use modelgraft.porting's WeightRenaming, "
            "WeightConverter, PrefixChange, GroupWeightRename or LayerPairCollapse."
        )
    scope = getattr(transform, "scope_prefix", None)
    if scope is not None:
        ours.scope_prefix, ours.base_model_prefix = scope, getattr(transform, "base_model_prefix", None)
    return ours


def _info_class() -> Any:
    found = _compat.transformers_load_info_class()
    return found if found is not None else LoadStateDictInfo


def _place(model: torch.nn.Module, params: Mapping[str, torch.Tensor], key: str, value: torch.Tensor) -> None:
    target = params[key]
    with torch.no_grad():
        if target.is_meta:
            module_name, _, leaf = key.rpartition(".")
            module = model.get_submodule(module_name) if module_name else model
            wrapped = torch.nn.Parameter(value.to(target.dtype), requires_grad=target.requires_grad)
            if leaf in module._parameters:
                module._parameters[leaf] = wrapped
            else:
                module._buffers[leaf] = value.to(target.dtype)
        else:
            target.copy_(value.to(target.dtype))


def convert_and_load_state_dict_in_model(
    model: torch.nn.Module,
    state_dict: Mapping[str, torch.Tensor],
    load_config: Any = None,
    disk_offload_index: dict[str, Any] | None = None,
) -> tuple[Any, dict[str, Any] | None]:
    """Load ``state_dict`` into ``model`` through ``load_config.weight_mapping``, as transformers does.

    ``load_config`` is transformers' ``LoadStateDictConfig`` or any object with a
    ``weight_mapping`` attribute (a list of transforms; ``None`` loads keys by name). Returns
    ``(loading_info, disk_offload_index)``; ``loading_info`` has transformers' fields
    (``missing_keys``, ``unexpected_keys``, ``mismatched_keys``, ``error_msgs``,
    ``conversion_errors``). The model remembers the transforms, so ``save_pretrained`` writes the
    state dict's layout back. Disk offload is not done here: ``disk_offload_index`` is returned
    as it came.

    Example:
        >>> from types import SimpleNamespace
        >>> from transformers import LlamaConfig, LlamaModel
        >>> from modelgraft.porting import WeightRenaming
        >>> model = LlamaModel(LlamaConfig(hidden_size=8, intermediate_size=8, num_hidden_layers=1,
        ...                                num_attention_heads=2, vocab_size=16))
        >>> old = {"decoder." + k: v.detach() + 1 for k, v in model.state_dict().items()}
        >>> config = SimpleNamespace(weight_mapping=[WeightRenaming("^decoder[.]", "")])
        >>> info, _ = convert_and_load_state_dict_in_model(model, old, config)
        >>> sorted(info.missing_keys), sorted(info.unexpected_keys)
        ([], [])
        >>> bool(model.norm.weight.eq(old["decoder.norm.weight"]).all())
        True
    """
    if not hasattr(model, "config") or not hasattr(model, "base_model_prefix"):
        raise ConversionError(
            f"`convert_and_load_state_dict_in_model` loads into a transformers model (a `PreTrainedModel`); "
            f"received a `{type(model).__name__}`. Load a plain module with `module.load_state_dict`."
        )
    from modelgraft.hooks import patched

    mapping = list(getattr(load_config, "weight_mapping", None) or [])
    entry = [_as_transformers_semantics(t) for t in mapping]
    # What a checkpoint holds: parameters and persistent buffers (the state dict's keys).
    params: dict[str, torch.Tensor] = dict(model.state_dict(keep_vars=True))
    missing = set(params)
    unexpected = {k for k in state_dict if k not in params}
    mismatched: set[tuple[str, tuple[int, ...], tuple[int, ...]]] = set()
    consumed: set[str] = set()
    if entry:
        with patched({}, conversions={type(model).__name__: entry}):
            state = apply_load_conversions(model, None, missing, unexpected, state_dict=state_dict)
        if state is not None:
            consumed = set(state.checkpoint_keys.values())
        params = dict(model.state_dict(keep_vars=True))
    # Keys no transform took: loaded under their own names where the model has them.
    for key in sorted((missing & set(state_dict)) - consumed):
        value = state_dict[key]
        if tuple(value.shape) != tuple(params[key].shape):
            mismatched.add((key, tuple(value.shape), tuple(params[key].shape)))
            continue
        _place(model, params, key, value)
        missing.discard(key)
        unexpected.discard(key)
    info = _info_class()(
        missing_keys=missing,
        unexpected_keys=unexpected,
        mismatched_keys=mismatched,
        error_msgs=[],
        conversion_errors={},
        skipped_pp_keys=set(),
    )
    return info, disk_offload_index
