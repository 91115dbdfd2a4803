"""The MoE layers of a model that record and replay hook, checked to be supported.

A module of its own so that the trace (``RoutingTrace.for_model``) and the engine adapters can
find a model's MoE layers without importing ``routing`` (which imports the trace).

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

__all__ = ["moe_layers"]


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
