"""Pattern matching of the documentation: regular expressions as keys, and exact names winning.

Adapted only in its import line; ``CustomAttention`` and ``CustomExperts`` are minimal stand-ins,
and the last lines load a tiny Llama to show which key won.
"""

from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaAttention
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeExperts

from _tiny import tiny_checkpoint
from modelgraft import clear_patch_mapping, register_patch_mapping


class CustomAttention(LlamaAttention):  # stand-in
    pass


class CustomExperts(Qwen2MoeExperts):  # stand-in
    pass


# Match all classes containing "Attention"
register_patch_mapping(mapping={".*Attention": CustomAttention})

# More examples
register_patch_mapping(
    mapping={
        ".*MoeExperts$": CustomExperts,  # Ends with "MoeExperts"
        "^Llama\\d+Attention$": CustomAttention,  # Llama2Attention, Llama3Attention, etc.
    }
)

# --- not in the documentation: exact names take precedence over patterns
model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama"))
print("with `.*Attention`:", type(model.model.layers[0].self_attn).__name__)


class ExactLlamaAttention(LlamaAttention):
    pass


register_patch_mapping(mapping={"LlamaAttention": ExactLlamaAttention})
model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama"))
print("with `LlamaAttention` too:", type(model.model.layers[0].self_attn).__name__)
clear_patch_mapping()
