"""The seed's complete example on transformers 4.57, where it reads differently.

On 5.x (``test_conversion_seed.py``) the example replaces the fused ``Qwen2MoeExperts`` by
per-expert ``ModuleList`` experts and overrides transformers' own expert merge. On 4.57 the experts
already are a per-expert ``ModuleList`` (no ``Qwen2MoeExperts`` class, no built-in conversion), and
the attention is picked from ``QWEN2MOE_ATTENTION_CLASSES`` by implementation name: the fused-QKV
replacement must still be built for every implementation, and the conversion still loads it.
"""

from __future__ import annotations

import pytest
import torch
from conversion_helpers import FusedQKVAttention, ModuleListExperts, tiny_qwen2_moe_config
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from _versions import requires_v4
from modelgraft import (
    Concatenate,
    WeightConverter,
    register_checkpoint_conversion_mapping,
    register_patch_mapping,
    report,
)

pytestmark = requires_v4

X = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def qwen2_moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen2-moe-v4")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_qwen2_moe_config()).save_pretrained(path)
    return path


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_seed_complete_example_on_4_57(qwen2_moe_dir, tmp_path, attn_implementation: str) -> None:
    plain = AutoModelForCausalLM.from_pretrained(
        qwen2_moe_dir, attn_implementation=attn_implementation
    ).eval()
    # As in the seed, with the import lines changed to modelgraft (4.57 needs no overwrite).
    register_patch_mapping(
        mapping={"Qwen2MoeExperts": ModuleListExperts, "Qwen2MoeAttention": FusedQKVAttention}
    )
    register_checkpoint_conversion_mapping(
        model_type_or_class_name="qwen2_moe",
        mapping=[
            WeightConverter(
                source_patterns=["q_proj", "k_proj", "v_proj"],
                target_patterns=["qkv_proj"],
                operations=[Concatenate(dim=0)],
            ),
        ],
    )
    model, info = AutoModelForCausalLM.from_pretrained(
        qwen2_moe_dir, output_loading_info=True, attn_implementation=attn_implementation
    )
    model.eval()
    layers = model.model.layers
    assert all(isinstance(layer.self_attn, FusedQKVAttention) for layer in layers)
    assert isinstance(layers[0].mlp.experts, torch.nn.ModuleList)  # per-expert already on 4.57
    assert not info["missing_keys"] and not info["unexpected_keys"]
    rep = report(model)
    assert len(rep.conversions) == 4  # q, k, v -> qkv_proj: weight and bias, in each of 2 layers
    assert "Qwen2MoeExperts" in rep.unmatched_keys  # no such class on 4.57, and it says so
    torch.testing.assert_close(model(X).logits, plain(X).logits, atol=1e-5, rtol=0)

    model.save_pretrained(tmp_path)
    original = load_file(qwen2_moe_dir / "model.safetensors")
    written = load_file(tmp_path / "model.safetensors")
    assert sorted(written) == sorted(original)
    assert all(torch.equal(written[k], original[k]) for k in original)
