"""Quantized per-expert layers meet the checkpoint conversion (issue 27 points 5 and 6).

bitsandbytes and optimum-quanto are not installed in the test venvs, so their part is played by
stand-ins that do what the issue found them doing:

* bitsandbytes 4-bit keeps a layer's weight as packed ``uint8`` storage of shape ``(N, 1)``; the
  save-side shape check compared it with the original float ``(out, in)`` and refused to save.
* a quantizing load hands each weight to ``quantizer.get_quantize_ops().convert(...)``, which (as
  transformers calls it) receives a list of tensors per key; quanto's reads ``value[0]``, so a bare
  tensor made it quantize one row ("1D Tensors cannot be quantized per-axis").
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from _versions import requires_fused_experts
from modelgraft.errors import ConversionShapeError
from modelgraft.grafts import linear_experts

pytestmark = requires_fused_experts


def _saved(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def _pack_like_bnb_4bit(layer: torch.nn.Linear) -> torch.Tensor:
    """What bitsandbytes' ``Params4bit`` holds: two 4-bit values per byte, as an (N, 1) uint8 column."""
    packed = torch.randint(0, 256, (layer.weight.numel() // 2, 1), dtype=torch.uint8)
    layer.weight = torch.nn.Parameter(packed, requires_grad=False)
    return packed


def test_a_packed_4bit_expert_weight_saves_under_its_checkpoint_name(
    tiny_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """Point 5: Mixtral's per-expert weights are renamed back on save (``mlp`` -> ``block_sparse_moe``);
    a renaming writes the quantized storage as it is instead of comparing it with the float shape."""
    source = tiny_checkpoint("mixtral")
    with linear_experts("mixtral").applied(strict=True):
        model = AutoModelForCausalLM.from_pretrained(source)
    original = _saved(source)
    experts = model.model.layers[0].mlp.experts
    packed = {i: _pack_like_bnb_4bit(experts[i].w1) for i in range(len(experts))}
    model.save_pretrained(tmp_path)
    saved = _saved(tmp_path)
    assert set(saved) == set(original)
    for i, tensor in packed.items():
        key = f"model.layers.0.block_sparse_moe.experts.{i}.w1.weight"
        got = saved[key]
        assert got.dtype == torch.uint8 and got.shape == tensor.shape and torch.equal(got, tensor)
    for key, tensor in original.items():  # everything else: the checkpoint, exactly
        if not (key.startswith("model.layers.0.block_sparse_moe.experts.") and key.endswith(".w1.weight")):
            assert saved[key].dtype == tensor.dtype and torch.equal(saved[key], tensor), key


def test_a_packed_expert_weight_that_an_operation_would_rearrange_is_refused_by_name(
    tiny_checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """Where the reverse rearranges tensors (GPT-OSS: the per-expert layers are stacked back into
    fused, interleaved 3D experts), packed storage cannot be reversed: a named error, never a file
    of shuffled bytes."""
    source = tiny_checkpoint("gpt_oss")
    with linear_experts("gpt_oss").applied(strict=True):
        model = AutoModelForCausalLM.from_pretrained(source)
    layer = model.model.layers[0].mlp.experts[0]
    gate = next(module for module in layer.children() if isinstance(module, torch.nn.Linear))
    _pack_like_bnb_4bit(gate)
    with pytest.raises(ConversionShapeError, match=r"is quantized \((Parameter|Tensor), torch.uint8.*save_original_format=False"):
        model.save_pretrained(tmp_path)
