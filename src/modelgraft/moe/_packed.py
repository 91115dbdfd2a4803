"""Keep a packed forward inside ``replay_routing`` from attending across its sequences.

transformers separates the sequences of a packed row (``position_ids`` restarting at 0, no
attention mask) only when the forward has no cache: with a cache, or with a 2-D attention mask
that marks the tokens of two sequences as real, the row is one causal sequence and every token
attends to the sequences packed before it. The loss is then silently wrong; the replayed experts
are right, so nothing else would show it.

Inside a replay block a forward pre-hook on the model looks at each forward:

* packed ``position_ids`` with ``use_cache`` not given: the forward runs with ``use_cache=False``
  (a training forward does not need the cache; the outputs are the packed-correct ones);
* packed ``position_ids`` with ``use_cache=True``, a cache passed in, or a 2-D attention mask that
  joins two packed sequences: refused with :class:`~modelgraft.errors.RoutingError`.

Positions that restart only where the attention mask is 0 (a padded batch's positions,
``mask.cumsum(-1) - 1``) are not packing, and 3-D positions (multimodal rotary) are left alone.

Example:
    >>> import torch
    >>> restarts(torch.tensor([[0, 1, 2, 0, 1]]), None)
    True
    >>> restarts(torch.tensor([[0, 0, 0, 1, 2]]), torch.tensor([[0, 0, 1, 1, 1]]))  # left padding
    False
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from modelgraft.errors import RoutingError

__all__ = ["guard_packed_forwards", "restarts"]

#: the keyword a cache is passed under: ``cache`` on transformers 5.2x, ``past_key_values`` before
_CACHE_NAMES = ("cache", "past_key_values")


def restarts(position_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> bool:
    """Whether a row's positions restart between two tokens the mask (if any) marks as real."""
    positions = position_ids if position_ids.dim() == 2 else position_ids.reshape(1, -1)
    if positions.shape[-1] < 2:
        return False
    jumps = positions[:, 1:] != positions[:, :-1] + 1
    if attention_mask is not None:
        real = attention_mask.to(torch.bool)
        if real.shape[0] != jumps.shape[0]:
            real = real.expand(jumps.shape[0], -1)
        jumps = jumps & real[:, 1:] & real[:, :-1]
    return bool(jumps.any())


def _named(forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    if len(args) <= 1:  # input_ids (or nothing) positionally: everything else is named
        return kwargs
    try:
        bound = inspect.signature(forward).bind_partial(*args, **kwargs)
    except TypeError:
        return kwargs
    return dict(bound.arguments)


def _check(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """``kwargs`` with ``use_cache=False`` added when needed, ``None`` to leave them, or an error."""
    named = _named(model.forward, args, kwargs)
    positions = named.get("position_ids")
    if not isinstance(positions, torch.Tensor) or positions.dim() not in (1, 2):
        return None
    mask = named.get("attention_mask")
    mask_2d = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
    if mask_2d is not None and mask_2d.shape[-1] != positions.shape[-1]:
        return None  # a mask over cached tokens too: not a packed training forward
    if not restarts(positions, mask_2d):
        return None
    where = f"`{type(model).__name__}` was called with packed `position_ids` (restarting inside a row)"
    if mask_2d is not None:
        raise RoutingError(
            f"{where} and a 2-D `attention_mask` that marks tokens of two packed sequences as real: transformers "
            "then lets each sequence attend to the ones packed before it. Pass `attention_mask=None` for a packed "
            "row (transformers separates the sequences by their positions), or pad the sequences instead of "
            "packing them."
        )
    cache = next((named[n] for n in _CACHE_NAMES if named.get(n) is not None), None)
    if cache is not None or named.get("use_cache") is True:
        given = "a cache" if cache is not None else "`use_cache=True`"
        raise RoutingError(
            f"{where} and {given}: with a cache transformers does not separate packed sequences, so each one "
            "attends to the ones packed before it and the loss is wrong. Pass `use_cache=False` (and no cache) for "
            "a packed forward; `pack_sequences` returns it with the packed tensors."
        )
    if named.get("use_cache") is not None or ("use_cache" in named and "use_cache" not in kwargs):
        return None  # use_cache=False given (or None passed positionally: left as the caller wrote it)
    if not _takes_use_cache(model.forward):
        return None
    return {**kwargs, "use_cache": False}


def _takes_use_cache(forward: Any) -> bool:
    try:
        parameters = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "use_cache" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def guard_packed_forwards(model: nn.Module) -> RemovableHandle:
    """Install the check on ``model``'s forward; remove the returned handle when the block ends."""

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        changed = _check(module, args, kwargs)
        return None if changed is None else (args, changed)

    return model.register_forward_pre_hook(hook, with_kwargs=True)
