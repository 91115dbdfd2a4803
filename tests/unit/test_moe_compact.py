"""Compact traces (issue 11, point 5): ids in the smallest integer dtype that holds ``num_experts``, in
memory, on disk and over the wire, never truncated."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from engine_payloads import qwen3_moe
from modelgraft import RoutingError
from modelgraft.moe import RoutingTrace, compact_dtype, record_routing, replay_routing


@pytest.mark.parametrize(
    ("experts", "signed", "dtype"),
    [
        (8, False, torch.uint8),
        (256, False, torch.uint8),
        (257, False, torch.int16),
        (128, True, torch.int16),
        (32768, False, torch.int16),
        (32769, False, torch.int32),
    ],
)
def test_compact_dtype_is_the_smallest_that_holds_the_ids(
    experts: int, signed: bool, dtype: torch.dtype
) -> None:
    assert compact_dtype(experts, signed=signed) == dtype
    ids = torch.tensor([[experts - 1, 0]] + ([[-1, -1]] if signed else []))
    trace = RoutingTrace(
        [ids], top_k=2, num_experts=experts, missing="live" if signed else "refuse"
    ).compact()
    assert trace.layers[0].dtype == dtype and torch.equal(trace[0], ids) and trace[0].dtype == torch.long


def test_a_recording_is_compact_and_replays_bit_identically() -> None:
    model = qwen3_moe()
    ids = torch.randint(1, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), record_routing(model) as trace:
        reference = model(input_ids=ids, use_cache=False).logits
    assert [t.dtype for t in trace.layers] == [torch.uint8] * 2 and trace.nbytes == 2 * 14 * 2
    with torch.no_grad(), replay_routing(model, RoutingTrace.from_bytes(trace.to_bytes())):
        replayed = model(input_ids=ids, use_cache=False).logits
    assert torch.equal(replayed, reference) and bool(torch.isfinite(replayed).all())


def test_the_file_and_the_bytes_hold_the_compact_dtype(tmp_path) -> None:
    ids = torch.randint(0, 128, (32, 8), generator=torch.Generator().manual_seed(0))
    trace = RoutingTrace([ids, ids.flip(0)], layer_ids=[3, 5], top_k=8, num_experts=128, batch_size=4)
    path = tmp_path / "routing.safetensors"
    trace.save(path)
    with safe_open(str(path), framework="pt") as handle:
        assert [handle.get_tensor(n).dtype for n in handle.keys()] == [torch.uint8, torch.uint8]
    data = trace.to_bytes()
    assert len(data) == len(path.read_bytes())  # the same safetensors content (key order may differ)
    assert len(data) < 2 * 32 * 8 + 1024  # one byte per id, plus the header
    back = RoutingTrace.from_bytes(data)
    assert back.layer_ids == [3, 5] and back.batch_size == 4 and back.missing == "refuse"
    assert all(torch.equal(a, b) for a, b in zip(back, trace))


def test_minus_one_rows_travel_as_int16_in_a_live_trace() -> None:
    ids = torch.tensor([[-1, -1], [3, 1], [0, 7]])
    trace = RoutingTrace([ids], top_k=2, num_experts=8, missing="live")
    back = RoutingTrace.from_bytes(trace.to_bytes())
    assert back.missing == "live" and back.layers[0].dtype == torch.int16 and torch.equal(back[0], ids)
    with pytest.raises(
        RoutingError, match=r"holds expert id -1, outside 0..7 \(-1 marks a token without a route"
    ):
        RoutingTrace([ids], top_k=2, num_experts=8).to_bytes()


def test_ids_that_do_not_fit_are_refused_never_truncated() -> None:
    with pytest.raises(RoutingError, match=r"Routing for layer `0` holds expert id 300, outside 0..255"):
        RoutingTrace([torch.tensor([[300, 1]])], top_k=2, num_experts=256).compact()
    with pytest.raises(RoutingError, match=r"the routing bytes cannot be read as safetensors"):
        RoutingTrace.from_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(RoutingError, match=r"must be `bytes` \(from `RoutingTrace.to_bytes`\); got `str`"):
        RoutingTrace.from_bytes("abc")  # type: ignore[arg-type]


def test_the_benchmark_trace_size() -> None:
    """32k tokens x 48 layers x top-8 with 128 experts: 12.6 MB compact, 8x less than int64."""
    ids = torch.zeros(32 * 1024, 8, dtype=torch.long)
    ids[:, 1] = 127
    wide = RoutingTrace([ids] * 48, top_k=8, num_experts=128)
    assert wide.nbytes == 100_663_296 and wide.compact().nbytes == 12_582_912
