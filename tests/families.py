"""The model families integration tests parametrise over: modelgraft's one family table, plus test facts.

The rows (model type, kind, what its tiny config needs, which grafts cover it) live in the product,
:mod:`modelgraft._families`, because tiny configs and the grafts' family lists are product. What only
tests need is added here: the reason a family is skipped when it cannot run here (``SKIPS``), and
the inputs each kind takes. Tests pick families with :func:`family_params` (a list of
``pytest.param`` with readable ids and skip marks that print the reason) and build models and inputs
with the methods below.

Example::

    @pytest.mark.parametrize("family", family_params(kinds={"decoder", "moe"}))
    def test_something(family):
        model = family.causal_lm().eval()
        logits = model(**family.inputs(model.config)).logits
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, PretrainedConfig

from _versions import missing_model_type

# Test infrastructure, not a test: the one family table (issue 14, point 4) lives in the product's
# private _families module and drives these helpers; no public name lists it.
from modelgraft import _families
from modelgraft.testing import tiny_config

KINDS = _families.KINDS

#: Why a family of the table cannot run here, beyond a model type the installed transformers lacks
#: (:func:`_versions.missing_model_type`); printed by ``pytest -ra``.
SKIPS: dict[str, str] = {
    # Its row exists for the tiny config that `linear_experts` reads to refuse it with this reason.
    "ernie4_5_vl_moe_text": (
        "ERNIE 4.5 VL's text model has no base model class in transformers' `MODEL_MAPPING`: "
        "`AutoModel` cannot build it alone"
    ),
}


@dataclass(frozen=True)
class Family:
    """One model family of the installed transformers, made tiny."""

    model_type: str
    kind: str  # one of KINDS
    skip: str | None = None  # why this family cannot run here (printed by pytest -ra)

    def config(self, **overrides: Any) -> PretrainedConfig:
        """The tiny config (the table's sizes for this family), with the caller's overrides."""
        return tiny_config(self.model_type, **overrides)

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
        return auto_class(config).from_config(config)

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


def auto_class(config: PretrainedConfig) -> type:
    """``AutoModelForCausalLM`` where transformers maps ``config`` to a causal LM, else ``AutoModel``."""
    try:
        AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        return AutoModel
    return AutoModelForCausalLM


def randomise_routers(model: torch.nn.Module, seed: int = 1) -> None:
    """Random router weights, so tokens reach many experts (initialisers often zero them)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            leaf = name.split(".")
            if ("router" in leaf or "gate" in leaf) and param.is_floating_point():
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)


FAMILIES: tuple[Family, ...] = tuple(
    Family(row.model_type, row.kind, SKIPS.get(row.model_type) or missing_model_type(row.model_type))
    for row in _families.FAMILIES
)

BY_TYPE: dict[str, Family] = {f.model_type: f for f in FAMILIES}


def family(model_type: str) -> Family:
    """The table entry of ``model_type`` (a clear error for a type the table lacks)."""
    try:
        return BY_TYPE[model_type]
    except KeyError:
        raise KeyError(
            f"`{model_type}` is not in the family table; add a row to `FAMILIES` in src/modelgraft/_families.py"
        ) from None


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
