"""Issue 10, point 7: a load reads classes and conversions from one snapshot, taken when it starts.

A hook registers a graft (or its other half) in the middle of a load, at three stages: before the
model is constructed, while it is constructed, and after construction but before the weights are
read. Whatever is registered meanwhile, the load must build and fill the model from what was
registered when it started, and ``report()`` must list every parameter the checkpoint did not
fill (strict mode then raises).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from load_hooks import STAGES, assert_same_as_plain, hooked
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

import modelgraft
from _versions import TRANSFORMERS_VERSION
from families import family
from modelgraft import (
    StrictModeError,
    register_checkpoint_conversion_mapping,
    report,
    unregister_checkpoint_conversion_mapping,
)
from modelgraft.grafts import Graft, fused_gate_up, fused_qkv, linear_experts


def _graft_cases() -> list[Any]:
    return [
        pytest.param(lambda: fused_qkv("llama"), "llama", id="fused_qkv-llama"),
        pytest.param(lambda: fused_gate_up("qwen2"), "qwen2", id="fused_gate_up-qwen2"),
        pytest.param(lambda: linear_experts("qwen2_moe"), "qwen2_moe", id="linear_experts-qwen2_moe"),
        pytest.param(lambda: fused_qkv("llava"), "llava", id="fused_qkv-llava"),
    ]


def _auto(model_type: str) -> Any:
    return AutoModelForImageTextToText if family(model_type).kind == "vlm" else AutoModelForCausalLM


def _make_graft(make: Callable[[], Graft]) -> Graft:
    graft = make()
    if not graft.mapping:
        pytest.skip(
            f"`{graft.name}` replaces no class on transformers {TRANSFORMERS_VERSION} (its experts are "
            "already per-expert modules), so there is no class/conversion pair to race"
        )
    return graft


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def make(model_type: str) -> Path:
        if model_type not in made:
            path = tmp_path_factory.mktemp(f"snapshot-{model_type}")
            torch.manual_seed(0)
            with modelgraft.unpatched():
                _auto(model_type).from_config(family(model_type).config()).save_pretrained(path)
            made[model_type] = path
        return made[model_type]

    return make


def _plain(path: Path, model_type: str) -> torch.nn.Module:
    with modelgraft.unpatched():
        return _auto(model_type).from_pretrained(path)


def _register_conversions(graft: Graft) -> None:
    for model_type, converters in graft.conversions.items():
        register_checkpoint_conversion_mapping(model_type, converters, overwrite=True)


def _not_loaded(model: torch.nn.Module) -> set[str]:
    return set(report(model).not_loaded)


def assert_differences_reported(model: torch.nn.Module, plain: torch.nn.Module) -> set[str]:
    """Every parameter that is not exactly the plain load's is listed in ``report()``."""
    theirs = plain.state_dict()
    differing = {
        name
        for name, value in model.named_parameters()
        if name not in theirs or theirs[name].shape != value.shape or not torch.equal(theirs[name], value)
    }
    assert differing <= _not_loaded(model), sorted(differing - _not_loaded(model))
    return differing


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize(("make", "model_type"), _graft_cases())
def test_a_graft_registered_during_a_plain_load_does_not_reach_it(
    make: Callable[[], Graft],
    model_type: str,
    stage: str,
    checkpoints: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    graft = _make_graft(make)
    path = checkpoints(model_type)
    plain = _plain(path, model_type)
    fired = hooked(type(plain), stage, graft.register, monkeypatch)
    model = type(plain).from_pretrained(path)
    try:
        assert fired == [True]
        assert_same_as_plain(model, plain)
        assert report(model).replaced == [] and report(model).conversions == [] and report(model).ok
        # The registration itself took effect for the next load.
        assert report(_auto(model_type).from_pretrained(path)).replaced
    finally:
        graft.unregister()


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize(("make", "model_type"), _graft_cases())
def test_conversions_registered_during_a_grafted_load_are_not_used_and_the_gap_is_reported(
    make: Callable[[], Graft],
    model_type: str,
    stage: str,
    checkpoints: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    graft = _make_graft(make)
    path = checkpoints(model_type)
    with graft.applied():  # the reference: the graft loaded with its conversions
        grafted = _auto(model_type).from_pretrained(path)
    cls = type(grafted)
    modelgraft.register_patch_mapping(graft.mapping)
    fired = hooked(cls, stage, lambda: _register_conversions(graft), monkeypatch)
    model = cls.from_pretrained(path)
    assert fired == [True]
    assert report(model).replaced  # the classes of the snapshot were used ...
    assert report(model).conversions == []  # ... and no conversion registered after it started
    differing = assert_differences_reported(model, grafted)
    # Fused layouts have no checkpoint keys without their conversion; per-expert Linear experts
    # take the checkpoint's per-expert keys by name.
    assert bool(differing) == (not graft.name.startswith("per-expert")), sorted(differing)
    assert report(model).ok == (not differing)

    # Strict mode: the same load raises when a parameter was not loaded, and passes otherwise.
    modelgraft.clear_patch_mapping()
    for key in graft.conversions:
        unregister_checkpoint_conversion_mapping(key)
    modelgraft.register_patch_mapping(graft.mapping)
    monkeypatch.setenv("MODELGRAFT_STRICT", "1")
    fired.clear()
    if differing:
        with pytest.raises(StrictModeError, match=sorted(differing)[0].replace(".", r"\.")):
            cls.from_pretrained(path)
    else:
        cls.from_pretrained(path)
    assert fired == [True]


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize(("make", "model_type"), _graft_cases())
def test_classes_registered_during_a_converting_load_are_not_used(
    make: Callable[[], Graft],
    model_type: str,
    stage: str,
    checkpoints: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    graft = _make_graft(make)
    path = checkpoints(model_type)
    plain = _plain(path, model_type)
    _register_conversions(graft)
    fired = hooked(type(plain), stage, lambda: modelgraft.register_patch_mapping(graft.mapping), monkeypatch)
    model = type(plain).from_pretrained(path)
    assert fired == [True]
    assert report(model).replaced == []
    assert [type(m) for _, m in model.named_modules()][1:] == [type(m) for _, m in plain.named_modules()][1:]
    assert_differences_reported(model, plain)
