"""Replacement classes and tiny checkpoints for the conversion tests.

``MoeMLP``, ``ModuleListExperts`` and ``FusedQKVAttention`` are the seed's complete example
(``qwen2_moe``), imported from ``examples/complete_qwen2_moe.py`` (the documentation's classes,
import lines changed to modelgraft), not copied; ``FusedQKVLlamaAttention`` is a
fused-QKV Llama attention that also handles grouped-query attention (q, k, v of unequal sizes).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

import torch.nn as nn
from transformers.activations import ACT2FN
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaAttention, eager_attention_forward
from transformers.models.qwen2_moe.modeling_qwen2_moe import apply_rotary_pos_emb

from modelgraft import Concatenate, WeightConverter
from modelgraft.testing import tiny_config

QKV = WeightConverter(
    source_patterns=["q_proj", "k_proj", "v_proj"],
    target_patterns=["qkv_proj"],
    operations=[Concatenate(dim=0)],
)
GATE_UP = WeightConverter(["gate_proj", "up_proj"], ["gate_up_proj"], [Concatenate(dim=0)])


def tiny_qwen2_moe_config(**overrides):
    """The family table's tiny qwen2_moe, with as many KV heads as heads (the seed's
    FusedQKVAttention assumes it)."""
    config = tiny_config("qwen2_moe", **{"num_key_value_heads": 4, **overrides})
    if getattr(config, "layer_types", None) is None:
        # The seed's attention reads `layer_types`, a 5.x config field; 4.57's qwen2_moe has no
        # sliding window in this config, so every layer is full attention there too.
        config.layer_types = ["full_attention"] * config.num_hidden_layers
    return config


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


# ---- the seed's complete example, imported from examples/ (the run there is under __main__) ------
def _seed_example():
    name = "complete_qwen2_moe"
    if name not in sys.modules:  # registered, so that its classes pickle by reference
        path = Path(__file__).resolve().parents[2] / "examples" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


MoeMLP = _seed_example().MoeMLP
ModuleListExperts = _seed_example().ModuleListExperts
FusedQKVAttention = _seed_example().FusedQKVAttention
