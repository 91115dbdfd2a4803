"""The complete example of the documentation: fused QKV attention and per-expert experts on qwen2_moe.

Adapted only in its import lines (``transformers.monkey_patching`` / ``conversion_mapping`` ->
``modelgraft``) and in loading a tiny local checkpoint instead of ``Qwen/Qwen1.5-MoE-A2.7B``. The
fused attention of the documentation assumes as many key/value heads as query heads, so the tiny
checkpoint has ``num_key_value_heads == num_attention_heads``. The last lines show the result.

The classes are the documentation's; the conversion tests import them from here
(``tests/integration/conversion_helpers.py``), so the run itself is under ``__main__``.
"""

from typing import Unpack

import torch
import torch.nn as nn
from transformers import AutoModelForCausalLM
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.qwen2_moe.modeling_qwen2_moe import apply_rotary_pos_emb
from transformers.utils.generic import TransformersKwargs

from modelgraft import (
    Concatenate,
    WeightConverter,
    clear_patch_mapping,  # for the check at the end
    register_checkpoint_conversion_mapping,
    register_patch_mapping,
    unregister_checkpoint_conversion_mapping,  # for the check at the end
)


class MoeMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.num_experts = config.num_experts
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.moe_intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj


# Adapted from the original Qwen2MoeExperts
class ModuleListExperts(nn.ModuleList):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.num_experts = config.num_experts
        for _ in range(self.num_experts):
            self.append(MoeMLP(config))

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        final_hidden_states = torch.zeros_like(hidden_states)
        with torch.no_grad():
            expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts)
            expert_mask = expert_mask.permute(2, 1, 0)

        for expert_idx in range(self.num_experts):
            top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[token_idx]
            current_hidden_states = self[expert_idx](current_state)
            current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
            final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
        return final_hidden_states


# Adapted from the original Qwen2MoeAttention
class FusedQKVAttention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True

        self.qkv_proj = nn.Linear(
            config.hidden_size, 3 * config.num_attention_heads * self.head_dim, bias=True
        )
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)

        if self.config.layer_types[layer_idx] == "sliding_attention":
            self.sliding_window = config.sliding_window

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states, key_states, value_states = self.qkv_proj(hidden_states).chunk(3, dim=-1)

        query_states = query_states.view(hidden_shape).transpose(1, 2)
        key_states = key_states.view(hidden_shape).transpose(1, 2)
        value_states = value_states.view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)

        attn_output, attn_weights = sdpa_attention_forward(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )

        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights


def main() -> None:
    from _tiny import tiny_checkpoint  # the examples' own helper, next to this file

    # The tiny stand-in for "Qwen/Qwen1.5-MoE-A2.7B", written by plain transformers before anything is registered.
    checkpoint = tiny_checkpoint("qwen2_moe", num_key_value_heads=4)

    # Registering monkey patches for the new attention and experts modules.
    register_patch_mapping(
        mapping={
            "Qwen2MoeExperts": ModuleListExperts,
            "Qwen2MoeAttention": FusedQKVAttention,
        }
    )

    # Registering weight conversion mappings adapted for the new modules. This registration will:
    # - Override the original conversion mapping for qwen2_moe which concatenated the experts into a single parameter format.
    # - Concatenate the q_proj, k_proj, v_proj weights/biases into a single qkv_proj weight/bias for the new fused attention module.
    register_checkpoint_conversion_mapping(
        model_type_or_class_name="qwen2_moe",
        mapping=[
            WeightConverter(
                source_patterns=["q_proj", "k_proj", "v_proj"],
                target_patterns=["qkv_proj"],
                operations=[Concatenate(dim=0)],
            ),
        ],
        overwrite=True,
    )

    model = AutoModelForCausalLM.from_pretrained(checkpoint)

    # --- not in the documentation: show what happened, and compare with the plain model ---------------
    layer = model.model.layers[0]
    print("attention:", type(layer.self_attn).__name__, tuple(layer.self_attn.qkv_proj.weight.shape))
    print(
        "experts:",
        type(layer.mlp.experts).__name__,
        len(layer.mlp.experts),
        "x",
        type(layer.mlp.experts[0]).__name__,
    )
    clear_patch_mapping()
    unregister_checkpoint_conversion_mapping("qwen2_moe")
    plain = AutoModelForCausalLM.from_pretrained(checkpoint)
    input_ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        diff = (model(input_ids).logits - plain(input_ids).logits).abs().max().item()
    print(
        f"plain model: {type(plain.model.layers[0].self_attn).__name__}; max |logits difference| = {diff:.2e}"
    )


if __name__ == "__main__":
    main()
