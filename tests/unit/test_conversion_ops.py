"""Property and unit tests of the conversion operations: every reverse is exact."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from modelgraft import (
    Chunk,
    Concatenate,
    ConversionContext,
    ConversionError,
    ConversionOperation,
    IrreversibleConversionError,
    MergeModulelist,
    SplitModulelist,
    Transpose,
)

FAST = settings(max_examples=40, deadline=None)


def _shapes(groups):
    return [[t.shape for t in g] for g in groups]


def _assert_same(a, b):
    assert len(a) == len(b)
    for ga, gb in zip(a, b, strict=True):
        assert len(ga) == len(gb)
        for x, y in zip(ga, gb, strict=True):
            assert x.shape == y.shape
            assert torch.equal(x, y)


def _roundtrip(op, groups, num_targets=1, target_shapes=None):
    out = op.convert(groups, ConversionContext(num_targets=num_targets, target_shapes=target_shapes))
    back = op.reverse(out, ConversionContext(num_targets=len(groups), source_shapes=_shapes(groups)))
    _assert_same(back, groups)
    return out


@st.composite
def concat_case(draw):
    ndim = draw(st.integers(1, 3))
    dim = draw(st.integers(-ndim, ndim - 1))
    base = draw(st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim))
    n_groups = draw(st.integers(1, 4))
    n_index = draw(st.integers(1, 3))
    sizes = draw(st.lists(st.integers(1, 5), min_size=n_groups, max_size=n_groups))  # unequal splits (GQA)
    groups = []
    for size in sizes:
        shape = list(base)
        shape[dim] = size
        groups.append([torch.randn(shape) for _ in range(n_index)])
    return dim, groups


@FAST
@given(concat_case())
def test_concatenate_reverse_is_exact_for_unequal_sizes(case):
    dim, groups = case
    out = _roundtrip(Concatenate(dim=dim), groups)
    assert len(out) == 1 and len(out[0]) == len(groups[0])


@FAST
@given(concat_case())
def test_chunk_reverse_is_exact_with_target_sizes(case):
    dim, groups = case
    joined = Concatenate(dim=dim).convert(groups, ConversionContext())
    out = _roundtrip(Chunk(dim=dim), joined, num_targets=len(groups), target_shapes=_shapes(groups))
    _assert_same(out, groups)


@FAST
@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 3), st.integers(0, 1))
def test_chunk_equal_split_roundtrip(parts, size, rows, dim):
    shape = [rows, rows]
    shape[dim] = parts * size
    t = torch.randn(shape)
    out = _roundtrip(Chunk(dim=dim, chunks=parts), [[t]])
    assert [o[0].shape[dim] for o in out] == [size] * parts


@st.composite
def stack_case(draw):
    ndim = draw(st.integers(1, 3))
    shape = draw(st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim))
    dim = draw(st.integers(-(ndim + 1), ndim))
    n_groups = draw(st.integers(1, 3))
    experts = draw(st.integers(1, 5))
    return dim, [[torch.randn(shape) for _ in range(experts)] for _ in range(n_groups)]


@FAST
@given(stack_case())
def test_merge_modulelist_roundtrip(case):
    dim, groups = case
    out = _roundtrip(MergeModulelist(dim=dim), groups)
    assert out[0][0].shape[dim] == len(groups[0])


@FAST
@given(stack_case())
def test_split_modulelist_roundtrip(case):
    dim, groups = case
    merged = MergeModulelist(dim=dim).convert(groups, ConversionContext())
    out = _roundtrip(SplitModulelist(dim=dim), merged)
    _assert_same(out, groups)


@FAST
@given(st.lists(st.integers(1, 4), min_size=2, max_size=4), st.data())
def test_transpose_roundtrip(shape, data):
    d0 = data.draw(st.integers(0, len(shape) - 1))
    d1 = data.draw(st.integers(0, len(shape) - 1))
    groups = [[torch.randn(shape)], [torch.randn(shape), torch.randn(shape)]]
    out = _roundtrip(Transpose(d0, d1), groups)
    assert out[0][0].shape == torch.randn(shape).transpose(d0, d1).shape


def test_gqa_qkv_shapes_split_back_exactly():
    q, k, v = torch.randn(64, 32), torch.randn(32, 32), torch.randn(32, 32)
    [[qkv]] = Concatenate(0).convert([[q], [k], [v]], ConversionContext())
    back = Concatenate(0).reverse([[qkv]], ConversionContext(source_shapes=[[q.shape], [k.shape], [v.shape]]))
    assert [tuple(g[0].shape) for g in back] == [(64, 32), (32, 32), (32, 32)]


def test_chunk_refuses_an_uneven_split_without_target_shapes():
    with pytest.raises(ConversionError, match=r"cannot split size 5 into 2 equal parts"):
        Chunk(dim=0).convert([[torch.ones(5)]], ConversionContext(num_targets=2))


def test_chunk_refuses_target_sizes_that_do_not_add_up():
    ctx = ConversionContext(num_targets=2, target_shapes=[[torch.Size([2])], [torch.Size([2])]])
    with pytest.raises(ConversionError, match=r"add up to 4, but the source has size 5"):
        Chunk(dim=0).convert([[torch.ones(5)]], ctx)


def test_bad_dim_is_reported_with_the_shape():
    with pytest.raises(ConversionError, match=r"dim=3, but received a tensor of shape \(2, 2\)"):
        Concatenate(dim=3).convert([[torch.ones(2, 2)]], ConversionContext())


def test_user_operation_without_reverse_raises_irreversible():
    class Double(ConversionOperation):
        def convert(self, tensors, context):
            return [[t * 2 for t in g] for g in tensors]

    op = Double()
    assert not op.is_reversible
    assert Concatenate().is_reversible
    with pytest.raises(
        IrreversibleConversionError, match=r"`Double` has no `reverse`.*save_original_format=False"
    ):
        op.reverse([[torch.ones(1)]], ConversionContext())


def test_ops_run_on_meta_tensors():
    groups = [[torch.empty(4, 8, device="meta")] * 3, [torch.empty(4, 8, device="meta")] * 3]
    for op in (MergeModulelist(0), Concatenate(1), Transpose(0, 1)):
        groups = op.convert(groups, ConversionContext())
    # 3 experts of (4, 8) stacked, two groups joined on dim 1, then dims 0 and 1 swapped.
    assert groups[0][0].shape == (8, 3, 8)
    assert groups[0][0].device.type == "meta"
