"""The MoE layers of a model that record and replay hook, checked to be supported, and the model
that owns them behind the wrappers users put around it.

A module of its own so that the trace (``RoutingTrace.for_model``) and the engine adapters can
find a model's MoE layers without importing ``routing`` (which imports the trace).

Wrappers (PEFT's ``PeftModel`` and its tuner, ``torch.compile``'s ``OptimizedModule``, DDP, FSDP,
DeepSpeed's engine, activation-checkpoint wrappers) hold the model as one child and run it through
its ``__call__``, but ``generate`` runs the inner model directly: :func:`wrapper_chain` lists the
modules from the one given down to the one that owns the MoE layers, so that record and replay hook
where the forwards really run.

Example:
    >>> import torch
    >>> moe_layers(torch.nn.Linear(2, 2))
    Traceback (most recent call last):
    ...
    modelgraft.errors.RoutingError: `Linear` has no MoE router module ...
"""

from __future__ import annotations

from torch import nn

from modelgraft.errors import RoutingError
from modelgraft.moe._discovery import MoELayer, find_moe_layers, unsupported_reason

__all__ = ["moe_layers", "wrapper_chain"]

# The one child under which wrappers keep the wrapped module: torch.compile, DDP/DataParallel and
# DeepSpeed, FSDP1, torch's checkpoint wrapper. A transformers model has several children (its
# backbone and head, or embeddings and layers), so it is never taken for a wrapper.
_WRAPPED_CHILD = ("_orig_mod", "module", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def _wrapped(module: nn.Module) -> nn.Module | None:
    """The module ``module`` wraps, or ``None`` when it is not a wrapper."""
    children = module._modules
    if type(module).__module__.split(".")[0] == "peft":
        # PeftModel keeps its tuner (or, for prompt learning, the model) as `base_model`, next to
        # prompt encoders; a tuner (LoraModel, ...) keeps the model as `model`.
        for name in ("base_model", "model"):
            child = children.get(name)
            if isinstance(child, nn.Module):
                return child
        return None
    if len(children) == 1:
        ((name, child),) = children.items()
        if name in _WRAPPED_CHILD and isinstance(child, nn.Module):
            return child
    return None


def wrapper_chain(model: nn.Module) -> list[nn.Module]:
    """``model``, then each module it wraps, down to the model that owns the MoE layers (last).

    Example:
        >>> import torch
        >>> inner = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
        >>> outer = torch.nn.Module()
        >>> outer.module = inner
        >>> [type(m).__name__ for m in wrapper_chain(outer)]
        ['Module', 'Sequential']
    """
    chain = [model]
    while (inner := _wrapped(chain[-1])) is not None and all(inner is not m for m in chain):
        chain.append(inner)
    return chain


def moe_layers(model: nn.Module) -> list[MoELayer]:
    """The MoE layers of ``model`` that record/replay would hook, in model order.

    Raises:
        RoutingError: the model has no MoE layer, or a family whose selection is not a top-k.
    """
    layers = find_moe_layers(model)
    if not layers:
        raise RoutingError(
            f"`{type(model).__name__}` has no MoE router module (a `*Router`/`*Gate` next to an "
            "`*Experts` module); record/replay needs a Mixture-of-Experts model."
        )
    for layer in layers:
        reason = unsupported_reason(layer.router) or unsupported_reason(layer.scope)
        if reason:
            raise RoutingError(
                f"MoE layer `{layer.name}` ({type(layer.router).__name__}) cannot be recorded or replayed: {reason}."
            )
    scopes = [id(layer.scope) for layer in layers]
    if len(set(scopes)) != len(scopes):
        raise RoutingError(
            f"Two routers of `{type(model).__name__}` share one MoE block; one block per router is supported."
        )
    return layers
