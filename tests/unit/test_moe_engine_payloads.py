"""Engine payloads as the engines build them (issue 11, points 1-4): vLLM's current and older output
objects, prefix-cached rows of -1, the HTTP payloads of vLLM and SGLang, physical expert ids."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from engine_payloads import (
    CompletionOutput,
    RequestOutput,
    engine_routes,
    npy_base64,
    qwen3_moe,
    sglang_response,
    vllm_output,
    vllm_server_response,
)
from modelgraft import RoutingError
from modelgraft.moe import from_sglang, from_vllm, replay_routing

PROMPTS = [[5, 9, 17, 33], [7, 40, 2]]
COMPLETIONS = [[[11, 12, 13]], [[21, 22], [23, 24]]]  # request 1 sampled twice (n=2)
MOE = [1, 2]  # layer 0 is dense


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return qwen3_moe()


def _expected(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The engine's rows of the MoE layers for that sequence, ``(tokens - 1, 2, top_k)``."""
    return torch.from_numpy(engine_routes(model, prompt + completion)[:, MOE].astype(np.int64))


def _rows(trace, request: int, seq: int, tokens: int) -> torch.Tensor:
    """Rows of one request (right padding), stacked over the MoE layers: ``(tokens, layers, top_k)``."""
    return torch.stack([t.reshape(-1, seq, t.shape[1])[request, :tokens] for t in trace], dim=1)


@pytest.mark.parametrize("split", [True, False], ids=["prompt_routed_experts", "single-array"])
def test_from_vllm_takes_request_outputs_and_joins_prompt_and_completion_rows(model, split: bool) -> None:
    outputs = [vllm_output(model, p, c, split=split) for p, c in zip(PROMPTS, COMPLETIONS)]
    if split:
        assert (
            outputs[0].prompt_routed_experts.dtype == np.int16
            and outputs[0].outputs[0].routed_experts.shape[0] == 2
        )
    trace = from_vllm(outputs, model)  # token counts come from the outputs: no mask needed
    assert trace.batch_size == 3 and trace.layer_ids == MOE and trace.num_tokens == 3 * 7
    sequences = [(p, c) for p, cs in zip(PROMPTS, COMPLETIONS) for c in cs]
    for row, (prompt, completion) in enumerate(sequences):
        tokens = len(prompt) + len(completion)
        got = _rows(trace, row, 7, tokens)
        assert torch.equal(got[: tokens - 1], _expected(model, prompt, completion)), row
        last = got[tokens - 1]  # the last token has no route: the spread filler, valid and distinct ids
        assert all(row.unique().numel() == 2 and bool((row < 8).all()) for row in last)


def test_the_two_arrays_and_the_server_json_give_the_same_trace(model) -> None:
    outputs = [vllm_output(model, p, c) for p, c in zip(PROMPTS, COMPLETIONS)]
    direct = from_vllm(outputs, model)
    pairs = [(o.prompt_routed_experts, c.routed_experts) for o in outputs for c in o.outputs]
    lengths = [len(o.prompt_token_ids) + len(c.token_ids) for o in outputs for c in o.outputs]
    as_arrays = from_vllm(pairs, model, input_lengths=lengths)
    as_json = from_vllm([vllm_server_response(o) for o in outputs], model)
    for other in (as_arrays, as_json):
        assert all(torch.equal(a, b) for a, b in zip(direct.layers, other.layers))


def test_a_mask_that_disagrees_with_the_token_counts_is_refused(model) -> None:
    outputs = [vllm_output(model, PROMPTS[0], COMPLETIONS[0][:1])]
    with pytest.raises(
        RoutingError, match=r"Request 0 has 7 tokens in the engine output .* has 6 real tokens"
    ):
        from_vllm(outputs, model, attention_mask=torch.tensor([[1, 1, 1, 1, 1, 1, 0]]))


def test_outputs_without_routes_or_token_ids_are_refused(model) -> None:
    bare = RequestOutput("r", None, [1, 2], None, [CompletionOutput(0, "", [3], None, None)], True)
    with pytest.raises(RoutingError, match=r"request 0 carries no routed experts; start vLLM with"):
        from_vllm([bare], model)
    reply = vllm_server_response(vllm_output(model, PROMPTS[0], COMPLETIONS[0][:1]))
    del reply["prompt_token_ids"]
    with pytest.raises(
        RoutingError, match=r"request 0 has no `prompt_token_ids`; vLLM returns token ids with"
    ):
        from_vllm([reply], model)


# ---- point 2: prefix-cache hits, rows of -1
def test_prefix_cached_rows_are_refused_by_default_naming_request_tokens_and_layer(model) -> None:
    outputs = [
        vllm_output(model, PROMPTS[0], COMPLETIONS[0][:1]),
        vllm_output(model, PROMPTS[1], COMPLETIONS[1][:1], cached=2),
    ]
    with pytest.raises(
        RoutingError, match=r"Request 1 has no route for tokens 0\.\.1 of decoder layer `1` \(rows of -1"
    ):
        from_vllm(outputs, model)


def test_prefix_cached_rows_are_kept_for_live_routing_when_asked(model) -> None:
    outputs = [vllm_output(model, PROMPTS[1], COMPLETIONS[1][:1], cached=2)]
    trace = from_vllm(outputs, model, missing="live")
    assert trace.missing == "live" and trace.layers[0].dtype == torch.int16  # -1 needs a signed dtype
    rows = _rows(trace, 0, 5, 5)
    assert bool((rows[:2] == -1).all()) and bool((rows[2:] >= 0).all())
    expected = _expected(model, PROMPTS[1], COMPLETIONS[1][0])
    assert torch.equal(rows[2:4], expected[2:])


def test_live_rows_route_as_the_router_would_and_every_other_row_is_forced(model) -> None:
    ids = torch.tensor([[3, 19, 44, 5, 61, 7]])
    with torch.no_grad():
        reference = model(input_ids=ids, use_cache=False).logits
    routes = engine_routes(model, [*ids[0].tolist(), 0])  # rows for all 6 tokens
    routes[:3] = -1
    trace = from_vllm([routes], model, input_lengths=[6], missing="live")
    with torch.no_grad(), replay_routing(model, trace):
        live = model(input_ids=ids, use_cache=False).logits
    # Unchanged weights: the router chooses for tokens 0-2 what it chose before, the others are forced
    # to the same experts, so the forward is bit-identical.
    assert torch.equal(live, reference)
    wrong = [t.clone() for t in trace.layers]
    for t in wrong:
        t[3:6] = torch.tensor([6, 7], dtype=t.dtype)  # other experts for the forced rows
    with torch.no_grad(), replay_routing(model, wrong, missing="live"):
        forced = model(input_ids=ids, use_cache=False).logits
    assert not torch.equal(forced[0, 3:], reference[0, 3:])  # forced rows are forced


def test_replay_refuses_minus_one_rows_without_the_live_policy(model) -> None:
    routes = engine_routes(model, [3, 19, 44, 5])
    routes[:1] = -1
    trace = from_vllm([routes], model, input_lengths=[4], missing="live")
    with pytest.raises(RoutingError, match=r"holds expert id -1, out of range .* only with `missing='live'`"):
        with replay_routing(model, trace, missing="refuse"):
            pass
    half = [t.clone() for t in trace.layers]
    half[0][2, 0] = -1
    with pytest.raises(RoutingError, match=r"has row 2 = \[-1, \d\]: a row is either all -1"):
        with replay_routing(model, half, missing="live"):
            pass
    gone = [torch.full_like(t, -1) for t in trace.layers]
    with pytest.raises(
        RoutingError, match=r"Every row of the routing for MoE layer `model.layers.1.mlp.gate` is -1"
    ):
        with replay_routing(model, gone, missing="live"):
            pass


def test_rows_before_routed_experts_prompt_start_are_missing_rows(model) -> None:
    output = vllm_output(model, PROMPTS[0], COMPLETIONS[0][:1], prompt_start=2)
    assert output.prompt_routed_experts.shape[0] == 2
    with pytest.raises(RoutingError, match=r"Request 0 has no route for tokens 0\.\.1 of decoder layer `1`"):
        from_vllm([output], model)
    trace = from_vllm([output], model, missing="live")
    assert bool((_rows(trace, 0, 7, 7)[:2] == -1).all())


# ---- point 3: HTTP payloads
@pytest.mark.parametrize("dtype", [np.int32, np.int16, np.uint8])
def test_vllm_npy_payloads_of_every_integer_dtype_decode(model, dtype) -> None:
    routes = engine_routes(model, [4, 8, 15, 16, 23]).astype(dtype)
    trace = from_vllm([npy_base64(routes)], model, input_lengths=[5])
    assert torch.equal(_rows(trace, 0, 5, 5)[:4], torch.from_numpy(routes[:, MOE].astype(np.int64)))


def _npy(header: str, body: bytes) -> str:
    head = header.encode("latin1")
    head += b" " * ((64 - (10 + len(head) + 1) % 64) % 64) + b"\n"
    return base64.b64encode(b"\x93NUMPY\x01\x00" + len(head).to_bytes(2, "little") + head + body).decode()


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        ("AAAA*AAA", r"request 0 is not valid base64"),
        (
            base64.b64encode(np.zeros((2, 3, 2), np.int32).tobytes()).decode(),
            r"base64 but not of a `.npy` file",
        ),
        (npy_base64(np.zeros((2, 3, 2), np.float32)), r"hold `<f4`; expected little-endian integer ids"),
        (
            npy_base64(np.zeros((2, 6), np.int32)),
            r"have shape \(2, 6\); expected \(tokens, num_hidden_layers, top_k\)",
        ),
        (npy_base64(np.zeros((2, 3, 2), ">i4")), r"hold `>i4`; expected little-endian"),
        (_npy("{'descr': '|O', 'fortran_order': False, 'shape': (1, 3, 2), }", b"\x00" * 6), r"hold `\|O`"),
        (
            _npy("{'descr': '<i4', 'fortran_order': False, 'shape': (2, 3, 2), }", b"\x00" * 8),
            r"hold 8 bytes of data for shape",
        ),
        (_npy("__import__('os')", b""), r"header that cannot be read"),
    ],
)
def test_malformed_vllm_npy_payloads_are_refused(model, payload: str, match: str) -> None:
    with pytest.raises(RoutingError, match=match):
        from_vllm([payload], model, input_lengths=[3])


def test_a_fortran_ordered_npy_decodes_like_the_c_ordered_one(model) -> None:
    routes = engine_routes(model, [4, 8, 15, 16])
    buffer = io.BytesIO()
    np.save(buffer, np.asfortranarray(routes), allow_pickle=False)
    fortran = base64.b64encode(buffer.getvalue()).decode()
    a = from_vllm([fortran], model, input_lengths=[4])
    b = from_vllm([npy_base64(routes)], model, input_lengths=[4])
    assert all(torch.equal(x, y) for x, y in zip(a.layers, b.layers))


@pytest.mark.parametrize("wire", ["int32", "uint16", "uint8"])
def test_sglang_generate_responses_decode_in_every_wire_dtype(model, wire: str) -> None:
    replies = [sglang_response(model, p, cs[0], wire=wire) for p, cs in zip(PROMPTS, COMPLETIONS)]
    if wire != "int32":
        assert replies[0]["meta_info"]["routed_experts_dtype"] == wire
    trace = from_sglang(replies, model)  # prompt_tokens + completion_tokens give the lengths
    expected = from_vllm([vllm_output(model, p, cs[:1]) for p, cs in zip(PROMPTS, COMPLETIONS)], model)
    assert all(torch.equal(a, b) for a, b in zip(trace.layers, expected.layers))
    meta_only = from_sglang([r["meta_info"] for r in replies], model)
    assert all(torch.equal(a, b) for a, b in zip(meta_only.layers, expected.layers))


def test_sglang_routed_experts_start_len_places_the_rows(model) -> None:
    reply = sglang_response(model, PROMPTS[0], COMPLETIONS[0][0], start_len=3)
    with pytest.raises(RoutingError, match=r"Request 0 has no route for tokens 0\.\.2 of decoder layer `1`"):
        from_sglang([reply], model)
    trace = from_sglang([reply], model, missing="live")
    rows = _rows(trace, 0, 7, 7)
    expected = _expected(model, PROMPTS[0], COMPLETIONS[0][0])
    assert bool((rows[:3] == -1).all()) and torch.equal(rows[3:6], expected[3:])


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"routed_experts_dtype": "float16"}, r"marked `float16`; SGLang sends int32, uint16 or uint8"),
        (
            {"routed_experts": base64.b64encode(b"\x01\x02\x03").decode(), "routed_experts_dtype": "uint16"},
            r"decodes to 3 bytes, not a whole number of uint16 ids",
        ),
        (
            {"routed_experts_start_len": -2},
            r"`routed_experts_start_len` of request 0 must be a non-negative integer",
        ),
    ],
)
def test_malformed_sglang_payloads_are_refused(model, change: dict, match: str) -> None:
    reply = sglang_response(model, PROMPTS[0], COMPLETIONS[0][0])
    reply["meta_info"].update(change)
    with pytest.raises(RoutingError, match=match):
        from_sglang([reply], model)


# ---- point 4: physical expert ids
def _physical(routes: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Ids an engine with expert-parallel load balancing reports: one physical replica per logical id."""
    inverse = {int(logical): physical for physical, logical in enumerate(table)}
    out = routes.copy()
    out[:, MOE] = np.vectorize(inverse.__getitem__)(routes[:, MOE])
    return out


def test_a_physical_to_logical_map_gives_the_logical_ids(model) -> None:
    routes = engine_routes(model, [4, 8, 15, 16, 23])
    table = np.array([3, 7, 0, 5, 1, 6, 2, 4, 3, 0])  # 10 physical slots: experts 3 and 0 replicated
    physical = _physical(routes, table)
    logical = from_vllm([routes], model, input_lengths=[5])
    for expert_map in (
        table,
        np.stack([table] * 3),
        np.stack([table] * 2),
    ):  # 1-D, per decoder layer, per MoE layer
        got = from_vllm([physical], model, input_lengths=[5], expert_map=expert_map)
        assert all(torch.equal(a, b) for a, b in zip(got.layers, logical.layers))


def test_ids_out_of_range_of_the_map_or_after_it_are_refused(model) -> None:
    routes = engine_routes(model, [4, 8, 15, 16, 23])
    routes[2, 2] = [11, 3]
    with pytest.raises(
        RoutingError, match=r"Request 0 routes token 2 of decoder layer `2` to physical expert 11, but the"
    ):
        from_vllm([routes], model, input_lengths=[5], expert_map=np.arange(10) % 8)
    routes[2, 2] = [8, 3]  # physical slot 8 is used by token 2 only; the map sends it to logical 9
    with pytest.raises(
        RoutingError, match=r"must lie in 0..7; found 9 \(request 0, token 2, decoder layer `2`: 9\)"
    ):
        from_vllm([routes], model, input_lengths=[5], expert_map=np.array([0, 1, 2, 3, 4, 5, 6, 7, 9, 1]))
    with pytest.raises(RoutingError, match=r"`expert_map` has shape \(4, 10\); expected"):
        from_vllm([routes], model, input_lengths=[5], expert_map=np.zeros((4, 10), np.int64))
