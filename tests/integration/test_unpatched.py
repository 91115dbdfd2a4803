"""modelgraft.unpatched(): plain loads whatever is registered or scoped outside, in this thread only."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from conversion_helpers import QKV, fused_qkv_class
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP

import modelgraft
from modelgraft import (
    patched,
    register_checkpoint_conversion_mapping,
    report,
    unpatched,
    unregister_checkpoint_conversion_mapping,
)
from modelgraft.testing import tiny_config


class MarkedMLP(LlamaMLP):
    """A replacement that computes exactly what LlamaMLP computes."""


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(tmp_path)
    return tmp_path


@pytest.fixture
def registered_globally():
    modelgraft.register_patch_mapping(
        {"LlamaAttention": fused_qkv_class(LlamaAttention), "LlamaMLP": MarkedMLP}
    )
    register_checkpoint_conversion_mapping("llama", [QKV])
    try:
        yield
    finally:
        modelgraft.unregister_patch_mapping(["LlamaAttention", "LlamaMLP"])
        unregister_checkpoint_conversion_mapping("llama")


def _layer_classes(model: torch.nn.Module) -> tuple[str, str]:
    layer = model.model.layers[0]
    return type(layer.self_attn).__name__, type(layer.mlp).__name__


def test_global_patches_and_conversions_do_not_reach_an_unpatched_load(checkpoint, registered_globally):
    grafted = AutoModelForCausalLM.from_pretrained(checkpoint)
    with unpatched():
        assert modelgraft.get_patch_mapping() == {}
        assert modelgraft.get_checkpoint_conversion_mapping("llama") is None
        plain = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert _layer_classes(grafted) == ("FusedQKVLlamaAttention", "MarkedMLP")
    assert _layer_classes(plain) == ("LlamaAttention", "LlamaMLP")
    assert not report(plain).replaced and not report(plain).conversions
    assert "model.layers.0.self_attn.q_proj.weight" in plain.state_dict()
    # Outside the block everything is as registered again.
    assert _layer_classes(AutoModelForCausalLM.from_pretrained(checkpoint))[1] == "MarkedMLP"
    x = torch.randint(0, 100, (1, 6))
    torch.testing.assert_close(plain(x).logits, grafted(x).logits, atol=1e-5, rtol=0)


def test_an_enclosing_patched_block_is_hidden_and_an_inner_one_applies(checkpoint):
    with patched({"LlamaMLP": MarkedMLP}, strict=True):
        with unpatched():
            assert _layer_classes(AutoModelForCausalLM.from_pretrained(checkpoint)) == (
                "LlamaAttention",
                "LlamaMLP",
            )
            with patched({"LlamaAttention": fused_qkv_class(LlamaAttention)}, conversions={"llama": [QKV]}):
                inner = AutoModelForCausalLM.from_pretrained(checkpoint)
        assert _layer_classes(inner) == ("FusedQKVLlamaAttention", "LlamaMLP")
        assert _layer_classes(AutoModelForCausalLM.from_pretrained(checkpoint)) == (
            "LlamaAttention",
            "MarkedMLP",
        )


def test_other_threads_keep_seeing_the_global_registry(checkpoint, registered_globally):
    entered, loaded = threading.Event(), threading.Event()
    seen: list[tuple[str, str]] = []

    def other_thread() -> None:
        entered.wait(timeout=60)
        seen.append(_layer_classes(AutoModelForCausalLM.from_pretrained(checkpoint)))
        loaded.set()

    worker = threading.Thread(target=other_thread)
    worker.start()
    with unpatched():
        entered.set()
        assert loaded.wait(timeout=120)
        mine = _layer_classes(AutoModelForCausalLM.from_pretrained(checkpoint))
    worker.join(timeout=60)
    assert seen == [("FusedQKVLlamaAttention", "MarkedMLP")]
    assert mine == ("LlamaAttention", "LlamaMLP")
