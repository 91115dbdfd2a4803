"""Manual construction of the documentation: ``apply_patches`` for ``Model(config)``.

Adapted only in its import lines and in using a tiny ``LlamaConfig`` and a tiny local checkpoint
instead of the full-size defaults and ``meta-llama/Llama-3.2-1B``. ``CustomAttention`` is a stand-in.
"""

from transformers import LlamaConfig, LlamaModel
from transformers.models.llama.modeling_llama import LlamaAttention

from _tiny import tiny_checkpoint
from modelgraft import apply_patches, register_patch_mapping

# Tiny stand-in for the full-size default config (``LlamaConfig()`` has 6.7B parameters).
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=128)


class CustomAttention(LlamaAttention):  # stand-in
    pass


# Register patch globally
register_patch_mapping(mapping={"LlamaAttention": CustomAttention})

# For manual construction, you need the context manager
with apply_patches():
    model = LlamaModel(LlamaConfig(**TINY))  # Uses CustomAttention
print("inside apply_patches:", type(model.layers[0].self_attn).__name__)

# Without the context manager, manual construction uses original classes
model = LlamaModel(LlamaConfig(**TINY))  # Uses LlamaAttention
print("without it:", type(model.layers[0].self_attn).__name__)

# But from_pretrained and from_config will always apply registered patches
model = LlamaModel.from_pretrained(tiny_checkpoint("llama"))  # Uses CustomAttention
print("from_pretrained:", type(model.layers[0].self_attn).__name__)
