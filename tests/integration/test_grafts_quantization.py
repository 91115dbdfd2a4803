"""What per-expert layers are for: a quantizer that only handles ``nn.Linear`` reaches the experts."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from _versions import requires_fused_experts
from families import family
from modelgraft.grafts import fused_qkv, linear_experts

quantize_dynamic = getattr(getattr(torch, "ao", None), "quantization", None)
pytestmark = [
    requires_fused_experts,
    pytest.mark.skipif(
        quantize_dynamic is None or not hasattr(quantize_dynamic, "quantize_dynamic"),
        reason="this torch has no torch.ao.quantization.quantize_dynamic",
    ),
]


def _quantized(model: nn.Module) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization announces its move to torchao
        return torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)


def _linear_count(module: nn.Module, kind: type) -> int:
    return sum(isinstance(m, kind) for m in module.modules())


@pytest.mark.parametrize("model_type", ["qwen2_moe", "mixtral", "olmoe"])
def test_dynamic_int8_quantization_reaches_every_expert_only_after_the_graft(model_type: str, tmp_path: Path):
    from torch.ao.nn.quantized.dynamic import Linear as QuantizedLinear

    torch.manual_seed(0)
    fam = family(model_type)
    plain = fam.causal_lm().eval()
    plain.save_pretrained(tmp_path)
    graft = linear_experts(model_type) + fused_qkv(model_type)
    with graft.applied(strict=True):
        grafted = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    config = plain.config
    experts = config.num_local_experts if hasattr(config, "num_local_experts") else config.num_experts

    # transformers' fused 3D experts are parameters, not nn.Linear: the quantizer cannot see them.
    assert _linear_count(_quantized(plain).model.layers[0].mlp.experts, QuantizedLinear) == 0
    quantized = _quantized(grafted)
    assert _linear_count(quantized.model.layers[0].mlp.experts, QuantizedLinear) == 3 * experts
    assert isinstance(quantized.model.layers[0].self_attn.qkv_proj, QuantizedLinear)

    inputs = fam.inputs(config)
    with torch.no_grad():
        expected, got = plain(**inputs).logits, quantized(**inputs).logits
    # int8 weights and activations: a few percent of the logits' scale, never a different model.
    assert (got - expected).abs().max() <= 0.1 * expected.abs().max()
