"""Helpers for tests and examples: tiny, valid configs of real model families.

:func:`tiny_config` turns any model type of the installed transformers into a config small enough
to build and run in milliseconds on a CPU (hidden size 64, 2 layers, 4 heads with 2 key/value heads
where the family has them, vocabulary 128, 4 experts with top-2 routing for MoE families). Composite
models (vision-language, encoder-decoder with sub-configs) get every sub-config shrunk the same way.

Example:
    >>> from modelgraft.testing import tiny_config
    >>> cfg = tiny_config("llama")
    >>> (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads)
    (64, 2, 4, 2)
    >>> tiny_config("qwen2_moe", hidden_size=32).hidden_size
    32
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from transformers import CONFIG_MAPPING, AutoConfig, PretrainedConfig

from modelgraft.errors import UnknownModelTypeError

__all__ = ["UnknownModelTypeError", "tiny_config", "tiny_overrides"]

VOCAB_SIZE = 128

# Canonical names first; a family whose config spells them differently is reached through the
# config class's own ``attribute_map`` (gpt2: n_embd, t5: d_model, ...), so one table fits all.
_TINY: dict[str, Any] = {
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

# What the generic table cannot know: fields whose valid value depends on the family.
_FAMILY: dict[str, dict[str, Any]] = {
    # Multi-head latent attention: ranks and rope/nope split of the 16-wide heads.
    "deepseek_v2": {
        "kv_lora_rank": 16,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 16,
        "num_key_value_heads": 4,
    },
    "deepseek_v3": {
        "kv_lora_rank": 16,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 16,
        "head_dim": 8,  # = qk_rope_head_dim: transformers 4.57 sizes the rotary embedding by head_dim
        "num_key_value_heads": 4,
    },
    # Jamba: one attention layer and one MoE layer among the two.
    "jamba": {
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "use_mamba_kernels": False,
        "mamba_dt_rank": 8,
    },
    # Models without grouped-query attention in their modeling code.
    "phi": {"num_key_value_heads": 4},
    "gpt_neox": {"num_key_value_heads": 4},
    "stablelm": {"num_key_value_heads": 4},
    "persimmon": {"num_key_value_heads": 4},
    "olmo": {"num_key_value_heads": 4},
    "opt": {"word_embed_proj_dim": 64},
    "gptj": {"rotary_dim": 8},
    "codegen": {"rotary_dim": 8},
    "falcon": {"new_decoder_architecture": True, "num_kv_heads": 2},
    "bloom": {"n_head": 4},
    "distilbert": {"hidden_dim": 128},
    # Two linear-attention layers alone leave the cache without an attention layer.
    "qwen3_next": {
        "layer_types": ["linear_attention", "full_attention"],
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
    },
    "t5": {"d_kv": 16},
    "llava": {"image_seq_length": 16},
    "modernbert": {"global_attn_every_n_layers": 2, "local_attention": 16},
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
    for name, value in _TINY.items():
        target = _resolve(config_class, fields, name)
        if target is not None and target not in kwargs:
            kwargs[target] = value
    for name, value in _FAMILY.get(model_type, {}).items():
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
