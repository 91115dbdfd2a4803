"""Recording around ``generate()`` gives a trace laid out like one forward of the forwarded tokens
(issue 10, point 6).

``generate`` forwards the padded prompts once (``batch * prompt`` rows), then one token per
sequence per step. The trace must come out per sequence, then per position, so that one training
forward over ``sequences[:, :-1]`` (the last generated token is never forwarded) replays exactly
the experts generate used; layouts that cannot be determined are refused.
"""

from __future__ import annotations

import pytest
import torch
from moe_helpers import ExpertInputs

from families import Family, family_params
from modelgraft import RoutingError
from modelgraft.moe import moe_layers, record_routing, replay_routing

PAD = 0
PROMPTS = [[5, 17, 33, 9, 4], [12, 7, 91], [3, 66, 21, 8]]  # left-padded to 5
NEW_TOKENS = 4
FAMILIES = family_params(kinds={"moe"}, model_types=["qwen3_moe", "mixtral", "deepseek_v3", "qwen2_moe"])


def _model(family: Family) -> torch.nn.Module:
    model = family.causal_lm(pad_token_id=PAD).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in moe_layers(model):
            for tensor in [*layer.router.parameters(), *layer.router.buffers()]:
                if tensor.is_floating_point():
                    tensor.copy_(torch.randn(tensor.shape, generator=gen))
    return model


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    return ids, mask


def _generate(model: torch.nn.Module, **kwargs) -> object:
    ids, mask = _prompts()
    options = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD)
    options.update(kwargs)
    return model.generate(
        input_ids=ids, attention_mask=mask, return_dict_in_generate=True, output_logits=True, **options
    )


def _training_batch(sequences: torch.Tensor) -> dict[str, torch.Tensor]:
    """The forward a trainer runs on generate's output: prompt + completion, minus the last token."""
    _, prompt_mask = _prompts()
    length = sequences.shape[1] - 1
    mask = torch.cat(
        [prompt_mask, torch.ones(len(PROMPTS), length - prompt_mask.shape[1], dtype=torch.long)], 1
    )
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # what generate used with left padding
    return {"input_ids": sequences[:, :-1], "attention_mask": mask, "position_ids": positions}


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_trace_replays_the_experts_generate_used(family: Family) -> None:
    model = _model(family)
    with ExpertInputs(model) as seen, record_routing(model) as trace, torch.no_grad():
        out = _generate(model)
    sequences = out.sequences
    batch, prompt = _prompts()[0].shape
    length = sequences.shape[1] - 1  # positions generate forwarded
    assert length == prompt + NEW_TOKENS - 1

    # What generate forwarded, read from the experts' own inputs: the padded prompts, then one
    # token per sequence per step. Laid out per (sequence, position) here, independently.
    for layer, routes in zip(seen.layers, trace, strict=True):
        calls = seen.calls[layer.name]
        assert [c.hidden.shape[0] for c in calls] == [batch * prompt] + [batch] * (NEW_TOKENS - 1)
        per_call = [seen.membership(layer.name, c) for c in calls]
        experts = per_call[0].shape[1]
        expected = torch.cat(
            [per_call[0].view(batch, prompt, experts), *(m.view(batch, 1, experts) for m in per_call[1:])],
            dim=1,
        ).reshape(batch * length, experts)
        assert routes.shape == (batch * length, layer.top_k)
        got = torch.zeros(batch * length, experts + 1, dtype=torch.bool).scatter_(
            1, routes.clamp(max=experts), True
        )
        assert torch.equal(got[:, :experts], expected), (
            f"{layer.name}: trace rows are not per (sequence, position)"
        )
        if calls[0].ids is not None:  # the ids themselves, order included
            ids = torch.cat(
                [calls[0].ids.view(batch, prompt, -1), *(c.ids.view(batch, 1, -1) for c in calls[1:])], dim=1
            )
            assert torch.equal(routes, ids.reshape(batch * length, -1))

    assert trace.batch_size == batch

    # One training forward over the generated sequences replays exactly those experts.
    inputs = _training_batch(sequences)
    with ExpertInputs(model) as received, replay_routing(model, trace), torch.no_grad():
        logits = model(**inputs, use_cache=False).logits
    received.assert_matches(trace)
    # ... and computes what generate computed at each step (same experts, same routing weights).
    for step, step_logits in enumerate(out.logits):
        replayed = logits[:, prompt - 1 + step]
        assert torch.isfinite(replayed).all()
        assert torch.allclose(replayed, step_logits, atol=1e-4, rtol=1e-4), (
            step,
            (replayed - step_logits).abs().max(),
        )
        assert torch.equal(replayed.argmax(-1), sequences[:, prompt + step])


@pytest.mark.parametrize("family", family_params(kinds={"moe"}, model_types=["qwen3_moe"]))
def test_generate_trace_extends_to_the_whole_sequences(family: Family) -> None:
    model = _model(family)
    with record_routing(model) as trace, torch.no_grad():
        sequences = _generate(model).sequences
    whole = trace.append_positions(1)
    batch, width = sequences.shape
    assert whole.batch_size == batch and whole.num_tokens == batch * width
    for short, full in zip(trace, whole, strict=True):
        full = full.view(batch, width, -1)
        assert torch.equal(full[:, :-1].reshape(-1, full.shape[-1]), short)
        last = full[:, -1]
        assert all(len(set(row)) == len(row) for row in last.tolist())  # valid routes, no repeated expert
    _, prompt_mask = _prompts()
    mask = torch.cat([prompt_mask, torch.ones(batch, width - prompt_mask.shape[1], dtype=torch.long)], 1)
    with ExpertInputs(model) as received, replay_routing(model, whole), torch.no_grad():
        model(input_ids=sequences, attention_mask=mask, use_cache=False)
    received.assert_matches(whole)
    with pytest.raises(
        RoutingError,
        match=r"routed 27 tokens but its routing data has 24 rows.*3 sequences of 8 positions.*append_positions\(1\)",
    ):
        with replay_routing(model, trace), torch.no_grad():
            model(input_ids=sequences, attention_mask=mask, use_cache=False)


@pytest.mark.parametrize("family", family_params(kinds={"moe"}, model_types=["qwen3_moe"]))
def test_layouts_that_cannot_be_determined_are_refused(family: Family) -> None:
    model = _model(family)
    with pytest.raises(RoutingError, match=r"beam search .*num_beams=2"):
        with record_routing(model), torch.no_grad():
            _generate(model, num_beams=2)
    with pytest.raises(RoutingError, match=r"without a KV cache"):
        with record_routing(model), torch.no_grad():
            _generate(model, use_cache=False)
    ids, mask = _prompts()
    with pytest.raises(
        RoutingError,
        match=r"Forward 3 inside `record_routing` continues a KV cache at position 5 .* end at position 3",
    ):
        with record_routing(model), torch.no_grad():
            first = model(input_ids=ids, attention_mask=mask, use_cache=True)
            model(input_ids=ids[:, :3], use_cache=True)  # a second, unrelated batch
            model(input_ids=ids[:, :1], past_key_values=first.past_key_values, use_cache=True)
    assert all("forward" not in layer.scope.__dict__ for layer in moe_layers(model))
    assert "generate" not in model.__dict__


@pytest.mark.parametrize("family", family_params(kinds={"moe"}, model_types=["qwen3_moe"]))
def test_independent_forwards_still_concatenate_in_call_order(family: Family) -> None:
    model = _model(family)
    ids, _ = _prompts()
    with record_routing(model) as one, torch.no_grad():
        model(input_ids=ids[:2], use_cache=False)
    with record_routing(model) as two, torch.no_grad():
        model(input_ids=ids[2:], use_cache=False)
    with record_routing(model) as both, torch.no_grad():
        model(input_ids=ids[:2], use_cache=False)
        model(input_ids=ids[2:], use_cache=False)
    assert both.batch_size is None
    for a, b, ab in zip(one, two, both, strict=True):
        assert torch.equal(ab, torch.cat([a, b]))
