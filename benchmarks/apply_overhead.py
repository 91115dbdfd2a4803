"""Cost of patching: modelgraft against transformers' built-in ``transformers.monkey_patching``.

Prints, from one run:

1. the median cost of one enter+exit of ``apply_patches()`` with every importable
   ``transformers.models.*.modeling_*`` module imported and 10 regex keys registered, for both
   libraries, and the speed-up of modelgraft over the built-in (target: under 1 ms, >= 300x);
2. the ratio of a tiny Llama ``from_pretrained`` with one patch to the same load without patches,
   for both libraries (target for modelgraft: <= 1.2x);
3. the time to register 2,000 keys one call at a time, exact names and patterns (target: well
   under a second; each registration costs the same whatever is registered already).

Importing every modeling module takes a while and a few GB of memory; this is a benchmark, never
a test. Run: ``python benchmarks/apply_overhead.py [--builtin-repeats N] [--loads N]``.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable

import torch
import transformers
import transformers.models
from transformers import AutoConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.utils import logging

import modelgraft
from modelgraft import hooks, swap

REGEX_KEYS = [
    "^Llama.*Attention$",
    "^Mistral.*MLP$",
    "Qwen2Moe.*Experts$",
    "^Gemma.*RMSNorm$",
    "^Bert.*SelfAttention$",
    "^T5.*LayerFF$",
    "^Phi.*MLP$",
    "^Falcon.*Attention$",
    "^GPT2.*Block$",
    "^Mixtral.*Experts$",
]


class Replacement(torch.nn.Module):
    """A replacement that is never constructed in part 1 (only bound and unbound)."""


class PatchedMLP(LlamaMLP):
    """The one patch of part 2: a trivial subclass, so the loaded model is unchanged."""


def import_all_modeling_modules() -> tuple[int, int, float]:
    """Import every ``transformers.models.*.modeling_*`` module that imports; return (ok, failed, s)."""
    start = time.perf_counter()
    ok = failed = 0
    for package in pkgutil.iter_modules(transformers.models.__path__):
        if not package.ispkg:
            continue
        sub = importlib.import_module(f"transformers.models.{package.name}")
        for module in pkgutil.iter_modules(sub.__path__):
            if not module.name.startswith("modeling_"):
                continue
            try:
                importlib.import_module(f"transformers.models.{package.name}.{module.name}")
                ok += 1
            except Exception:
                failed += 1
    return ok, failed, time.perf_counter() - start


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def enter_exit(cm_factory: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        with cm_factory():
            pass

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--builtin-repeats", type=int, default=5, help="enter+exit samples of the built-in")
    parser.add_argument("--repeats", type=int, default=500, help="enter+exit samples of modelgraft")
    parser.add_argument("--loads", type=int, default=9, help="timed loads per mode (after one warm-up)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    from transformers import monkey_patching as builtin

    ok, failed, seconds = import_all_modeling_modules()
    print(
        f"imported {ok} modeling modules ({failed} failed) in {seconds:.1f} s; {len(sys.modules)} modules loaded"
    )

    # ---- 1. enter+exit of apply_patches() with 10 regex keys -------------------------------------
    mapping = {key: Replacement for key in REGEX_KEYS}
    modelgraft.register_patch_mapping(mapping)
    start = time.perf_counter()
    with modelgraft.apply_patches():
        pass
    first = time.perf_counter() - start
    ours = median_seconds(enter_exit(modelgraft.apply_patches), args.repeats)
    modelgraft.clear_patch_mapping()

    builtin.register_patch_mapping(mapping)
    theirs = median_seconds(enter_exit(builtin.apply_patches), args.builtin_repeats)
    builtin.clear_patch_mapping()
    print(f"scope: {len(swap.in_scope_modules())} modules in modelgraft's scope")
    print(f"apply_patches enter+exit, 10 regex keys, median of {args.repeats} / {args.builtin_repeats}:")
    print(
        f"  modelgraft: {ours * 1e3:.4f} ms (first entry, which indexes every module: {first * 1e3:.1f} ms)"
    )
    print(f"  built-in:   {theirs * 1e3:.1f} ms")
    print(f"  speed-up of modelgraft over the built-in: {theirs / ours:.0f}x")

    # ---- 2. tiny Llama from_pretrained: one patch vs none -----------------------------------------
    config = AutoConfig.for_model(
        "llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    with tempfile.TemporaryDirectory() as folder:
        LlamaForCausalLM(config).save_pretrained(folder)

        def load() -> object:
            return LlamaForCausalLM.from_pretrained(folder)

        def timed() -> float:
            load()  # warm-up
            return median_seconds(load, args.loads)

        plain_ours = timed()
        modelgraft.register_patch_mapping({"LlamaMLP": PatchedMLP})
        assert type(load().model.layers[0].mlp) is PatchedMLP
        patched_ours = timed()
        modelgraft.clear_patch_mapping()

        hooks.uninstall()  # the built-in alone, as transformers ships it
        try:
            plain_theirs = timed()
            builtin.register_patch_mapping({"LlamaMLP": PatchedMLP})
            assert type(load().model.layers[0].mlp) is PatchedMLP
            patched_theirs = timed()
            builtin.clear_patch_mapping()
        finally:
            hooks.install()

    print(f"tiny Llama from_pretrained, median of {args.loads} loads (ms): patched / unpatched = ratio")
    print(
        f"  modelgraft: {patched_ours * 1e3:.1f} / {plain_ours * 1e3:.1f} = {patched_ours / plain_ours:.2f}x"
    )
    print(
        f"  built-in:   {patched_theirs * 1e3:.1f} / {plain_theirs * 1e3:.1f} = {patched_theirs / plain_theirs:.2f}x"
    )

    # ---- 3. registering many keys ---------------------------------------------------------------
    registration_cost()


def register_one_by_one(keys: list[str]) -> float:
    """Seconds to register ``keys`` one ``register_patch_mapping`` call each (then clear)."""
    start = time.perf_counter()
    for key in keys:
        modelgraft.register_patch_mapping({key: Replacement})
    elapsed = time.perf_counter() - start
    modelgraft.clear_patch_mapping()
    return elapsed


def registration_cost(count: int = 2000) -> None:
    exact = register_one_by_one([f"Block{i}" for i in range(count)])
    patterns = register_one_by_one([f"^Block{i}(Attention|MLP)$" for i in range(count)])
    print(
        f"registering {count} keys one by one: exact names {exact * 1e3:.0f} ms, patterns {patterns * 1e3:.0f} ms"
    )


if __name__ == "__main__":
    main()
