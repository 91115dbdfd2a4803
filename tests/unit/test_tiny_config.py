"""modelgraft.testing.tiny_config: small valid configs for the families of tests/families.py."""

from __future__ import annotations

import pytest
import torch

from families import FAMILIES, family_params
from modelgraft.testing import UnknownModelTypeError, tiny_config, tiny_overrides


def test_the_table_covers_at_least_forty_families_of_every_kind() -> None:
    runnable = [f for f in FAMILIES if f.skip is None]
    assert len(runnable) >= 40
    assert {f.kind for f in runnable} == {"decoder", "moe", "encoder", "vlm", "seq2seq"}


@pytest.mark.parametrize("family", family_params())
def test_each_family_builds_tiny_and_runs_a_forward(family) -> None:
    torch.manual_seed(0)
    config = family.config()
    model = family.base_model().eval()
    n_params = sum(p.numel() for p in model.parameters())
    # "tiny": well under the millions of a default config, whatever the family's spelling.
    assert n_params < 1_500_000, f"{family.model_type}: {n_params} parameters"
    with torch.no_grad():
        out = model(**family.inputs(config))
    hidden = out[0] if not hasattr(out, "last_hidden_state") else out.last_hidden_state
    assert hidden.shape[0] == 2
    assert torch.isfinite(hidden).all()


@pytest.mark.parametrize(
    ("model_type", "expected"),
    [
        (
            "llama",
            {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2},
        ),
        ("gpt2", {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 128}),
        ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "vocab_size": 128}),
        ("qwen2_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
        ("deepseek_v3", {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1}),
        ("bert", {"hidden_size": 64, "intermediate_size": 128, "vocab_size": 128}),
    ],
)
def test_tiny_sizes_are_set_through_each_familys_own_spelling(model_type: str, expected: dict) -> None:
    config = tiny_config(model_type)
    assert {k: getattr(config, k) for k in expected} == expected


def test_overrides_win_over_tiny_defaults() -> None:
    config = tiny_config("qwen2", hidden_size=32, num_key_value_heads=4)
    assert (config.hidden_size, config.num_key_value_heads, config.num_hidden_layers) == (32, 4, 2)


def test_composite_models_get_tiny_sub_configs_and_sub_config_overrides_merge() -> None:
    config = tiny_config("llava", text_config={"hidden_size": 32})
    assert config.text_config.hidden_size == 32
    assert config.text_config.num_hidden_layers == 2  # the rest of the tiny text config is kept
    assert config.vision_config.hidden_size == 64
    assert config.image_token_index < config.text_config.vocab_size


def test_special_token_ids_are_moved_inside_the_tiny_vocabulary() -> None:
    kwargs = tiny_overrides("llava")
    assert kwargs["image_token_index"] < 128


def test_unknown_model_type_lists_close_matches() -> None:
    with pytest.raises(
        UnknownModelTypeError, match=r"Unknown model type `qwen2moe`.*Close matches: .*`qwen2_moe`"
    ):
        tiny_config("qwen2moe")


def test_unknown_model_type_error_is_a_key_error() -> None:
    with pytest.raises(KeyError):
        tiny_config("definitely_not_a_model")
