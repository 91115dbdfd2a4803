"""modelgraft.porting behaves as transformers' conversion API (issue 18, point 3).

Each operation, called with transformers' ``convert(input_dict, source_patterns=...,
target_patterns=..., **kwargs)`` protocol, gives what transformers' own operation of the same name
gives on the same tensors (hypothesis over shapes and values), and its ``reverse_op`` undoes it;
transforms hold their patterns in lists; renamings whose rule is code rename as transformers'.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from _versions import IS_V5
from modelgraft import porting

requires_table = pytest.mark.skipif(
    not IS_V5, reason="transformers 4.57 has no conversion API to compare with"
)


def _core():
    from transformers import core_model_loading

    return core_model_loading


def test_patterns_are_lists_as_in_transformers() -> None:
    conv = porting.WeightConverter("experts.*.w1.weight", ["experts.gate_proj"], [porting.MergeModulelist(0)])
    assert conv.source_patterns == ["experts.*.w1.weight"] and conv.target_patterns == ["experts.gate_proj"]
    assert isinstance(conv.source_patterns, list)
    rename = porting.WeightRenaming(["a", "b"], "c")
    assert rename.source_patterns == ["a", "b"] and rename.target_patterns == ["c"]
    assert isinstance(porting.PrefixChange(prefix_to_add="model"), porting.WeightRenaming)
    assert isinstance(porting.GroupWeightRename(["x"], ["y"]), porting.WeightRenaming)


def test_porting_transforms_match_as_transformers_even_with_plain_patterns() -> None:
    # one key renamed by two renamings, as in radio's entry: transformers chains them
    first = porting.WeightRenaming("radio_model.model.blocks", "encoder.layer")
    second = porting.WeightRenaming("attn.proj", "attention.o_proj")
    key = "radio_model.model.blocks.0.attn.proj.weight"
    assert porting.rename_source_key(key, [first, second], []) == (
        "encoder.layer.0.attention.o_proj.weight",
        None,
    )


def _tensor(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g)


def _same(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        x = a[k][0] if isinstance(a[k], list) else a[k]
        y = b[k][0] if isinstance(b[k], list) else b[k]
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), k


dims = st.integers(min_value=1, max_value=4)


@requires_table
@settings(max_examples=25, deadline=None)
@given(rows=dims, cols=dims, parts=st.integers(2, 3), seed=st.integers(0, 1000))
def test_concatenate_and_chunk_give_transformers_results(rows: int, cols: int, parts: int, seed: int) -> None:
    core = _core()
    sources = [f"p{i}" for i in range(parts)]
    inputs = {s: [_tensor((rows, cols), seed + i)] for i, s in enumerate(sources)}
    ours = porting.Concatenate(dim=0).convert(
        dict(inputs), source_patterns=sources, target_patterns=["fused"]
    )
    theirs = core.Concatenate(dim=0).convert(dict(inputs), source_patterns=sources, target_patterns=["fused"])
    _same(ours, theirs)
    back = porting.Concatenate(dim=0).reverse_op.convert(
        {"fused": [ours["fused"]]}, source_patterns=["fused"], target_patterns=sources
    )
    _same(back, {s: inputs[s][0] for s in sources})


@requires_table
@settings(max_examples=25, deadline=None)
@given(experts=st.integers(1, 4), rows=dims, cols=dims, seed=st.integers(0, 1000))
def test_merge_and_split_modulelist_give_transformers_results(
    experts: int, rows: int, cols: int, seed: int
) -> None:
    core = _core()
    tensors = [_tensor((rows, cols), seed + e) for e in range(experts)]
    args = {"source_patterns": ["experts.*.w1.weight"], "target_patterns": ["experts.gate_proj"]}
    ours = porting.MergeModulelist(0).convert({"experts.*.w1.weight": list(tensors)}, **args)
    theirs = core.MergeModulelist(0).convert({"experts.*.w1.weight": list(tensors)}, **args)
    _same(ours, theirs)
    back = porting.MergeModulelist(0).reverse_op
    assert isinstance(back, porting.SplitModulelist)
    split = back.convert(
        {"experts.gate_proj": ours["experts.gate_proj"]},
        source_patterns=["experts.gate_proj"],
        target_patterns=["experts.*.w1.weight"],
    )
    got = split["experts.*.w1.weight"]
    got = got if isinstance(got, list) else [got]
    assert len(got) == experts and all(torch.equal(a, b) for a, b in zip(got, tensors))


@requires_table
@settings(max_examples=25, deadline=None)
@given(half=dims, cols=dims, dim=st.integers(0, 1), inverse=st.booleans(), seed=st.integers(0, 1000))
def test_interleave_gives_transformers_results(
    half: int, cols: int, dim: int, inverse: bool, seed: int
) -> None:
    core = _core()
    shape = (2 * half, cols) if dim == 0 else (cols, 2 * half)
    t = _tensor(shape, seed)
    args = {"source_patterns": ["w13"], "target_patterns": ["gate_up"]}
    ours = porting.Interleave(dim, inverse).convert({"w13": [t]}, **args)
    theirs = core.Interleave(dim, inverse).convert({"w13": [t]}, **args)
    _same(ours, theirs)
    back = porting.Interleave(dim, inverse).reverse_op.convert(
        {"gate_up": ours["gate_up"]}, source_patterns=["gate_up"], target_patterns=["w13"]
    )
    assert torch.equal(back["w13"], t)


class _Fused(nn.Module):
    def __init__(self, sizes: list[int], cols: int) -> None:
        super().__init__()
        self.q = nn.Linear(cols, sizes[0], bias=False)
        self.k = nn.Linear(cols, sizes[1], bias=False)
        self.v = nn.Linear(cols, sizes[2], bias=False)


@requires_table
@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(1, 5), min_size=3, max_size=3), cols=dims, seed=st.integers(0, 1000))
def test_split_sizes_parts_like_the_target_parameters_as_transformers(
    sizes: list[int], cols: int, seed: int
) -> None:
    core = _core()
    model = _Fused(sizes, cols)
    fused = _tensor((sum(sizes), cols), seed)
    kwargs = {
        "source_patterns": ["qkv"],
        "target_patterns": ["q", "k", "v"],
        "full_layer_name": "q.weight",
        "model": model,
    }
    ours = porting.Split(0).convert({"qkv": [fused]}, **kwargs)
    theirs = core.Split(0).convert({"qkv": [fused]}, **kwargs)
    _same(ours, theirs)


@requires_table
@pytest.mark.parametrize("already_transposed", [False, True])
def test_transpose_check_dims_keeps_a_tensor_already_in_the_target_shape(already_transposed: bool) -> None:
    core = _core()
    model = nn.Module()
    model.w = nn.Parameter(torch.zeros(2, 3, 4))
    t = _tensor((2, 3, 4) if already_transposed else (2, 4, 3), 7)
    kwargs = {"source_patterns": ["w"], "target_patterns": ["w"], "full_layer_name": "w", "model": model}
    ours = porting.Transpose(1, 2, check_dims=True).convert({"w": [t]}, **kwargs)
    theirs = core.Transpose(1, 2, check_dims=True).convert({"w": [t]}, **kwargs)
    _same(ours, theirs)


def test_transpose_check_dims_round_trips_through_a_save() -> None:
    from modelgraft.conversion.ops import ConversionContext

    op = porting.Transpose(1, 2, check_dims=True)
    for shape in ((2, 4, 3), (2, 3, 4)):
        t = _tensor(shape, 3)
        [[out]] = op.convert([[t]], ConversionContext(target_shapes=[[torch.Size([2, 3, 4])]]))
        assert out.shape == (2, 3, 4)
        [[back]] = op.reverse([[out]], ConversionContext(source_shapes=[[t.shape]]))
        assert back.shape == t.shape and torch.equal(back, t)


def test_split_outside_the_last_place_is_refused() -> None:
    from modelgraft import ConversionError
    from modelgraft.conversion.ops import ConversionContext

    with pytest.raises(ConversionError, match="must be the last operation"):
        porting.Split(0).convert([[torch.zeros(4, 2)]], ConversionContext(num_targets=2))


LAYER_PAIR_KEYS = [
    "model.layers.0.mixer.q_proj.weight",
    "model.layers.1.mixer.up_proj.weight",
    "model.layers.5.mlp_alpha",
    "model.layers.4.attn_alpha",
    "model.norm.weight",
    "model.layers.3.mixerx.weight",
]


@requires_table
@pytest.mark.parametrize("key", LAYER_PAIR_KEYS)
def test_layer_pair_collapse_renames_as_transformers(key: str) -> None:
    core = _core()
    ours = porting.rename_source_key(key, [porting.LayerPairCollapse()], [])[0]
    theirs = core.rename_source_key(key, [core.LayerPairCollapse()], [])[0]
    assert ours == theirs


@requires_table
@pytest.mark.parametrize(
    "key", ["model.attn_res.attn_queries.3", "attn_res.attn_queries.0.weight", "model.other.1"]
)
def test_index_offset_renaming_renames_as_transformers(key: str) -> None:
    core = _core()
    args = (r"attn_res\.attn_queries\.(\d+)", r"layers.\1.attention_input.query")
    ours = porting.rename_source_key(key, [porting.Inkling2IndexOffsetWeightRename(*args, offset=1)], [])[0]
    theirs = core.rename_source_key(key, [core.Inkling2IndexOffsetWeightRename(*args, offset=1)], [])[0]
    assert ours == theirs
