"""A key that names the class being loaded replaces that class too (``AutoModel*`` resolves it early)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from modelgraft import StrictModeError, patched, register_patch_mapping, report, unpatched


class MyCausalLM(LlamaForCausalLM):
    pass


class Unrelated(torch.nn.Module):
    pass


def _plain(path: Path) -> torch.nn.Module:
    with unpatched():
        return AutoModelForCausalLM.from_pretrained(path)


@pytest.mark.parametrize("scoped", [True, False], ids=["patched", "registered"])
def test_auto_from_pretrained_builds_the_replacement_of_the_loaded_class(
    tiny_llama_dir: Path, scoped: bool
) -> None:
    plain = _plain(tiny_llama_dir)
    if scoped:
        with patched({"LlamaForCausalLM": MyCausalLM}):
            model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    else:
        register_patch_mapping({"LlamaForCausalLM": MyCausalLM})
        model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert type(model) is MyCausalLM
    assert report(model).ok, report(model).summary()
    assert [r.path for r in report(model).replaced] == [""]
    expected = plain.state_dict()
    got = model.state_dict()
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_auto_from_config_builds_the_replacement_of_the_loaded_class(tiny_llama_dir: Path) -> None:
    config = _plain(tiny_llama_dir).config
    with patched({"LlamaForCausalLM": MyCausalLM}):
        model = AutoModelForCausalLM.from_config(config)
    assert type(model) is MyCausalLM


def test_a_replacement_that_is_not_a_subclass_of_the_loaded_class_is_a_problem(tiny_llama_dir: Path) -> None:
    with patched({"LlamaForCausalLM": Unrelated}):
        model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert type(model) is LlamaForCausalLM
    assert any("is not a subclass" in p and "`LlamaForCausalLM`" in p for p in report(model).problems)
    with (
        pytest.raises(StrictModeError, match="`Unrelated` is not a subclass of it"),
        patched({"LlamaForCausalLM": Unrelated}, strict=True),
    ):
        AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
