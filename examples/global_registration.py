"""Global registration of the documentation: one patch, then several at once with ``overwrite=True``.

Adapted only in its import line. The documentation leaves ``SequentialExperts`` and
``CustomAttention`` to the reader; minimal stand-ins are defined here so that it runs.
"""

import torch.nn as nn

from modelgraft import get_patch_mapping, register_patch_mapping


class SequentialExperts(nn.Module):  # stand-in
    pass


class CustomAttention(nn.Module):  # stand-in
    pass


# Register a single patch
register_patch_mapping(mapping={"Qwen2MoeExperts": SequentialExperts})

# Register multiple patches at once
register_patch_mapping(
    mapping={
        "Qwen2MoeExperts": SequentialExperts,
        "Qwen2MoeAttention": CustomAttention,
    },
    # Overwrite existing patches if they exist
    overwrite=True,
)

# --- not in the documentation: show the result
print({key: cls.__name__ for key, cls in get_patch_mapping().items()})
