"""Replacement classes and tiny checkpoints for the conversion tests.

``MoeMLP``, ``ModuleListExperts`` and ``FusedQKVAttention`` are the seed's complete example
(``qwen2_moe``), with the import lines changed to modelgraft; ``FusedQKVLlamaAttention`` is a
fused-QKV Llama attention that also handles grouped-query attention (q, k, v of unequal sizes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Unpack

import torch
import torch.nn as nn
from transformers import AutoConfig
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaAttention, eager_attention_forward
from transformers.models.qwen2_moe.modeling_qwen2_moe import apply_rotary_pos_emb
from transformers.utils.generic import TransformersKwargs

from modelgraft import Concatenate, WeightConverter

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "vocab_size": 128}
QKV = WeightConverter(
    source_patterns=["q_proj", "k_proj", "v_proj"],
    target_patterns=["qkv_proj"],
    operations=[Concatenate(dim=0)],
)
GATE_UP = WeightConverter(["gate_proj", "up_proj"], ["gate_up_proj"], [Concatenate(dim=0)])


def tiny_llama_config(**overrides):
    kw = {**TINY, "num_attention_heads": 4, "num_key_value_heads": 2, "attention_bias": True, **overrides}
    return AutoConfig.for_model("llama", **kw)


def tiny_qwen2_moe_config(**overrides):
    kw = {
        **TINY,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,  # the seed's FusedQKVAttention assumes as many KV heads as heads
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 16,
        **overrides,
    }
    return AutoConfig.for_model("qwen2_moe", **kw)


class _FusedQKVMixin:
    """Attention with q, k and v in one ``qkv_proj`` (sizes follow the KV heads: GQA-exact)."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        bias = self.q_proj.bias is not None
        del self.q_proj, self.k_proj, self.v_proj
        self.sizes = [config.num_attention_heads * self.head_dim] + [
            config.num_key_value_heads * self.head_dim
        ] * 2
        self.qkv_proj = nn.Linear(config.hidden_size, sum(self.sizes), bias=bias)

    def forward(
        self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs
    ):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q, k, v = self.qkv_proj(hidden_states).split(self.sizes, dim=-1)
        q, k, v = (t.view(hidden_shape).transpose(1, 2) for t in (q, k, v))
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        name = self.config._attn_implementation
        # (`ALL_ATTENTION_FUNCTIONS.get_interface` is transformers 5.x only.)
        interface: Callable = eager_attention_forward if name == "eager" else ALL_ATTENTION_FUNCTIONS[name]
        out, weights = interface(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
        return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def fused_qkv_class(base: type[nn.Module]) -> type[nn.Module]:
    """A fused-QKV subclass of a Llama-style attention class (``LlamaAttention``, ``Qwen2Attention``...)."""
    return type(f"FusedQKV{base.__name__}", (_FusedQKVMixin, base), {})


FusedQKVLlamaAttention = fused_qkv_class(LlamaAttention)


class FusedGateUpLlamaMLP(nn.Module):
    """Llama MLP with gate and up in one ``gate_up_proj``."""

    def __init__(self, config):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


# ---- the seed's complete example (import lines changed to modelgraft) ---------------------------
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

        layer_types = getattr(self.config, "layer_types", None)  # (a transformers 5.x config field)
        if layer_types is not None and layer_types[layer_idx] == "sliding_attention":
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
