"""A model grafted in place saves exactly what the plain model's save writes.

On transformers 5, a plain MoE model built with ``from_config`` saves its experts per expert (its
save undoes transformers' own expert merge). Grafting such a model in place (here with
``fused_qkv``, which leaves the experts alone) must not change that: same names, same tensors.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from modelgraft import graft_model
from modelgraft.grafts import fused_gate_up, fused_qkv
from modelgraft.testing import tiny_config

CASES = [
    pytest.param(fused_qkv, "mixtral", id="fused_qkv-mixtral"),
    pytest.param(fused_qkv, "qwen3_moe", id="fused_qkv-qwen3_moe"),
    pytest.param(fused_gate_up, "deepseek_v3", id="fused_gate_up-deepseek_v3"),
    pytest.param(fused_qkv, "llama", id="fused_qkv-llama"),
]


@pytest.mark.parametrize(("make_graft", "model_type"), CASES)
def test_save_after_graft_model_writes_the_plain_save(make_graft, model_type: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(tiny_config(model_type)).eval()
    plain.save_pretrained(tmp_path / "plain")
    grafted = graft_model(copy.deepcopy(plain), make_graft(model_type))
    assert sorted(grafted.state_dict()) != sorted(plain.state_dict())
    grafted.save_pretrained(tmp_path / "grafted")

    want = load_file(tmp_path / "plain" / "model.safetensors")
    got = load_file(tmp_path / "grafted" / "model.safetensors")
    assert sorted(got) == sorted(want), (sorted(set(got) - set(want))[:3], sorted(set(want) - set(got))[:3])
    for key, tensor in want.items():
        assert got[key].shape == tensor.shape and got[key].dtype == tensor.dtype, key
        assert torch.equal(got[key], tensor), key
