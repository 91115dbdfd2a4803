"""The conversion engine's wiring into transformers 5.x (the counterpart of
:mod:`modelgraft._compat._conversion_v4`); see :mod:`modelgraft._compat.engine`.

The engine is the :class:`~modelgraft._compat.engine.ConversionEngine` given to :func:`conversion_wrappers`;
this module never imports it. Wrapped (the ``conversion`` sites of :mod:`modelgraft._compat.wraps`),
in ``transformers.modeling_utils``:

* ``PreTrainedModel.post_init``: remembers the conversion scopes a model was built under, so a
  model made with ``from_config`` saves its original layout after the scope has ended.
* ``get_model_conversion_mapping`` (the name ``from_pretrained`` calls): drops transformers'
  built-in transforms for every (sub)model that has a modelgraft entry; that entry replaces them.
* ``PreTrainedModel._load_pretrained_model``: after transformers has loaded every key that fits,
  fills the missing converted parameters from the checkpoint files, or from the ``state_dict`` the
  load was given (before ``_finalize_model_loading`` would randomly initialise them).
* ``revert_weight_conversion`` (the name ``save_pretrained`` calls): reverses modelgraft's conversions
  exactly and leaves the other keys to transformers.

Example:
    >>> from modelgraft._compat.wraps import sites
    >>> from dataclasses import replace
    >>> from modelgraft._compat._features import FEATURES
    >>> line = replace(FEATURES, builtin_conversion=True)
    >>> sorted(conversion_wrappers(engine=None)) == sorted(s.attribute for s in sites("conversion", features=line))
    True
"""

from __future__ import annotations

import contextvars
import inspect
from collections.abc import Callable
from typing import Any

import torch

# This module is 5.x only; on 4.57 (where it is never imported) mypy still checks it, so the
# version-specific ignores below carry `unused-ignore` to type-check on both lines.
from transformers import conversion_mapping as _tcm  # type: ignore[attr-defined, unused-ignore]
from transformers import core_model_loading as _tcore  # type: ignore[attr-defined, unused-ignore]

from modelgraft._compat.engine import ConversionEngine, LoadRequest, wrap_post_init
from modelgraft._compat.wraps import Makers

__all__ = ["conversion_wrappers"]

# Set while a save applies transformers' built-in reverse to a state dict that modelgraft has
# already brought back to the plain model's own layout: the built-ins must not be filtered then.
_BUILTINS_UNFILTERED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "modelgraft_builtins_unfiltered", default=False
)


def _signature(transform: Any) -> tuple[Any, ...]:
    return (
        type(transform).__name__,
        tuple(getattr(transform, "_original_source_patterns", ()) or ()),
        tuple(getattr(transform, "_original_target_patterns", ()) or ()),
    )


def _filter_builtins(engine: ConversionEngine, model: Any, transforms: list[Any]) -> list[Any]:
    paths = engine.scope_paths(model)
    if not paths:
        return transforms
    drop: set[tuple[Any, ...]] = set()
    base = getattr(model, "base_model_prefix", "") or ""
    for path in paths:
        sub = model.get_submodule(path) if path else model
        builtin = _tcm.extract_weight_conversions_for_model(sub) or []
        # transformers scopes sub-model transforms with the path minus the base model prefix.
        prefix = None if not path else path.removeprefix(base).removeprefix(".")
        drop.update((prefix, *_signature(t)) for t in builtin)
    return [t for t in transforms if (getattr(t, "scope_prefix", None), *_signature(t)) not in drop]


def _wrap_get_model_conversion_mapping(engine: ConversionEngine) -> Any:
    def wrap(original: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
        def get_model_conversion_mapping(model: Any, *args: Any, **kwargs: Any) -> list[Any]:
            transforms = original(model, *args, **kwargs)
            if not engine.active() or _BUILTINS_UNFILTERED.get():
                return transforms
            return _filter_builtins(engine, model, transforms)

        return get_model_conversion_mapping

    return wrap


def _renamer(weight_mapping: list[Any]) -> Any:
    """The loader's own key renamings (not its converters), as one ``str -> str`` function.

    ``rename_source_key`` (every 5.x release has it) with no converter applies the renamings in
    turn, as the loader does (5.21 on also names that step ``apply_renamings``).
    """
    renamings = [t for t in weight_mapping if isinstance(t, _tcore.WeightRenaming)]
    if not renamings:
        return None
    return lambda key: _tcore.rename_source_key(key, renamings, [])[0]


# `set_param_for_module`'s parameters are the installed release's: read once, not per weight.
_SET_PARAM: Any = _tcore.set_param_for_module
_SET_PARAM_ARGS = inspect.signature(_SET_PARAM).parameters


def _set_param(model: Any, name: str, value: torch.Tensor, loading_info: Any, quantizer: Any) -> None:
    """``set_param_for_module`` with the arguments this release takes: 5.16 on ``(model, name,
    value, loading_info, hf_quantizer)``; 5.1 to 5.15 with a ``distributed_operation`` before the
    quantizer; 5.0 with the loading report's key sets instead of ``loading_info``."""
    if "loading_info" not in _SET_PARAM_ARGS:
        _SET_PARAM(
            model,
            name,
            value,
            loading_info.mismatched_keys,
            loading_info.missing_keys,
            loading_info.unexpected_keys,
            None,
            quantizer,
        )
    elif "distributed_operation" in _SET_PARAM_ARGS:
        _SET_PARAM(model, name, value, loading_info, None, quantizer)
    else:
        _SET_PARAM(model, name, value, loading_info, quantizer)


def _quantizing_placer(model: Any, quantizer: Any, loading_info: Any) -> Any:
    """With a quantizing load, hand each converted weight the quantizer wants to its quantize step,
    exactly as transformers' loading loop does with the weights it loads, so that fused layers are
    quantized like the separate ones (not left in full precision)."""
    if quantizer is None:
        return None

    def place(key: str, tensor: torch.Tensor) -> bool:
        if not quantizer.param_needs_quantization(model, key):
            return False
        # A list of one tensor per key, as transformers' loading loop hands a renamed weight: some
        # quantize ops read `value[0]` unconditionally (quanto, EETQ, FBGEMM FP8, FP-Quant), and on
        # a bare tensor that is its first row ("1D Tensors cannot be quantized per-axis").
        realized = quantizer.get_quantize_ops().convert(
            {key: [tensor]},
            source_patterns=[key],
            target_patterns=[key],
            full_layer_name=key,
            model=model,
            config=model.config,
            missing_keys=loading_info.missing_keys,
        )
        for name, value in realized.items():
            value = value[0] if isinstance(value, list) else value
            _set_param(model, name, value, loading_info, quantizer)
        return True

    return place


def _wrap_load_pretrained_model(engine: ConversionEngine) -> Any:
    def wrap(original: Any) -> Any:
        def _load_pretrained_model(
            model: Any, state_dict: Any, checkpoint_files: Any, load_config: Any, *a: Any, **kw: Any
        ) -> Any:
            result = original(model, state_dict, checkpoint_files, load_config, *a, **kw)
            # 5.1 on return `(loading_info, offload_index)`; 5.0 the loading info alone.
            pair = isinstance(result, tuple)
            loading_info, offload_index = result if pair else (result, result.disk_offload_index)
            if engine.active():
                offloaded: dict[Any, Any] = offload_index if offload_index is not None else {}

                def offload(key: str, tensor: torch.Tensor) -> None:
                    # Converted weights have no range in the checkpoint to point at: written out, as
                    # transformers does for its own converted weights, and read back when used.
                    from transformers.integrations.accelerate import (  # type: ignore[attr-defined, unused-ignore]
                        offload_weight,  # only when offloading; 5.x only
                    )

                    offload_weight(tensor, key, getattr(load_config, "disk_offload_folder", None), offloaded)

                engine.load(
                    LoadRequest(
                        model=model,
                        checkpoint_files=checkpoint_files,
                        missing_keys=loading_info.missing_keys,
                        unexpected_keys=loading_info.unexpected_keys,
                        device_map=getattr(load_config, "device_map", None),
                        rename=_renamer(getattr(load_config, "weight_mapping", None) or []),
                        offload=offload,
                        place=_quantizing_placer(
                            model, getattr(load_config, "hf_quantizer", None), loading_info
                        ),
                        state_dict=state_dict,  # `from_pretrained(..., state_dict=)`: converted like files
                    )
                )
                if offloaded and offload_index is None:
                    offload_index = offloaded
            if pair:
                return loading_info, offload_index
            loading_info.disk_offload_index = offload_index
            return loading_info

        return _load_pretrained_model

    return wrap


def _wrap_revert(engine: ConversionEngine) -> Any:
    def wrap(original: Callable[..., dict[Any, Any]]) -> Callable[..., dict[Any, Any]]:
        def revert_weight_conversion(model: Any, state_dict: dict[Any, Any]) -> dict[Any, Any]:
            reversed_ = engine.reverse(model, state_dict)
            if reversed_ is None:
                return original(model, state_dict)
            rest = {k: state_dict[k] for k in reversed_.untouched}
            rest.update(reversed_.converted)
            root_claimed = "" in reversed_.scope_paths
            if root_claimed and getattr(model, "_weight_conversions", None) is None:
                if reversed_.from_checkpoint:
                    # Loaded through a root entry, which is the model's whole mapping: `rest` is
                    # the checkpoint's layout already; transformers' built-ins would undo twice.
                    return rest
                # Built with `from_config` and grafted: `rest` is the plain model's own layout,
                # which the plain model's save turns into the checkpoint's with the built-ins.
                token = _BUILTINS_UNFILTERED.set(True)
                try:
                    return original(model, rest)
                finally:
                    _BUILTINS_UNFILTERED.reset(token)
            # Otherwise the remaining transforms (load-time ones, renamings of legacy layouts,
            # other sub-models) still apply, except to keys already under their checkpoint names.
            if not reversed_.exact:
                return original(model, rest)
            out = original(model, {k: v for k, v in rest.items() if k not in reversed_.exact})
            out.update((k, rest[k]) for k in reversed_.exact)
            return out

        return revert_weight_conversion

    return wrap


def conversion_wrappers(engine: ConversionEngine) -> Makers:
    """The load/save wrappers calling ``engine``, for the ``conversion`` sites (see
    :meth:`~modelgraft._compat.line.TransformersLine.conversion_wrappers`)."""
    return {
        "get_model_conversion_mapping": _wrap_get_model_conversion_mapping(engine),
        "revert_weight_conversion": _wrap_revert(engine),
        "_load_pretrained_model": _wrap_load_pretrained_model(engine),
        "post_init": wrap_post_init(engine),
    }
