"""Conversion rules: pattern matching, validation, registry, lookup precedence, scoped overlay.

Unit tests of ``modelgraft.conversion.rules`` and ``modelgraft.conversion.keys`` (their own file): they import it directly, the one exception to
tests using public names only (issue 14); everything else comes from the public namespaces.
"""

from __future__ import annotations

import threading

import pytest

from _versions import requires_builtin_conversion
from modelgraft import (
    Concatenate,
    ConversionError,
    ConversionOperation,
    WeightConverter,
    WeightRenaming,
    get_checkpoint_conversion_mapping,
    patched,
    register_checkpoint_conversion_mapping,
    registry,
    unregister_checkpoint_conversion_mapping,
)
from modelgraft.conversion.keys import Pattern

QKV = WeightConverter(["q_proj", "k_proj", "v_proj"], ["qkv_proj"], [Concatenate(dim=0)])


@pytest.fixture(autouse=True)
def _clean_registry():
    with registry.restoring():
        yield


def lookup_conversions(class_name, model_type):
    """The entry a load of this (sub)model would use, from the registry visible here."""
    return registry.current().lookup_conversions(class_name, model_type)


def scoped_conversions(conversions):
    return patched({}, conversions=conversions)


def test_pattern_matches_segment_runs_with_prefix_and_suffix():
    m = Pattern("q_proj").match("model.layers.0.self_attn.q_proj.weight")
    assert (m.prefix, m.suffix, m.index) == ("model.layers.0.self_attn", "weight", None)
    assert Pattern("q_proj").match("model.layers.0.self_attn.q_proj.bias").suffix == "bias"


def test_pattern_never_matches_inside_a_segment():
    assert Pattern("v_proj").match("model.layers.0.self_attn.qkv_proj.weight") is None
    assert Pattern("proj").match("a.q_proj.weight") is None


def test_star_pattern_captures_the_expert_index():
    m = Pattern("mlp.experts.*.gate_proj.weight").match("model.layers.1.mlp.experts.12.gate_proj.weight")
    assert (m.prefix, m.suffix, m.index) == ("model.layers.1", "", 12)
    assert (
        Pattern("mlp.experts.*.gate_proj.weight").match("model.layers.1.mlp.experts.x.gate_proj.weight")
        is None
    )


def test_pattern_build_is_the_inverse_of_match():
    p = Pattern("experts.*.up_proj")
    key = "model.layers.3.mlp.experts.7.up_proj.weight"
    m = p.match(key)
    assert p.build(m.prefix, m.suffix, m.index) == key


@pytest.mark.parametrize("bad", ["", "(q|k_proj", "experts[.w"])
def test_invalid_patterns_are_rejected(bad):
    with pytest.raises(ConversionError, match=r"[Pp]attern|non-empty"):
        WeightConverter([bad], ["x"], [Concatenate()])


@pytest.mark.parametrize(
    "regex", [r"\.experts.*.w1.weight", "^model.q_proj$", "experts.w*.weight", "(q|k)_proj", "a..b"]
)
def test_regex_patterns_use_transformers_semantics(regex):
    """Patterns of transformers' conversion mapping are accepted and match as it does (issue 12)."""
    assert WeightConverter([regex], ["x"], [Concatenate()]).uses_transformers_semantics
    assert not WeightConverter(
        ["mlp.experts.*.w1.weight"], ["x"], [Concatenate()]
    ).uses_transformers_semantics


def test_converter_rejects_foreign_operations():
    with pytest.raises(ConversionError, match=r"is neither a modelgraft `ConversionOperation` nor"):
        WeightConverter(["a"], ["b"], [object()])


def test_renaming_needs_equal_lengths():
    with pytest.raises(ConversionError, match=r"renames one to one.*differ in length"):
        WeightRenaming(["a"], ["b", "c"])
    # Several sources to one target: each is renamed to it, as in transformers.
    assert WeightRenaming(["a", "b"], ["c"]).uses_transformers_semantics


def test_converters_are_immutable_and_comparable():
    with pytest.raises(AttributeError, match="immutable"):
        QKV.operations = ()
    assert QKV == WeightConverter(["q_proj", "k_proj", "v_proj"], "qkv_proj", [Concatenate(0)])
    assert QKV != WeightConverter(["q_proj", "k_proj", "v_proj"], "qkv_proj", [Concatenate(1)])


def test_is_reversible_reflects_user_ops():
    class NoReverse(ConversionOperation):
        def convert(self, tensors, context):
            return tensors

    assert QKV.is_reversible
    assert not WeightConverter(["a"], ["b"], [NoReverse()]).is_reversible


def test_register_get_unregister():
    register_checkpoint_conversion_mapping("tiny_type", [QKV])
    assert get_checkpoint_conversion_mapping("tiny_type") == [QKV]
    got = get_checkpoint_conversion_mapping("tiny_type")
    got.append(QKV)  # a copy: the registry is unchanged
    assert get_checkpoint_conversion_mapping("tiny_type") == [QKV]
    unregister_checkpoint_conversion_mapping(["tiny_type"])
    assert get_checkpoint_conversion_mapping("tiny_type") is None


def test_duplicate_needs_overwrite_and_leaves_registry_unchanged():
    register_checkpoint_conversion_mapping("tiny_type", [QKV])
    other = WeightRenaming("wq", "q_proj")
    with pytest.raises(ConversionError, match=r"`tiny_type` already exists in modelgraft.*overwrite=True"):
        register_checkpoint_conversion_mapping("tiny_type", [other])
    assert get_checkpoint_conversion_mapping("tiny_type") == [QKV]
    register_checkpoint_conversion_mapping("tiny_type", [other], overwrite=True)
    assert get_checkpoint_conversion_mapping("tiny_type") == [other]


@requires_builtin_conversion
def test_builtin_transformers_conversion_needs_overwrite():
    with pytest.raises(ConversionError, match=r"`qwen2_moe` already exists in the installed transformers"):
        register_checkpoint_conversion_mapping("qwen2_moe", [QKV])
    assert get_checkpoint_conversion_mapping("qwen2_moe") is None
    register_checkpoint_conversion_mapping("qwen2_moe", [QKV], overwrite=True)
    assert get_checkpoint_conversion_mapping("qwen2_moe") == [QKV]


@requires_builtin_conversion
def test_transformers_converters_are_rejected_with_a_hint():
    from transformers.core_model_loading import WeightRenaming as HFRenaming

    with pytest.raises(
        ConversionError, match=r"not a modelgraft `WeightConverter`.*Import them from `modelgraft`"
    ):
        register_checkpoint_conversion_mapping("tiny_type", [HFRenaming("a", "b")])


def test_unregister_unknown_key_changes_nothing():
    register_checkpoint_conversion_mapping("tiny_type", [QKV])
    with pytest.raises(
        ConversionError, match=r"Cannot unregister conversion mapping\(s\) `nope`: not registered"
    ):
        unregister_checkpoint_conversion_mapping(["tiny_type", "nope"])
    assert get_checkpoint_conversion_mapping("tiny_type") == [QKV]


def test_lookup_class_name_wins_over_model_type():
    by_type = [WeightRenaming("a", "b")]
    register_checkpoint_conversion_mapping("tiny_type", by_type)
    register_checkpoint_conversion_mapping("TinyForCausalLM", [QKV])
    assert lookup_conversions("TinyForCausalLM", "tiny_type") == ("TinyForCausalLM", (QKV,))
    assert lookup_conversions("TinyModel", "tiny_type") == ("tiny_type", tuple(by_type))
    assert lookup_conversions("Other", "other") is None


def test_scoped_overlay_is_invisible_to_other_threads():
    seen = {}
    inside = threading.Event()
    done = threading.Event()

    def other():
        inside.wait()
        seen["other"] = lookup_conversions("X", "tiny_type")
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with scoped_conversions({"tiny_type": [QKV]}):
        seen["mine"] = lookup_conversions("X", "tiny_type")
        inside.set()
        done.wait()
    t.join()
    assert seen == {"mine": ("tiny_type", (QKV,)), "other": None}
    assert lookup_conversions("X", "tiny_type") is None


def test_scoped_overlay_wins_over_global_and_nests():
    register_checkpoint_conversion_mapping("tiny_type", [WeightRenaming("a", "b")])
    with scoped_conversions({"tiny_type": [QKV]}):
        with scoped_conversions({"TinyModel": []}):
            assert lookup_conversions("TinyModel", "tiny_type") == ("TinyModel", ())
            assert lookup_conversions("Other", "tiny_type") == ("tiny_type", (QKV,))
        assert get_checkpoint_conversion_mapping("TinyModel") is None
    assert get_checkpoint_conversion_mapping("tiny_type") == [WeightRenaming("a", "b")]


def test_scoped_overlay_validates_entries():
    with (
        pytest.raises(ConversionError, match=r"must be a list of `WeightConverter`"),
        scoped_conversions({"x": QKV}),
    ):
        pass
