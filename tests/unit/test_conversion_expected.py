"""Source checks of the conversion engine: every checkpoint tensor is checked against the shape the
original model expects before it is concatenated, and a failing operation names its keys and shapes.

Unit tests of ``modelgraft.conversion._checks`` (their own file): they import it directly, the one exception to
tests using public names only (issue 14); everything else comes from the public namespaces.
"""

from __future__ import annotations

import pytest
import torch

from modelgraft import (
    Chunk,
    Concatenate,
    ConversionError,
    ConversionOperation,
    ConversionShapeError,
    MergeModulelist,
    SplitModulelist,
    Transpose,
    WeightConverter,
)
from modelgraft.conversion._checks import Expected, check_sources, expected_sources
from modelgraft.conversion._plan import Group, plan_groups, run_convert

S = torch.Size
QKV = WeightConverter(["q_proj", "k_proj", "v_proj"], "qkv_proj", [Concatenate(dim=0)])
MERGE = WeightConverter(
    ["experts.*.gate_proj.weight", "experts.*.up_proj.weight"],
    "experts.gate_up_proj",
    [MergeModulelist(dim=0), Concatenate(dim=1)],
)


def _qkv_group(shapes: tuple[tuple, tuple, tuple]) -> Group:
    src = {f"l.0.{n}.weight": S(s) for n, s in zip(("q_proj", "k_proj", "v_proj"), shapes)}
    [group] = plan_groups([QKV], ["l.0.qkv_proj.weight"], src).groups
    return group


def _merge_group(gate: list[tuple], up: list[tuple]) -> Group:
    src = {f"m.experts.{i}.gate_proj.weight": S(s) for i, s in enumerate(gate)}
    src.update({f"m.experts.{i}.up_proj.weight": S(s) for i, s in enumerate(up)})
    [group] = plan_groups([MERGE], ["m.experts.gate_up_proj"], src).groups
    return group


# ---- what each source is expected to be --------------------------------------------------------
def test_sources_of_the_original_model_are_expected_at_their_original_shapes():
    group = _qkv_group(((6, 8), (6, 8), (4, 8)))  # rows moved from v to q: 6 + 6 + 4 == 8 + 4 + 4
    original = {
        "l.0.q_proj.weight": S((8, 8)),
        "l.0.k_proj.weight": S((4, 8)),
        "l.0.v_proj.weight": S((4, 8)),
    }
    [original_group] = plan_groups([QKV], ["l.0.qkv_proj.weight"], original).groups
    expected = expected_sources(group, original_group, original, [[S((16, 8))]], "`Tiny`")
    assert expected is not None and expected.shapes == [[S((8, 8))], [S((4, 8))], [S((4, 8))]]
    with pytest.raises(
        ConversionShapeError,
        match=r"Checkpoint key `l\.0\.q_proj\.weight` has shape \(6, 8\), but converter "
        r"WeightConverter\(\['q_proj', 'k_proj', 'v_proj'\].* expects \(8, 8\) there \(its shape in the "
        r"original `Tiny`\)",
    ):
        check_sources(group, group.source_shapes, [[torch.float32]] * 3, expected)


def test_expert_merges_into_an_original_fused_parameter_expect_equal_parts():
    # transformers' own layout: the original model holds the merged parameter, not the per-expert keys.
    group = _merge_group([(6, 8)] * 3, [(10, 8)] * 3)  # gate 2 rows short, up 2 rows long: sums fit
    original = {"m.experts.gate_up_proj": S((3, 16, 8))}
    expected = expected_sources(group, None, original, [[S((3, 16, 8))]], "`TinyMoe`")
    assert expected is not None and expected.shapes == [[S((8, 8))] * 3, [S((8, 8))] * 3]
    with pytest.raises(
        ConversionShapeError,
        match=r"`m\.experts\.0\.gate_proj\.weight` has shape \(6, 8\).* expects \(8, 8\) there "
        r"\(an equal part of `m\.experts\.gate_up_proj` of the original `TinyMoe`",
    ):
        check_sources(group, group.source_shapes, [[torch.float32] * 3] * 2, expected)


def test_no_expectation_where_neither_sources_nor_targets_are_original():
    group = _qkv_group(((8, 8), (4, 8), (4, 8)))
    assert expected_sources(group, None, {}, [[S((16, 8))]], "`Tiny`") is None
    # An expectation that the operations do not turn into the target's shape is not one (a
    # quantized or otherwise reshaped target): no check rather than a false error.
    original = {
        "l.0.q_proj.weight": S((8, 8)),
        "l.0.k_proj.weight": S((4, 8)),
        "l.0.v_proj.weight": S((4, 8)),
    }
    [original_group] = plan_groups([QKV], ["l.0.qkv_proj.weight"], original).groups
    assert expected_sources(group, original_group, original, [[S((16, 4))]], "`Tiny`") is None


# ---- checks on what the checkpoint holds --------------------------------------------------------
def test_a_missing_expert_is_named_with_the_expected_count():
    group = _merge_group([(8, 8)] * 2, [(8, 8)] * 2)
    expected = Expected([[S((8, 8))] * 3, [S((8, 8))] * 3], "its shape in the original `TinyMoe`")
    with pytest.raises(
        ConversionShapeError,
        match=r"expects 3 tensor\(s\) for source pattern `experts\.\*\.gate_proj\.weight` under `m`.*holds 2: "
        r"`m\.experts\.2\.gate_proj\.weight` is missing",
    ):
        check_sources(group, group.source_shapes, [[torch.float32] * 2] * 2, expected)


def test_an_expert_missing_from_one_source_pattern_only_is_refused_without_any_expectation():
    group = _merge_group([(8, 8)] * 3, [(8, 8)] * 2)
    with pytest.raises(
        ConversionShapeError,
        match=r"found `experts\.\*\.up_proj\.weight` under `m` for indices \[0, 1\] \(another source pattern "
        r"has 3\): `m\.experts\.2\.up_proj\.weight` is missing from the checkpoint",
    ):
        check_sources(group, group.source_shapes, [[torch.float32] * 3, [torch.float32] * 2], None)


def test_a_gap_in_expert_indices_is_refused_without_any_expectation():
    src = {f"m.experts.{i}.{n}.weight": S((8, 8)) for i in (0, 1, 3) for n in ("gate_proj", "up_proj")}
    [group] = plan_groups([MERGE], ["m.experts.gate_up_proj"], src).groups
    with pytest.raises(
        ConversionShapeError, match=r"`m\.experts\.2\.gate_proj\.weight` is missing from the checkpoint"
    ):
        check_sources(group, group.source_shapes, [[torch.float32] * 3] * 2, None)


def test_sources_of_one_group_must_share_a_dtype():
    group = _qkv_group(((8, 8), (4, 8), (4, 8)))
    with pytest.raises(
        ConversionShapeError,
        match=r"`l\.0\.q_proj\.weight` is torch\.float32 but `l\.0\.k_proj\.weight` is torch\.bfloat16",
    ):
        check_sources(group, group.source_shapes, [[torch.float32], [torch.bfloat16], [torch.float32]], None)


def test_checkpoint_keys_are_named_as_the_checkpoint_spells_them():
    group = _qkv_group(((6, 8), (6, 8), (4, 8)))
    expected = Expected([[S((8, 8))], [S((4, 8))], [S((4, 8))]], "its shape in the original `Tiny`")
    with pytest.raises(ConversionShapeError, match=r"`base\.l\.0\.q_proj\.weight` has shape \(6, 8\)"):
        check_sources(group, group.source_shapes, [[torch.float32]] * 3, expected, name=lambda k: f"base.{k}")


# ---- a failing operation names the converter, the keys and the shapes ---------------------------
class _TorchFailure(ConversionOperation):
    def convert(self, tensors, context):
        return [[torch.mm(t, t) for t in group] for group in tensors]  # fails on non-square tensors

    def reverse(self, tensors, context):
        return tensors


@pytest.mark.parametrize(
    ("converter", "sources", "targets", "shapes", "op"),
    [
        (QKV, {"q_proj": (8, 8), "k_proj": (8,), "v_proj": (4, 8)}, ["qkv_proj"], [[(16, 8)]], "Concatenate"),
        (
            WeightConverter("qkv_proj", ["q_proj", "k_proj", "v_proj"], [Chunk(dim=0)]),
            {"qkv_proj": (18, 8)},
            ["q_proj", "k_proj", "v_proj"],
            [[(8, 8)], [(4, 8)], [(4, 8)]],
            "Chunk",
        ),
        (
            WeightConverter("experts.*.w", "experts.fused", [MergeModulelist(dim=0)]),
            {"experts.0.w": (4, 8), "experts.1.w": (8, 4)},
            ["experts.fused"],
            [[(2, 4, 8)]],
            "MergeModulelist",
        ),
        (
            WeightConverter("experts.fused", "experts.*.w", [SplitModulelist(dim=2)]),
            {"experts.fused": (2, 4)},
            ["experts.0.w", "experts.1.w"],
            [[(4,), (4,)]],
            "SplitModulelist",
        ),
        (WeightConverter("w", "w_t", [Transpose(0, 1)]), {"w": (8,)}, ["w_t"], [[(8,)]], "Transpose"),
        (WeightConverter("w", "w2", [_TorchFailure()]), {"w": (4, 8)}, ["w2"], [[(4, 8)]], "_TorchFailure"),
    ],
    ids=["Concatenate", "Chunk", "MergeModulelist", "SplitModulelist", "Transpose", "user-op"],
)
def test_operation_failures_are_shape_errors_naming_keys_and_shapes(converter, sources, targets, shapes, op):
    src = {f"l.0.{k}": S(s) for k, s in sources.items()}
    [group] = plan_groups([converter], [f"l.0.{t}" for t in targets], src).groups
    tensors = [[torch.zeros(src[k]) for k in keys] for keys in group.sources]
    first = group.flat_sources[0]
    with pytest.raises(ConversionShapeError) as info:
        run_convert(group, tensors, [[S(s) for s in g] for g in shapes])
    message = str(info.value)
    assert f"Converter {converter!r}" in message
    assert f"`{op}" in message
    assert f"`{first}` {tuple(src[first])}" in message
    assert f"must produce `{group.flat_targets[0]}` {tuple(shapes[0][0])}" in message
    assert not isinstance(info.value.__cause__, ConversionShapeError)


def test_an_operation_that_is_not_implemented_is_not_called_a_shape_error():
    group = Group(WeightConverter("w", "w2", [ConversionOperation()]), (("w",),), (("w2",),), [[S((2,))]])
    with pytest.raises(NotImplementedError, match=r"must implement `convert"):
        run_convert(group, [[torch.zeros(2)]], None)


def test_wrapped_errors_stay_conversion_errors():
    assert issubclass(ConversionShapeError, ConversionError)
