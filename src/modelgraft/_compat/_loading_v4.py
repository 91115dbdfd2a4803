"""The conversion engine's wiring into transformers 4.57 (the counterpart of
:mod:`modelgraft._compat._loading_v5`, which wires it into 5.x).

4.57 has no conversion machinery of its own: one checkpoint key fills one parameter, and
``save_pretrained`` writes ``state_dict()`` as it is. Wrapped, in ``transformers.modeling_utils``:

* ``PreTrainedModel.post_init``: remembers the conversion scopes a model was built under, so a
  model made with ``from_config`` saves its original layout after the scope has ended.
* ``PreTrainedModel._load_pretrained_model``: makes the checkpoint files (or the ``state_dict``)
  and device map of this load visible to the next wrapper, and drops the checkpoint keys a conversion consumed from the
  unexpected keys it reports (``_adjust_missing_and_unexpected_keys``).
* ``_find_missing_and_unexpected_keys`` (the name ``_load_pretrained_model`` calls): right after
  transformers found the missing keys, and before it materialises and initialises them, fills the
  missing converted parameters from the checkpoint files; they are then no longer missing, so
  transformers neither initialises them nor warns about them.
* ``PreTrainedModel.save_pretrained``: writes the original layout (``save_original_format=True``,
  the default, as on 5.x) by reversing modelgraft's conversions in the state dict it saves.

Example:
    >>> from modelgraft._compat import _loading_v4
    >>> _loading_v4.builtin_conversion_exists("qwen2_moe")
    False
"""

from __future__ import annotations

import re
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

from modelgraft._wrapping import Wrappers
from modelgraft.conversion import load as _load
from modelgraft.conversion import save as _save
from modelgraft.conversion.rules import has_any_conversions

__all__ = ["builtin_conversion_exists", "install", "installed", "uninstall"]

_wrappers = Wrappers()


@dataclass
class _Load:
    """What the inner wrappers of one ``_load_pretrained_model`` call need to share."""

    files: list[str] | None
    state_dict: dict | None
    device_map: dict | None
    key_mapping: dict[str, str] | None
    quantizer: Any = None
    consumed: set[str] = field(default_factory=set)


_current: ContextVar[_Load | None] = ContextVar("modelgraft_v4_conversion_load", default=None)


def builtin_conversion_exists(key: str) -> bool:
    """Whether transformers converts ``key``'s checkpoints itself: never on 4.57."""
    return False


def _modeling_utils() -> Any:
    from transformers import modeling_utils

    return modeling_utils


def _renamer(model: Any, key_mapping: dict[str, str] | None) -> Any:
    """The loader's own key renamings, as 4.57 applies them (the class's legacy-layout renames, then
    the first matching ``key_mapping`` pattern); the base-model prefix is left to the engine."""

    def rename(key: str) -> str:
        new_key = model._fix_state_dict_key_on_load(key)[0]
        for pattern, replacement in (key_mapping or {}).items():
            new_key, count = re.subn(pattern, replacement, new_key)
            if count:
                break
        return new_key

    return rename


def _wrap_load_pretrained_model(original: Any) -> Any:
    def _load_pretrained_model(
        cls: type, model: Any, state_dict: Any, checkpoint_files: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if not has_any_conversions():
            return original(cls, model, state_dict, checkpoint_files, *args, **kwargs)
        files = list(checkpoint_files) if checkpoint_files and state_dict is None else None
        token = _current.set(
            _Load(
                files,
                state_dict,
                kwargs.get("device_map"),
                kwargs.get("key_mapping"),
                kwargs.get("hf_quantizer"),
            )
        )
        try:
            return original(cls, model, state_dict, checkpoint_files, *args, **kwargs)
        finally:
            _current.reset(token)

    return _load_pretrained_model


def _wrap_find_missing(original: Any) -> Any:
    def _find_missing_and_unexpected_keys(model: Any, *args: Any, **kwargs: Any) -> Any:
        missing, unexpected = original(model, *args, **kwargs)
        load = _current.get()
        if load is None or (load.files is None and load.state_dict is None):
            return missing, unexpected
        still_missing, left_unexpected = set(missing), set(unexpected)
        _load.apply_load_conversions(
            model,
            load.files,
            still_missing,
            left_unexpected,
            _load.device_for_map(load.device_map),
            _renamer(model, load.key_mapping),
            place=_unquantized_notice(model, load.quantizer),
            state_dict=load.state_dict,  # `from_pretrained(..., state_dict=)`: converted like files
        )
        load.consumed |= set(unexpected) - left_unexpected
        # Consumed keys stay "unexpected" until the shards are loaded, so transformers does not try
        # to load them into parameters that do not exist; they are dropped from the final report.
        return [k for k in missing if k in still_missing], unexpected

    return _find_missing_and_unexpected_keys


def _unquantized_notice(model: Any, quantizer: Any) -> Any:
    """4.57 quantizes only the weights it reads itself: say so for each converted weight (a problem
    in the report, an error in strict mode) instead of returning a partly quantized model silently."""
    if quantizer is None:
        return None
    from modelgraft.report import _report_for

    def place(key: str, tensor: torch.Tensor) -> bool:
        _report_for(model).problems.append(
            f"`{key}` was built by a modelgraft conversion and is not quantized by "
            f"{type(quantizer).__name__}: transformers 4.57 quantizes only the weights it loads itself. "
            "Use transformers 5.x, or keep these modules out of quantization (`modules_to_not_convert`)."
        )
        return False

    return place


def _wrap_adjust(original: Any) -> Any:
    def _adjust_missing_and_unexpected_keys(self: Any, *args: Any, **kwargs: Any) -> Any:
        missing, unexpected = original(self, *args, **kwargs)
        load = _current.get()
        if load is not None and load.consumed:
            unexpected = [k for k in unexpected if k not in load.consumed]
        return missing, unexpected

    return _adjust_missing_and_unexpected_keys


def _wrap_post_init(original: Any) -> Any:
    def post_init(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if has_any_conversions():
            scopes = _load.resolve_scopes(self)
            if scopes:
                object.__setattr__(self, _load.STATE_ATTR, _load.ConversionState(scopes=scopes))
        return result

    return post_init


def _wrap_save_pretrained(original: Any) -> Any:
    def save_pretrained(
        self: Any, save_directory: Any, *args: Any, save_original_format: bool = True, **kwargs: Any
    ) -> Any:
        if len(args) >= 2:  # `is_main_process, state_dict` given by position
            kwargs.setdefault("is_main_process", args[0])
            kwargs["state_dict"], args = args[1], args[2:]
        if save_original_format:
            state_dict = kwargs.get("state_dict")
            full = state_dict if state_dict is not None else self.state_dict()
            reversed_ = _save.reverse_state_dict(self, full)
            if reversed_ is not None:
                converted, untouched, _scopes = reversed_
                out = {k: full[k] for k in untouched}
                out.update(converted)
                kwargs["state_dict"] = out
        return original(self, save_directory, *args, **kwargs)

    return save_pretrained


def installed() -> bool:
    """Whether the conversion wrappers are in place."""
    return _wrappers.installed


def install() -> None:
    """Install the load/save wrappers (idempotent)."""
    mu = _modeling_utils()
    base = mu.PreTrainedModel
    _wrappers.install(
        [
            (mu, "_find_missing_and_unexpected_keys", _wrap_find_missing),
            (base, "_load_pretrained_model", _wrap_load_pretrained_model),
            (base, "_adjust_missing_and_unexpected_keys", _wrap_adjust),
            (base, "post_init", _wrap_post_init),
            (base, "save_pretrained", _wrap_save_pretrained),
        ]
    )


def uninstall() -> None:
    """Remove the load/save wrappers (idempotent)."""
    _wrappers.uninstall()
