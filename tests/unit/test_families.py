"""modelgraft._families: the one table of model families, and what reads it (issue 14, point 4)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest
from transformers import PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import modelgraft
from families import FAMILIES as TEST_FAMILIES
from modelgraft import _compat, _families
from modelgraft.grafts import (
    CHUNKED_LM_LOSS_FAMILIES,
    FUSED_GATE_UP_FAMILIES,
    FUSED_QKV_FAMILIES,
    LINEAR_EXPERTS_FAMILIES,
)
from modelgraft.testing import tiny_config

SRC = Path(modelgraft.__file__).parent


def _imported_modules(path: Path) -> set[str]:
    """Every module a source file imports, at module level or inside functions."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


@pytest.mark.parametrize(
    "path",
    [*sorted((SRC / "grafts").glob("*.py")), SRC / "verify.py"],
    ids=lambda p: f"{p.parent.name}/{p.name}",
)
def test_grafts_and_verify_do_not_import_the_test_helpers(path: Path) -> None:
    imported = _imported_modules(path)
    assert "modelgraft.testing" not in imported, f"{path.name} imports modelgraft.testing"


def test_the_moe_test_families_are_not_part_of_the_product() -> None:
    assert importlib.util.find_spec("modelgraft.moe._families") is None
    assert not (SRC / "moe" / "_families.py").exists()


@pytest.mark.parametrize(
    ("name", "families"),
    [
        (_families.FUSED_QKV, FUSED_QKV_FAMILIES),
        (_families.FUSED_GATE_UP, FUSED_GATE_UP_FAMILIES),
        (_families.LINEAR_EXPERTS, LINEAR_EXPERTS_FAMILIES),
        (_families.CHUNKED_LM_LOSS, CHUNKED_LM_LOSS_FAMILIES),
    ],
)
def test_each_grafts_family_list_is_read_from_the_table(name: str, families: tuple[str, ...]) -> None:
    rows = [f.model_type for f in _families.FAMILIES if name in f.grafts]
    assert families == tuple(rows) and len(set(families)) == len(families)


def test_the_tests_parametrise_over_the_same_table() -> None:
    assert [(f.model_type, f.kind) for f in TEST_FAMILIES] == [
        (f.model_type, f.kind) for f in _families.FAMILIES
    ]
    assert {f.kind for f in _families.FAMILIES} == set(_families.KINDS)


def test_model_types_and_grafts_of_the_table_are_unique_and_known() -> None:
    types = [f.model_type for f in _families.FAMILIES]
    assert len(types) == len(set(types))
    for row in _families.FAMILIES:
        assert row.kind in _families.KINDS, row
        assert row.grafts <= {
            _families.FUSED_QKV,
            _families.FUSED_GATE_UP,
            _families.LINEAR_EXPERTS,
            _families.CHUNKED_LM_LOSS,
        }, row


@pytest.mark.parametrize("row", [f for f in _families.FAMILIES if f.tiny], ids=lambda f: f.model_type)
def test_every_tiny_fix_of_a_row_reaches_its_config(row: _families.Family) -> None:
    if row.model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers has no `{row.model_type}` here")
    config = tiny_config(row.model_type)
    for name, value in row.tiny.items():
        got = getattr(config, name)
        if isinstance(value, dict) and isinstance(got, PretrainedConfig):
            # a nested config (DBRX's `attn_config`) is built from the dict: each field reaches it
            for key, item in value.items():
                assert getattr(got, key) == item, f"{row.model_type}.{name}.{key}"
        else:
            assert got == value, f"{row.model_type}.{name}"


def test_a_graft_name_that_is_not_ready_made_is_refused() -> None:
    with pytest.raises(ValueError, match=r"`fused_everything` is not a ready-made graft"):
        _families.covered_by("fused_everything")


@pytest.mark.parametrize("name", [_families.FUSED_QKV, _families.FUSED_GATE_UP, _families.LINEAR_EXPERTS])
def test_a_default_family_list_names_only_model_types_the_installed_transformers_has(name: str) -> None:
    missing = [t for t in _families.covered_by(name) if t not in CONFIG_MAPPING]
    assert not missing, missing


def test_linear_experts_covers_on_4_57_only_families_per_expert_or_still_fused_there() -> None:
    covered = _families.covered_by(_families.LINEAR_EXPERTS)
    if _compat.FUSED_MOE_EXPERTS:
        assert {"gpt_oss", "llama4_text", "granitemoe", "aria_text"} <= set(covered)
        return
    per_expert = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "flex_olmo", "deepseek_v2", "deepseek_v3")
    assert set(per_expert) <= set(covered)
    assert "gpt_oss" in covered and "llama4_text" in covered  # fused on 4.57 too
    for model_type in ("granitemoe", "granitemoeshared", "qwen3_vl_moe_text", "aria_text"):
        assert model_type not in covered, model_type  # a layout of their own on 4.57


@pytest.mark.parametrize(
    "model_type",
    [f.model_type for f in _families.FAMILIES if f.model_type.startswith(("deepseek_v", "glm4_moe_lite"))],
)
def test_every_latent_attention_config_gets_the_tiny_mla_sizes(model_type: str) -> None:
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers has no `{model_type}` here")
    config = tiny_config(model_type)
    assert (config.qk_rope_head_dim, config.qk_nope_head_dim, config.kv_lora_rank, config.v_head_dim) == (
        8,
        8,
        16,
        16,
    )
