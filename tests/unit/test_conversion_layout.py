"""Byte layouts of row rearrangements: the bytes they name are exactly what the operations produce.

Unit tests of ``modelgraft.conversion._layout`` (their own file): they import it directly, the one exception to
tests using public names only (issue 14); everything else comes from the public namespaces.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from modelgraft import Chunk, Concatenate, ConversionOperation, MergeModulelist, Transpose, WeightConverter
from modelgraft.conversion._layout import ByteLayout, convert_layouts
from modelgraft.conversion._plan import Group, run_convert
from modelgraft.conversion._safetensors import SafetensorsFile, read_ranges_into


def _layouts(tmp_path, groups: list[list[torch.Tensor]]) -> list[list[ByteLayout]]:
    """Save the tensors to one safetensors file and describe each by its byte range there."""
    path = tmp_path / "src.safetensors"
    names = {f"g{i}.t{j}": t.contiguous() for i, g in enumerate(groups) for j, t in enumerate(g)}
    save_file(names, path)
    f = SafetensorsFile(path)
    return [
        [
            ByteLayout(tuple(t.shape), t.element_size(), ((str(path), *f.byte_range(f"g{i}.t{j}")),))
            for j, t in enumerate(g)
        ]
        for i, g in enumerate(groups)
    ]


def _materialise(layout: ByteLayout, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(layout.shape, dtype=dtype)
    read_ranges_into(layout.ranges, out)
    return out


def _expected(operations, groups):
    converter = WeightConverter([f"s{i}" for i in range(len(groups))], ["t"], operations)
    group = Group(converter, tuple((f"s{i}",) for i in range(len(groups))), (("t",),))
    return run_convert(group, groups, None)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_concatenate_along_any_dim_names_exactly_the_concatenated_bytes(tmp_path_factory, data):
    ndim = data.draw(st.integers(1, 3))
    dim = data.draw(st.integers(-ndim, ndim - 1))
    base = data.draw(st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim))
    count = data.draw(st.integers(1, 4))
    tensors = []
    for k in range(count):
        shape = list(base)
        shape[dim] = data.draw(st.integers(1, 4))
        tensors.append(torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) + 1000 * k)
    groups = [[t] for t in tensors]
    layouts = convert_layouts([Concatenate(dim=dim)], _layouts(tmp_path_factory.mktemp("c"), groups), 0)
    assert layouts is not None
    expected = _expected([Concatenate(dim=dim)], groups)
    assert torch.equal(_materialise(layouts[0][0], torch.float32), expected[0][0])


@settings(max_examples=30, deadline=None)
@given(
    experts=st.integers(1, 5),
    rows=st.lists(st.integers(1, 4), min_size=2, max_size=3),
    cols=st.integers(1, 4),
    cat_dim=st.sampled_from([1, -2]),
)
def test_expert_merge_then_concatenate_matches_transformers_layout(
    tmp_path_factory, experts, rows, cols, cat_dim
):
    """The qwen2_moe merge: stack per-expert gate and up, then join them along dim 1."""
    groups = [
        [torch.randn(r, cols) for _ in range(experts)]  # one pattern (gate, up, ...) per row count
        for r in rows
    ]
    ops = [MergeModulelist(dim=0), Concatenate(dim=cat_dim)]
    layouts = convert_layouts(ops, _layouts(tmp_path_factory.mktemp("m"), groups), 0)
    assert layouts is not None
    assert torch.equal(_materialise(layouts[0][0], torch.float32), _expected(ops, groups)[0][0])


@pytest.mark.parametrize("operation", [Transpose(0, 1), Chunk(dim=0), MergeModulelist(dim=1)])
def test_operations_that_are_not_row_rearrangements_are_left_to_the_generic_path(tmp_path, operation):
    groups = [[torch.randn(4, 4)]]
    assert convert_layouts([operation], _layouts(tmp_path, groups), 0) is None


def test_fragmented_results_are_left_to_the_generic_path(tmp_path):
    # Joining columns of two 64x8 fp32 weights gives 128 ranges of 32 bytes: cheaper to read and cat.
    groups = [[torch.randn(64, 8)], [torch.randn(64, 8)]]
    assert convert_layouts([Concatenate(dim=1)], _layouts(tmp_path, groups)) is None
    assert convert_layouts([Concatenate(dim=1)], _layouts(tmp_path, groups), min_average_range=0) is not None


def test_mismatched_shapes_are_left_to_the_generic_path_which_reports_them(tmp_path):
    groups = [[torch.randn(2, 3)], [torch.randn(2, 4)]]
    assert convert_layouts([Concatenate(dim=0)], _layouts(tmp_path, groups), 0) is None


def test_a_new_operation_declares_its_own_fast_path_in_its_own_class(tmp_path):
    # An operation outside modelgraft that only reorders its groups: one class, and the byte-layout
    # path runs it exactly as the generic path runs `convert`.
    class Swap(ConversionOperation):
        def convert(self, tensors, context):
            return list(reversed(tensors))

        def reverse(self, tensors, context):
            return list(reversed(tensors))

        def convert_layouts(self, layouts):
            return list(reversed(layouts))

    groups = [[torch.arange(6.0).reshape(2, 3)], [torch.arange(6.0, 12.0).reshape(2, 3)]]
    ops = [Swap(), Concatenate(dim=0)]
    layouts = convert_layouts(ops, _layouts(tmp_path, groups), 0)
    assert layouts is not None
    got = _materialise(layouts[0][0], torch.float32)
    want = _expected(ops, groups)[0][0]
    assert got.shape == want.shape == (4, 3) and got.dtype == want.dtype
    assert torch.equal(got, want) and torch.equal(got[:2], groups[1][0])
    # Without the override the operation computes: the generic path takes over.
    del Swap.convert_layouts
    assert convert_layouts(ops, _layouts(tmp_path, groups), 0) is None
