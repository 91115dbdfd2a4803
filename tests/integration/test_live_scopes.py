"""graft_model picks, for each replaced module, the conversion entry a load would use for it.

A load gives a sub-model that has an entry under its own class name (``LlamaModel`` inside
``LlamaForCausalLM``) its own scope, with keys local to it; a graft in place must use the same
entry, or the two ways of grafting convert the same weights differently.
"""

from __future__ import annotations

import tempfile

import torch
from transformers import AutoModelForCausalLM

import modelgraft
from modelgraft import WeightRenaming, graft_model
from modelgraft.grafts import fused_qkv
from modelgraft.testing import tiny_config


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.arange(14).reshape(2, 7) % 128
    with torch.no_grad():
        return model(ids).logits


def test_an_inner_class_name_entry_wins_for_its_keys_as_at_load_time() -> None:
    graft = fused_qkv("llama")
    # The outer entry converts nothing of the attention; the inner one (keys local to `model.`)
    # fuses q/k/v. Loading uses the inner one for `model.*`; so must graft_model.
    conversions = {
        "LlamaForCausalLM": [WeightRenaming(r"^unused_prefix\.", "still_unused.")],
        "LlamaModel": list(graft.conversions["llama"]),
    }
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    expected = _logits(plain)
    with tempfile.TemporaryDirectory() as folder:
        plain.save_pretrained(folder)
        with modelgraft.patched(graft.mapping, conversions=conversions):
            loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    in_place = graft_model(plain, graft.mapping, conversions=conversions)

    loaded_state = loaded.state_dict()
    in_place_state = in_place.state_dict()
    assert sorted(in_place_state) == sorted(loaded_state)
    assert any("qkv_proj" in k for k in in_place_state)
    for key, tensor in loaded_state.items():
        assert in_place_state[key].dtype == tensor.dtype, key
        assert torch.equal(in_place_state[key], tensor), key
    got = _logits(in_place)
    assert got.shape == expected.shape and bool(torch.isfinite(got).all())
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
