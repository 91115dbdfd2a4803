"""vLLM/SGLang adapters and RoutingTrace storage (issue 4, point 6 and the trace format).

Engine output is synthetic, built to the documented conventions: ``(num_tokens - 1,
num_hidden_layers, top_k)`` int32 per request, dense layers' rows zero, SGLang as base64 int32.
"""

from __future__ import annotations

import base64
import itertools

import numpy as np
import pytest
import torch

from modelgraft import RoutingError
from modelgraft.moe import RoutingTrace, from_sglang, from_vllm, join_routes, moe_layers, replay_routing
from moe_families import build_tiny

LENGTHS = [5, 3]  # tokens per request: prompt + completion


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    # Layer 0 dense, layers 1 and 2 MoE: vLLM rows for layer 0 are zeros and must be dropped.
    return build_tiny("qwen3_moe", num_hidden_layers=3, mlp_only_layers=[0])


def _engine_output(lengths: list[int], dtype: np.dtype = np.int32, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        routes = np.zeros((n - 1, 3, 2), dtype=dtype)
        for row in range(n - 1):
            for layer in (1, 2):
                routes[row, layer] = rng.choice(8, size=2, replace=False)
        out.append(routes)
    return out


def test_moe_layers_come_from_the_model(model: torch.nn.Module) -> None:
    assert [layer.layer_id for layer in moe_layers(model)] == [1, 2]


@pytest.mark.parametrize("dtype", [np.int32, np.int16, np.uint8])
@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_from_vllm_lays_out_the_padded_batch(
    model: torch.nn.Module, dtype: np.dtype, padding_side: str
) -> None:
    engine = _engine_output(LENGTHS, dtype)
    trace = from_vllm(engine, model, input_lengths=LENGTHS, padding_side=padding_side)
    assert trace.layer_ids == [1, 2] and trace.top_k == 2 and trace.num_experts == 8
    assert len(trace) == 2 and trace.num_tokens == 2 * max(LENGTHS)
    seq = max(LENGTHS)
    for j, layer in enumerate((1, 2)):
        grid = trace[j].reshape(2, seq, 2)
        for i, n in enumerate(LENGTHS):
            real = grid[i, seq - n :] if padding_side == "left" else grid[i, :n]
            assert torch.equal(real[: n - 1], torch.from_numpy(engine[i][:, layer].astype(np.int64)))
            assert real[n - 1].unique().numel() == 2  # the filled last token: two distinct valid experts
        pads = grid[1, : seq - LENGTHS[1]] if padding_side == "left" else grid[1, LENGTHS[1] :]
        assert pads.unique().numel() == 4  # 2 pad rows, spread over 4 different experts

    ids = torch.ones(2, seq, dtype=torch.long)
    mask = torch.zeros(2, seq, dtype=torch.long)
    for i, n in enumerate(LENGTHS):
        mask[i, seq - n :] = 1 if padding_side == "left" else 0
        mask[i, :n] = 1 if padding_side == "right" else mask[i, :n]
    with torch.no_grad(), replay_routing(model, trace):
        model(input_ids=ids, attention_mask=mask, use_cache=False)


def test_from_vllm_accepts_full_rows_and_an_attention_mask(model: torch.nn.Module) -> None:
    engine = [np.concatenate([r, np.ones((1, 3, 2), np.int32)]) for r in _engine_output(LENGTHS)]
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    trace = from_vllm(engine, model, attention_mask=mask)
    assert torch.equal(trace[0].reshape(2, 5, 2)[1, 2:], torch.from_numpy(engine[1][:, 1].astype(np.int64)))


def test_from_vllm_row_count_error(model: torch.nn.Module) -> None:
    engine = _engine_output([5, 3])
    with pytest.raises(RoutingError, match=r"request 1 have 2 rows but the request has 4 tokens; expected 3"):
        from_vllm(engine, model, input_lengths=[5, 4])


def test_from_vllm_layer_axis(model: torch.nn.Module) -> None:
    moe_only = [r[:, 1:] for r in _engine_output(LENGTHS)]  # TensorRT-LLM style: MoE layers only
    assert torch.equal(
        from_vllm(moe_only, model, input_lengths=LENGTHS)[1],
        from_vllm(_engine_output(LENGTHS), model, input_lengths=LENGTHS)[1],
    )
    with pytest.raises(RoutingError, match=r"request 0 have 4 layers; expected num_hidden_layers=3"):
        from_vllm([np.zeros((4, 4, 2), np.int32)], model, input_lengths=[5])


def test_from_vllm_rejects_floats_and_bad_ids(model: torch.nn.Module) -> None:
    with pytest.raises(RoutingError, match=r"request 0 must be an integer array .* got `torch.float32`"):
        from_vllm([np.zeros((4, 3, 2), np.float32)], model, input_lengths=[5])
    bad = _engine_output([5])
    bad[0][1, 2, 0] = -1
    with pytest.raises(RoutingError, match=r"must lie in 0..7; found -1"):
        from_vllm(bad, model, input_lengths=[5])


def test_from_vllm_refuses_repeated_layer_ids() -> None:
    with pytest.raises(
        RoutingError, match=r"several routing sites per decoder layer \(layer ids \[0, 0, 1, 1\]\)"
    ):
        from_vllm(_engine_output([5]), moe_layer_ids=[0, 0, 1, 1], num_experts=8, input_lengths=[5])


def test_from_vllm_needs_layer_information() -> None:
    with pytest.raises(RoutingError, match=r"Pass `model`, or `moe_layer_ids` and `num_experts`"):
        from_vllm(_engine_output([5]), input_lengths=[5])


def test_from_sglang_decodes_base64(model: torch.nn.Module) -> None:
    engine = _engine_output(LENGTHS)
    payloads = [base64.b64encode(r.astype("<i4").tobytes()).decode() for r in engine]
    expected = from_vllm(engine, model, input_lengths=LENGTHS)
    got = from_sglang([payloads[0], {"routed_experts": payloads[1]}], model, input_lengths=LENGTHS)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    with pytest.raises(RoutingError, match=r"request 0 holds 3 ids, not a multiple of .* = 6"):
        from_sglang([base64.b64encode(np.zeros(3, "<i4").tobytes())], model, input_lengths=[2])


def test_trace_save_load_round_trip(tmp_path) -> None:
    trace = RoutingTrace(
        [torch.tensor([[0, 7], [3, 2]]), torch.tensor([[1, 4], [5, 6]])],
        layer_ids=[1, 3],
        top_k=2,
        num_experts=8,
        model_type="deepseek_v3",
        layer_names=["model.layers.1.mlp.gate", "model.layers.3.mlp.gate"],
    )
    path = tmp_path / "routing.safetensors"
    trace.save(path)
    loaded = RoutingTrace.load(path)
    assert (loaded.layer_ids, loaded.top_k, loaded.num_experts, loaded.model_type) == (
        [1, 3],
        2,
        8,
        "deepseek_v3",
    )
    assert loaded.layer_names == trace.layer_names
    # Ids come back in the smallest dtype that holds 8 experts (issue 11, point 5).
    assert all(torch.equal(a.long(), b) and a.dtype == torch.uint8 for a, b in zip(loaded.layers, trace))


def test_trace_load_rejects_other_files(tmp_path) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "weights.safetensors"
    save_file({"w": torch.zeros(2)}, str(path))
    with pytest.raises(RoutingError, match=r"is not a modelgraft routing trace"):
        RoutingTrace.load(path)


def test_trace_constructor_checks() -> None:
    with pytest.raises(RoutingError, match=r"2 layer tensors but 1 `layer_ids`"):
        RoutingTrace([torch.zeros(1, 2, dtype=torch.long)] * 2, layer_ids=[0])
    with pytest.raises(RoutingError, match=r"layer `0` must be a 2-D integer tensor"):
        RoutingTrace([torch.zeros(3)])


# ---- multi-turn incremental transfer (vLLM routed_experts_prompt_start, SGLang routed_experts_start_len)
def _turns(total: int, cuts: list[int], seed: int = 3) -> tuple[np.ndarray, list[tuple[int, np.ndarray]]]:
    """The whole route array of one request, and its parts as an engine sends them turn by turn."""
    whole = _engine_output([total + 1], seed=seed)[0]  # `total` routed rows
    bounds = [0, *cuts, total]
    return whole, [(a, whole[a:b]) for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize("cuts", [[3], [2, 5], [1, 2, 3, 4]])
def test_join_routes_rebuilds_the_whole_request_in_any_order(cuts: list[int]) -> None:
    whole, parts = _turns(7, cuts)
    joined = join_routes(list(reversed(parts)))
    assert torch.equal(joined, torch.from_numpy(whole.astype(np.int64)))


def test_joined_turns_feed_from_vllm_like_a_whole_array(model: torch.nn.Module) -> None:
    whole, parts = _turns(LENGTHS[0] - 1, [2])
    rest = _engine_output(LENGTHS[1:], seed=9)
    direct = from_vllm([whole, *rest], model, input_lengths=LENGTHS)
    joined = from_vllm([join_routes(parts), *rest], model, input_lengths=LENGTHS)
    assert all(torch.equal(a, b) for a, b in zip(direct, joined))


def test_join_routes_checks_rows_sent_twice() -> None:
    whole, _ = _turns(6, [])
    again = whole[2:5].copy()
    assert torch.equal(
        join_routes([(0, whole[:4]), (2, again)]), torch.from_numpy(whole[:5].astype(np.int64))
    )
    again[1, 1] = (again[1, 1] + 1) % 8  # token 3 routed differently the second time
    with pytest.raises(RoutingError, match="Token 3 was routed differently"):
        join_routes([(0, whole[:4]), (2, again)])
    kept = join_routes([(0, whole[:4]), (2, again)], overlap="last")
    assert torch.equal(kept[3], torch.from_numpy(again[1].astype(np.int64)))


@pytest.mark.parametrize(
    ("parts", "message"),
    [
        (lambda w: [(0, w[:2]), (3, w[3:])], r"Rows for tokens \[2, 3\) are missing"),
        (lambda w: [(1, w[1:])], r"rows for tokens \[0, 1\) are missing"),
        (lambda w: [(0, w[:2]), (2, w[2:, :1])], r"every part must be \(rows, 3, 2\)"),
        (lambda w: [], "at least one"),
    ],
)
def test_join_routes_errors_name_the_problem(parts, message: str) -> None:
    whole, _ = _turns(6, [])
    with pytest.raises(RoutingError, match=message):
        join_routes(parts(whole))


# ---- issue 10, point 15: malformed SGLang payloads
@pytest.mark.parametrize(
    ("payload", "match"),
    [
        ("AAAA*AAA", r"request 0 is not valid base64"),
        ("AAAAA", r"request 0 is not valid base64"),
        (
            base64.b64encode(b"\x01\x00\x00\x00\x02\x00").decode(),
            r"request 0 decodes to 6 bytes, not a whole number of int32",
        ),
        ("", r"request 0 is empty"),
        (3.5, r"request 0 must be a base64 string"),
        ({"other": "AAAA"}, r"Request 0's `meta_info` has no `routed_experts`"),
    ],
)
def test_from_sglang_refuses_malformed_payloads(model: torch.nn.Module, payload: object, match: str) -> None:
    with pytest.raises(RoutingError, match=match):
        from_sglang([payload], model, input_lengths=[2])


def test_from_vllm_refuses_an_all_zero_moe_layer_unless_allowed(model: torch.nn.Module) -> None:
    engine = _engine_output(LENGTHS)
    for routes in engine:
        routes[:, 2] = 0  # layer 2 (MoE) never captured, e.g. another pipeline stage's
    with pytest.raises(RoutingError, match=r"Every routed expert id of MoE layer `2` is 0 in every request"):
        from_vllm(engine, model, input_lengths=LENGTHS)
    trace = from_vllm(engine, model, input_lengths=LENGTHS, allow_all_zero=True)
    assert not bool(trace[1][:4].any())  # request 0's four routed rows, as sent
