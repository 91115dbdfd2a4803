"""Issue 2, point 6: concurrent loads with different scoped patches, and a bystander without patches;
issue 10, points 7 (registration during another thread's load) and 9 (fork during a load)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from load_hooks import assert_same_as_plain, hooked
from transformers import AutoModelForCausalLM, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaAttention

import modelgraft
from _versions import TRANSFORMERS_VERSION
from families import family
from modelgraft import patched, registry, report, swap, unpatched
from modelgraft.grafts import Graft, fused_qkv, linear_experts

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


# ---- issue 10, point 7: a graft registered globally while another thread loads plainly -----------
HANG_GUARD_S = 300  # only a guard against a deadlock hanging the suite, never a speed limit


@pytest.mark.parametrize(
    ("make", "model_type"),
    [
        pytest.param(lambda: fused_qkv("llama"), "llama", id="fused_qkv-llama"),
        pytest.param(lambda: linear_experts("qwen2_moe"), "qwen2_moe", id="linear_experts-qwen2_moe"),
    ],
)
@pytest.mark.parametrize("stage", ["before construction", "during construction"])
def test_a_graft_registered_by_another_thread_mid_load_does_not_reach_the_load(
    make: Callable[[], Graft],
    model_type: str,
    stage: str,
    tiny_checkpoint: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    graft = make()
    if not graft.mapping:
        pytest.skip(
            f"`{graft.name}` replaces no class on transformers {TRANSFORMERS_VERSION} (experts are already "
            "per-expert modules there)"
        )
    path = tiny_checkpoint(model_type)
    with unpatched():
        plain = AutoModelForCausalLM.from_pretrained(path)
    inside, registered = threading.Event(), threading.Event()

    def wait_for_the_registration() -> None:
        inside.set()
        assert registered.wait(HANG_GUARD_S)

    hooked(type(plain), stage, wait_for_the_registration, monkeypatch)
    loaded: list[torch.nn.Module] = []
    errors: list[BaseException] = []

    def load() -> None:
        try:
            loaded.append(type(plain).from_pretrained(path))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    thread = threading.Thread(target=load)
    thread.start()
    try:
        assert inside.wait(HANG_GUARD_S)
        graft.register()  # from this thread, while the other one is inside its load
    finally:
        registered.set()
        thread.join(HANG_GUARD_S)
    try:
        assert not thread.is_alive() and not errors, errors
        (model,) = loaded
        assert_same_as_plain(model, plain)
        assert report(model).ok and not report(model).replaced and not report(model).conversions
    finally:
        graft.unregister()


# ---- issue 10, point 9: fork() while another thread is inside a load ------------------------------
class ForkAttention(LlamaAttention):
    """Blocks its load (inside the construction lock, with the swap live) until released."""

    inside = threading.Event()
    release = threading.Event()

    def __init__(self, *args: object, **kwargs: object) -> None:
        ForkAttention.inside.set()
        ForkAttention.release.wait(HANG_GUARD_S)
        super().__init__(*args, **kwargs)


def _child_checks(path: Path) -> str:
    """Run in the forked child: a plain load and a registration must work, with no swap left live."""
    from transformers.models.llama import modeling_llama

    if modeling_llama.LlamaAttention is not LlamaAttention:
        return f"the parent's swap is live in the child: {modeling_llama.LlamaAttention}"
    model = AutoModelForCausalLM.from_pretrained(path)
    kinds = {type(m).__name__ for m in model.modules()}
    if "ForkAttention" in kinds or "LlamaAttention" not in kinds:
        return f"the child's plain load built {sorted(kinds)}"
    modelgraft.register_patch_mapping({"NoSuchBlockInTheChild": ThreadAttentionMLP})
    with patched({"LlamaAttention": _make_attention(99)}):
        grafted = AutoModelForCausalLM.from_pretrained(path)
    if type(grafted.model.layers[0].self_attn).__name__ != "ThreadAttention99":
        return "a patched load in the child did not swap"
    return "ok"


class ThreadAttentionMLP(torch.nn.Module):
    """Registered (not built) in the child, to prove the registry's write lock is free there."""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork() does not exist on this platform")
def test_fork_while_another_thread_is_inside_a_load(tiny_llama_dir: Path) -> None:
    ForkAttention.inside.clear()
    ForkAttention.release.clear()
    errors: list[BaseException] = []

    def load() -> None:
        try:
            with patched({"LlamaAttention": ForkAttention}):
                AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    # A second thread holds the registry's write lock at the moment of the fork.
    writer_inside, writer_release = threading.Event(), threading.Event()

    def hold_registry() -> None:
        with registry._write_lock:
            writer_inside.set()
            writer_release.wait(HANG_GUARD_S)

    loader, writer = threading.Thread(target=load), threading.Thread(target=hold_registry)
    loader.start()
    writer.start()
    read_end, write_end = os.pipe()
    try:
        assert ForkAttention.inside.wait(HANG_GUARD_S) and writer_inside.wait(HANG_GUARD_S)
        pid = os.fork()
        if pid == 0:  # the child: never return into pytest
            status = 1
            try:
                os.close(read_end)
                message = _child_checks(tiny_llama_dir)
                status = 0 if message == "ok" else 1
            except BaseException as exc:
                message = f"{type(exc).__name__}: {exc}"
            finally:
                os.write(write_end, message.encode()[:4000])
                os._exit(status)
        os.close(write_end)
        deadline = time.monotonic() + HANG_GUARD_S
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail("the forked child hung (killed after the hang guard)")
            time.sleep(0.05)
        with os.fdopen(read_end, "rb") as pipe:
            message = pipe.read().decode()
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, message
        assert message == "ok"
    finally:
        ForkAttention.release.set()
        writer_release.set()
        loader.join(HANG_GUARD_S)
        writer.join(HANG_GUARD_S)
    assert not errors, errors
    from transformers.models.llama import modeling_llama

    assert modeling_llama.LlamaAttention is LlamaAttention
