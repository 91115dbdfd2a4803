"""Shared fixtures: a clean patch registry around every test, and tiny local checkpoints."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PretrainedConfig

import modelgraft

#: Tiny config overrides per model family, shared by the integration tests.
TINY: dict[str, dict] = {
    "llama": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    ),
    "qwen3_moe": dict(
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        vocab_size=128,
    ),
    "bert": dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128
    ),
}


def tiny_config(model_type: str, **overrides: object) -> PretrainedConfig:
    """A tiny config of ``model_type`` from the :data:`TINY` table."""
    return AutoConfig.for_model(model_type, **{**TINY[model_type], **overrides})


@pytest.fixture(autouse=True)
def _clean_registry() -> Iterator[None]:
    """Every test starts and ends with an empty global patch registry."""
    modelgraft.clear_patch_mapping()
    yield
    modelgraft.clear_patch_mapping()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Return ``make(model_type)``: a saved tiny checkpoint of that family (built once per session).

    Call it before entering ``patched(...)``: the checkpoint is built under the patches in effect.
    """
    made: dict[str, Path] = {}

    def make(model_type: str) -> Path:
        if model_type not in made:
            path = tmp_path_factory.mktemp(f"tiny-{model_type}")
            auto = AutoModel if model_type == "bert" else AutoModelForCausalLM
            torch.manual_seed(0)
            auto.from_config(tiny_config(model_type)).save_pretrained(path)
            made[model_type] = path
        return made[model_type]

    return make


@pytest.fixture
def tiny_llama_dir(tiny_checkpoint: Callable[[str], Path]) -> Path:
    """A saved tiny Llama causal-LM checkpoint (hidden 32, 2 layers, vocab 128)."""
    return tiny_checkpoint("llama")
