"""Issue 2, points 1 (matching rules and precedence) and 2 (atomic, validated registration); issue 10,
points 9 (fork during a load, the write lock held), 10 (catastrophic patterns), 11 (out-of-order exits)
and 16 (linear cost, released classes); issue 14, point 1 (a scope takes a graft whole).

Unit tests of ``modelgraft.registry`` (their own file): they import it directly, the one exception to
tests using public names only (issue 14); everything else comes from the public namespaces.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import os
import re
import signal
import threading
import time
import weakref
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP
from transformers.models.mt5 import modeling_mt5
from transformers.models.t5 import modeling_t5

import modelgraft
from modelgraft import (
    Concatenate,
    Graft,
    PatchRegistrationError,
    ReplacementTypeError,
    WeightConverter,
    _safe_regex,
    apply_patches,
    clear_patch_mapping,
    get_checkpoint_conversion_mapping,
    get_patch_mapping,
    patched,
    register_patch_mapping,
    registry,
    unregister_patch_mapping,
)
from modelgraft.grafts import fused_qkv_class
from modelgraft.registry import explain, find_replacement


class A(torch.nn.Module):
    pass


class B(torch.nn.Module):
    pass


class C(torch.nn.Module):
    pass


# ---- point 1: matching rules --------------------------------------------------------------------
def test_exact_key_matches_only_that_class_name() -> None:
    register_patch_mapping({"T5Attention": A})
    assert find_replacement("T5Attention") == ("T5Attention", A)
    for other in ("MT5Attention", "LongT5Attention", "UMT5Attention", "SpeechT5Attention", "T5AttentionX"):
        assert find_replacement(other) is None, other


def test_exact_key_swaps_t5_but_not_mt5_modules() -> None:
    original_mt5 = modeling_mt5.MT5Attention
    register_patch_mapping({"T5Attention": A})
    with apply_patches():
        assert modeling_t5.T5Attention is A
        assert modeling_mt5.MT5Attention is original_mt5
    assert modeling_t5.T5Attention is not A


def test_other_keys_are_regexes_matched_with_search() -> None:
    register_patch_mapping({"Llama\\d*Attention": A, "^Qwen.*MLP$": B})
    assert find_replacement("MyLlama3Attention") == ("Llama\\d*Attention", A)  # unanchored: search
    assert find_replacement("Qwen2MoeMLP") == ("^Qwen.*MLP$", B)
    assert find_replacement("Qwen2MoeMLPx") is None


def test_exact_key_wins_over_a_pattern_registered_earlier() -> None:
    register_patch_mapping({".*Attention": A})
    register_patch_mapping({"LlamaAttention": B})
    assert find_replacement("LlamaAttention") == ("LlamaAttention", B)
    assert find_replacement("MistralAttention") == (".*Attention", A)


def test_first_registered_pattern_wins_even_after_overwrite() -> None:
    register_patch_mapping({"Attention$": A, "Llama.*": B})
    assert find_replacement("LlamaAttention") == ("Attention$", A)
    register_patch_mapping({"Llama.*": C}, overwrite=True)  # overwriting keeps the key's place
    assert find_replacement("LlamaAttention") == ("Attention$", A)
    assert find_replacement("LlamaMLP") == ("Llama.*", C)


def test_scoped_overlay_combines_with_the_global_registry() -> None:
    register_patch_mapping({".*Attention": A, "LlamaMLP": A})
    with patched({"Attention$": B, "LlamaMLP": C}):
        assert find_replacement("MistralAttention") == ("Attention$", B)  # scoped patterns first
        assert find_replacement("LlamaMLP") == ("LlamaMLP", C)  # scoped key hides global key
        with patched({"MistralAttention": C}):
            assert find_replacement("MistralAttention") == ("MistralAttention", C)
    assert find_replacement("MistralAttention") == (".*Attention", A)
    assert get_patch_mapping() == {"LlamaMLP": A, ".*Attention": A}


def test_explain_names_the_winner_and_why_the_others_lost() -> None:
    register_patch_mapping({".*Attention": A, "LlamaAttention": B, "MLP": C})
    result = explain("LlamaAttention")
    assert result.winner == "LlamaAttention" and result.replacement is B
    reasons = {c.key: c.reason for c in result.candidates}
    assert reasons[".*Attention"] == "pattern matches but exact key `LlamaAttention` wins"
    assert reasons["MLP"] == "exact name differs"


# ---- point 2: validated, atomic registration ----------------------------------------------------
@pytest.mark.parametrize(
    ("mapping", "error", "message"),
    [
        (
            {"LlamaMLP": B, "LlamaAttention(": C},
            PatchRegistrationError,
            r"`LlamaAttention\(` is not a valid regular",
        ),
        (
            {"LlamaMLP": B, "X": A()},
            ReplacementTypeError,
            r"key `X` must be a class .* received an instance of `A`",
        ),
        (
            {"LlamaMLP": B, "X": int},
            ReplacementTypeError,
            r"`int` for key `X` must be a subclass of nn.Module",
        ),
        ({"LlamaMLP": B, "": C}, PatchRegistrationError, r"Patch key `''` is invalid"),
        ({"LlamaMLP": B, 3: C}, PatchRegistrationError, r"Patch key `3` is invalid"),
        (
            {"LlamaMLP": B, "Kept": C},
            PatchRegistrationError,
            r"`Kept` is already registered .*`overwrite=True`",
        ),
        (["LlamaMLP"], PatchRegistrationError, r"`mapping` must be a dict .* received `list`"),
    ],
)
def test_invalid_registration_raises_and_changes_nothing(mapping: object, error: type, message: str) -> None:
    register_patch_mapping({"Kept": A, ".*Kept": A})
    before = get_patch_mapping()
    with pytest.raises(error, match=message):
        register_patch_mapping(mapping)  # type: ignore[arg-type]
    assert get_patch_mapping() == before
    assert list(get_patch_mapping()) == list(before)


def test_registration_errors_subclass_the_builtins() -> None:
    with pytest.raises(ValueError):
        register_patch_mapping({"(": A})
    with pytest.raises(TypeError):
        register_patch_mapping({"X": object})


def test_unregister_unknown_key_raises_and_removes_nothing() -> None:
    register_patch_mapping({"LlamaMLP": A, ".*Attention": B})
    with pytest.raises(
        PatchRegistrationError, match=r"Cannot unregister `Missing`: the key is not registered"
    ):
        unregister_patch_mapping(["LlamaMLP", "Missing"])
    assert get_patch_mapping() == {"LlamaMLP": A, ".*Attention": B}
    unregister_patch_mapping(["LlamaMLP", ".*Attention"])
    assert get_patch_mapping() == {}


def test_get_patch_mapping_returns_a_copy_and_clear_empties() -> None:
    register_patch_mapping({"LlamaMLP": A})
    copy = get_patch_mapping()
    copy["Other"] = B
    assert get_patch_mapping() == {"LlamaMLP": A}
    clear_patch_mapping()
    assert get_patch_mapping() == {}


def test_overwrite_replaces_the_class() -> None:
    register_patch_mapping({"LlamaMLP": A})
    register_patch_mapping({"LlamaMLP": B}, overwrite=True)
    assert get_patch_mapping() == {"LlamaMLP": B}


def test_scoped_mapping_is_validated_like_registration() -> None:
    with pytest.raises(PatchRegistrationError, match="not a valid regular expression"), patched({"[": A}):
        pass  # pragma: no cover - never entered
    assert get_patch_mapping() == {}


def test_concurrent_registrations_are_all_kept() -> None:
    import threading

    def register(i: int) -> None:
        for j in range(50):
            register_patch_mapping({f"Block{i}x{j}": A})
            assert f"Block{i}x{j}" in get_patch_mapping()

    threads = [threading.Thread(target=register, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(get_patch_mapping()) == 200


def test_patched_is_private_to_each_asyncio_task() -> None:
    import asyncio

    async def load_with(cls: type, other_done: asyncio.Event, done: asyncio.Event) -> type | None:
        with patched({"LlamaMLP": cls}):
            done.set()
            await other_done.wait()  # both blocks are open at the same time here
            return find_replacement("LlamaMLP")[1]

    async def main() -> tuple[type | None, type | None, object]:
        first, second = asyncio.Event(), asyncio.Event()
        results = await asyncio.gather(load_with(A, second, first), load_with(B, first, second))
        return (*results, find_replacement("LlamaMLP"))

    assert asyncio.run(main()) == (A, B, None)


HANG_GUARD_S = 300  # only a guard against a hang stalling the suite, never a speed limit


# ---- issue 19, point 8: no key can hang a load, by construction (RE2 matches in linear time) -------
@pytest.mark.parametrize(
    "key",
    [
        r"(\w\w?)+!",
        r"(\w+)+!",
        r"(A*)*!",
        r"(Attention|\w)+!",
        r"(\w|\w\w)+!",
        r"\w*\w*\w*!",
        r"^(\w+){2,30}!",
    ],
)
def test_patterns_that_backtrack_in_re_are_matched_in_linear_time(key: str) -> None:
    """Shapes that take Python's `re` exponential time on a near miss (`(\\w\\w?)+!` passed the old static
    check and took over 8 s on one 40-character name) answer at once; a guard thread fails a hang."""
    register_patch_mapping({key: A})
    assert type(_safe_regex.matcher(key).regex).__module__.startswith("re2")  # the linear-time engine
    name = "A" * 40 + "Attention"
    found: list[object] = []
    worker = threading.Thread(target=lambda: found.append(find_replacement(name)), daemon=True)
    worker.start()
    worker.join(HANG_GUARD_S)
    assert not worker.is_alive() and found == [None]
    assert find_replacement(name + "!") == (key, A)


@pytest.mark.parametrize(
    ("key", "why"),
    [
        (r"(Llama)\1MLP", "invalid escape sequence"),
        (r"(?=Llama)\w+MLP", "invalid perl operator"),
        (r"(?<!Fast)Attention", "invalid perl operator"),
        (r"\w++MLP", "bad repetition operator"),
        (r"(?x) Llama MLP", "invalid perl operator"),
    ],
)
def test_patterns_re2_cannot_express_are_refused_with_the_key_named(key: str, why: str) -> None:
    register_patch_mapping({"Kept": A})
    with pytest.raises(PatchRegistrationError, match=rf"Patch key `{re.escape(key)}` is refused: RE2.*{why}"):
        register_patch_mapping({"LlamaMLP": B, key: C})
    assert get_patch_mapping() == {"Kept": A}  # nothing of the mapping was registered
    with pytest.raises(PatchRegistrationError, match=rf"`{re.escape(key)}`"), patched({key: C}):
        pass  # pragma: no cover - never entered


@pytest.mark.parametrize(
    "key",
    [
        ".*Attention$",
        "^Qwen.*Experts$",
        "(Llama|Mistral)MLP",
        "(Llama|Mistral)+MLP",
        r"(\w|\d)+MLP",
        "(?:Llama|Lla)+MLP",
        r"Llama\d*Attention",
        "^Qwen.*MLP$",
        ".*SelfAttention$",
        "^(Qwen2|Qwen3)Moe.*Experts$",
        "(?:Gemma|Gemma2)RMSNorm",
        r"(\d{1,3}\.){3}\d+",
        ".*Model.*Attention.*",
        "^Mixtral.*Experts$",
        "Attention$",
    ],
)
def test_ordinary_patterns_are_accepted(key: str) -> None:
    register_patch_mapping({key: A})
    assert list(get_patch_mapping()) == [key]


def test_a_pattern_is_matched_once_per_class_name(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: collections.Counter[str] = collections.Counter()
    real_compile = _safe_regex._compile

    class CountingPattern:
        def __init__(self, compiled: Any) -> None:
            self._compiled = compiled

        def search(self, text: str, *args: int) -> Any:
            calls[text] += 1
            return self._compiled.search(text, *args)

    key = ".*Attention$(?#matched-once test)"  # a pattern string no other test compiles
    with monkeypatch.context() as m:
        m.setattr(_safe_regex, "_compile", lambda pattern: CountingPattern(real_compile(pattern)))
        register_patch_mapping({key: A})
    for i in range(3):
        register_patch_mapping({f"Other{i}": B})  # every registration makes a new snapshot
        assert find_replacement("LlamaAttention") == (key, A)
        assert find_replacement("LlamaMLP") is None
        with apply_patches():
            pass
        assert explain("LlamaAttention").winner == key
    assert calls["LlamaAttention"] == 1
    assert calls["LlamaMLP"] == 1
    assert max(calls.values()) == 1


# ---- issue 10, point 11: patched() blocks exited out of order -----------------------------------
def test_patched_blocks_exited_out_of_order_each_remove_only_their_own_layer() -> None:
    from modelgraft import WeightRenaming, get_checkpoint_conversion_mapping

    register_patch_mapping({"LlamaMLP": A})
    outer = patched(
        {"LlamaAttention": B}, conversions={"llama": [WeightRenaming("wq", "q_proj")]}, strict=True
    )
    inner = patched({"MistralMLP": C})
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)  # out of order: the inner block is still open
    assert get_patch_mapping() == {"LlamaMLP": A, "MistralMLP": C}
    assert get_checkpoint_conversion_mapping("llama") is None
    assert not registry.snapshot().strict
    inner.__exit__(None, None, None)
    assert get_patch_mapping() == {"LlamaMLP": A}
    assert get_checkpoint_conversion_mapping("llama") is None
    assert not registry.snapshot().strict


def test_unpatched_blocks_exited_out_of_order_restore_the_outer_view() -> None:
    from modelgraft import unpatched

    hidden = unpatched()
    scope = patched({"LlamaAttention": B})
    hidden.__enter__()
    scope.__enter__()
    hidden.__exit__(None, None, None)
    register_patch_mapping({"LlamaMLP": A})
    assert get_patch_mapping() == {"LlamaMLP": A, "LlamaAttention": B}
    scope.__exit__(None, None, None)
    assert get_patch_mapping() == {"LlamaMLP": A}


# ---- issue 10, point 16: linear registration, and nothing cached keeps a class alive --------------
class _CountingKey(str):
    """A key that counts how often it is hashed: the work a registration does on each key."""

    hashes: ClassVar[collections.Counter[str]] = collections.Counter()

    def __hash__(self) -> int:
        _CountingKey.hashes[str.__str__(self)] += 1
        return str.__hash__(self)


def test_registering_keys_one_by_one_never_revisits_earlier_keys() -> None:
    _CountingKey.hashes.clear()
    n = 2000
    for i in range(n):
        register_patch_mapping({_CountingKey(f"Block{i}"): A})
    first, last = _CountingKey.hashes["Block0"], _CountingKey.hashes[f"Block{n - 1}"]
    # Linear total cost: the first key is not touched again by the 1,999 registrations after it.
    assert first == last, (first, last)
    assert max(_CountingKey.hashes.values()) == first
    assert len(get_patch_mapping()) == n


def _make_replacement() -> type:
    class Temporary(LlamaMLP):
        pass

    return Temporary


@pytest.mark.parametrize("how", ["unregister", "clear", "scoped"])
def test_a_removed_replacement_class_is_released(how: str) -> None:
    from transformers import LlamaForCausalLM

    from modelgraft.testing import tiny_config

    cls = _make_replacement()
    ref = weakref.ref(cls)
    mapping = {"LlamaMLP": cls, "^LlamaM[L]P$(?#released)": cls}
    scope = patched(mapping) if how == "scoped" else contextlib.nullcontext()
    if how != "scoped":
        register_patch_mapping(mapping)
    with scope:
        with apply_patches():
            assert modeling_llama.LlamaMLP is cls
        model = LlamaForCausalLM._from_config(tiny_config("llama"))
        assert type(model.model.layers[0].mlp) is cls
        assert explain("LlamaMLP").replacement is cls
        del model
    if how == "unregister":
        unregister_patch_mapping(list(mapping))
    elif how == "clear":
        clear_patch_mapping()
    register_patch_mapping({"LlamaAttention": B})  # later activity must not revive it either
    with apply_patches():
        pass
    del cls, mapping, scope
    gc.collect()
    assert ref() is None, [type(r).__name__ for r in gc.get_referrers(ref())]


# ---- one graft value: a registry scope takes classes and conversions together (issue 14, point 1) --
def _qkv_converter() -> WeightConverter:
    names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    return WeightConverter(names, ["self_attn.qkv_proj"], [Concatenate(dim=0)])


def _user_graft() -> Graft:
    """Fused QKV for Llama written by hand: a class and the conversion that goes with it."""
    return Graft({"LlamaAttention": fused_qkv_class(LlamaAttention)}, {"llama": [_qkv_converter()]})


def test_a_graft_goes_into_one_registry_scope_whole() -> None:
    graft = _user_graft()
    with modelgraft.patched(graft):
        snap = modelgraft.registry.snapshot()
        assert snap.mapping == graft.mapping
        assert snap.conversions == {"llama": (_qkv_converter(),)}
        assert modelgraft.registry.current().conversions == snap.conversions
    assert modelgraft.get_patch_mapping() == {} and get_checkpoint_conversion_mapping("llama") is None


# ---- issue 10, point 9: fork() while another thread is inside a load ------------------------------
# (moved from tests/integration/test_threads.py: a second thread holds ``registry._write_lock``)
HANG_GUARD_S = 300  # only a guard against a deadlock hanging the suite, never a speed limit


def _make_attention(i: int) -> type:
    def __init__(self: LlamaAttention, *args: object, **kwargs: object) -> None:
        time.sleep(0.0005)  # widen the window in which another thread could observe the swap
        LlamaAttention.__init__(self, *args, **kwargs)

    return type(f"ThreadAttention{i}", (LlamaAttention,), {"__init__": __init__})


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
