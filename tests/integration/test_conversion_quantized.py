"""Quantizing loads (torchao int8 weight-only, CPU): converted weights are quantized like the rest."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from _versions import requires_v4, requires_v5
from families import family
from modelgraft import StrictModeError, report
from modelgraft.grafts import fused_gate_up, fused_qkv

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None,
    reason="needs `torchao` (installed by `make setup` through the dev extra)",
)


def _quantization_config():
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    return TorchAoConfig(Int8WeightOnlyConfig())


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    family("llama").causal_lm(hidden_size=128, intermediate_size=256).save_pretrained(tmp_path)
    return tmp_path


@requires_v5
def test_fused_weights_are_quantized_exactly_like_the_separate_ones(checkpoint: Path) -> None:
    plain = AutoModelForCausalLM.from_pretrained(
        checkpoint, quantization_config=_quantization_config()
    ).eval()
    with (fused_qkv("llama") + fused_gate_up("llama")).applied(strict=True):
        grafted = AutoModelForCausalLM.from_pretrained(
            checkpoint, quantization_config=_quantization_config()
        ).eval()
    quantized = type(plain.model.layers[0].self_attn.q_proj.weight)
    assert quantized is not torch.nn.Parameter  # the quantizer did replace the plain weights
    layer = grafted.model.layers[0]
    assert type(layer.self_attn.qkv_proj.weight) is quantized
    assert type(layer.mlp.gate_up_proj.weight) is quantized
    assert not report(grafted).problems
    ids = torch.randint(0, 100, (2, 9))
    with torch.no_grad():
        # int8 weight-only scales each output row: fused rows get the very scales separate rows get.
        torch.testing.assert_close(grafted(ids).logits, plain(ids).logits, atol=1e-5, rtol=0)


@requires_v4
def test_unquantized_converted_weights_are_reported_on_4_57(checkpoint: Path) -> None:
    with fused_qkv("llama").applied():
        grafted = AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=_quantization_config())
    problems = report(grafted).problems
    assert any(
        "qkv_proj.weight` was built by a modelgraft conversion and is not quantized" in p for p in problems
    )
    with pytest.raises(StrictModeError, match="not quantized"), fused_qkv("llama").applied(strict=True):
        AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=_quantization_config())
