"""Grafted loads with a ``device_map``: whole-model CPU maps, and converted weights offloaded to disk."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from _versions import requires_v4, requires_v5
from families import family_params
from modelgraft import ConversionError, patched, report
from modelgraft.grafts import fused_gate_up, fused_qkv

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None,
    reason="device_map needs `accelerate` (installed by `make setup` through the dev extra)",
)
FAMILIES = family_params(model_types=["llama", "qwen2", "qwen3"])


def _checkpoint(family, folder: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    plain = family.causal_lm(num_hidden_layers=2).eval()
    plain.save_pretrained(folder)
    return plain


def _grafted_load(family, folder: Path, **kwargs) -> torch.nn.Module:
    graft = fused_qkv(family.model_type) + fused_gate_up(family.model_type)
    with patched(graft.mapping, conversions=graft.conversions):
        return AutoModelForCausalLM.from_pretrained(folder, **kwargs).eval()


def _assert_same_outputs(grafted: torch.nn.Module, plain: torch.nn.Module, family) -> None:
    inputs = family.inputs(plain.config)
    expected = plain(**inputs).logits
    # With and without autograd: the fused layers take different paths in each.
    torch.testing.assert_close(grafted(**inputs).logits, expected, atol=1e-5, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(grafted(**inputs).logits, expected, atol=1e-5, rtol=0)


def _assert_saves_the_original(grafted: torch.nn.Module, source: Path, out: Path) -> None:
    grafted.save_pretrained(out)
    original = load_file(source / "model.safetensors")
    written = {}
    for f in sorted(out.glob("*.safetensors")):
        written.update(load_file(f))
    assert written.keys() == original.keys()
    assert all(torch.equal(written[k], original[k]) for k in original)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("device_map", ["cpu", "auto"])
def test_a_grafted_model_loads_with_a_device_map(family, device_map, tmp_path):
    plain = _checkpoint(family, tmp_path / "ckpt")
    grafted = _grafted_load(family, tmp_path / "ckpt", device_map=device_map)
    assert hasattr(grafted.model.layers[0].self_attn, "qkv_proj")
    assert not report(grafted).problems
    _assert_same_outputs(grafted, plain, family)
    _assert_saves_the_original(grafted, tmp_path / "ckpt", tmp_path / "out")


#: Layer 1 on disk, everything else on the CPU.
DISK_MAP = {
    "model.embed_tokens": "cpu",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.norm": "cpu",
    "model.rotary_emb": "cpu",
    "lm_head": "cpu",
}


@requires_v5
@pytest.mark.parametrize("family", FAMILIES)
def test_converted_weights_offloaded_to_disk_are_written_converted_and_read_back(family, tmp_path):
    plain = _checkpoint(family, tmp_path / "ckpt")
    offload = tmp_path / "offload"
    grafted = _grafted_load(family, tmp_path / "ckpt", device_map=DISK_MAP, offload_folder=str(offload))
    layer = grafted.model.layers[1]
    assert layer.self_attn.qkv_proj.weight.device.type == "meta"  # offloaded, not held in memory
    stored = load_file(offload / "model.layers.1.self_attn.qkv_proj.weight.safetensors")
    expected = torch.cat([plain.model.layers[1].self_attn.get_submodule(f"{n}_proj").weight for n in "qkv"])
    assert torch.equal(stored["model.layers.1.self_attn.qkv_proj.weight"], expected)
    assert not report(grafted).problems
    _assert_same_outputs(grafted, plain, family)
    _assert_saves_the_original(grafted, tmp_path / "ckpt", tmp_path / "out")


@requires_v4
def test_disk_offload_of_a_converted_weight_is_refused_clearly_on_4_57(tmp_path):
    family = FAMILIES[0].values[0]
    _checkpoint(family, tmp_path / "ckpt")
    with pytest.raises(ConversionError, match=r'placed on "disk".*Keep the converted modules on "cpu"'):
        _grafted_load(family, tmp_path / "ckpt", device_map=DISK_MAP, offload_folder=str(tmp_path / "off"))
