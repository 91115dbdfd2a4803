"""Quick start of the documentation: replace LlamaAttention in every load.

Adapted only in its import line (``transformers.monkey_patching`` -> ``modelgraft``) and in loading
a tiny local Llama checkpoint instead of ``meta-llama/Llama-3.2-1B``.
"""

from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaAttention

from _tiny import tiny_checkpoint
from modelgraft import register_patch_mapping


# Define your replacement class (must inherit from nn.Module)
class CustomLlamaAttention(LlamaAttention):
    def forward(self, *args, **kwargs):
        # Your custom implementation
        print("Using custom attention!")
        return super().forward(*args, **kwargs)


# Register the patch globally (only applies to transformers modeling modules)
register_patch_mapping(mapping={"LlamaAttention": CustomLlamaAttention})

# Load a model - the patch is automatically applied during initialization
model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama"))

# All LlamaAttention layers in the model are now CustomLlamaAttention instances
print(type(model.model.layers[0].self_attn))  # <class '__main__.CustomLlamaAttention'>
