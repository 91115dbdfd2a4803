"""Issue 2, point 10: the seed's examples (registration, pattern matching, manual construction,
troubleshooting) with the import line changed to modelgraft, on tiny local checkpoints.

Only the checkpoint names (hub ids become tiny local folders) and the config sizes differ from
the seed; each test runs the seed's statements in its order.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
from transformers import AutoModelForCausalLM, LlamaModel
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaAttention
from transformers.models.mistral import modeling_mistral
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeAttention

from families import family
from modelgraft import (
    Concatenate,
    WeightConverter,
    apply_patches,
    clear_patch_mapping,
    get_patch_mapping,
    register_checkpoint_conversion_mapping,
    register_patch_mapping,
    unregister_checkpoint_conversion_mapping,
    unregister_patch_mapping,
)


class SequentialExperts(nn.Module):
    pass


class CustomAttention(LlamaAttention):
    pass


class CustomExperts(nn.Module):
    pass


class CustomMLP(nn.Module):
    pass


class CustomQwenAttention(Qwen2MoeAttention):
    pass


def test_quick_start(tiny_llama_dir: Path) -> None:
    class CustomLlamaAttention(LlamaAttention):
        calls = 0

        def forward(self, *args: object, **kwargs: object) -> tuple:
            CustomLlamaAttention.calls += 1
            return super().forward(*args, **kwargs)

    register_patch_mapping(mapping={"LlamaAttention": CustomLlamaAttention})
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert type(model.model.layers[0].self_attn) is CustomLlamaAttention
    model(torch.tensor([[1, 2, 3]]))
    assert CustomLlamaAttention.calls == 2


def test_global_registration() -> None:
    register_patch_mapping(mapping={"Qwen2MoeExperts": SequentialExperts})
    register_patch_mapping(
        mapping={
            "Qwen2MoeExperts": SequentialExperts,
            "Qwen2MoeAttention": CustomQwenAttention,
        },
        overwrite=True,
    )
    assert get_patch_mapping() == {
        "Qwen2MoeExperts": SequentialExperts,
        "Qwen2MoeAttention": CustomQwenAttention,
    }


def test_pattern_matching_and_unregistering() -> None:
    register_patch_mapping(mapping={".*Attention": CustomAttention})
    register_patch_mapping(
        mapping={
            ".*MoeExperts$": CustomExperts,
            "^Llama\\d+Attention$": CustomAttention,
        }
    )
    with apply_patches():
        assert modeling_llama.LlamaAttention is CustomAttention  # `.*Attention`
        model = LlamaModel(family("llama").config())
    assert type(model.layers[0].self_attn) is CustomAttention

    register_patch_mapping(
        mapping={"Qwen2MoeExperts": CustomExperts, "Qwen2MoeAttention": CustomQwenAttention}
    )
    unregister_patch_mapping(keys=["Qwen2MoeExperts"])
    unregister_patch_mapping(keys=["Qwen2MoeAttention"])
    unregister_patch_mapping(keys=[".*Attention"])
    assert list(get_patch_mapping()) == [".*MoeExperts$", "^Llama\\d+Attention$"]
    clear_patch_mapping()
    assert get_patch_mapping() == {}


def test_exact_match_precedence_over_pattern() -> None:
    class PatternAttention(nn.Module):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__()

    register_patch_mapping({"LlamaAttention": CustomAttention, ".*Attention": PatternAttention})
    with apply_patches():
        assert modeling_llama.LlamaAttention is CustomAttention
        assert modeling_mistral.MistralAttention is PatternAttention


def test_manual_construction(tiny_llama_dir: Path) -> None:
    register_patch_mapping(mapping={"LlamaAttention": CustomAttention})
    with apply_patches():
        model = LlamaModel(family("llama").config())  # Uses CustomAttention
    assert type(model.layers[0].self_attn) is CustomAttention
    model = LlamaModel(family("llama").config())  # Uses LlamaAttention
    assert type(model.layers[0].self_attn) is LlamaAttention
    model = LlamaModel.from_pretrained(tiny_llama_dir)  # Uses CustomAttention
    assert type(model.layers[0].self_attn) is CustomAttention


def test_troubleshooting_checks(tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    register_patch_mapping(mapping={"LlamaAttention": CustomAttention})
    register_patch_mapping(mapping={".*MLP": CustomMLP})
    print(get_patch_mapping())
    printed = capsys.readouterr().out
    assert "'LlamaAttention': <class" in printed and "'.*MLP': <class" in printed
    assert "LlamaAttention" in dir(modeling_llama)
    unregister_patch_mapping([".*MLP"])

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert type(model.model.layers[0].self_attn) is CustomAttention
    for name, module in model.named_modules():
        if "attn" in name.lower():  # the seed filters on "attention"; Llama names the block self_attn
            print(f"{name}: {type(module)}")
    lines = capsys.readouterr().out.splitlines()
    blocks = [line for line in lines if line.split(":")[0].endswith("self_attn")]
    assert blocks == [f"model.layers.{i}.self_attn: {CustomAttention}" for i in range(2)]


def test_troubleshooting_cleanup(tiny_llama_dir: Path) -> None:
    try:
        register_patch_mapping(mapping={"LlamaAttention": CustomAttention})
        model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
        assert type(model.model.layers[0].self_attn) is CustomAttention
    finally:
        clear_patch_mapping()
    assert get_patch_mapping() == {}
    plain = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert type(plain.model.layers[0].self_attn) is LlamaAttention


class LlamaFusedAttention(LlamaAttention):
    """The seed's fused-QKV attention: one ``qkv_proj`` instead of ``q_proj``/``k_proj``/``v_proj``."""

    def __init__(self, config: object, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        q, k, v = self.q_proj, self.k_proj, self.v_proj
        self.sizes = (q.out_features, k.out_features, v.out_features)
        del self.q_proj, self.k_proj, self.v_proj
        self.qkv_proj = nn.Linear(q.in_features, sum(self.sizes), bias=q.bias is not None)

    def forward(self, hidden_states: torch.Tensor, *args: object, **kwargs: object) -> tuple:
        query, key, value = self.qkv_proj(hidden_states).split(self.sizes, dim=-1)
        self.q_proj = lambda _x: query  # reuse the parent's forward with precomputed projections
        self.k_proj = lambda _x: key
        self.v_proj = lambda _x: value
        try:
            return super().forward(hidden_states, *args, **kwargs)
        finally:
            del self.q_proj, self.k_proj, self.v_proj


def test_troubleshooting_weight_conversion(tiny_llama_dir: Path) -> None:
    register_patch_mapping(
        mapping={
            "LlamaAttention": LlamaFusedAttention,
        }
    )
    register_checkpoint_conversion_mapping(
        model_type_or_class_name="llama",
        mapping=[
            WeightConverter(
                source_patterns=["q_proj", "k_proj", "v_proj"],
                target_patterns=["qkv_proj"],
                operations=[
                    Concatenate(dim=0),
                ],
            )
        ],
        overwrite=True,
    )
    try:
        model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    finally:
        unregister_checkpoint_conversion_mapping("llama")
    clear_patch_mapping()
    plain = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    attention = plain.model.layers[0].self_attn
    expected = torch.cat([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight])
    torch.testing.assert_close(model.model.layers[0].self_attn.qkv_proj.weight, expected)
    ids = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(model(ids).logits, plain(ids).logits)
