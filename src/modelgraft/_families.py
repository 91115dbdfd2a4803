"""The one table of model families, and the tiny configs it drives.

Each :class:`Family` row names a transformers ``model_type``, its kind, what its tiny config needs
beyond the generic sizes, and which ready-made grafts cover it by default. Everything else reads
this table:

* :func:`tiny_config` / :func:`tiny_overrides` (re-exported by :mod:`modelgraft.testing`; used by
  :func:`modelgraft.verify` for a model-type target and by the grafts to find the classes they
  replace) build configs from the generic sizes plus the row's ``tiny`` fixes;
* each graft's default family list (``FUSED_QKV_FAMILIES``, ...) is :func:`covered_by` of its name;
* the tests parametrise over the rows (``tests/families.py`` adds what only tests need: skip reasons
  and inputs).

A model type without a row still gets a tiny config (the generic sizes fit most families).

Example:
    >>> cfg = tiny_config("llama")
    >>> (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads)
    (64, 2, 4, 2)
    >>> covered_by(FUSED_QKV)[:3], row("jamba").kind
    (('llama', 'mistral', 'ministral'), 'moe')
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from transformers import CONFIG_MAPPING, AutoConfig, PretrainedConfig

from modelgraft import _compat
from modelgraft.errors import UnknownModelTypeError

__all__ = [
    "CHUNKED_LM_LOSS",
    "FAMILIES",
    "FUSED_GATE_UP",
    "FUSED_QKV",
    "KINDS",
    "LINEAR_EXPERTS",
    "ROUTING_FIXES",
    "ROUTING_NESTED",
    "ROUTING_SIZES",
    "Family",
    "UnknownModelTypeError",
    "covered_by",
    "row",
    "tiny_config",
    "tiny_overrides",
]

KINDS = ("decoder", "moe", "encoder", "vlm", "seq2seq")

# The ready-made grafts, by the name of the function that makes each (``modelgraft.grafts``).
FUSED_QKV, FUSED_GATE_UP, LINEAR_EXPERTS, CHUNKED_LM_LOSS = (
    "fused_qkv",
    "fused_gate_up",
    "linear_experts",
    "chunked_lm_loss",
)
_GRAFTS = (FUSED_QKV, FUSED_GATE_UP, LINEAR_EXPERTS, CHUNKED_LM_LOSS)


@dataclass(frozen=True)
class Family:
    """One row of the table.

    Attributes:
        model_type: a transformers ``model_type`` (``"llama"``).
        kind: one of :data:`KINDS`.
        grafts: the ready-made grafts that cover this family by default on the installed
            transformers (each one tested on it); empty where transformers has no ``model_type``.
        tiny: config fields its tiny config needs beyond the generic sizes (values that depend on
            the family: head splits of latent attention, layer patterns, ...).
    """

    model_type: str
    kind: str
    grafts: frozenset[str] = frozenset()
    tiny: Mapping[str, Any] = field(default_factory=dict)


def _f(model_type: str, kind: str, *grafts: str, where_fused: tuple[str, ...] = (), **tiny: Any) -> Family:
    """A row; ``where_fused`` grafts cover it only where its MoE experts are fused 3D tensors.

    transformers 4.57 builds most MoE families with per-expert layers already (or in a layout of
    their own), so a graft written for the fused experts of transformers 5 does not cover them
    there. A default list only names model types the installed transformers has.
    """
    unknown = (set(grafts) | set(where_fused)) - set(_GRAFTS)
    if kind not in KINDS or unknown:  # a typo in the table below
        raise ValueError(f"family `{model_type}`: bad kind `{kind}` or grafts {sorted(unknown)}")
    covered = set(grafts) | (set(where_fused) if _compat.FUSED_MOE_EXPERTS else set())
    if model_type not in CONFIG_MAPPING:
        covered = set()
    return Family(model_type, kind, frozenset(covered), MappingProxyType(tiny))


_QKV_GATE_UP_LOSS = (FUSED_QKV, FUSED_GATE_UP, CHUNKED_LM_LOSS)
# transformers 4.57 spells the rotary settings `rope_scaling`, 5.x `rope_parameters`; multimodal
# rotary sections must fill the 8 rotary dims of a 16-wide head.
_MROPE: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}

FAMILIES: tuple[Family, ...] = (
    # decoder-only language models
    _f("llama", "decoder", *_QKV_GATE_UP_LOSS),
    _f("mistral", "decoder", *_QKV_GATE_UP_LOSS),
    _f("ministral", "decoder", *_QKV_GATE_UP_LOSS),
    _f("qwen2", "decoder", *_QKV_GATE_UP_LOSS),
    _f("qwen3", "decoder", *_QKV_GATE_UP_LOSS),
    _f("gemma", "decoder", *_QKV_GATE_UP_LOSS),
    _f("gemma2", "decoder", *_QKV_GATE_UP_LOSS),
    _f("gemma3_text", "decoder", *_QKV_GATE_UP_LOSS),
    # phi, gpt_neox, stablelm, persimmon, olmo: no grouped-query attention in their modeling code
    _f("phi", "decoder", CHUNKED_LM_LOSS, num_key_value_heads=4),
    _f("phi3", "decoder", CHUNKED_LM_LOSS),
    _f("olmo", "decoder", *_QKV_GATE_UP_LOSS, num_key_value_heads=4),
    _f("olmo2", "decoder", *_QKV_GATE_UP_LOSS),
    _f("olmo3", "decoder", *_QKV_GATE_UP_LOSS),
    _f("granite", "decoder", *_QKV_GATE_UP_LOSS),
    _f("cohere", "decoder", *_QKV_GATE_UP_LOSS),
    _f("cohere2", "decoder", *_QKV_GATE_UP_LOSS),
    _f("starcoder2", "decoder", FUSED_QKV, CHUNKED_LM_LOSS),
    _f("stablelm", "decoder", CHUNKED_LM_LOSS, num_key_value_heads=4),
    _f("gpt2", "decoder"),
    _f("gpt_neox", "decoder", num_key_value_heads=4),
    _f("gptj", "decoder", rotary_dim=8),
    _f("gpt_bigcode", "decoder"),
    _f("codegen", "decoder", rotary_dim=8),
    _f("falcon", "decoder", new_decoder_architecture=True, num_kv_heads=2),
    _f("opt", "decoder", word_embed_proj_dim=64),
    _f("bloom", "decoder", n_head=4),
    _f("biogpt", "decoder"),
    _f("xglm", "decoder"),
    _f("persimmon", "decoder", CHUNKED_LM_LOSS, num_key_value_heads=4),
    _f("helium", "decoder", *_QKV_GATE_UP_LOSS),
    _f("smollm3", "decoder", *_QKV_GATE_UP_LOSS),
    _f("glm", "decoder", FUSED_QKV, CHUNKED_LM_LOSS),
    _f("glm4", "decoder", FUSED_QKV, CHUNKED_LM_LOSS),
    _f("nemotron", "decoder", FUSED_QKV, CHUNKED_LM_LOSS),
    _f("exaone4", "decoder", *_QKV_GATE_UP_LOSS),
    _f("apertus", "decoder", FUSED_QKV, CHUNKED_LM_LOSS),
    _f("arcee", "decoder", FUSED_QKV, CHUNKED_LM_LOSS),
    _f("seed_oss", "decoder", *_QKV_GATE_UP_LOSS),
    _f("ernie4_5", "decoder", *_QKV_GATE_UP_LOSS),
    _f("hunyuan_v1_dense", "decoder", *_QKV_GATE_UP_LOSS),
    # mixture-of-experts language models
    _f("mixtral", "moe", FUSED_QKV, LINEAR_EXPERTS, CHUNKED_LM_LOSS),
    _f("qwen2_moe", "moe", *_QKV_GATE_UP_LOSS, LINEAR_EXPERTS),
    _f("qwen3_moe", "moe", FUSED_QKV, LINEAR_EXPERTS, CHUNKED_LM_LOSS),
    _f("olmoe", "moe", FUSED_QKV, LINEAR_EXPERTS, CHUNKED_LM_LOSS),
    _f("flex_olmo", "moe", FUSED_QKV, LINEAR_EXPERTS, CHUNKED_LM_LOSS),
    # multi-head latent attention: sizes from `_MLA` (every config with a `qk_rope_head_dim`)
    _f("deepseek_v2", "moe", FUSED_GATE_UP, LINEAR_EXPERTS, CHUNKED_LM_LOSS),
    _f(
        "deepseek_v3",
        "moe",
        FUSED_GATE_UP,
        LINEAR_EXPERTS,
        CHUNKED_LM_LOSS,
        head_dim=8,  # = qk_rope_head_dim: transformers 4.57 sizes the rotary embedding by head_dim
    ),
    _f("phimoe", "moe", FUSED_QKV, LINEAR_EXPERTS, CHUNKED_LM_LOSS),
    _f("granitemoe", "moe", CHUNKED_LM_LOSS, where_fused=(LINEAR_EXPERTS,)),
    _f("granitemoeshared", "moe", CHUNKED_LM_LOSS, where_fused=(LINEAR_EXPERTS,)),
    _f("minimax", "moe", FUSED_QKV, LINEAR_EXPERTS, CHUNKED_LM_LOSS),
    _f("glm4_moe", "moe", *_QKV_GATE_UP_LOSS, LINEAR_EXPERTS),
    _f("ernie4_5_moe", "moe", *_QKV_GATE_UP_LOSS, LINEAR_EXPERTS),
    _f("hunyuan_v1_moe", "moe", *_QKV_GATE_UP_LOSS, LINEAR_EXPERTS),
    _f("dots1", "moe", *_QKV_GATE_UP_LOSS, LINEAR_EXPERTS),
    # transposed, interleaved, biased experts with a clamped SwiGLU; fused on 4.57 too
    _f("gpt_oss", "moe", LINEAR_EXPERTS, CHUNKED_LM_LOSS),
    # one attention layer and one MoE layer among the two
    _f(
        "jamba",
        "moe",
        LINEAR_EXPERTS,
        CHUNKED_LM_LOSS,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        use_mamba_kernels=False,
        mamba_dt_rank=8,
    ),
    # two linear-attention layers alone leave the cache without an attention layer
    _f(
        "qwen3_next",
        "moe",
        LINEAR_EXPERTS,
        CHUNKED_LM_LOSS,
        layer_types=["linear_attention", "full_attention"],
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    ),
    # MoE families whose experts only the declared layouts, fused-checkpoint converters or the
    # family's own gated activation make per-expert layers (most only in transformers 5)
    _f(
        "qwen3_5_moe_text",
        "moe",
        where_fused=(LINEAR_EXPERTS,),
        layer_types=["linear_attention", "full_attention"],
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    ),
    _f(
        "qwen3_vl_moe_text",
        "moe",
        where_fused=(LINEAR_EXPERTS,),
        **({} if _compat.IS_V5 else {"rope_scaling": _MROPE}),
    ),
    # the MoE block is opt-in; the per-layer input embedding defaults to a 262k vocabulary
    _f(
        "gemma4_text",
        "moe",
        where_fused=(LINEAR_EXPERTS,),
        enable_moe_block=True,
        vocab_size_per_layer_input=128,
        hidden_size_per_layer_input=8,
        top_k_experts=2,
    ),
    # transposed experts that run on every token (the router scales the inputs); fused on 4.57 too
    _f("llama4_text", "moe", LINEAR_EXPERTS),
    # one linear-attention (mamba) layer and one attention layer
    _f(
        "granitemoehybrid",
        "moe",
        where_fused=(LINEAR_EXPERTS,),
        layer_types=["linear_attention", "full_attention"] if _compat.IS_V5 else ["mamba", "attention"],
    ),
    _f("granitemoe_swa", "moe", where_fused=(LINEAR_EXPERTS,)),
    _f("aria_text", "moe", where_fused=(LINEAR_EXPERTS,)),
    _f("afmoe", "moe", where_fused=(LINEAR_EXPERTS,)),
    _f("axk1", "moe", where_fused=(LINEAR_EXPERTS,)),
    _f("axk2", "moe", where_fused=(LINEAR_EXPERTS,)),
    _f("cohere2_moe", "moe", where_fused=(LINEAR_EXPERTS,)),
    # DeepSeek-V3.2's sparse-attention indexer (latent attention sizes from `_MLA`)
    _f(
        "deepseek_v32", "moe", where_fused=(LINEAR_EXPERTS,), index_head_dim=16, index_n_heads=2, index_topk=4
    ),
    _f("exaone_moe", "moe", where_fused=(LINEAR_EXPERTS,)),
    _f("glm4_moe_lite", "moe", where_fused=(LINEAR_EXPERTS,)),
    # GLM-4.5V rotates half of each head
    _f(
        "glm4v_moe_text",
        "moe",
        where_fused=(LINEAR_EXPERTS,),
        **(
            {"rope_parameters": {**_MROPE, "partial_rotary_factor": 0.5}}
            if _compat.IS_V5
            else {"rope_scaling": _MROPE, "partial_rotary_factor": 0.5}
        ),
    ),
    _f("glm_moe_dsa", "moe", where_fused=(LINEAR_EXPERTS,)),
    _f("hy_v3", "moe", where_fused=(LINEAR_EXPERTS,)),
    # its sliding-window heads have sizes of their own
    _f(
        "inkling_text",
        "moe",
        where_fused=(LINEAR_EXPERTS,),
        swa_num_attention_heads=4,
        swa_num_key_value_heads=2,
        swa_head_dim=16,
    ),
    _f("kolibri1", "moe", where_fused=(LINEAR_EXPERTS,)),
    _f("laguna", "moe", where_fused=(LINEAR_EXPERTS,)),
    _f("mellum", "moe", where_fused=(LINEAR_EXPERTS,)),
    _f("mimo_v2_flash", "moe", where_fused=(LINEAR_EXPERTS,)),
    _f("minimax_m2", "moe", where_fused=(LINEAR_EXPERTS,)),
    _f("minimax_m3_vl_text", "moe", where_fused=(LINEAR_EXPERTS,)),
    _f("mistral4", "moe", where_fused=(LINEAR_EXPERTS,)),
    _f("openai_privacy_filter", "moe", where_fused=(LINEAR_EXPERTS,)),
    _f("solar_open", "moe", where_fused=(LINEAR_EXPERTS,)),
    _f("dots3_note_text", "moe", where_fused=(LINEAR_EXPERTS,)),
    # DBRX sizes its attention and experts in nested configs, with `rope_theta` and `clip_qkv` as
    # released checkpoints have them (its attention reads both; the config class defines neither
    # default); `d_model` by its own name, since the experts copy it before `hidden_size` maps onto it
    # its experts are 2D stacks on both lines (4.57 stores them as 5 does), so covered on both
    _f(
        "dbrx",
        "moe",
        LINEAR_EXPERTS,
        d_model=64,
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
    ),
    # ERNIE 4.5 VL: expert sizes per modality (text, vision), and an M-RoPE split of the 8 rotary
    # frequencies of a 16-wide head (the default [22, 22, 20] is for 128-wide heads)
    _f(
        "ernie4_5_vl_moe_text",
        "moe",
        moe_intermediate_size=[32, 32],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [3, 3, 2]},
    ),
    # its sparse (DSA) attention layers take no rope part (the config refuses one); one linear and
    # one indexed attention layer, the second MLP sparse (its default keeps the first three dense)
    _f(
        "glm5_next_text",
        "moe",
        where_fused=(LINEAR_EXPERTS,),
        mlp_layer_types=["dense", "sparse"],
        qk_rope_head_dim=0,
        qk_nope_head_dim=16,
        layer_types=["linear_attention", "indexed_attention"],
        linear_num_heads=2,
        index_n_heads=2,
        index_topk=16,
    ),
    # the M-RoPE split must fill the 4 rotary frequencies of its 8-wide rope part
    _f(
        "hy_v4_vl_text",
        "moe",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
    ),
    # one short-convolution layer and one attention layer (its default schedule is for 24 layers),
    # the second MLP sparse (its default keeps the first two dense)
    _f(
        "lfm2_moe",
        "moe",
        where_fused=(LINEAR_EXPERTS,),
        layer_types=["conv", "full_attention"],
        num_dense_layers=1,
    ),
    # its config accepts top-1 routing only
    _f("zaya", "moe", where_fused=(LINEAR_EXPERTS,), num_experts_per_tok=1),
    _f("minicpm5_moe", "moe", where_fused=(LINEAR_EXPERTS,)),
    # BERT-like encoders
    _f("bert", "encoder"),
    _f("roberta", "encoder"),
    _f("xlm-roberta", "encoder"),
    _f("camembert", "encoder"),
    _f("distilbert", "encoder", hidden_dim=128),
    _f("albert", "encoder"),
    _f("electra", "encoder"),
    _f("deberta", "encoder"),
    _f("deberta-v2", "encoder"),
    _f("mpnet", "encoder"),
    _f("ernie", "encoder"),
    _f("modernbert", "encoder", global_attn_every_n_layers=2, local_attention=16),
    # vision-language
    _f("llava", "vlm", image_seq_length=16),
    # encoder-decoder
    _f("t5", "seq2seq", d_kv=16),
    _f("mt5", "seq2seq"),
    _f("bart", "seq2seq"),
)

_BY_TYPE: dict[str, Family] = {f.model_type: f for f in FAMILIES}


def row(model_type: str) -> Family | None:
    """The table's row for ``model_type``, or None when the table has none."""
    return _BY_TYPE.get(model_type)


def covered_by(graft: str) -> tuple[str, ...]:
    """The model types a ready-made graft covers by default, in table order.

    Example:
        >>> covered_by(LINEAR_EXPERTS)[:2]
        ('mixtral', 'qwen2_moe')
    """
    if graft not in _GRAFTS:
        raise ValueError(f"`{graft}` is not a ready-made graft; expected one of {list(_GRAFTS)}")
    return tuple(f.model_type for f in FAMILIES if graft in f.grafts)


# ---- tiny configs -----------------------------------------------------------------------------

VOCAB_SIZE = 128

# Canonical names first; a family whose config spells them differently is reached through the
# config class's own ``attribute_map`` (gpt2: n_embd, t5: d_model, ...), so one table fits all.
_SIZES: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "max_position_embeddings": 256,
    # MoE
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "decoder_sparse_step": 1,
    # encoder-decoder and older spellings that have no attribute_map entry
    "num_decoder_layers": 2,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "d_ff": 128,
    "n_inner": 128,
    "ffn_dim": 128,
    "embedding_size": 64,
    # vision towers
    "image_size": 32,
    "patch_size": 8,
    "projection_dim": 32,
    # sliding windows larger than any test sequence keep masks simple
    "sliding_window": 64,
}

# Multi-head latent attention (every config with a `qk_rope_head_dim`, unless its row says
# otherwise): the defaults' rope/nope split (64/128) does not fit 16-wide tiny heads.
_MLA: dict[str, Any] = {
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "num_key_value_heads": 4,
}

# ---- the routing profile (tests/moe_families.py builds every MoE family with it) ----------------
# 8 experts with top-2 in 4 groups of which 2 are kept exercises group-limited routing, which
# tiny_config's 4 experts in 1 group would not.
# Set only where the family's config has the attribute: small sizes, every layer MoE, 8 experts
# with top-2 in 4 groups of which 2 are kept (exercises group-limited routing).
ROUTING_SIZES: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 32,
    "moe_intermediate_size": 16,
    "expert_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    "ffn_hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 64,
    "num_experts": 8,
    "n_routed_experts": 8,
    "num_local_experts": 8,
    "moe_num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "top_k_experts": 2,
    "num_dense_layers": 0,
    "moe_k": 2,
    "top_k": 2,
    "n_group": 4,
    "topk_group": 2,
    "first_k_dense_replace": 0,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "qk_head_dim": 16,
    "v_head_dim": 8,
    "sliding_window": 16,
    "pad_token_id": 0,
    "n_shared_experts": 1,
    "moe_hidden_size": 16,
    "linear_head_dim": 16,
    "index_head_dim": 16,
    "index_topk": 4,
    "router_hidden_size": 16,
    "shared_intermediate_size": 16,
    "expert_ffn_hidden_size": 16,
    "zero_expert_num": 2,
    "hidden_size_per_layer_input": 8,
    "vocab_size_per_layer_input": 128,
    "mamba_n_heads": 4,
    "mamba_d_state": 8,
    "mamba_chunk_size": 16,
}

# Family-specific fixes on top of ROUTING_SIZES (sizes the generic table cannot express).
ROUTING_FIXES: dict[str, dict[str, Any]] = {
    "zaya": {"num_experts_per_tok": 1},
    "gemma4_text": {"enable_moe_block": True, "per_layer_config": {}},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    # Every layer MoE (its default keeps layer 0 dense), and an M-RoPE split of the 8 rotary
    # frequencies of a 16-wide head: the default split [22, 22, 20] is for 64 (128-wide heads).
    "ernie4_5_vl_moe_text": {
        "moe_intermediate_size": [16, 16],
        "mlp_layer_types": ["sparse", "sparse"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [3, 3, 2]},
    },
    # Its config derives no per-layer MLP schedule (`mlp_layer_types` defaults to None, which the
    # decoder layer indexes); released checkpoints spell it out.
    "deepseek_ocr2_text": {"mlp_layer_types": ["sparse", "sparse"]},
    # DBRX sizes its attention and experts in nested configs. `rope_theta` and `clip_qkv` as the
    # released checkpoints have them: the attention reads `attn_config.rope_theta`, which the
    # config class does not define, and clamps with `clip_qkv`, which fails when it is None.
    # `d_model` by its own name: the experts copy it before `hidden_size` is mapped onto it.
    "dbrx": {
        "d_model": 32,
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 16, "moe_num_experts": 8, "moe_top_k": 2},
    },
    # Two MoE layers (each of its `num_layers` holds two attention blocks and one MoE), and the
    # rotary size equal to the rope part of the latent heads, as in released checkpoints.
    "longcat_flash": {"num_layers": 2, "head_dim": 8},
    # Its sliding-window layers double the kv heads: with 2 query heads, 1 kv head keeps both kinds valid.
    "mimo_v2_flash": {"head_dim": 24, "num_key_value_heads": 1},
    # Sizes the generic table does not name, which leave these families above the tiny cap.
    "deepseek_v4": {"o_lora_rank": 16},
    "inkling2_text": {"unpadded_vocab_size": 128},
    "inkling2_loop_text": {"unpadded_vocab_size": 128},
    "switch_transformers": {"d_ff": 32},
    "nllb-moe": {"encoder_ffn_dim": 32, "decoder_ffn_dim": 32},
    # Its DSA attention layers take no rope part (the config refuses one); one of each attention
    # kind (linear, indexed), every layer MoE (its default keeps the first three dense).
    "glm5_next_text": {
        "index_topk": 16,
        "qk_rope_head_dim": 0,
        "qk_nope_head_dim": 16,
        "layer_types": ["linear_attention", "indexed_attention"],
        "mlp_layer_types": ["sparse", "sparse"],
        "linear_num_heads": 2,
        "index_n_heads": 2,
    },
    # Step 3.7's text tower (built through `_NESTED`): every layer MoE (its default keeps the first
    # three dense) and a small shared expert; its vision tower sized down by hand (one 2x2-patch layer).
    "step3p5": {"mlp_layer_types": ["sparse", "sparse"], "share_expert_dim": 16},
    "step3p7": {
        "vision_config": {
            "hidden_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 28,
            "patch_size": 14,
            "max_position_embeddings": 4,
        }
    },
    "hy_v4_vl_text": {
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
    },
    "glm4v_moe_text": {
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [2, 1, 1],
        }
    },
}

# Sub-configs that get the tiny profile of their own model type: the composite's top-level config
# names none of the sizes, so ROUTING_SIZES alone would leave the text tower at full size.
ROUTING_NESTED: dict[str, dict[str, str]] = {
    "step3p7": {"text_config": "step3p5"},
}

_SPECIAL_TOKEN_SUFFIXES = ("token_id", "token_index", "_token_ids")


def _fields(config_class: type[PretrainedConfig]) -> set[str]:
    if dataclasses.is_dataclass(config_class):
        return {f.name for f in dataclasses.fields(config_class)}
    return set(vars(config_class()))


def _resolve(config_class: type[PretrainedConfig], fields: set[str], name: str) -> str | None:
    if name in fields:
        return name
    mapped = getattr(config_class, "attribute_map", {}).get(name)
    return mapped if mapped in fields else None


def tiny_overrides(model_type: str) -> dict[str, Any]:
    """Return the keyword arguments :func:`tiny_config` passes to ``AutoConfig.for_model``.

    Sub-configs (``text_config``, ``vision_config``, ...) come back as dicts that are themselves
    tiny, with their ``model_type`` set.

    Args:
        model_type: a key of ``transformers.CONFIG_MAPPING`` such as ``"llama"``.

    Returns:
        The tiny keyword arguments, without any user overrides.

    Example:
        >>> tiny_overrides("mixtral")["num_local_experts"]
        4
    """
    config_class = _config_class(model_type)
    fields = _fields(config_class)
    kwargs: dict[str, Any] = {}
    for name, value in _SIZES.items():
        target = _resolve(config_class, fields, name)
        if target is not None and target not in kwargs:
            kwargs[target] = value
    if "qk_rope_head_dim" in fields:
        for name, value in _MLA.items():
            kwargs[_resolve(config_class, fields, name) or name] = value
    family = row(model_type)
    for name, value in (family.tiny if family is not None else {}).items():
        target = _resolve(config_class, fields, name) or name
        kwargs[target] = value
    sub_configs = getattr(config_class, "sub_configs", {}) or {}
    default = None
    for name in sub_configs:
        if name not in fields or isinstance(kwargs.get(name), dict):
            continue
        default = default if default is not None else config_class()
        sub = getattr(default, name, None)
        sub_type = getattr(sub, "model_type", None)
        if isinstance(sub_type, str) and sub_type in CONFIG_MAPPING:
            kwargs[name] = {"model_type": sub_type, **tiny_overrides(sub_type)}
    kwargs.update(_special_tokens(config_class, fields, kwargs))
    return kwargs


def _special_tokens(
    config_class: type[PretrainedConfig], fields: set[str], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """Move special token ids that fall outside the tiny vocabulary to its top end.

    An image token id of 32000 with a 128-token embedding would index out of range.
    """
    text = kwargs.get("text_config")
    vocab = kwargs.get("vocab_size") or (text.get("vocab_size") if isinstance(text, dict) else None)
    if vocab is None:
        return {}
    defaults = _field_defaults(config_class)
    fixed: dict[str, Any] = {}
    next_free = vocab - 1
    for name in sorted(fields):
        if not name.endswith(_SPECIAL_TOKEN_SUFFIXES) or name in kwargs:
            continue
        value = defaults.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= vocab:
            fixed[name] = next_free
            next_free -= 1
        elif isinstance(value, list) and any(isinstance(v, int) and v >= vocab for v in value):
            fixed[name] = [v if v < vocab else vocab - 1 for v in value]
    return fixed


def _field_defaults(config_class: type[PretrainedConfig]) -> dict[str, Any]:
    """Declared defaults, read without building a config (which may log about its own defaults)."""
    if not dataclasses.is_dataclass(config_class):
        return vars(config_class())
    return {
        f.name: f.default for f in dataclasses.fields(config_class) if f.default is not dataclasses.MISSING
    }


def _config_class(model_type: str) -> type[PretrainedConfig]:
    if model_type not in CONFIG_MAPPING:
        close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING.keys()), n=5, cutoff=0.6)
        hint = f" Close matches: {', '.join(f'`{c}`' for c in close)}." if close else ""
        raise UnknownModelTypeError(
            f"Unknown model type `{model_type}`: expected a key of transformers' CONFIG_MAPPING "
            f"(e.g. `llama`, `qwen2_moe`, `bert`).{hint}"
        )
    return CONFIG_MAPPING[model_type]


def tiny_config(model_type: str, **overrides: Any) -> PretrainedConfig:
    """Return a small, valid config of ``model_type`` for fast tests and examples.

    Args:
        model_type: a model type of the installed transformers (``"llama"``, ``"mixtral"``,
            ``"bert"``, ``"llava"``, ...).
        **overrides: config fields that win over the tiny defaults (``hidden_size=32``,
            ``attention_bias=True``, a ``text_config`` dict, ...).

    Returns:
        The config built by ``AutoConfig.for_model(model_type, **tiny, **overrides)``.

    Raises:
        UnknownModelTypeError: ``model_type`` is not known; the message lists close matches.

    Example:
        >>> cfg = tiny_config("llava")
        >>> cfg.text_config.hidden_size, cfg.vision_config.hidden_size
        (64, 64)
        >>> tiny_config("lama")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        modelgraft.errors.UnknownModelTypeError: Unknown model type `lama`: ...
    """
    kwargs = tiny_overrides(model_type)
    for name, value in overrides.items():
        if isinstance(value, dict) and isinstance(kwargs.get(name), dict):
            kwargs[name] = {**kwargs[name], **value}
        else:
            kwargs[name] = value
    return AutoConfig.for_model(model_type, **kwargs)
