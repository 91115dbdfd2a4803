"""The examples of the documentation's API reference, one after the other.

Adapted only in their import lines, in loading tiny local checkpoints instead of hub models, and in a
tiny ``Qwen2MoeConfig`` for ``apply_patches``. The documentation leaves ``SequentialExperts``,
``CustomAttention``, ``CustomLlamaAttention`` and ``CustomExperts`` to the reader: stand-ins that
subclass the classes they replace are defined here, so the loads build.
"""

from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen2MoeModel
from transformers.models.llama.modeling_llama import LlamaAttention
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeExperts

from _tiny import tiny_checkpoint
from modelgraft import (
    apply_patches,
    clear_patch_mapping,
    get_patch_mapping,
    register_patch_mapping,
    unregister_patch_mapping,
)
from modelgraft.testing import tiny_overrides

TINY_QWEN2_MOE = tiny_overrides("qwen2_moe")


class SequentialExperts(Qwen2MoeExperts):  # stand-in
    pass


class CustomExperts(Qwen2MoeExperts):  # stand-in
    pass


class CustomAttention(LlamaAttention):  # stand-in
    pass


class CustomLlamaAttention(LlamaAttention):  # stand-in
    pass


# register_patch_mapping ------------------------------------------------------------------------------
# Register exact class name
register_patch_mapping(mapping={"Qwen2MoeExperts": SequentialExperts})

# Register with regex pattern to match multiple classes
register_patch_mapping(
    mapping={".*Attention": CustomAttention}  # Matches LlamaAttention, MistralAttention, etc.
)

# Match specific model versions
register_patch_mapping(
    mapping={"^Llama\\d+Attention$": CustomLlamaAttention}  # Matches Llama2Attention, Llama3Attention
)

# The patch will be automatically applied during loading
model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama"))
print("register_patch_mapping:", type(model.model.layers[0].self_attn).__name__)
clear_patch_mapping()

# unregister_patch_mapping ----------------------------------------------------------------------------
# Register a patch
register_patch_mapping(mapping={"Qwen2MoeExperts": CustomExperts})

# Unregister the patch
unregister_patch_mapping(["Qwen2MoeExperts"])

# The patch will no longer be applied during loading
model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("qwen2_moe"))
print("unregister_patch_mapping:", type(model.model.layers[0].mlp.experts).__name__)

# clear_patch_mapping ---------------------------------------------------------------------------------
# Register some patches
register_patch_mapping(mapping={"Qwen2MoeExperts": CustomExperts})

# Clear all patches
clear_patch_mapping()
print("clear_patch_mapping:", get_patch_mapping())

# apply_patches ---------------------------------------------------------------------------------------
# Register a patch
register_patch_mapping(mapping={"Qwen2MoeExperts": CustomExperts})

# Apply patches within the context
with apply_patches():
    # The model will use CustomExperts instead of Qwen2MoeExperts
    model = Qwen2MoeModel(Qwen2MoeConfig(**TINY_QWEN2_MOE))
print("apply_patches, inside:", type(model.layers[0].mlp.experts).__name__)

# Outside the context, original classes are restored
# The model will use Qwen2MoeExperts again
model = Qwen2MoeModel(Qwen2MoeConfig(**TINY_QWEN2_MOE))
print("apply_patches, outside:", type(model.layers[0].mlp.experts).__name__)
