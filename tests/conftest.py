"""Shared fixtures: clean patch and conversion registries around every test, and tiny local checkpoints
(saved ones, and saved ones with the plain model they came from)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM

import modelgraft
from families import family

# Test infrastructure, not a test: the one private name here. No public call restores the global
# registry (classes *and* conversions, with their order) as it was; `clear_patch_mapping` only
# empties the classes, and the public conversion API reads one key at a time and cannot list them.
from modelgraft import registry


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--release-smoke",
        action="store_true",
        help="run only the smoke subset of tests/release_smoke.py (the version walk's, per release)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--release-smoke"):
        return
    from release_smoke import selected

    keep = [item for item in items if selected(item.nodeid)]
    config.hook.pytest_deselected(items=[item for item in items if not selected(item.nodeid)])
    items[:] = keep


@pytest.fixture(autouse=True)
def _clean_registry() -> Iterator[None]:
    """Every test starts with an empty global patch registry, and leaves the global registry
    (classes and conversions) as it found it."""
    modelgraft.clear_patch_mapping()
    with registry.restoring():
        yield


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Return ``make(model_type)``: a saved tiny checkpoint of that family (built once per session).

    Call it before entering ``patched(...)``: the checkpoint is built under the patches in effect.
    """
    made: dict[str, Path] = {}

    def make(model_type: str) -> Path:
        if model_type not in made:
            path = tmp_path_factory.mktemp(f"tiny-{model_type}")
            auto = AutoModel if model_type == "bert" else AutoModelForCausalLM
            torch.manual_seed(0)
            auto.from_config(family(model_type).config()).save_pretrained(path)
            made[model_type] = path
        return made[model_type]

    return make


@pytest.fixture(scope="module")
def plain_checkpoint(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[..., tuple[Path, torch.nn.Module]]:
    """Return ``make(model_type, seed=0)``: a plain tiny checkpoint on disk and the plain model it
    came from (the base model where the family has no causal LM), built once per test module."""
    made: dict[tuple[str, int], tuple[Path, torch.nn.Module]] = {}

    def make(model_type: str, seed: int = 0) -> tuple[Path, torch.nn.Module]:
        if (model_type, seed) not in made:
            torch.manual_seed(seed)
            model = family(model_type).model().eval()
            path = tmp_path_factory.mktemp(f"plain-{model_type}-{seed}")
            model.save_pretrained(path)
            made[model_type, seed] = (path, model)
        return made[model_type, seed]

    return make


@pytest.fixture
def tiny_llama_dir(tiny_checkpoint: Callable[[str], Path]) -> Path:
    """A saved tiny Llama causal-LM checkpoint (2 layers, vocab 128; see tests/families.py)."""
    return tiny_checkpoint("llama")
