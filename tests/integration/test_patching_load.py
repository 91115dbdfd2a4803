"""Issue 2, points 3 (restore on every exit) and 5 (automatic patching of every load path)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaForCausalLM,
    LlamaModel,
)
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaAttention

from families import family
from modelgraft import (
    ReplacementTypeError,
    apply_patches,
    clear_patch_mapping,
    register_patch_mapping,
    report,
)


class CustomAttention(LlamaAttention):
    pass


class FailingAttention(LlamaAttention):
    def __init__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("init failed on purpose")


def _build(loader: str, tiny_llama_dir: Path) -> None:
    """Build a Llama through one of the three construction paths the patches cover."""
    if loader == "from_config":
        AutoModelForCausalLM.from_config(family("llama").config())
    elif loader == "from_pretrained":
        LlamaForCausalLM.from_pretrained(tiny_llama_dir)
    else:
        with apply_patches():
            LlamaModel(family("llama").config())


# ---- point 3 ------------------------------------------------------------------------------------
@pytest.mark.parametrize("loader", ["from_config", "from_pretrained", "apply_patches"])
def test_failing_replacement_is_restored(loader: str, tiny_llama_dir: Path) -> None:
    register_patch_mapping({"LlamaAttention": FailingAttention})
    with pytest.raises(RuntimeError, match="init failed on purpose"):
        _build(loader, tiny_llama_dir)
    assert modeling_llama.LlamaAttention is LlamaAttention
    clear_patch_mapping()
    model = LlamaModel(family("llama").config())
    assert type(model.layers[0].self_attn) is LlamaAttention


class AttentionOfAnotherSignature(torch.nn.Module):
    def __init__(self, hidden_size: int, heads: int) -> None:
        super().__init__()


# Issue 28, point 8: a replacement whose __init__ does not take the original's arguments.
@pytest.mark.parametrize("loader", ["from_config", "from_pretrained", "apply_patches"])
def test_a_replacement_that_cannot_take_the_originals_arguments_is_named_with_its_key(
    loader: str, tiny_llama_dir: Path
) -> None:
    register_patch_mapping({"LlamaAttention": AttentionOfAnotherSignature})
    with pytest.raises(ReplacementTypeError) as raised:
        _build(loader, tiny_llama_dir)
    message = str(raised.value)
    assert isinstance(raised.value, TypeError)
    assert "`AttentionOfAnotherSignature`" in message and "key `LlamaAttention`" in message, message
    assert "LlamaAttention.__init__(self, config" in message, message  # what it must accept
    assert isinstance(raised.value.__cause__, TypeError)
    assert modeling_llama.LlamaAttention is LlamaAttention


def test_an_error_inside_a_replacements_own_init_is_left_as_it_is() -> None:
    class Raising(LlamaAttention):
        def __init__(self, *args: object, **kwargs: object) -> None:
            raise TypeError("a bug of the user's own")

    register_patch_mapping({"LlamaAttention": Raising})
    with pytest.raises(TypeError, match="a bug of the user's own") as raised, apply_patches():
        LlamaModel(family("llama").config())
    assert not isinstance(raised.value, ReplacementTypeError)


def test_exception_inside_apply_patches_block_restores() -> None:
    register_patch_mapping({"LlamaAttention": CustomAttention})
    with pytest.raises(KeyError), apply_patches():
        assert modeling_llama.LlamaAttention is CustomAttention
        raise KeyError("boom")
    assert modeling_llama.LlamaAttention is LlamaAttention


def test_nested_apply_patches_and_manual_construction() -> None:
    register_patch_mapping({"LlamaAttention": CustomAttention})
    with apply_patches():
        with apply_patches():
            inner = LlamaModel(family("llama").config())
        outer = LlamaModel(family("llama").config())
    plain = LlamaModel(family("llama").config())
    assert type(inner.layers[0].self_attn) is CustomAttention
    assert type(outer.layers[0].self_attn) is CustomAttention
    assert type(plain.layers[0].self_attn) is LlamaAttention


# ---- point 5 ------------------------------------------------------------------------------------
# (The one-swap-per-load and single-scan tests count on ``modelgraft.swap.STATS`` and the hooks test
# calls ``modelgraft.hooks``: they live in those modules' own unit files, tests/unit/test_swap.py and
# tests/unit/test_hooks.py.)


def test_output_loading_info_is_returned_only_when_asked(tiny_llama_dir: Path) -> None:
    register_patch_mapping({"LlamaAttention": CustomAttention})
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert isinstance(model, LlamaForCausalLM)
    model, info = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, output_loading_info=True)
    assert info["missing_keys"] == set() or not info["missing_keys"]
    assert type(model.model.layers[0].self_attn) is CustomAttention


def test_load_inside_apply_patches_reports_the_enclosing_swap(tiny_llama_dir: Path) -> None:
    register_patch_mapping({"LlamaAttention": CustomAttention})
    with apply_patches():
        model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert type(model.model.layers[0].self_attn) is CustomAttention
    assert [r.original for r in report(model).replaced] == [
        "transformers.models.llama.modeling_llama.LlamaAttention"
    ] * 2
    assert report(model).unmatched_keys == []
