"""The conversion engine's wiring into transformers 4.57 (the counterpart of
:mod:`modelgraft._compat._conversion_v5`, which wires it into 5.x); see :mod:`modelgraft._compat.engine`.

4.57 has no conversion machinery of its own: one checkpoint key fills one parameter, and
``save_pretrained`` writes ``state_dict()`` as it is. The engine is the
:class:`~modelgraft._compat.engine.ConversionEngine` given to :func:`conversion_wrappers`; this module never
imports it. Wrapped (the ``conversion`` sites of :mod:`modelgraft._compat.wraps`), in
``transformers.modeling_utils``:

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
    >>> from modelgraft._compat.wraps import sites
    >>> from dataclasses import replace
    >>> from modelgraft._compat._features import FEATURES
    >>> line = replace(FEATURES, builtin_conversion=False)
    >>> sorted(conversion_wrappers(engine=None)) == sorted(s.attribute for s in sites("conversion", features=line))
    True
"""

from __future__ import annotations

import re
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

from modelgraft._compat.engine import ConversionEngine, LoadRequest, wrap_post_init
from modelgraft._compat.wraps import Makers

__all__ = ["conversion_wrappers"]


@dataclass
class _Load:
    """What the inner wrappers of one ``_load_pretrained_model`` call need to share."""

    files: list[str] | None
    state_dict: dict[Any, Any] | None
    device_map: dict[Any, Any] | None
    key_mapping: dict[str, str] | None
    quantizer: Any = None
    consumed: set[str] = field(default_factory=set)


_current: ContextVar[_Load | None] = ContextVar("modelgraft_v4_conversion_load", default=None)


def _renamer(model: Any, key_mapping: dict[str, str] | None) -> Any:
    """The loader's own key renamings, as 4.57 applies them (the class's legacy-layout renames, then
    the first matching ``key_mapping`` pattern); the base-model prefix is left to the engine."""

    def rename(key: str) -> str:
        new_key: str = model._fix_state_dict_key_on_load(key)[0]
        for pattern, replacement in (key_mapping or {}).items():
            new_key, count = re.subn(pattern, replacement, new_key)
            if count:
                break
        return new_key

    return rename


def _wrap_load_pretrained_model(engine: ConversionEngine) -> Any:
    def wrap(original: Any) -> Any:
        def _load_pretrained_model(
            cls: type, model: Any, state_dict: Any, checkpoint_files: Any, *args: Any, **kwargs: Any
        ) -> Any:
            if not engine.active():
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

    return wrap


def _wrap_find_missing(engine: ConversionEngine) -> Any:
    def wrap(original: Any) -> Any:
        def _find_missing_and_unexpected_keys(model: Any, *args: Any, **kwargs: Any) -> Any:
            missing, unexpected = original(model, *args, **kwargs)
            load = _current.get()
            if load is None or (load.files is None and load.state_dict is None):
                return missing, unexpected
            still_missing, left_unexpected = set(missing), set(unexpected)
            engine.load(
                LoadRequest(
                    model=model,
                    checkpoint_files=load.files,
                    missing_keys=still_missing,
                    unexpected_keys=left_unexpected,
                    device_map=load.device_map,
                    rename=_renamer(model, load.key_mapping),
                    place=_unquantized_notice(engine, model, load.quantizer),
                    state_dict=load.state_dict,  # `from_pretrained(..., state_dict=)`: converted like files
                )
            )
            load.consumed |= set(unexpected) - left_unexpected
            # Consumed keys stay "unexpected" until the shards are loaded, so transformers does not try
            # to load them into parameters that do not exist; they are dropped from the final report.
            return [k for k in missing if k in still_missing], unexpected

        return _find_missing_and_unexpected_keys

    return wrap


def _unquantized_notice(engine: ConversionEngine, model: Any, quantizer: Any) -> Any:
    """4.57 quantizes only the weights it reads itself: say so for each converted weight (a problem
    in the report, an error in strict mode) instead of returning a partly quantized model silently."""
    if quantizer is None:
        return None

    def place(key: str, tensor: torch.Tensor) -> bool:
        engine.report_problem(
            model,
            f"`{key}` was built by a modelgraft conversion and is not quantized by "
            f"{type(quantizer).__name__}: transformers 4.57 quantizes only the weights it loads itself. "
            "Use transformers 5.x, or keep these modules out of quantization (`modules_to_not_convert`).",
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


def _wrap_save_pretrained(engine: ConversionEngine) -> Any:
    def wrap(original: Any) -> Any:
        def save_pretrained(
            self: Any, save_directory: Any, *args: Any, save_original_format: bool = True, **kwargs: Any
        ) -> Any:
            if len(args) >= 2:  # `is_main_process, state_dict` given by position
                kwargs.setdefault("is_main_process", args[0])
                kwargs["state_dict"], args = args[1], args[2:]
            if save_original_format:
                state_dict = kwargs.get("state_dict")
                full = state_dict if state_dict is not None else self.state_dict()
                reversed_ = engine.reverse(self, full)
                if reversed_ is not None:
                    out = {k: full[k] for k in reversed_.untouched}
                    out.update(reversed_.converted)
                    kwargs["state_dict"] = out
            return original(self, save_directory, *args, **kwargs)

        return save_pretrained

    return wrap


def conversion_wrappers(engine: ConversionEngine) -> Makers:
    """The load/save wrappers calling ``engine``, for the ``conversion`` sites (see
    :meth:`~modelgraft._compat.line.TransformersLine.conversion_wrappers`)."""
    return {
        "_find_missing_and_unexpected_keys": _wrap_find_missing(engine),
        "_load_pretrained_model": _wrap_load_pretrained_model(engine),
        "_adjust_missing_and_unexpected_keys": _wrap_adjust,
        "post_init": wrap_post_init(engine),
        "save_pretrained": _wrap_save_pretrained(engine),
    }
