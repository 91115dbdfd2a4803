"""Group planning, the safetensors reader, key translation and device lookup of the conversion engine.

Unit tests of ``modelgraft.conversion._plan`` (their own file): they import it directly, the one exception to
tests using public names only (issue 14); everything else comes from the public namespaces.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from modelgraft import (
    Chunk,
    Concatenate,
    ConversionError,
    ConversionOperation,
    ConversionShapeError,
    MergeModulelist,
    MissingSourceKeyError,
    SplitModulelist,
    WeightConverter,
    WeightRenaming,
)
from modelgraft.conversion._plan import plan_groups, run_convert, run_reverse
from modelgraft.conversion._safetensors import SafetensorsFile
from modelgraft.conversion.keys import translate_checkpoint_keys

QKV = WeightConverter(["q_proj", "k_proj", "v_proj"], "qkv_proj", [Concatenate(dim=0)])
S = torch.Size


def _src(prefix: str, shapes: dict[str, tuple]) -> dict[str, torch.Size]:
    return {f"{prefix}.{k}": S(v) for k, v in shapes.items()}


def test_groups_pair_weight_and_bias_per_layer_in_source_order():
    src = {}
    for layer in range(2):
        for suffix, shape in (("weight", (4, 2)), ("bias", (4,))):
            src.update(_src(f"l.{layer}", {f"{n}.{suffix}": shape for n in ("v_proj", "q_proj", "k_proj")}))
    targets = [f"l.{i}.qkv_proj.{s}" for i in range(2) for s in ("weight", "bias")]
    plan = plan_groups([QKV], targets, src)
    assert len(plan.groups) == 4 and not plan.unsourced_targets
    g = next(g for g in plan.groups if g.targets == (("l.1.qkv_proj.bias",),))
    assert g.sources == (("l.1.q_proj.bias",), ("l.1.k_proj.bias",), ("l.1.v_proj.bias",))
    assert g.source_shapes == [[S([4])]] * 3


def test_star_sources_are_ordered_by_numeric_index():
    conv = WeightConverter("experts.*.w", "experts.fused", [MergeModulelist(dim=0)])
    src = {f"m.experts.{i}.w": S((2, 2)) for i in (10, 2, 1, 0)}
    [g] = plan_groups([conv], ["m.experts.fused"], src).groups
    assert g.sources == (tuple(f"m.experts.{i}.w" for i in (0, 1, 2, 10)),)


def test_star_targets_receive_split_tensors_by_index():
    conv = WeightConverter("experts.fused", "experts.*.w", [SplitModulelist(dim=0)])
    targets = [f"m.experts.{i}.w" for i in range(3)]
    [g] = plan_groups([conv], targets, {"m.experts.fused": S((3, 2))}).groups
    fused = torch.arange(6.0).reshape(3, 2)
    [[a, b, c]] = run_convert(g, [[fused]], [[S((2,))] * 3])
    assert c.tolist() == [4.0, 5.0]
    assert torch.equal(run_reverse(g, [[a, b, c]])[0][0], fused)


def test_partial_sources_raise_and_absent_sources_are_reported():
    src = _src("l.0", {"q_proj.weight": (4, 2), "k_proj.weight": (2, 2)})
    with pytest.raises(MissingSourceKeyError, match=r"needs checkpoint key `l\.0\.v_proj\.weight`"):
        plan_groups([QKV], ["l.0.qkv_proj.weight"], src)
    assert not plan_groups([QKV], ["l.0.qkv_proj.weight"], src, strict_sources=False).groups
    plan = plan_groups([QKV], ["l.0.qkv_proj.weight"], {})
    assert plan.unsourced_targets == [(QKV, "l.0.qkv_proj.weight")]


def test_two_converters_building_the_same_target_from_the_checkpoint_are_an_overlap_error():
    """Issue 19: not "the first one wins" (an accident of registration order)."""
    other = WeightConverter(["a", "b", "c"], "qkv_proj", [Concatenate(dim=0)])
    src = _src("l", {"q_proj.weight": (1, 1), "k_proj.weight": (1, 1), "v_proj.weight": (1, 1)})
    src.update(_src("l", {"a.weight": (1, 1), "b.weight": (1, 1), "c.weight": (1, 1)}))
    for order in ([other, QKV], [QKV, other]):
        with pytest.raises(ConversionError, match=r"both build `l.qkv_proj.weight` from this checkpoint"):
            plan_groups(order, ["l.qkv_proj.weight"], src)


def test_an_alternative_layout_the_checkpoint_does_not_hold_is_no_overlap():
    other = WeightConverter(["a", "b", "c"], "qkv_proj", [Concatenate(dim=0)])
    src = _src("l", {"q_proj.weight": (1, 1), "k_proj.weight": (1, 1), "v_proj.weight": (1, 1)})
    assert [g.converter for g in plan_groups([other, QKV], ["l.qkv_proj.weight"], src).groups] == [QKV]


def test_renaming_round_trips():
    ren = WeightRenaming(["wq", "wk"], ["q_proj", "k_proj"])
    [g] = plan_groups(
        [ren], ["l.q_proj.weight", "l.k_proj.weight"], {"l.wq.weight": S((2,)), "l.wk.weight": S((2,))}
    ).groups
    q, k = torch.ones(2), torch.zeros(2)
    assert run_convert(g, [[q], [k]], None) == [[q], [k]]
    assert run_reverse(g, [[q], [k]]) == [[q], [k]]


def test_chunk_uses_target_sizes_for_unequal_parts_and_reverse_checks_shapes():
    conv = WeightConverter("qkv_proj", ["q_proj", "k_proj", "v_proj"], [Chunk(dim=0)])
    [g] = plan_groups(
        [conv], ["l.q_proj.weight", "l.k_proj.weight", "l.v_proj.weight"], {"l.qkv_proj.weight": S((8, 2))}
    ).groups
    fused = torch.arange(16.0).reshape(8, 2)
    out = run_convert(g, [[fused]], [[S((4, 2))], [S((2, 2))], [S((2, 2))]])
    assert [tuple(t[0].shape) for t in out] == [(4, 2), (2, 2), (2, 2)]
    assert torch.equal(run_reverse(g, out)[0][0], fused)
    with pytest.raises(
        ConversionShapeError,
        match=r"produced shape \(4, 2\) for `l\.q_proj\.weight`, but the model parameter has shape \(4, 3\)",
    ):
        run_convert(g, [[fused]], [[S((4, 3))], [S((2, 3))], [S((2, 3))]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool])
def test_safetensors_reader_matches_safetensors(tmp_path, dtype):
    data = {"a": (torch.randn(3, 5) * 10).to(dtype), "b": torch.zeros(0), "c": torch.tensor(7.0)}
    save_file(data, tmp_path / "x.safetensors")
    f = SafetensorsFile(tmp_path / "x.safetensors")
    assert sorted(f.keys()) == ["a", "b", "c"]
    for k, v in data.items():
        got = f.read(k)
        assert got.dtype == v.dtype and got.shape == v.shape and torch.equal(got, v)
    rows = torch.empty(4, 5, dtype=dtype)
    f.read_into("a", rows[1:])
    assert torch.equal(rows[1:], data["a"])


def test_key_translation_adds_or_strips_the_base_model_prefix():
    from transformers import AutoConfig, LlamaForCausalLM, LlamaModel

    cfg = AutoConfig.for_model(
        "llama", hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2, vocab_size=8
    )
    with torch.device("meta"):
        head, base = LlamaForCausalLM(cfg), LlamaModel(cfg)
    ckpt_head = ["model.layers.0.x", "lm_head.weight"]
    assert translate_checkpoint_keys(base, set(base.state_dict()), ckpt_head) == {
        "model.layers.0.x": "layers.0.x",
        "lm_head.weight": "lm_head.weight",
    }
    assert translate_checkpoint_keys(head, set(head.state_dict()), ["layers.0.x", "lm_head.weight"]) == {
        "layers.0.x": "model.layers.0.x",
        "lm_head.weight": "lm_head.weight",
    }
    assert translate_checkpoint_keys(head, set(head.state_dict()), ckpt_head) == {k: k for k in ckpt_head}


def test_device_for_picks_the_longest_device_map_prefix():
    from modelgraft.conversion.load import device_for_map

    find = device_for_map({"": "cpu", "model.layers.1": 0, "lm_head": "disk"})
    assert find("model.layers.0.self_attn.qkv_proj.weight") == "cpu"
    assert find("model.layers.1.self_attn.qkv_proj.weight") == 0
    assert find("model.layers.10.mlp.w") == "cpu"  # a prefix matches whole dotted names only
    assert find("lm_head.weight") == "disk"  # passed on: the load step offloads it
    assert device_for_map(None)("x") == "cpu"
    assert device_for_map({"model": "cpu"})("lm_head.weight") == "cpu"  # no prefix matches


# ---- issue 19: a user operation whose reverse is not its inverse is found at load --------------------
class _Scale(ConversionOperation):
    """A user operation: ``convert`` scales by 2; ``reverse`` undoes it, or not (``exact=False``)."""

    def __init__(self, exact: bool) -> None:
        self.exact = exact

    def convert(self, tensors, context):
        return [[t * 2 for t in g] for g in tensors]

    def reverse(self, tensors, context):
        return [[t / 2 if self.exact else t.clone() for t in g] for g in tensors]


@pytest.mark.parametrize("exact", [True, False])
def test_a_user_reverse_that_is_not_the_inverse_is_refused_at_load(exact: bool) -> None:
    conv = WeightConverter("w_old", "w_new", [_Scale(exact)])
    [group] = plan_groups([conv], ["l.w_new.weight"], {"l.w_old.weight": S((2, 3))}).groups
    loaded = torch.arange(6.0).reshape(2, 3)
    if exact:
        [[out]] = run_convert(group, [[loaded]], [[S((2, 3))]])
        assert torch.equal(out, loaded * 2)
        return
    with pytest.raises(
        ConversionError, match=r"the reverse of `_Scale` does not undo its convert on `l.w_old.weight`"
    ):
        run_convert(group, [[loaded]], [[S((2, 3))]])
