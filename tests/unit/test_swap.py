"""Issue 2, points 4 (only nn.Module classes are swapped; a scan imports nothing) and 5 (one swap per
load, one scan per composite model) and 6 (concurrent scoped loads), and swap mechanics.

Unit tests of ``modelgraft.swap`` (their own file): they import it directly, the one exception to
tests using public names only (issue 14); everything else comes from the public namespaces.
"""

from __future__ import annotations

import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    LlamaForCausalLM,
    LlavaForConditionalGeneration,
)
from transformers.models.clip.modeling_clip import CLIPAttention
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaAttention

from families import family
from modelgraft import apply_patches, patched, register_patch_mapping, report, swap


class Anything(torch.nn.Module):
    pass


def _bindings(module: types.ModuleType) -> dict[str, object]:
    return dict(vars(module))


@pytest.mark.parametrize("key", [".*Output", ".*Config", "Output", ".*", "PreTrainedModel", "Config"])
def test_broad_patterns_touch_only_module_classes_and_import_nothing(key: str) -> None:
    before_modules = set(sys.modules)
    before = _bindings(modeling_llama)
    register_patch_mapping({key: Anything})
    with apply_patches():
        assert set(sys.modules) == before_modules  # the scan imported nothing
        inside = _bindings(modeling_llama)
        changed = {name for name in before if inside[name] is not before[name]}
        for name in changed:
            original = before[name]
            assert isinstance(original, type) and issubclass(original, torch.nn.Module), name
        assert modeling_llama.LlamaConfig is before["LlamaConfig"]
        assert modeling_llama.BaseModelOutputWithPast is before["BaseModelOutputWithPast"]
    assert _bindings(modeling_llama) == before
    assert set(sys.modules) == before_modules


def test_output_pattern_swaps_nothing_in_llama() -> None:
    register_patch_mapping({".*Output": Anything})
    before = _bindings(modeling_llama)
    with apply_patches():
        assert _bindings(modeling_llama) == before


def test_nested_apply_patches_restore_in_order() -> None:
    original = modeling_llama.LlamaMLP

    class Outer(torch.nn.Module):
        pass

    class Inner(torch.nn.Module):
        pass

    with patched({"LlamaMLP": Outer}), apply_patches():
        assert modeling_llama.LlamaMLP is Outer
        with patched({"LlamaMLP": Inner}), apply_patches():
            assert modeling_llama.LlamaMLP is Inner
        assert modeling_llama.LlamaMLP is Outer
    assert modeling_llama.LlamaMLP is original


def test_a_module_removed_from_sys_modules_is_restored_without_error() -> None:
    fake = types.ModuleType("transformers.models.fake.modeling_fake")

    class FakeAttention(torch.nn.Module):
        pass

    fake.FakeAttention = FakeAttention
    sys.modules[fake.__name__] = fake
    try:
        with patched({"FakeAttention": Anything}), apply_patches():
            assert fake.FakeAttention is Anything
            del sys.modules[fake.__name__]
    finally:
        sys.modules.pop(fake.__name__, None)
    assert fake.FakeAttention is FakeAttention


def test_module_imported_during_the_block_gets_the_original_back() -> None:
    original = modeling_llama.LlamaMLP
    name = "transformers.models.fake2.modeling_fake2"

    class Rep(torch.nn.Module):
        pass

    with patched({"LlamaMLP": Rep}), apply_patches():
        late = types.ModuleType(name)
        late.LlamaMLP = modeling_llama.LlamaMLP  # what `from ..llama.modeling_llama import LlamaMLP` does
        sys.modules[name] = late
    try:
        assert late.LlamaMLP is original
    finally:
        del sys.modules[name]


def test_user_prefix_brings_a_package_into_scope() -> None:
    module = types.ModuleType("mypkg_scope_test.blocks")

    class Block(torch.nn.Module):
        pass

    module.Block = Block
    sys.modules[module.__name__] = module
    try:
        with patched({"Block": Anything}), apply_patches():
            assert module.Block is Block  # not in scope yet
        swap.add_scope_prefix("mypkg_scope_test")
        with patched({"Block": Anything}), apply_patches():
            assert module.Block is Anything
        assert module.Block is Block
    finally:
        swap.remove_scope_prefix("mypkg_scope_test")
        del sys.modules[module.__name__]


def test_plan_is_cached_per_snapshot() -> None:
    register_patch_mapping({"LlamaMLP": Anything})
    with apply_patches():
        pass
    scans = swap.STATS["scans"]
    for _ in range(3):
        with apply_patches():
            assert modeling_llama.LlamaMLP is Anything
    assert swap.STATS["scans"] == scans


def test_reentering_patched_with_the_same_mapping_reuses_the_plan() -> None:
    mapping = {"LlamaMLP": Anything, ".*Experts$": Anything}
    with patched(mapping), apply_patches():
        pass
    scans = swap.STATS["scans"]
    for _ in range(3):
        with patched(dict(mapping)), apply_patches():
            assert modeling_llama.LlamaMLP is Anything
    assert swap.STATS["scans"] == scans

    class Other(torch.nn.Module):
        pass

    with patched({"LlamaMLP": Other}), apply_patches():  # different content: a new plan
        pass
    assert swap.STATS["scans"] == scans + 1


def test_apply_patches_blocks_exited_out_of_order_restore_the_originals() -> None:
    """Issue 10, point 11: each block restores by what it bound, whatever the exit order."""
    original = modeling_llama.LlamaMLP

    class Outer(torch.nn.Module):
        pass

    class Inner(torch.nn.Module):
        pass

    outer_scope, inner_scope = patched({"LlamaMLP": Outer}), patched({"LlamaMLP": Inner})
    outer_scope.__enter__()
    outer = apply_patches()
    outer.__enter__()
    inner_scope.__enter__()
    inner = apply_patches()
    inner.__enter__()
    assert modeling_llama.LlamaMLP is Inner
    outer.__exit__(None, None, None)  # out of order: the inner block is still open
    assert modeling_llama.LlamaMLP is Inner
    inner.__exit__(None, None, None)
    assert modeling_llama.LlamaMLP is original
    outer_scope.__exit__(None, None, None)
    inner_scope.__exit__(None, None, None)
    assert swap._active == []


# ---- issue 2, point 5: every load path is patched with one swap, a composite model with one scan ----
# (moved from tests/integration/test_patching_load.py: they count on ``swap.STATS``)
class CustomAttention(LlamaAttention):
    pass


class CustomClipAttention(CLIPAttention):
    pass


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


# ---- issue 2, point 6: concurrent loads with different scoped patches, and a bystander without ----
# (moved from tests/integration/test_threads.py: it compares the swap scope's bindings, read through
# ``swap.in_scope_modules``, before and after)
N_PATCHED = 8
ROUNDS = 3


def _make_attention(i: int) -> type:
    def __init__(self: LlamaAttention, *args: object, **kwargs: object) -> None:
        time.sleep(0.0005)  # widen the window in which another thread could observe the swap
        LlamaAttention.__init__(self, *args, **kwargs)

    return type(f"ThreadAttention{i}", (LlamaAttention,), {"__init__": __init__})


@pytest.fixture
def fast_switching() -> Iterator[None]:
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


def _scope_bindings() -> dict[tuple[str, str], object]:
    return {
        (name, attr): value
        for name, module in swap.in_scope_modules()
        for attr, value in vars(module).items()
    }


def test_concurrent_scoped_loads_get_their_own_classes(fast_switching: None, tiny_llama_dir: Path) -> None:
    classes = [_make_attention(i) for i in range(N_PATCHED)]
    before = _scope_bindings()
    barrier = threading.Barrier(N_PATCHED + 1)
    results: dict[int, list[set[type]]] = {i: [] for i in range(N_PATCHED + 1)}
    errors: list[BaseException] = []

    def load(i: int) -> AutoModelForCausalLM:
        # Alternate the load paths so both wrapped entry points race each other.
        if i % 2:
            return AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
        return LlamaForCausalLM._from_config(family("llama").config())

    def worker(i: int) -> None:
        try:
            for _ in range(ROUNDS):
                barrier.wait()
                if i == N_PATCHED:  # the bystander: no patches at all
                    model = load(i)
                else:
                    with patched({"LlamaAttention": classes[i]}):
                        model = load(i)
                results[i].append({type(m) for m in model.modules() if isinstance(m, LlamaAttention)})
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(N_PATCHED + 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert not errors, errors
    for i in range(N_PATCHED):
        assert results[i] == [{classes[i]}] * ROUNDS, i
    assert results[N_PATCHED] == [{LlamaAttention}] * ROUNDS
    after = _scope_bindings()
    leaked = [key for key, value in before.items() if after.get(key, value) is not value]
    assert leaked == []
    assert all(key in after for key in before)
