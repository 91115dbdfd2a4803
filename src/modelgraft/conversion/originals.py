"""The original model's keys and shapes: what the checkpoint layout of a grafted model is.

Built from the model's own class and config on the ``meta`` device (no memory), with the original
classes bound and no registration visible, so it is the un-grafted model whatever is patched. The
load step checks conversion sources against it; the save step plans the reverse from it.

Example:
    >>> import torch
    >>> from transformers import LlamaConfig, LlamaModel
    >>> config = LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1,
    ...                      num_attention_heads=2, num_key_value_heads=2, vocab_size=16)
    >>> original_shapes(LlamaModel(config))["layers.0.mlp.up_proj.weight"]
    torch.Size([16, 8])
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, cast

import torch

from modelgraft import _compat, registry, swap
from modelgraft._forksafe import ForkSafeLock

__all__ = ["cached_original_shapes", "original_shapes"]

# (model class, config as JSON) -> the original model's shapes, for repeated loads of one model.
_ORIGINALS: OrderedDict[tuple[type, str], dict[str, torch.Size]] = OrderedDict()
_ORIGINALS_KEPT = 8
_originals_lock = ForkSafeLock()


def cached_original_shapes(model: torch.nn.Module) -> dict[str, torch.Size]:
    """Keys and shapes of the original (un-grafted) model: the meta build that saving uses.

    It runs in an empty context (no load in progress, no ``patched`` block) with the global
    registry hidden, so the sub-models a composite model builds through ``from_config`` while it
    is constructed are original too, instead of joining this load's swap. The build depends only
    on the class and the config, so the last few are kept.
    """
    try:
        key: tuple[type, str] | None = (type(model), cast(Any, model).config.to_json_string())
    except (AttributeError, TypeError, ValueError):  # no config, or one JSON cannot hold: not kept
        key = None
    with _originals_lock:
        found = _ORIGINALS.get(key) if key is not None else None
    if found is not None:
        return found

    def build() -> dict[str, torch.Size]:
        with registry.isolated():
            return original_shapes(model)

    shapes = contextvars.Context().run(build)
    if key is not None:
        with _originals_lock:
            _ORIGINALS[key] = shapes
            while len(_ORIGINALS) > _ORIGINALS_KEPT:
                _ORIGINALS.popitem(last=False)
    return shapes


@contextlib.contextmanager
def _originals_bound() -> Iterator[None]:
    """Hold the core's construction lock (no other thread's class swap goes live meanwhile) and
    bind the original classes back, in case the save runs inside an ``apply_patches()`` block."""
    with swap.LOCK, swap.suspended():
        yield


def _torch_dtypes(config: Any) -> Any:
    """``config`` with ``dtype`` fields named by string (``"float32"``, as a loaded config holds them)
    turned into torch dtypes, in it and its sub-configs: some modules build tensors with
    ``dtype=config.dtype`` in their constructor (Apertus 1.5's xIELU) and fail on a string."""
    seen: set[int] = set()

    def fix(cfg: Any) -> None:
        if id(cfg) in seen or not hasattr(cfg, "to_dict"):
            return
        seen.add(id(cfg))
        value = getattr(cfg, "dtype", None)
        if isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype):
            cfg.dtype = getattr(torch, value)
        for name in getattr(cfg, "sub_configs", None) or {}:
            fix(getattr(cfg, name, None))

    fix(config)
    return config


def original_shapes(model: torch.nn.Module) -> dict[str, torch.Size]:
    """Keys and shapes of the original (unpatched) model class, built on the meta device."""
    with _originals_bound(), _compat.TRANSFORMERS.meta_device():
        original = type(model)(_torch_dtypes(copy.deepcopy(model.config)))
    return {k: v.shape for k, v in original.state_dict().items()}
