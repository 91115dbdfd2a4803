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
    with pytest.raises(
        ConversionShapeError,
        match=r"is quantized \((Parameter|Tensor), torch.uint8.*save_original_format=False",
    ):
        model.save_pretrained(tmp_path)


@pytest.mark.parametrize("reads", ["as_torchao_does", "value_0_as_quanto_does"])
def test_a_quantizing_load_hands_each_converted_weight_to_the_quantizer_as_transformers_does(
    reads: str, tiny_checkpoint: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Point 6: the placer handed ``convert`` ``{key: tensor}`` where transformers hands
    ``{key: [tensor]}``. torchao's quantize op takes either; quanto's reads ``value[0]``. The stand-in
    for quanto (not installed) is torchao's op reading ``value[0]`` as quanto's does: on main it
    quantized each expert weight's first row, a (64,) weight in a (128, 64) layer."""
    pytest.importorskip("torchao.quantization", reason="torchao is not installed")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_
    from transformers import TorchAoConfig
    from transformers.integrations import torchao as hf_torchao

    received: list[tuple[str, object]] = []
    original = hf_torchao.TorchAoQuantize.convert

    def convert(self: object, input_dict: dict, **kwargs: object) -> object:
        key, value = next(iter(input_dict.items()))
        received.append((key, value))
        if reads == "value_0_as_quanto_does":
            input_dict = {key: [value[0]]}  # quanto: `value = value[0]`, whatever it was handed
        return original(self, input_dict, **kwargs)

    monkeypatch.setattr(hf_torchao.TorchAoQuantize, "convert", convert)
    source = tiny_checkpoint("mixtral")
    with linear_experts("mixtral").applied(strict=True):
        quantized = AutoModelForCausalLM.from_pretrained(
            source, quantization_config=TorchAoConfig(Int8WeightOnlyConfig())
        ).eval()
        reference = AutoModelForCausalLM.from_pretrained(source).eval()
    # The same quantization of the loaded fp32 model, on the layers the quantizing load quantized
    # (transformers leaves `lm_head` alone).
    chosen = {
        n.rpartition(".")[0] for n, p in quantized.named_parameters() if type(p) is not torch.nn.Parameter
    }
    assert {
        f"model.layers.0.mlp.experts.{i}.{w}"
        for i in range(quantized.config.num_local_experts)
        for w in ("w1", "w2", "w3")
    } <= chosen
    quantize_(reference, Int8WeightOnlyConfig(), filter_fn=lambda module, fqn: fqn in chosen)

    expert_keys = [k for k, _ in received if ".mlp.experts." in k]
    config = quantized.config
    assert len(expert_keys) == 3 * config.num_local_experts * config.num_hidden_layers
    for key, value in received:  # transformers' form: a list of one weight, as loaded
        assert isinstance(value, list) and len(value) == 1 and value[0].dim() == 2, (key, type(value))
    for (name, got), (_, expected) in zip(
        quantized.named_parameters(), reference.named_parameters(), strict=True
    ):
        assert type(got) is type(expected) and got.shape == expected.shape and got.dtype == expected.dtype, (
            name
        )
    experts = quantized.model.layers[0].mlp.experts
    assert type(experts[0].w1.weight).__name__ == "Int8Tensor"
    assert tuple(experts[0].w1.weight.shape) == (config.intermediate_size, config.hidden_size)
    inputs = {
        "input_ids": torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    }
    with torch.no_grad():
        got, expected = quantized(**inputs).logits, reference(**inputs).logits
    assert got.shape == expected.shape and got.dtype == expected.dtype and torch.isfinite(got).all()
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
