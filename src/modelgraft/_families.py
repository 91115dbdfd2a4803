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

from modelgraft.errors import UnknownModelTypeError

__all__ = [
    "CHUNKED_LM_LOSS",
    "FAMILIES",
    "FUSED_GATE_UP",
    "FUSED_QKV",
    "KINDS",
    "LINEAR_EXPERTS",
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
        grafts: the ready-made grafts that cover this family by default (each one tested on it).
        tiny: config fields its tiny config needs beyond the generic sizes (values that depend on
            the family: head splits of latent attention, layer patterns, ...).
    """

    model_type: str
    kind: str
    grafts: frozenset[str] = frozenset()
    tiny: Mapping[str, Any] = field(default_factory=dict)


def _f(model_type: str, kind: str, *grafts: str, **tiny: Any) -> Family:
    unknown = set(grafts) - set(_GRAFTS)
    if kind not in KINDS or unknown:  # a typo in the table below
        raise ValueError(f"family `{model_type}`: bad kind `{kind}` or grafts {sorted(unknown)}")
    return Family(model_type, kind, frozenset(grafts), MappingProxyType(tiny))


_QKV_GATE_UP_LOSS = (FUSED_QKV, FUSED_GATE_UP, CHUNKED_LM_LOSS)
_MLA = {"kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16}

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
    # multi-head latent attention: ranks and the rope/nope split of the 16-wide heads
    _f("deepseek_v2", "moe", FUSED_GATE_UP, LINEAR_EXPERTS, CHUNKED_LM_LOSS, **_MLA, num_key_value_heads=4),
    _f(
        "deepseek_v3",
        "moe",
        FUSED_GATE_UP,
        LINEAR_EXPERTS,
        CHUNKED_LM_LOSS,
        **_MLA,
        head_dim=8,  # = qk_rope_head_dim: transformers 4.57 sizes the rotary embedding by head_dim
        num_key_value_heads=4,
    ),
    _f("phimoe", "moe", FUSED_QKV, LINEAR_EXPERTS, CHUNKED_LM_LOSS),
    _f("granitemoe", "moe", CHUNKED_LM_LOSS),
    _f("granitemoeshared", "moe", CHUNKED_LM_LOSS),
    _f("minimax", "moe", FUSED_QKV, LINEAR_EXPERTS, CHUNKED_LM_LOSS),
    _f("glm4_moe", "moe", *_QKV_GATE_UP_LOSS, LINEAR_EXPERTS),
    _f("ernie4_5_moe", "moe", *_QKV_GATE_UP_LOSS, LINEAR_EXPERTS),
    _f("hunyuan_v1_moe", "moe", *_QKV_GATE_UP_LOSS, LINEAR_EXPERTS),
    _f("dots1", "moe", *_QKV_GATE_UP_LOSS, LINEAR_EXPERTS),
    _f("gpt_oss", "moe", CHUNKED_LM_LOSS),
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
        >>> covered_by(LINEAR_EXPERTS)[-2:]
        ('jamba', 'qwen3_next')
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
