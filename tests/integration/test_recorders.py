"""Issue 2, point 7: output recorders follow replacements per instance, never through class state."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaModel, Qwen3MoeModel
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaPreTrainedModel
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoePreTrainedModel

from families import family
from modelgraft import clear_patch_mapping, patch_output_recorders, register_patch_mapping

IDS = torch.tensor([[1, 2, 3, 4, 5]])


class StandaloneAttention(torch.nn.Module):
    """Not a LlamaAttention subclass: only a patched recorder can find it."""

    def __init__(self, config: object, layer_idx: int) -> None:
        super().__init__()
        self.marker = torch.nn.Linear(1, 1)

    def forward(self, hidden_states: torch.Tensor, *args: object, **kwargs: object) -> tuple:
        weights = torch.ones(hidden_states.shape[0], 1, hidden_states.shape[1], hidden_states.shape[1])
        return hidden_states, weights


# The class whose output is recorded as router logits: the router on transformers 5.x, the
# sparse-MoE block (which holds the router) on 4.57.
ROUTER_RECORDED = Qwen3MoePreTrainedModel._can_record_outputs["router_logits"].target_class


class StandaloneRouter(torch.nn.Module):
    def __init__(self, config: object) -> None:
        super().__init__()
        self.inner = ROUTER_RECORDED(config)

    def forward(self, hidden_states: torch.Tensor) -> tuple:
        return self.inner(hidden_states)


def _attentions(model: torch.nn.Module) -> int:
    # transformers 4.57 returns None instead of () when nothing was captured.
    return len(model(IDS, output_attentions=True).attentions or ())


def _router_logits(model: torch.nn.Module) -> int:
    return len(model(IDS, output_router_logits=True).router_logits)


def test_llama_attentions_survive_a_patched_load_and_clear() -> None:
    class_level = dict(LlamaPreTrainedModel._can_record_outputs)
    register_patch_mapping({"LlamaAttention": StandaloneAttention})
    grafted = AutoModelForCausalLM.from_config(family("llama").config(), attn_implementation="eager")
    assert _attentions(grafted) == 2  # the instance records the replacement
    clear_patch_mapping()
    assert LlamaPreTrainedModel._can_record_outputs == class_level
    assert LlamaPreTrainedModel._can_record_outputs["attentions"] is LlamaAttention
    fresh = LlamaModel(family("llama").config(attn_implementation="eager"))
    assert _attentions(fresh) == 2
    loaded = AutoModelForCausalLM.from_config(family("llama").config(), attn_implementation="eager")
    assert _attentions(loaded) == 2
    assert _attentions(grafted) == 2


def test_plain_pretrained_llama_keeps_its_attentions(tiny_llama_dir: Path) -> None:
    register_patch_mapping({"LlamaAttention": StandaloneAttention})
    AutoModelForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation="eager")
    clear_patch_mapping()
    plain = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation="eager")
    assert _attentions(plain) == 2


def test_qwen3_moe_router_logits_survive() -> None:
    recorder = Qwen3MoePreTrainedModel._can_record_outputs["router_logits"]
    target = recorder.target_class
    register_patch_mapping({ROUTER_RECORDED.__name__: StandaloneRouter})
    grafted = Qwen3MoeModel._from_config(family("qwen3_moe").config())
    assert any(isinstance(m, StandaloneRouter) for m in grafted.modules())
    assert _router_logits(grafted) == 2
    clear_patch_mapping()
    assert Qwen3MoePreTrainedModel._can_record_outputs["router_logits"] is recorder
    assert recorder.target_class is target  # the shared OutputRecorder was not mutated
    plain = Qwen3MoeModel._from_config(family("qwen3_moe").config())
    assert _router_logits(plain) == 2


@pytest.mark.parametrize("call", ["snapshot", "replacements"])
def test_manual_patch_output_recorders(call: str) -> None:
    register_patch_mapping({"LlamaAttention": StandaloneAttention})
    from modelgraft import apply_patches

    with apply_patches():
        model = LlamaModel(family("llama").config(attn_implementation="eager"))
    assert _attentions(model) == 0  # built manually: the recorders still point at LlamaAttention
    model = LlamaModel(family("llama").config(attn_implementation="eager"))
    with apply_patches():
        model = LlamaModel(family("llama").config(attn_implementation="eager"))
    if call == "snapshot":
        assert patch_output_recorders(model) == 1
    else:
        assert patch_output_recorders(model, replacements={LlamaAttention: StandaloneAttention}) == 1
    assert _attentions(model) == 2
    assert LlamaPreTrainedModel._can_record_outputs["attentions"] is LlamaAttention
