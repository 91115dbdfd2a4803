"""Ready-made grafts: fused QKV attention, fused gate/up MLP, per-expert ``nn.Linear`` experts, chunked LM loss.

Each graft is a :class:`modelgraft.Graft`: the classes to replace plus the checkpoint conversions
that go with them, for a set of model types. Pass it wherever modelgraft takes a patch mapping::

    graft = fused_qkv() + linear_experts()
    with modelgraft.patched(graft):            # or graft.applied()
        model = AutoModelForCausalLM.from_pretrained(path)
    modelgraft.graft_model(built_model, graft) # a model that is already built
    modelgraft.register_graft(graft)           # global, until modelgraft.unregister_graft(graft)

Example:
    >>> from modelgraft.grafts import fused_gate_up, fused_qkv
    >>> graft = fused_qkv("qwen3") + fused_gate_up("qwen3")
    >>> sorted(graft.mapping)
    ['Qwen3Attention', 'Qwen3MLP']
"""

from __future__ import annotations

from modelgraft.errors import (
    ExpertsAdapterError,
    ExpertsImplementationError,
    GraftConflictError,
    UnsupportedFamilyError,
)
from modelgraft.graft import Graft
from modelgraft.grafts import _peft
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
    "ExpertsAdapterError",
    "ExpertsImplementationError",
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

# PEFT's adjustments (and the refusal of adapters PEFT would load incompletely) are in place as soon
# as modelgraft's grafts are imported, also in a process that only loads a plain model.
_peft.ensure_installed()
