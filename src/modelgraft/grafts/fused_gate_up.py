"""Fused gate/up MLP: one ``gate_up_proj`` instead of ``gate_proj`` and ``up_proj``.

For Llama-like MLPs (``down(act(gate(x)) * up(x))``), :func:`fused_gate_up_class` builds a subclass
whose ``__init__`` runs the original one and then fuses the two projections (see
:mod:`modelgraft.grafts._fused`), so the family's own forward runs unchanged. Dense MLPs and the
shared experts of MoE models are covered; per-expert weights of MoE experts are not MLP modules
and are left alone. The checkpoint conversion is ``Concatenate(dim=0)`` of gate and up.

Example:
    >>> from transformers.models.llama.modeling_llama import LlamaMLP
    >>> from modelgraft.testing import tiny_config
    >>> mlp = fused_gate_up_class(LlamaMLP)(tiny_config("llama"))
    >>> sorted(name for name, _ in mlp.named_parameters())
    ['down_proj.weight', 'gate_up_proj.weight']
"""

from __future__ import annotations

from torch import nn

from modelgraft._families import FUSED_GATE_UP, covered_by
from modelgraft.grafts._common import Graft, _Part, fused_linears_part
from modelgraft.grafts._fused import fused_subclass

__all__ = ["FUSED_GATE_UP_FAMILIES", "GATE_UP_NAMES", "fused_gate_up", "fused_gate_up_class"]

GATE_UP_NAMES = ("gate_proj", "up_proj")
FUSED_NAME = "gate_up_proj"

#: Model types :func:`fused_gate_up` covers by default (each one tested).
FUSED_GATE_UP_FAMILIES: tuple[str, ...] = covered_by(FUSED_GATE_UP)


def fused_gate_up_class(mlp_class: type[nn.Module]) -> type[nn.Module]:
    """Return the fused gate/up subclass of ``mlp_class`` (the same class on every call)."""
    return fused_subclass(mlp_class, GATE_UP_NAMES, FUSED_NAME, "FusedGateUp")


def _part(model_type: str) -> _Part:
    return fused_linears_part(
        model_type,
        GATE_UP_NAMES,
        FUSED_NAME,
        fused_gate_up_class,
        ("MLP", "fused gate/up", FUSED_GATE_UP_FAMILIES),
    )


def fused_gate_up(*model_types: str) -> Graft:
    """The fused gate/up MLP graft for ``model_types`` (default: :data:`FUSED_GATE_UP_FAMILIES`).

    Example:
        >>> sorted(fused_gate_up("deepseek_v3").mapping)
        ['DeepseekV3MLP']
    """
    return Graft.of("fused gate/up", model_types, FUSED_GATE_UP_FAMILIES, _part)
