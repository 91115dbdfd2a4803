"""Troubleshooting "my patch is not applied", from the documentation.

Adapted only in its import lines; ``CustomAttention`` is a stand-in. ``modelgraft explain CLASS``
(and ``modelgraft inspect MODEL``) answer the same questions from the command line.
"""

from transformers.models.llama.modeling_llama import LlamaAttention

from modelgraft import get_patch_mapping, register_patch_mapping


class CustomAttention(LlamaAttention):  # stand-in
    pass


# For exact names - must match exactly (case-sensitive)
register_patch_mapping(mapping={"LlamaAttention": CustomAttention})

# For patterns - use valid regex
register_patch_mapping(mapping={".*Attention": CustomAttention})

print(get_patch_mapping())
# Shows all registered mappings: {'LlamaAttention': <class 'CustomAttention'>, '.*MLP': <class 'CustomMLP'>}

from transformers.models.llama import modeling_llama  # noqa: E402

print(dir(modeling_llama))  # Look for the class name
