"""Ready-made grafts: fused QKV attention, fused gate/up MLP, per-expert ``nn.Linear`` experts, chunked LM loss.

Each graft is a :class:`Graft`: a patch mapping plus the checkpoint conversions that go with it,
for a set of model types. Use one globally or for one block::

    graft = fused_qkv() + linear_experts()
    with graft.applied():                      # or modelgraft.patched(graft.mapping, conversions=graft.conversions)
        model = AutoModelForCausalLM.from_pretrained(path)
    graft.register()                           # global, until graft.unregister()

Example:
    >>> from modelgraft.grafts import fused_gate_up, fused_qkv
    >>> graft = fused_qkv("qwen3") + fused_gate_up("qwen3")
    >>> sorted(graft.mapping)
    ['Qwen3Attention', 'Qwen3MLP']
"""

from __future__ import annotations

from modelgraft.grafts._bundle import Graft, GraftConflictError, UnsupportedFamilyError
from modelgraft.grafts._fused import FusedSlice, FusionError
from modelgraft.grafts.chunked_loss import (
    CHUNKED_LM_LOSS_FAMILIES,
    DoubleBackwardError,
    LossInputError,
    chunked_lm_loss,
    chunked_lm_loss_class,
    graft_chunked_lm_loss,
)
from modelgraft.grafts.fused_gate_up import FUSED_GATE_UP_FAMILIES, fused_gate_up, fused_gate_up_class
from modelgraft.grafts.fused_qkv import FUSED_QKV_FAMILIES, fused_qkv, fused_qkv_class
from modelgraft.grafts.linear_experts import (
    LINEAR_EXPERTS_FAMILIES,
    LinearExpert,
    linear_experts,
    linear_experts_class,
)

__all__ = [
    "CHUNKED_LM_LOSS_FAMILIES",
    "FUSED_GATE_UP_FAMILIES",
    "FUSED_QKV_FAMILIES",
    "LINEAR_EXPERTS_FAMILIES",
    "DoubleBackwardError",
    "FusedSlice",
    "FusionError",
    "Graft",
    "GraftConflictError",
    "LinearExpert",
    "LossInputError",
    "UnsupportedFamilyError",
    "chunked_lm_loss",
    "chunked_lm_loss_class",
    "fused_gate_up",
    "fused_gate_up_class",
    "fused_qkv",
    "fused_qkv_class",
    "graft_chunked_lm_loss",
    "linear_experts",
    "linear_experts_class",
]
