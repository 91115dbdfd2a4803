"""Issue 2, points 1 (matching rules and precedence) and 2 (atomic, validated registration)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.mt5 import modeling_mt5
from transformers.models.t5 import modeling_t5

from modelgraft import (
    PatchRegistrationError,
    ReplacementTypeError,
    apply_patches,
    clear_patch_mapping,
    get_patch_mapping,
    patched,
    register_patch_mapping,
    unregister_patch_mapping,
)
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
