"""A packed forward inside ``replay_routing`` never attends across its sequences (issue 20 point 4).

transformers separates the sequences of a packed row (``position_ids`` restarting, no attention mask)
only without a cache; with the config's default ``use_cache=True`` and no gradient checkpointing each
packed sequence attended to the ones before it, and the loss was silently wrong. A replay block now
runs such a forward without a cache, and refuses an explicit cache or a mask that joins sequences.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from moe_helpers import ExpertInputs
from transformers import DynamicCache

from engine_payloads import qwen3_moe
from modelgraft import RoutingError
from modelgraft.moe import pack_routes, pack_sequences, record_routing, replay_routing
from modelgraft.moe._packed import restarts

LENGTHS = [5, 3, 6, 2]
SEQ = 6


@pytest.fixture
def padded():
    """A training-mode policy (no gradient checkpointing, config use_cache=True), a left-padded batch,
    its trace, and the padded batch's logits as the per-sequence reference."""
    model = qwen3_moe(num_hidden_layers=3, dense=(0,)).train()
    assert model.config.use_cache is True
    ids = torch.randint(1, 128, (4, SEQ), generator=torch.Generator().manual_seed(2))
    mask = (torch.arange(SEQ) >= SEQ - torch.tensor(LENGTHS)[:, None]).long()
    ids = ids * mask
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad(), record_routing(model) as trace:
        reference = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    return model, ids, mask, trace, reference


def _per_sequence(
    logits: torch.Tensor, packs: list[list[int]], mask: torch.Tensor
) -> dict[int, torch.Tensor]:
    found = {}
    for r, row in enumerate(packs):
        start = 0
        for sample in row:
            n = int(mask[sample].sum())
            found[sample] = logits[r, start : start + n]
            start += n
    return found


def test_packed_replay_without_use_cache_attends_within_each_sequence(padded) -> None:
    model, ids, mask, trace, reference = padded
    packed = pack_sequences(ids, mask)
    routes = pack_routes(trace, mask, position_ids=packed["position_ids"])
    with torch.no_grad(), ExpertInputs(model) as seen, replay_routing(model, routes):
        # what a trainer writes: no use_cache argument, the config says True
        out = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"])
    seen.assert_matches(routes)
    assert out.past_key_values is None  # the forward ran without a cache
    with torch.no_grad(), replay_routing(model, routes):
        uncached = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False)
    assert out.logits.dtype == uncached.logits.dtype and torch.equal(out.logits, uncached.logits)
    for sample, got in _per_sequence(out.logits, packed["packs"], mask).items():
        want = reference[sample, SEQ - LENGTHS[sample] :]
        assert got.shape == want.shape and bool(torch.isfinite(got).all())
        assert torch.allclose(got, want, atol=1e-5), (sample, (got - want).abs().max())


def test_packed_loss_is_the_same_with_and_without_gradient_checkpointing(padded) -> None:
    model, ids, mask, trace, _ = padded
    packed = pack_sequences(ids, mask)
    routes = pack_routes(trace, mask)
    labels = packed["input_ids"].masked_fill(packed["position_ids"] == 0, -100)
    losses = []
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable()
        with replay_routing(model, routes):
            loss = model(
                input_ids=packed["input_ids"], position_ids=packed["position_ids"], labels=labels
            ).loss
            loss.backward()
        losses.append(loss.detach())
    assert torch.isfinite(losses[0]) and torch.equal(losses[0], losses[1]), losses


def test_a_packed_forward_with_a_cache_or_a_joining_mask_is_refused(padded) -> None:
    model, ids, mask, trace, _ = padded
    packed = pack_sequences(ids, mask)
    routes = pack_routes(trace, mask)
    inputs = {"input_ids": packed["input_ids"], "position_ids": packed["position_ids"]}
    cache_name = "cache" if "cache" in model.model.forward.__code__.co_varnames else "past_key_values"
    refused = [
        ({"use_cache": True}, r"packed `position_ids` .* and `use_cache=True`: .* Pass `use_cache=False`"),
        ({cache_name: DynamicCache(config=model.config)}, r"and a cache: with a cache transformers does not"),
        (
            {"attention_mask": torch.ones_like(packed["input_ids"]), "use_cache": False},
            r"2-D `attention_mask` that marks tokens of two packed sequences as real.*attention_mask=None",
        ),
    ]
    for extra, message in refused:
        with pytest.raises(RoutingError, match=message) as caught, torch.no_grad():
            with replay_routing(model, routes):
                model(**inputs, **extra)
        assert isinstance(caught.value, ValueError)


def test_padded_positions_under_a_mask_are_not_packing(padded) -> None:
    """The hf-generate layout (left padding, positions from the mask's cumsum) keeps its cache."""
    model, ids, mask, trace, reference = padded
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    assert bool((positions[:, 1:] == 0).any())  # positions repeat 0 over the padding
    with torch.no_grad(), replay_routing(model, trace):
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions)
    assert out.past_key_values is not None
    real = mask.bool()
    assert torch.equal(out.logits[real], reference[real])


def test_pack_sequences_says_use_cache_false(padded) -> None:
    _, ids, mask, _, _ = padded
    packed = pack_sequences(ids, mask, [[0, 1], [2, 3]])
    assert packed["use_cache"] is False


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    pad=st.integers(0, 3),
)
def test_restarts_sees_packing_and_only_packing(lengths: list[int], pad: int) -> None:
    packed = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    assert restarts(packed, None) == (len(lengths) > 1)
    assert restarts(packed, torch.ones_like(packed)) == (len(lengths) > 1)
    # one sequence, padded on either side, positions from the mask: never packing
    for left in (True, False):
        real = torch.ones(sum(lengths), dtype=torch.long)
        blank = torch.zeros(pad, dtype=torch.long)
        mask = torch.cat([blank, real] if left else [real, blank]).unsqueeze(0)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        assert not restarts(positions, mask)
