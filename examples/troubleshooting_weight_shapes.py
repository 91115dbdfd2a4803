"""Troubleshooting "weight shape mismatch", from the documentation: a fused attention plus its conversion.

Adapted in its import lines (``Concatenate``, which the documentation uses without importing, is
imported too) and in loading a tiny local Llama checkpoint. The documentation leaves
``LlamaFusedAttention`` to the reader: the ready-made one of ``modelgraft.grafts`` is used. The last
lines compare the logits with the plain model's.
"""

import torch
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaAttention

from _tiny import tiny_checkpoint
from modelgraft import (
    Concatenate,
    WeightConverter,
    register_checkpoint_conversion_mapping,
    register_patch_mapping,
)
from modelgraft.grafts import fused_qkv_class

LlamaFusedAttention = fused_qkv_class(LlamaAttention)
CHECKPOINT = tiny_checkpoint("llama")  # written by plain transformers before anything is registered

register_patch_mapping(
    mapping={
        "LlamaAttention": LlamaFusedAttention,
    }
)

register_checkpoint_conversion_mapping(
    model_type_or_class_name="llama",
    mapping=[
        WeightConverter(
            source_patterns=["q_proj", "k_proj", "v_proj"],
            target_patterns=["qkv_proj"],
            operations=[
                Concatenate(dim=0),
            ],
        )
    ],
    overwrite=True,
)

# --- not in the documentation: load, then compare with the plain model
from modelgraft import clear_patch_mapping, unregister_checkpoint_conversion_mapping  # noqa: E402

model = AutoModelForCausalLM.from_pretrained(CHECKPOINT)
attn = model.model.layers[0].self_attn
print(type(attn).__name__, "qkv_proj", tuple(attn.qkv_proj.weight.shape))
clear_patch_mapping()
unregister_checkpoint_conversion_mapping("llama")
plain = AutoModelForCausalLM.from_pretrained(CHECKPOINT)
ids = torch.tensor([[5, 6, 7, 8]])
with torch.no_grad():
    print(f"max |logits difference| = {(model(ids).logits - plain(ids).logits).abs().max().item():.2e}")
