"""Issue 2, point 6: concurrent loads with different scoped patches, and a bystander without patches."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaAttention

from families import family
from modelgraft import patched, swap

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
