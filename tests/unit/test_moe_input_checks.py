"""Routing data that would replay wrong numbers quietly is refused (issue 19, smaller points).

Each check names what it found and where: all ``-1`` layers and ``expert_map`` entries of ``-1``
(missing routes, not "every id is 0"), negative ids other than ``-1``, a ``.npy`` header whose
``fortran_order`` is not a bool, negative or disagreeing ``input_lengths``, a trace file whose
``batch_size`` was edited, a replay whose forward has another batch layout, repeated layer ids,
``compact_dtype`` of a non-positive count, and a trace saved to a path that cannot be written.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine_payloads import npy_base64, qwen3_moe
from modelgraft import RoutingError
from modelgraft.moe import RoutingTrace, compact_dtype, from_vllm, record_routing, replay_routing

ENGINE = {"moe_layer_ids": [0, 1], "num_experts": 4, "num_hidden_layers": 2}


def _rows(tokens: int, fill: int | None = None) -> np.ndarray:
    """(tokens - 1, 2 layers, top-2) routes: distinct valid ids, or a constant ``fill``."""
    if fill is not None:
        return np.full((tokens - 1, 2, 2), fill, dtype=np.int32)
    return (np.arange((tokens - 1) * 4).reshape(tokens - 1, 2, 2) % 4).astype(np.int32)


def test_an_all_missing_layer_is_a_missing_route_not_an_all_zero_layer() -> None:
    rows = _rows(4)
    rows[:, 1] = -1  # layer 1 never captured
    for missing in ("refuse", "live"):
        with pytest.raises(
            RoutingError, match=r"MoE layer `1` has no route in any request \(every row is -1"
        ):
            from_vllm([rows], input_lengths=[4], missing=missing, **ENGINE)


def test_an_expert_map_entry_of_minus_one_is_a_missing_route() -> None:
    table = np.array([0, 1, 2, 3, -1])  # physical slot 4 has no logical expert
    rows = _rows(3)
    rows[1, 0] = [4, 1]
    with pytest.raises(
        RoutingError,
        match=r"token 1 of decoder layer `0` to physical expert 4, which `expert_map` maps to -1",
    ):
        from_vllm([rows], input_lengths=[3], expert_map=table, **ENGINE)


@pytest.mark.parametrize("bad", [-2, -7])
def test_negative_ids_other_than_minus_one_are_refused(bad: int) -> None:
    trace = RoutingTrace([torch.tensor([[0, 1], [bad, bad]])], top_k=2, num_experts=4, missing="live")
    with pytest.raises(
        RoutingError, match=rf"row 1 = \[{bad}, {bad}\]: only -1 marks a token without a route"
    ):
        trace.compact()
    model = qwen3_moe(num_hidden_layers=1, dense=())
    layers = [torch.tensor([[0, 1], [bad, bad], [2, 3]])]
    with pytest.raises(RoutingError, match=r"only -1 marks a token without a route"):
        with replay_routing(model, layers, missing="live"):
            pass
    rows = _rows(3)
    rows[0, 0] = [bad, bad]
    with pytest.raises(RoutingError, match=rf"found {bad}"):
        from_vllm([rows], input_lengths=[3], missing="live", **ENGINE)


@pytest.mark.parametrize("value", ["0", "1", "None", "'no'"])
def test_an_npy_header_whose_fortran_order_is_not_a_bool_is_refused(value: str) -> None:
    raw = base64.b64decode(npy_base64(_rows(3)))
    size = int.from_bytes(raw[8:10], "little")
    header = (
        raw[10 : 10 + size].decode("latin1").replace("'fortran_order': False", f"'fortran_order': {value}")
    )
    header = header.rstrip("\n").ljust(size - 1) + "\n"
    assert len(header) == size
    payload = base64.b64encode(raw[:10] + header.encode("latin1") + raw[10 + size :]).decode()
    with pytest.raises(
        RoutingError, match=rf"`fortran_order` {value} in their header; expected True or False"
    ):
        from_vllm([payload], input_lengths=[3], **ENGINE)


def test_negative_input_lengths_are_refused() -> None:
    with pytest.raises(
        RoutingError, match=r"`input_lengths` must hold non-negative token counts, one per request; got -3"
    ):
        from_vllm([_rows(3), _rows(3)], input_lengths=[3, -3], **ENGINE)


def test_an_attention_mask_and_input_lengths_that_disagree_are_refused() -> None:
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    with pytest.raises(
        RoutingError, match=r"`attention_mask` and `input_lengths` disagree: mask row 0 has 3"
    ):
        from_vllm([_rows(3), _rows(4)], attention_mask=mask, input_lengths=[4, 4], **ENGINE)
    trace = from_vllm([_rows(3), _rows(4)], attention_mask=mask, input_lengths=[3, 4], **ENGINE)
    assert trace.batch_size == 2 and trace.num_tokens == 8


def test_a_trace_file_whose_batch_size_was_changed_is_refused(tmp_path: Path) -> None:
    trace = RoutingTrace([torch.arange(24).reshape(12, 2) % 8], top_k=2, num_experts=8, batch_size=2)
    path = tmp_path / "routing.safetensors"
    trace.save(path)
    assert RoutingTrace.load(path).batch_size == 2
    with safe_open(str(path), framework="pt") as handle:
        meta, tensors = handle.metadata(), {k: handle.get_tensor(k) for k in handle.keys()}
    edited = tmp_path / "edited.safetensors"
    save_file(tensors, str(edited), metadata={**meta, "batch_size": json.dumps(3)})  # 3 still divides 12
    with pytest.raises(
        RoutingError,
        match=r"metadata `batch_size` 3 and `seq_len` 6 describe 18 rows but tensor `layer.0` has 12",
    ):
        RoutingTrace.load(edited)


def test_a_trace_laid_out_for_another_batch_is_refused_at_the_forward() -> None:
    model = qwen3_moe(num_hidden_layers=1, dense=())
    ids = torch.randint(1, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), record_routing(model) as trace:
        model(input_ids=ids, use_cache=False)
    assert trace.batch_size == 2
    with pytest.raises(
        RoutingError, match=r"lays out 2 sequences of 6 positions, but this forward .* has 3 sequences of 4"
    ):
        with torch.no_grad(), replay_routing(model, trace):
            model(input_ids=ids.reshape(3, 4), use_cache=False)
    with torch.no_grad(), replay_routing(model, trace):  # the same 12 tokens in the recorded layout
        model(input_ids=ids, use_cache=False)


def test_select_layers_refuses_a_layer_given_twice() -> None:
    trace = RoutingTrace([torch.tensor([[0, 1]]), torch.tensor([[2, 3]])], layer_ids=[1, 2])
    with pytest.raises(RoutingError, match=r"`layer_ids` names decoder layer `2` twice"):
        trace.select_layers([2, 2])


@pytest.mark.parametrize("count", [0, -1, -300, True, 2.0])
def test_compact_dtype_refuses_a_count_that_is_not_positive(count: object) -> None:
    with pytest.raises(RoutingError, match=r"`num_experts` must be a positive integer"):
        compact_dtype(count)  # type: ignore[arg-type]


def test_saving_a_trace_to_a_bad_path_names_the_path(tmp_path: Path) -> None:
    trace = RoutingTrace([torch.tensor([[0, 1]])], top_k=2, num_experts=4)
    bad = tmp_path / "missing-dir" / "routing.safetensors"
    with pytest.raises(RoutingError, match=rf"Cannot write the routing trace to `{bad}`"):
        trace.save(bad)
