"""Porting from transformers' built-in API: errors, scope prefixes and string recorders (issue 12)."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch

import modelgraft
from modelgraft import (
    PatchRegistrationError,
    apply_patches,
    clear_patch_mapping,
    patch_output_recorders,
    register_patch_mapping,
)


@pytest.fixture(autouse=True)
def _clean():
    clear_patch_mapping()
    yield
    clear_patch_mapping()


def test_unregister_unknown_keeps_transformers_wording():
    with pytest.raises(
        PatchRegistrationError, match=r"Cannot unregister `Nope`.*not found in monkey patch mapping cache"
    ):
        modelgraft.unregister_patch_mapping(["Nope"])
    with pytest.raises(ValueError, match="not found in monkey patch mapping cache"):
        modelgraft.unregister_patch_mapping("Nope")


def test_add_scope_prefix_is_public():
    assert modelgraft.add_scope_prefix is modelgraft.swap.add_scope_prefix
    assert "add_scope_prefix" in modelgraft.__all__ and "remove_scope_prefix" in modelgraft.__all__


class _ProbeBlock(torch.nn.Module):
    pass


class _ProbeReplacement(torch.nn.Module):
    pass


@pytest.mark.parametrize("name", ["transformers.mg_scope_probe", "transformers.generation.mg_scope_probe"])
def test_add_scope_prefix_inside_transformers_is_honoured(name):
    """A prefix under `transformers.` that the user adds is swapped like any other (it was ignored)."""
    module = types.ModuleType(name)
    module._ProbeBlock = _ProbeBlock
    sys.modules[name] = module
    try:
        register_patch_mapping({"_ProbeBlock": _ProbeReplacement})
        with apply_patches():
            assert module._ProbeBlock is _ProbeBlock  # not in scope without the prefix
        modelgraft.add_scope_prefix(name)
        try:
            with apply_patches():
                assert module._ProbeBlock is _ProbeReplacement
            assert module._ProbeBlock is _ProbeBlock
        finally:
            modelgraft.remove_scope_prefix(name)
        with apply_patches():
            assert module._ProbeBlock is _ProbeBlock
    finally:
        del sys.modules[name]


@dataclasses.dataclass
class _Recorder:  # the fields of transformers' OutputRecorder that matter here
    target_class: type | None
    index: int = 0
    layer_name: str | None = None
    class_name: str | None = None


class _Original(torch.nn.Module):
    pass


class _Replacement(torch.nn.Module):
    pass


def _model_with(recorders: dict) -> torch.nn.Module:
    cls = type("_RecModel", (torch.nn.Module,), {"_can_record_outputs": recorders})
    return cls()


def test_string_recorder_naming_a_patched_class_follows_it():
    """As in transformers: a class-name string recorder becomes the replacement class."""
    register_patch_mapping({"_Original": _Replacement})
    model = _model_with({"out": "_Original", "other": "SomeClassName"})
    assert patch_output_recorders(model) == 1
    assert model._can_record_outputs["out"] is _Replacement
    assert model._can_record_outputs["other"] == "SomeClassName"
    assert type(model)._can_record_outputs["out"] == "_Original"  # class-level state untouched


def test_class_name_only_recorder_gets_the_replacement_class():
    register_patch_mapping({"_Original": _Replacement})
    model = _model_with(
        {"a": _Recorder(None, class_name="_Original"), "b": _Recorder(None, class_name="self_attn")}
    )
    patch_output_recorders(model)
    assert model._can_record_outputs["a"].target_class is _Replacement
    assert model._can_record_outputs["b"].target_class is None
    assert type(model)._can_record_outputs["a"].target_class is None
