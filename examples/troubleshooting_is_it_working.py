"""Troubleshooting "how do I know my patch works", from the documentation.

Adapted only in its import lines and in loading a tiny local Llama checkpoint instead of
``meta-llama/Llama-3.2-1B``; a patch is registered first (stand-in class) so there is something to
see, and the last line prints modelgraft's report, which lists every replaced module.
"""

from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaAttention

from _tiny import tiny_checkpoint
from modelgraft import register_patch_mapping, report


class CustomAttention(LlamaAttention):  # stand-in
    pass


register_patch_mapping(mapping={"LlamaAttention": CustomAttention})

model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama"))

# Check the type of a specific module
print(type(model.model.layers[0].self_attn))  # Should show your custom class

# Or iterate through all modules
for name, module in model.named_modules():
    if "attention" in name.lower():
        print(f"{name}: {type(module)}")

# --- not in the documentation: Llama names its attention `self_attn`, so the loop above finds the
# `post_attention_layernorm`s instead; modelgraft's report lists the replaced modules whatever their names.
print(report(model).summary())
