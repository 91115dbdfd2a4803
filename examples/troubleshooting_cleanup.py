"""Troubleshooting "cleaning up patches", from the documentation: ``clear_patch_mapping`` in ``finally``.

Adapted only in its import lines and in loading a tiny local Llama checkpoint instead of
``meta-llama/Llama-2-7b-chat-hf``; ``CustomAttention`` is a stand-in. The last lines show that a
load after the cleanup is plain again.
"""

from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaAttention

from _tiny import tiny_checkpoint
from modelgraft import clear_patch_mapping, register_patch_mapping


class CustomAttention(LlamaAttention):  # stand-in
    pass


try:
    register_patch_mapping(mapping={"LlamaAttention": CustomAttention})
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama"))
    # ... use model ...
    print("inside:", type(model.model.layers[0].self_attn).__name__)
finally:
    clear_patch_mapping()  # Always clean up

# --- not in the documentation
model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama"))
print("after cleanup:", type(model.model.layers[0].self_attn).__name__)
