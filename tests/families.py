"""The one table of model families that integration tests parametrise over.

Each :class:`Family` names a transformers ``model_type``, its kind, extra tiny-config overrides on
top of :func:`modelgraft.testing.tiny_config`, and the reason it is skipped when it cannot run
here. Tests pick families with :func:`family_params` (a list of ``pytest.param`` with readable ids
and skip marks that print the reason) and build models and inputs with the methods below.

Example::

    @pytest.mark.parametrize("family", family_params(kinds={"decoder", "moe"}))
    def test_something(family):
        model = family.causal_lm().eval()
        logits = model(**family.inputs(model.config)).logits
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, PretrainedConfig

from _versions import missing_model_type
from modelgraft.testing import tiny_config

KINDS = ("decoder", "moe", "encoder", "vlm", "seq2seq")


@dataclass(frozen=True)
class Family:
    """One model family of the installed transformers, made tiny."""

    model_type: str
    kind: str  # one of KINDS
    overrides: dict[str, Any] = field(default_factory=dict)
    skip: str | None = None  # why this family cannot run here (printed by pytest -ra)

    def config(self, **overrides: Any) -> PretrainedConfig:
        """The tiny config, with this family's and the caller's overrides."""
        return tiny_config(self.model_type, **{**self.overrides, **overrides})

    @property
    def has_lm_head(self) -> bool:
        return self.kind in ("decoder", "moe")

    def causal_lm(self, **overrides: Any) -> torch.nn.Module:
        """``AutoModelForCausalLM.from_config`` of the tiny config (decoder and MoE kinds)."""
        return AutoModelForCausalLM.from_config(self.config(**overrides))

    def model(self, **overrides: Any) -> torch.nn.Module:
        """The causal LM where transformers maps this config to one, else the base model
        (multimodal text towers such as ``qwen3_vl_moe_text`` have no causal-LM class of their own)."""
        config = self.config(**overrides)
        try:
            AutoModelForCausalLM._model_mapping[type(config)]
        except KeyError:
            return AutoModel.from_config(config)
        return AutoModelForCausalLM.from_config(config)

    def base_model(self, **overrides: Any) -> torch.nn.Module:
        """``AutoModel.from_config`` of the tiny config (every kind)."""
        return AutoModel.from_config(self.config(**overrides))

    def inputs(
        self, config: PretrainedConfig, batch: int = 2, seq: int = 12, seed: int = 0
    ) -> dict[str, Any]:
        """Deterministic model inputs for ``config`` (token ids, plus pixels for vision-language)."""
        generator = torch.Generator().manual_seed(seed)
        text = getattr(config, "text_config", None) or config
        vocab = text.vocab_size
        ids = torch.randint(0, min(vocab, 100), (batch, seq), generator=generator)
        kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if self.kind == "seq2seq":
            kwargs["decoder_input_ids"] = ids
        if self.kind == "vlm":
            vision = config.vision_config
            size = vision.image_size
            kwargs["pixel_values"] = torch.randn(batch, 3, size, size, generator=generator)
            image = torch.full((batch, config.image_seq_length), config.image_token_index)
            kwargs["input_ids"] = torch.cat([image, ids], dim=1)
            kwargs["attention_mask"] = torch.ones_like(kwargs["input_ids"])
        return kwargs


def _f(model_type: str, kind: str, skip: str | None = None, **overrides: Any) -> Family:
    return Family(model_type, kind, overrides, skip)


FAMILIES: tuple[Family, ...] = (
    # decoder-only language models
    _f("llama", "decoder"),
    _f("mistral", "decoder"),
    _f("ministral", "decoder"),
    _f("qwen2", "decoder"),
    _f("qwen3", "decoder"),
    _f("gemma", "decoder"),
    _f("gemma2", "decoder"),
    _f("gemma3_text", "decoder"),
    _f("phi", "decoder"),
    _f("phi3", "decoder"),
    _f("olmo", "decoder"),
    _f("olmo2", "decoder"),
    _f("olmo3", "decoder"),
    _f("granite", "decoder"),
    _f("cohere", "decoder"),
    _f("cohere2", "decoder"),
    _f("starcoder2", "decoder"),
    _f("stablelm", "decoder"),
    _f("gpt2", "decoder"),
    _f("gpt_neox", "decoder"),
    _f("gptj", "decoder"),
    _f("gpt_bigcode", "decoder"),
    _f("codegen", "decoder"),
    _f("falcon", "decoder"),
    _f("opt", "decoder"),
    _f("bloom", "decoder"),
    _f("biogpt", "decoder"),
    _f("xglm", "decoder"),
    _f("persimmon", "decoder"),
    _f("helium", "decoder"),
    _f("smollm3", "decoder"),
    _f("glm", "decoder"),
    _f("glm4", "decoder"),
    _f("nemotron", "decoder"),
    _f("exaone4", "decoder"),
    _f("apertus", "decoder"),
    _f("arcee", "decoder"),
    _f("seed_oss", "decoder"),
    _f("ernie4_5", "decoder"),
    _f("hunyuan_v1_dense", "decoder"),
    # mixture-of-experts language models
    _f("mixtral", "moe"),
    _f("qwen2_moe", "moe"),
    _f("qwen3_moe", "moe"),
    _f("olmoe", "moe"),
    _f("flex_olmo", "moe"),
    _f("deepseek_v2", "moe"),
    _f("deepseek_v3", "moe"),
    _f("phimoe", "moe"),
    _f("granitemoe", "moe"),
    _f("granitemoeshared", "moe"),
    _f("minimax", "moe"),
    _f("glm4_moe", "moe"),
    _f("ernie4_5_moe", "moe"),
    _f("hunyuan_v1_moe", "moe"),
    _f("dots1", "moe"),
    _f("gpt_oss", "moe"),
    _f("jamba", "moe"),
    _f("qwen3_next", "moe"),
    # MoE families of transformers 5 (skipped, with the reason, where the installed one lacks them)
    *(
        _f(t, "moe", missing_model_type(t))
        for t in (
            "qwen3_5_moe_text",
            "qwen3_vl_moe_text",
            "gemma4_text",
            "llama4_text",
            "granitemoehybrid",
            "granitemoe_swa",
            "aria_text",
            "afmoe",
            "axk1",
            "axk2",
            "cohere2_moe",
            "deepseek_v32",
            "exaone_moe",
            "glm4_moe_lite",
            "glm4v_moe_text",
            "glm_moe_dsa",
            "hy_v3",
            "inkling_text",
            "kolibri1",
            "laguna",
            "mellum",
            "mimo_v2_flash",
            "minimax_m2",
            "minimax_m3_vl_text",
            "mistral4",
            "openai_privacy_filter",
            "solar_open",
            "dots3_note_text",
        )
    ),
    # BERT-like encoders
    _f("bert", "encoder"),
    _f("roberta", "encoder"),
    _f("xlm-roberta", "encoder"),
    _f("camembert", "encoder"),
    _f("distilbert", "encoder"),
    _f("albert", "encoder"),
    _f("electra", "encoder"),
    _f("deberta", "encoder"),
    _f("deberta-v2", "encoder"),
    _f("mpnet", "encoder"),
    _f("ernie", "encoder"),
    _f("modernbert", "encoder"),
    # vision-language
    _f("llava", "vlm"),
    # encoder-decoder
    _f("t5", "seq2seq"),
    _f("mt5", "seq2seq"),
    _f("bart", "seq2seq"),
)

BY_TYPE: dict[str, Family] = {f.model_type: f for f in FAMILIES}


def family(model_type: str) -> Family:
    """The table entry of ``model_type`` (a clear error for a type the table lacks)."""
    try:
        return BY_TYPE[model_type]
    except KeyError:
        raise KeyError(f"`{model_type}` is not in tests/families.py; add it to FAMILIES") from None


def family_params(kinds: Iterable[str] | None = None, model_types: Iterable[str] | None = None) -> list[Any]:
    """``pytest.param`` entries for the chosen families, id'd by model type, skips attached.

    Args:
        kinds: keep only these kinds (``{"decoder", "moe"}``); all when ``None``.
        model_types: keep only these model types, in this order; all when ``None``.
    """
    chosen = [family(t) for t in model_types] if model_types is not None else list(FAMILIES)
    if kinds is not None:
        wanted = set(kinds)
        chosen = [f for f in chosen if f.kind in wanted]
    return [
        pytest.param(f, id=f.model_type, marks=[pytest.mark.skip(reason=f.skip)] if f.skip else [])
        for f in chosen
    ]
