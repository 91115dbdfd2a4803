"""Issue 10, point 7: a graft registered during another thread's load does not reach that load.

Issue 2, point 6 (concurrent loads with different scoped patches) reads the swap scope through
``modelgraft.swap`` and issue 10, point 9 (fork during a load) holds ``modelgraft.registry``'s write
lock: those tests live in the modules' own unit files, tests/unit/test_swap.py and
tests/unit/test_registry.py (issue 14, point 5).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from load_hooks import assert_same_as_plain, hooked
from transformers import AutoModelForCausalLM

from _versions import TRANSFORMERS_VERSION
from modelgraft import report, unpatched
from modelgraft.grafts import Graft, fused_qkv, linear_experts

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
