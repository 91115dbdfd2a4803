"""torchao int8 weight-only quantization of per-expert layers runs each layer's own forward.

Issue 27 point 1: the default ``grouped_mm`` path stacked ``layer.weight`` of every exact
``nn.Linear``, which fails on torchao's ``Int8Tensor`` weights (``aten.stack`` is not implemented)
and would bypass their quantized matmul where stacking worked. The quantized grafted model must
compute what the same quantization of the eager per-expert model computes: same greedy ids,
shapes, dtypes, finite values.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from _versions import requires_fused_experts
from families import family, randomise_routers
from modelgraft.grafts import linear_experts

torchao_quantization = pytest.importorskip("torchao.quantization", reason="torchao is not installed")

pytestmark = requires_fused_experts


def _int8_weight_only(model: torch.nn.Module) -> torch.nn.Module:
    config = getattr(torchao_quantization, "Int8WeightOnlyConfig", None)
    if config is None:  # older torchao: the function form
        torchao_quantization.quantize_(model, torchao_quantization.int8_weight_only())
    else:
        torchao_quantization.quantize_(model, config())
    return model


def _expert_weight_types(model: torch.nn.Module) -> list[type]:
    return [
        type(module.weight)
        for name, module in model.named_modules()
        if ".experts." in name and isinstance(module, torch.nn.Linear)
    ]


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_torchao_int8_weight_only_grafted_experts_match_the_eager_per_expert_reference(
    model_type: str, tiny_checkpoint: Callable[[str], Path]
) -> None:
    source = tiny_checkpoint(model_type)
    with linear_experts(model_type).applied(strict=True):
        grouped = AutoModelForCausalLM.from_pretrained(source).eval()  # the default: grouped_mm
        eager = AutoModelForCausalLM.from_pretrained(source, experts_implementation="eager").eval()
    for model in (grouped, eager):
        randomise_routers(model)  # every expert gets tokens
    inputs = family(model_type).inputs(grouped.config)
    with torch.no_grad():
        unquantized = grouped(**inputs).logits
    assert grouped.config._experts_implementation in (None, "grouped_mm")
    _int8_weight_only(grouped)
    _int8_weight_only(eager)

    config = grouped.config
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    types = _expert_weight_types(grouped)
    assert len(types) == 3 * experts * config.num_hidden_layers
    # every expert linear quantized: its weight a torchao tensor subclass (0.18: `Int8Tensor`)
    assert all(t not in (torch.nn.Parameter, torch.Tensor) for t in types), {t.__name__ for t in types}
    with torch.no_grad():
        got, expected = grouped(**inputs).logits, eager(**inputs).logits
    assert got.shape == expected.shape == unquantized.shape and got.dtype == expected.dtype == torch.float32
    assert torch.isfinite(got).all() and torch.isfinite(expected).all()
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    # int8 weights: close to the fp32 model, yet not the fp32 model (the quantized matmul ran).
    drift = (got - unquantized).abs().max()
    assert 0 < drift <= 0.05 * unquantized.abs().max()
