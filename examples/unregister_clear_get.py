"""Unregistering, clearing and listing patches, as in the documentation.

Adapted only in its import lines; the registrations at the top (stand-in classes) make the
documented calls meaningful, and each step prints the registry.
"""

import torch.nn as nn

from modelgraft import (
    clear_patch_mapping,
    get_patch_mapping,
    register_patch_mapping,
    unregister_patch_mapping,
)


class CustomExperts(nn.Module):  # stand-in
    pass


register_patch_mapping(
    {"Qwen2MoeExperts": CustomExperts, "Qwen2MoeAttention": CustomExperts, ".*Attention": CustomExperts}
)
print("registered:", sorted(get_patch_mapping()))

# Unregister a single patch (use exact name or pattern from registration)
unregister_patch_mapping(keys=["Qwen2MoeExperts"])
print("after unregistering one:", sorted(get_patch_mapping()))

# Unregister multiple patches at once
register_patch_mapping({"Qwen2MoeExperts": CustomExperts})
unregister_patch_mapping(keys=["Qwen2MoeExperts", "Qwen2MoeAttention"])

# Unregister a pattern
unregister_patch_mapping(keys=[".*Attention"])
print("after unregistering all three:", sorted(get_patch_mapping()))

register_patch_mapping({"Qwen2MoeExperts": CustomExperts})
clear_patch_mapping()

current_patches = get_patch_mapping()
print(current_patches)
