"""Issue 2, points 3 (restore on every exit) and 5 (automatic patching of every load path, one scan)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    LlamaForCausalLM,
    LlamaModel,
    LlavaForConditionalGeneration,
)
from transformers.models.clip.modeling_clip import CLIPAttention
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP

from families import family
from modelgraft import (
    apply_patches,
    clear_patch_mapping,
    hooks,
    patched,
    register_patch_mapping,
    report,
    swap,
)


class CustomAttention(LlamaAttention):
    pass


class CustomClipAttention(CLIPAttention):
    pass


class FailingAttention(LlamaAttention):
    def __init__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("init failed on purpose")


# ---- point 3 ------------------------------------------------------------------------------------
@pytest.mark.parametrize("loader", ["from_config", "from_pretrained", "apply_patches"])
def test_failing_replacement_is_restored(loader: str, tiny_llama_dir: Path) -> None:
    register_patch_mapping({"LlamaAttention": FailingAttention})
    with pytest.raises(RuntimeError, match="init failed on purpose"):
        if loader == "from_config":
            AutoModelForCausalLM.from_config(family("llama").config())
        elif loader == "from_pretrained":
            LlamaForCausalLM.from_pretrained(tiny_llama_dir)
        else:
            with apply_patches():
                LlamaModel(family("llama").config())
    assert modeling_llama.LlamaAttention is LlamaAttention
    clear_patch_mapping()
    model = LlamaModel(family("llama").config())
    assert type(model.layers[0].self_attn) is LlamaAttention


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
LOADERS = {
    "LlamaForCausalLM.from_pretrained": lambda d: LlamaForCausalLM.from_pretrained(d),
    "LlamaForCausalLM._from_config": lambda d: LlamaForCausalLM._from_config(family("llama").config()),
    "AutoModelForCausalLM.from_pretrained": lambda d: AutoModelForCausalLM.from_pretrained(d),
    "AutoModelForCausalLM.from_config": lambda d: AutoModelForCausalLM.from_config(family("llama").config()),
    "AutoModel.from_pretrained": lambda d: AutoModel.from_pretrained(d),
    "AutoModel.from_config": lambda d: AutoModel.from_config(family("llama").config()),
}


@pytest.mark.parametrize("loader", list(LOADERS))
def test_every_load_path_is_patched_with_one_swap(loader: str, tiny_llama_dir: Path) -> None:
    register_patch_mapping({"LlamaAttention": CustomAttention})
    swaps = swap.STATS["swaps"]
    model = LOADERS[loader](tiny_llama_dir)
    assert swap.STATS["swaps"] - swaps == 1
    attentions = [m for m in model.modules() if isinstance(m, LlamaAttention)]
    assert len(attentions) == 2 and all(type(m) is CustomAttention for m in attentions)
    assert modeling_llama.LlamaAttention is LlamaAttention  # restored after the load
    assert {r.key for r in report(model).replaced} == {"LlamaAttention"}


def _check_llava(model: torch.nn.Module) -> None:
    types = [type(m) for m in model.modules() if isinstance(m, (LlamaAttention, CLIPAttention))]
    assert types.count(CustomAttention) == 2 and types.count(CustomClipAttention) == 2, types
    replaced = report(model).replaced
    assert len(replaced) == 4
    assert {r.path.split(".")[1] for r in replaced} == {"language_model", "vision_tower"}


def test_composite_model_is_patched_with_a_single_scan(tmp_path: Path) -> None:
    mapping = {"LlamaAttention": CustomAttention, "CLIPAttention": CustomClipAttention}
    with patched(mapping):
        swaps, scans = swap.STATS["swaps"], swap.STATS["scans"]
        model = LlavaForConditionalGeneration._from_config(family("llava").config())
        assert swap.STATS["swaps"] - swaps == 1  # the nested _from_config calls joined the outer load
        assert swap.STATS["scans"] - scans <= 1
        _check_llava(model)
    with patched(mapping):  # the same content again: the cached plan may be reused
        model.save_pretrained(tmp_path)
        swaps, scans = swap.STATS["swaps"], swap.STATS["scans"]
        loaded = AutoModelForImageTextToText.from_pretrained(tmp_path)
        assert swap.STATS["swaps"] - swaps == 1
        assert swap.STATS["scans"] - scans <= 1
        _check_llava(loaded)
    assert modeling_llama.LlamaAttention is LlamaAttention


def test_hooks_can_be_removed_and_reinstalled(tiny_llama_dir: Path) -> None:
    register_patch_mapping({"LlamaMLP": type("MyMLP", (LlamaMLP,), {})})
    hooks.uninstall()
    try:
        assert not hooks.installed()
        plain = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
        assert type(plain.model.layers[0].mlp) is LlamaMLP
    finally:
        hooks.install()
        hooks.install()  # idempotent
    assert hooks.installed()
    patched_model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert type(patched_model.model.layers[0].mlp).__name__ == "MyMLP"


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
