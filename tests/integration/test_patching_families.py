"""Automatic patching across model families (from the shared table): every instance of the
family's attention class is built from the replacement, and nothing stays swapped afterwards."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM

from families import Family, family_params
from modelgraft import WeightConverter, patched, report

MODEL_TYPES = ["llama", "gpt2", "qwen3_moe", "mixtral", "bert", "t5", "mt5", "bart", "llava"]


def _attention_class(model: torch.nn.Module) -> type:
    for module in model.modules():
        cls = type(module)
        if cls.__name__.endswith("Attention") and cls.__module__.startswith("transformers.models."):
            return cls
    raise AssertionError(f"no attention class in {type(model).__name__}")


@pytest.mark.parametrize("family", family_params(model_types=MODEL_TYPES))
def test_family_attention_is_replaced_everywhere(family: Family) -> None:
    plain = AutoModel.from_config(family.config())
    original = _attention_class(plain)
    expected = sum(type(m) is original for m in plain.modules())
    replacement = type(f"Grafted{original.__name__}", (original,), {})
    home = sys.modules[original.__module__]

    with patched({original.__name__: replacement}, strict=True):
        model = AutoModel.from_config(family.config())

    assert sum(type(m) is replacement for m in model.modules()) == expected > 0
    assert not any(type(m) is original for m in model.modules())
    assert getattr(home, original.__name__) is original
    assert len(report(model).replaced) == expected


def test_patched_conversions_apply_inside_the_block_only(tiny_llama_dir: Path) -> None:
    from test_seed_patching_examples import LlamaFusedAttention

    from modelgraft import Concatenate

    fuse = WeightConverter(["q_proj", "k_proj", "v_proj"], ["qkv_proj"], [Concatenate(dim=0)])
    with patched({"LlamaAttention": LlamaFusedAttention}, conversions={"llama": [fuse]}, strict=True):
        fused = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    plain = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    ids = torch.tensor([[5, 6, 7, 8]])
    torch.testing.assert_close(fused(ids).logits, plain(ids).logits)
    assert type(fused.model.layers[1].self_attn) is LlamaFusedAttention
    assert report(plain).replaced == []
