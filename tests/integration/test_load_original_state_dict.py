"""``modelgraft.load_original_state_dict``: weights in the checkpoint layout (what
``original_state_dict`` streams) loaded into a built transformers model, plain or grafted (issue 20
point 5).

For every (graft, family) of the ready-made graft tables, a grafted model built from *other*
weights gets the plain checkpoint's stream; afterwards its tensors equal, bit for bit, those of the
same graft loaded from the checkpoint with ``from_pretrained``, and its own stream is the plain
checkpoint. The way back (a grafted stream into a plain model), tied weights, the strict checks and
``strict=False`` are tested on a few families.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from weight_sync_helpers import assert_matches_plain

from _versions import requires_fused_experts_unless_fused_on_both_lines
from families import auto_class
from modelgraft import ConversionError, graft_model, load_original_state_dict, original_state_dict
from modelgraft.grafts import (
    FUSED_GATE_UP_FAMILIES,
    FUSED_QKV_FAMILIES,
    LINEAR_EXPERTS_FAMILIES,
    Graft,
    chunked_lm_loss,
    fused_gate_up,
    fused_qkv,
    linear_experts,
)
from modelgraft.testing import tiny_config

CASES = [
    *[pytest.param(fused_qkv, t, id=f"fused_qkv-{t}") for t in FUSED_QKV_FAMILIES],
    *[pytest.param(fused_gate_up, t, id=f"fused_gate_up-{t}") for t in FUSED_GATE_UP_FAMILIES],
    *[
        pytest.param(
            linear_experts,
            t,
            id=f"linear_experts-{t}",
            marks=requires_fused_experts_unless_fused_on_both_lines(t),
        )
        for t in LINEAR_EXPERTS_FAMILIES
    ],
    *[pytest.param(chunked_lm_loss, t, id=f"chunked_lm_loss-{t}") for t in ("llama", "qwen2_moe")],
]


def _grafted(how: str, graft: Graft, path: Path, plain: torch.nn.Module) -> torch.nn.Module:
    if how == "load":
        with graft.applied(strict=True):
            return auto_class(plain.config).from_pretrained(path).eval()
    model = copy.deepcopy(plain)
    graft_model(model, graft)
    return model


def _same_tensors(got: torch.nn.Module, want: torch.nn.Module) -> None:
    a, b = got.state_dict(), want.state_dict()
    assert list(a) == list(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize(("make_graft", "model_type"), CASES)
def test_a_grafted_model_built_from_other_weights_loads_the_plain_stream_exactly(
    make_graft, model_type: str, plain_checkpoint
) -> None:
    path, plain = plain_checkpoint(model_type)
    other_path, other = plain_checkpoint(model_type, seed=1)
    graft = make_graft(model_type)
    target = _grafted("load", graft, other_path, other)
    reference = _grafted("load", graft, path, plain)  # the same graft, loaded from the checkpoint
    result = load_original_state_dict(target, original_state_dict(plain))
    assert result.missing_keys == [] and result.unexpected_keys == []
    _same_tensors(target, reference)
    assert_matches_plain(list(original_state_dict(target)), path, plain, target)


@pytest.mark.parametrize(
    ("make_graft", "model_type"),
    [
        (fused_qkv, "llama"),
        (fused_gate_up, "llama"),
        pytest.param(
            linear_experts, "qwen2_moe", marks=requires_fused_experts_unless_fused_on_both_lines("qwen2_moe")
        ),
        (linear_experts, "mixtral"),
        (chunked_lm_loss, "llama"),
    ],
)
def test_both_ways_between_in_place_grafted_and_plain_models(
    make_graft, model_type: str, plain_checkpoint
) -> None:
    path, plain = plain_checkpoint(model_type)
    _, other = plain_checkpoint(model_type, seed=1)
    grafted = _grafted("in_place", make_graft(model_type), path, copy.deepcopy(other))
    load_original_state_dict(grafted, original_state_dict(plain))
    assert_matches_plain(list(original_state_dict(grafted)), path, plain, grafted)
    fresh = copy.deepcopy(other)  # plain, other weights
    load_original_state_dict(fresh, dict(original_state_dict(grafted)))
    _same_tensors(fresh, plain)


def _tied(seed: int) -> torch.nn.Module:
    config = tiny_config("llama", tie_word_embeddings=True)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def test_tied_weights_load_under_both_names_and_must_agree() -> None:
    source, target = _tied(0), _tied(1)
    assert target.lm_head.weight is target.model.embed_tokens.weight
    stream = dict(original_state_dict(source))
    assert "lm_head.weight" in stream and "model.embed_tokens.weight" in stream
    load_original_state_dict(target, stream)
    _same_tensors(target, source)
    assert target.lm_head.weight is target.model.embed_tokens.weight  # still tied
    stream["lm_head.weight"] = stream["lm_head.weight"] + 1
    with pytest.raises(ConversionError, match=r"give different values for the same elements of"):
        load_original_state_dict(target, stream)


def test_strict_lists_every_missing_unexpected_shape_and_dtype_problem_and_loads_nothing(
    plain_checkpoint,
) -> None:
    path, plain = plain_checkpoint("llama")
    _, other = plain_checkpoint("llama", seed=1)
    target = _grafted("in_place", fused_qkv("llama"), path, copy.deepcopy(other))
    before = {k: v.clone() for k, v in target.state_dict().items()}
    stream = dict(original_state_dict(plain))
    q = "model.layers.0.self_attn.q_proj.weight"
    del stream[q]
    stream["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    stream["model.norm.weight"] = stream["model.norm.weight"][:-1]
    stream["model.layers.1.mlp.up_proj.weight"] = stream["model.layers.1.mlp.up_proj.weight"].double()
    with pytest.raises(ConversionError) as caught:
        load_original_state_dict(target, stream)
    message = str(caught.value)
    assert isinstance(caught.value, ValueError)
    assert f"1 missing key(s): `{q}`" in message
    assert "1 unexpected key(s): `model.layers.0.self_attn.extra.weight`" in message
    assert "1 shape mismatch(es): `model.norm.weight`: expected (64,), received (63,)" in message
    assert (
        "1 dtype mismatch(es): `model.layers.1.mlp.up_proj.weight`: expected torch.float32, received torch.float64"
    ) in message
    assert "Nothing was loaded" in message
    for key, tensor in target.state_dict().items():
        assert torch.equal(tensor, before[key]), key


def test_non_strict_reports_missing_and_unexpected_and_keeps_what_is_not_given(plain_checkpoint) -> None:
    path, plain = plain_checkpoint("llama")
    _, other = plain_checkpoint("llama", seed=1)
    target = _grafted("in_place", fused_qkv("llama"), path, copy.deepcopy(other))
    q = "model.layers.0.self_attn.q_proj.weight"
    stream = dict(original_state_dict(plain))
    del stream[q]
    stream["unknown.weight"] = torch.zeros(1)
    result = load_original_state_dict(target, stream, strict=False)
    assert result.missing_keys == [q] and result.unexpected_keys == ["unknown.weight"]
    got = dict(original_state_dict(target))
    assert torch.equal(got[q], dict(original_state_dict(other))[q])  # q's rows of qkv_proj kept
    for name, tensor in stream.items():
        if name in got:
            assert torch.equal(got[name], tensor), name


def test_not_a_model_or_not_pairs_is_refused(plain_checkpoint) -> None:
    _, plain = plain_checkpoint("llama")
    with pytest.raises(ConversionError, match=r"expects a `torch.nn.Module`, received `dict`"):
        load_original_state_dict({}, original_state_dict(plain))  # type: ignore[arg-type]
    with pytest.raises(ConversionError, match=r"iterable of `\(name, tensor\)` pairs"):
        load_original_state_dict(plain, [torch.zeros(1)])  # type: ignore[list-item]
    with pytest.raises(ConversionError, match=r"`model.norm.weight` is given twice"):
        norm = plain.model.norm.weight.detach()
        load_original_state_dict(plain, [("model.norm.weight", norm), ("model.norm.weight", norm)])


def test_the_docs_example_runs_as_written() -> None:
    import re

    doc = (Path(__file__).resolve().parents[2] / "docs" / "conversion.md").read_text()
    found = re.search(r"<!-- example: load-original-state-dict -->\n```python\n(.*?)\n```", doc, re.S)
    assert found is not None
    namespace: dict[str, object] = {}
    exec(compile(found.group(1), "docs/conversion.md [load-original-state-dict]", "exec"), namespace)
    reference, policy = namespace["reference"], namespace["policy"]
    assert any("FusedQKV" in type(m).__name__ for m in reference.modules())  # it was grafted
    got, want = dict(original_state_dict(reference)), dict(original_state_dict(policy))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
