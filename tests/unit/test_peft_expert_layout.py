"""The expert LoRA layouts (grafts._peft_experts) carry the same update, walked by hypothesis.

Per-expert pairs fused into PEFT's 3D layout and split back are bit for bit the same tensors, and
the fused pair's per-expert update (PEFT's ``A.reshape(E, R, in)``, ``B.reshape(out, R, E)``) is
the per-expert layers' update, with gate rows first or interleaved; a fused pair trained on the
plain model splits at its own rank with the same update.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from modelgraft.errors import ExpertsAdapterError
from modelgraft.grafts._peft_experts import fuse_down, fuse_gate_up, split_down, split_gate_up, swap_roles

sizes = st.tuples(
    st.integers(1, 4),  # experts
    st.integers(1, 5),  # I
    st.integers(1, 5),  # H
    st.integers(0, 3),  # gate rank (0: no LoRA)
    st.integers(0, 3),  # up rank
    st.booleans(),  # interleaved
    st.integers(0, 2**31 - 1),
).filter(lambda s: s[3] + s[4] > 0)


def _pairs(
    num: int, rank: int, inp: int, out: int, gen: torch.Generator
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [
        (torch.randn(rank, inp, generator=gen), torch.randn(out, rank, generator=gen)) for _ in range(num)
    ]


def _peft_update(a: torch.Tensor, b: torch.Tensor, num: int) -> torch.Tensor:
    """PEFT's per-expert update of a fused pair, in float64 (the order of sums aside)."""
    a_e = a.double().reshape(num, -1, a.shape[-1])
    b_e = b.double().reshape(b.shape[0], -1, num)
    return torch.einsum("ore,eri->eoi", b_e, a_e)


@settings(max_examples=60, deadline=None)
@given(sizes)
def test_per_expert_gate_and_up_fuse_into_the_same_update_and_split_back_bit_for_bit(case) -> None:
    num, inter, hidden, r_g, r_u, interleaved, seed = case
    gen = torch.Generator().manual_seed(seed)
    gate = _pairs(num, r_g, hidden, inter, gen) if r_g else None
    up = _pairs(num, r_u, hidden, inter, gen) if r_u else None
    a, b = fuse_gate_up(gate, up, inter, interleaved=interleaved)
    assert a.shape == (num * (r_g + r_u), hidden) and b.shape == (2 * inter, num * (r_g + r_u))

    update = _peft_update(a, b, num)
    zero = torch.zeros(num, inter, hidden, dtype=torch.float64)
    g = torch.stack([bb.double() @ aa.double() for aa, bb in gate]) if gate else zero
    u = torch.stack([bb.double() @ aa.double() for aa, bb in up]) if up else zero
    expected = (
        torch.stack([g, u], dim=2).reshape(num, 2 * inter, hidden) if interleaved else torch.cat([g, u], 1)
    )
    torch.testing.assert_close(update, expected)

    back = split_gate_up(
        a,
        b,
        num=num,
        inter=inter,
        gate_rank=r_g or None,
        up_rank=r_u or None,
        where="x",
        interleaved=interleaved,
    )
    for e, (bg, bu) in enumerate(back):
        for got, want in ((bg, gate and gate[e]), (bu, up and up[e])):
            if want is None:
                assert got is None
            else:
                assert got is not None and all(torch.equal(x, y) for x, y in zip(got, want))


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 5),
    st.integers(1, 5),
    st.integers(1, 4),
    st.booleans(),
    st.integers(0, 2**31 - 1),
)
def test_a_fused_pair_of_the_plain_model_splits_at_its_rank_with_the_same_update(
    num: int, inter: int, hidden: int, rank: int, interleaved: bool, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    a, b = torch.randn(num * rank, hidden, generator=gen), torch.randn(2 * inter, num * rank, generator=gen)
    back = split_gate_up(
        a, b, num=num, inter=inter, gate_rank=rank, up_rank=rank, where="x", interleaved=interleaved
    )
    g = torch.stack([bb.double() @ aa.double() for (aa, bb), _ in back])
    u = torch.stack([bb.double() @ aa.double() for _, (aa, bb) in back])
    whole = (
        torch.stack([g, u], dim=2).reshape(num, 2 * inter, hidden) if interleaved else torch.cat([g, u], 1)
    )
    torch.testing.assert_close(whole, _peft_update(a, b, num))


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.integers(1, 5), st.integers(1, 5), st.integers(1, 3), st.integers(0, 2**31 - 1))
def test_down_pairs_and_transposed_roles_round_trip_bit_for_bit(
    num: int, inp: int, out: int, rank: int, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    pairs = _pairs(num, rank, inp, out, gen)
    a, b = fuse_down(pairs)
    assert all(torch.equal(x, y) for p, q in zip(split_down(a, b, num), pairs) for x, y in zip(p, q))
    sa, sb = swap_roles(a, b, num)
    # PEFT reading the parameter transposed: its update is the transpose of the layers' update
    torch.testing.assert_close(_peft_update(sa, sb, num), _peft_update(a, b, num).transpose(1, 2))
    assert all(torch.equal(x, y) for x, y in zip(swap_roles(sa, sb, num), (a, b)))


def test_a_fused_pair_that_is_not_block_diagonal_is_refused_at_the_per_expert_ranks() -> None:
    a, b = torch.randn(4, 3), torch.randn(4, 4)  # one expert, rank 4 = 2 + 2, I = 2
    with pytest.raises(
        ExpertsAdapterError, match=r"`layers.0.experts.gate_up_proj` \(expert 0\) is not block diagonal"
    ):
        split_gate_up(a, b, num=1, inter=2, gate_rank=2, up_rank=2, where="layers.0.experts.gate_up_proj")
    with pytest.raises(
        ExpertsAdapterError, match=r"has rank 4, and the per-expert layers here have ranks gate=3, up=2"
    ):
        split_gate_up(a, b, num=1, inter=2, gate_rank=3, up_rank=2, where="x")
    assert isinstance(ExpertsAdapterError("x"), ValueError)
