"""Grafted models survive copy.deepcopy, pickle and torch.save, also into a fresh process."""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaAttention

from _versions import requires_fused_experts
from families import family
from modelgraft.grafts import fused_gate_up, fused_qkv, fused_qkv_class, linear_experts

GRAFTS = {
    "llama": lambda: fused_qkv("llama") + fused_gate_up("llama"),
    "qwen2_moe": lambda: fused_qkv("qwen2_moe") + linear_experts("qwen2_moe"),
}
CASES = [
    pytest.param("llama", id="llama-fused_qkv+fused_gate_up"),
    pytest.param("qwen2_moe", id="qwen2_moe-fused_qkv+linear_experts", marks=requires_fused_experts),
]


def _grafted(model_type: str, tmp_path: Path) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    plain = family(model_type).causal_lm().eval()
    plain.save_pretrained(tmp_path / "ckpt")
    with GRAFTS[model_type]().applied(strict=True):
        grafted = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    return plain, grafted


def _logits(model: torch.nn.Module, model_type: str) -> torch.Tensor:
    with torch.no_grad():
        return model(**family(model_type).inputs(model.config)).logits


@pytest.mark.parametrize("model_type", CASES)
def test_deepcopy_keeps_outputs_and_the_original_layout_on_save(model_type, tmp_path):
    plain, grafted = _grafted(model_type, tmp_path)
    twin = copy.deepcopy(grafted)
    assert type(twin.model.layers[0].self_attn) is type(grafted.model.layers[0].self_attn)
    torch.testing.assert_close(_logits(twin, model_type), _logits(plain, model_type), atol=1e-5, rtol=0)
    twin.save_pretrained(tmp_path / "out")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in reloaded.state_dict().items())


@pytest.mark.parametrize("model_type", CASES)
def test_torch_save_of_a_grafted_model_loads_in_a_fresh_process(model_type, tmp_path):
    plain, grafted = _grafted(model_type, tmp_path)
    inputs = family(model_type).inputs(plain.config)
    torch.save(
        {"model": grafted, "inputs": inputs, "logits": _logits(grafted, model_type)}, tmp_path / "m.pt"
    )
    script = textwrap.dedent(
        f"""
        import torch
        saved = torch.load({str(tmp_path / "m.pt")!r}, weights_only=False)
        model = saved["model"]
        with torch.no_grad():
            logits = model(**saved["inputs"]).logits
        assert torch.equal(logits, saved["logits"]), (logits - saved["logits"]).abs().max()
        print(type(model.model.layers[0].self_attn).__name__)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("FusedQKV" + type(plain.model.layers[0].self_attn).__name__)


class MyAttention(fused_qkv_class(LlamaAttention)):
    """A user's subclass of a grafted class (importable, so it pickles by reference)."""


def test_grafted_classes_pickle_as_their_recipe_and_user_subclasses_by_reference():
    grafted = fused_qkv_class(LlamaAttention)
    assert pickle.loads(pickle.dumps(grafted)) is grafted
    assert b"fused_subclass" in pickle.dumps(grafted)
    assert pickle.loads(pickle.dumps(MyAttention)) is MyAttention
