"""Weight sync of a PEFT (LoRA) model: the base model's original names, adapters merged.

An inference engine holds the base model, not the adapters: what it needs after each step is the
base weights with the adapters merged in, under the checkpoint's names. That is what verl and
OpenRLHF do for LoRA policies: ``merge_adapter()``, push the merged weights, ``unmerge_adapter()``.
:func:`modelgraft.original_state_dict` of a PEFT model follows that contract:

* every LoRA layer must be merged (``model.merge_adapter()``); an unmerged adapter is refused,
  since its weights would silently not reach the engine;
* while the pairs are yielded, each LoRA wrapper stands aside for its base layer (put back when the
  iteration ends, is closed or fails), so the names and layout are exactly those of the base
  model (``model.layers.0.self_attn.q_proj.weight``, original checkpoint layout for grafted
  modules), with no ``base_model.model.`` prefix, no ``base_layer`` and no ``lora_`` tensors;
* ``modules_to_save`` copies and other PEFT tuners than LoRA-style layers are refused.

Example:
    >>> import torch
    >>> _peft_layers(torch.nn.Linear(2, 2))
    []
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from modelgraft.errors import ConversionError

__all__ = ["without_adapters"]


def _is_peft(module: nn.Module) -> bool:
    return type(module).__module__.startswith("peft.")


def _peft_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost PEFT modules of ``model`` (LoRA wrappers, ``modules_to_save`` wrappers)."""
    found: list[tuple[str, nn.Module]] = []
    skip: str | None = None
    for name, module in model.named_modules():
        if skip is not None and name.startswith(skip + "."):
            continue
        if name and _is_peft(module) and not isinstance(module, (nn.ModuleDict, nn.ParameterDict)):
            found.append((name, module))
            skip = name
    return found


def without_adapters(model: nn.Module) -> tuple[nn.Module, Callable[[], None] | None]:
    """The base model to stream, its LoRA wrappers replaced by their merged base layers, and how to put
    them back (``None`` when ``model`` holds no PEFT layer: nothing was changed).

    Raises:
        ConversionError: an adapter that is not merged, ``modules_to_save``, or a PEFT layer without
            a ``base_layer``, naming the module.
    """
    get_base: Any = getattr(model, "get_base_model", None)
    base = get_base() if _is_peft(model) and callable(get_base) else model
    layers = _peft_layers(base)
    if not layers:
        return base, None
    for name, layer in layers:
        if not hasattr(layer, "base_layer") or not isinstance(layer.base_layer, nn.Module):
            raise ConversionError(
                f"`original_state_dict` cannot stream `{name}` ({type(layer).__name__}, e.g. `modules_to_save`): "
                "only LoRA-style layers with a `base_layer` are supported. Sync a merged copy "
                "(`merge_and_unload()` of a copy) instead."
            )
        active = [a for a in getattr(layer, "active_adapters", ()) if a in getattr(layer, "lora_A", {})]
        if active and not getattr(layer, "merged", False):
            raise ConversionError(
                f"`original_state_dict` of a PEFT model yields the base weights with the adapters merged, but the "
                f"adapter of `{name}` is not merged, so the engine would get the weights without it. Call "
                "`model.merge_adapter()` before syncing and `model.unmerge_adapter()` after (what verl and OpenRLHF "
                "do for LoRA)."
            )
    parents = []
    for name, layer in layers:
        parent_name, _, child = name.rpartition(".")
        parent = base.get_submodule(parent_name) if parent_name else base
        parents.append((parent, child, layer))
    for parent, child, layer in parents:
        setattr(parent, child, layer.base_layer)

    def restore() -> None:
        for parent, child, layer in parents:
            setattr(parent, child, layer)

    return base, restore


def restoring(
    pairs: Iterator[tuple[str, torch.Tensor]], restore: Callable[[], None]
) -> Iterator[tuple[str, Any]]:
    """``pairs``, then ``restore()`` when the iteration ends, is closed or fails."""
    try:
        yield from pairs
    finally:
        restore()
