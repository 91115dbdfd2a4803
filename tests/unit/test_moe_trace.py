"""RoutingTrace.load on tampered files refuses with RoutingError (issue 10, point 13).

Each file below is a valid trace with one thing changed, written with safetensors directly, the way
a corrupted or hand-edited file reaches a trainer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from modelgraft import RoutingError
from modelgraft.moe import RoutingTrace

FORMAT = "modelgraft.routing/1"


def _meta(**changes: Any) -> dict[str, str]:
    meta = {
        "format": FORMAT,
        "layer_ids": json.dumps([0, 1]),
        "layer_names": json.dumps(["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]),
        "top_k": json.dumps(2),
        "num_experts": json.dumps(8),
        "model_type": json.dumps("qwen3_moe"),
    }
    for key, value in changes.items():
        if value is None:
            meta.pop(key)
        else:
            meta[key] = value
    return meta


def _tensors(**changes: Any) -> dict[str, torch.Tensor]:
    tensors = {
        "layer.0": torch.tensor([[0, 7], [3, 2]], dtype=torch.int32),
        "layer.1": torch.tensor([[1, 4], [5, 6]], dtype=torch.int32),
    }
    for key, value in changes.items():
        key = key.replace("_", ".")
        if value is None:
            tensors.pop(key)
        else:
            tensors[key] = value
    return tensors


def _write(tmp_path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> Path:
    path = tmp_path / "routing.safetensors"
    save_file(tensors, str(path), metadata=meta)
    return path


def test_an_untampered_file_loads(tmp_path: Path) -> None:
    loaded = RoutingTrace.load(_write(tmp_path, _tensors(), _meta()))
    assert loaded.layer_ids == [0, 1] and loaded.top_k == 2 and loaded.num_experts == 8
    assert [t.dtype for t in loaded.layers] == [torch.uint8, torch.uint8]  # compact in memory (issue 11)
    assert [t.dtype for t in loaded] == [torch.long, torch.long]  # indexing gives int64
    assert loaded[0].tolist() == [[0, 7], [3, 2]]


@pytest.mark.parametrize(
    ("tensor", "dtype_name"),
    [
        (torch.tensor([[0.0, 7.0], [3.0, 2.0]]), "float32"),
        (torch.tensor([[0.5, 7.0], [3.0, 2.0]], dtype=torch.float16), "float16"),
        (torch.tensor([[True, False], [False, True]]), "bool"),
    ],
)
def test_non_integer_ids_are_refused(tmp_path: Path, tensor: torch.Tensor, dtype_name: str) -> None:
    path = _write(tmp_path, _tensors(layer_1=tensor), _meta())
    with pytest.raises(RoutingError, match=rf"`layer.1` holds `torch.{dtype_name}` ids; expected integers"):
        RoutingTrace.load(path)


@pytest.mark.parametrize(
    ("tensors", "match"),
    [
        (_tensors(layer_1=None), r"tensors \[`layer.0`\] but its metadata names 2 layers"),
        (_tensors(layer_2=torch.zeros(2, 2, dtype=torch.int32)), r"unexpected tensor `layer.2`"),
        (_tensors(extra=torch.zeros(2, 2, dtype=torch.int32)), r"unexpected tensor `extra`"),
        (_tensors(layer_1=torch.zeros(2, 2, 1, dtype=torch.int32)), r"`layer.1` has shape \(2, 2, 1\)"),
        (_tensors(layer_1=torch.tensor([[1, 4, 0], [5, 6, 0]])), r"`layer.1` has 3 columns but top_k=2"),
        (_tensors(layer_1=torch.tensor([[1, 4], [5, 9]])), r"`layer.1` holds expert id 9, outside 0..7"),
        (_tensors(layer_1=torch.tensor([[1, -4], [5, 6]])), r"`layer.1` holds expert id -4, outside 0..7"),
    ],
)
def test_bad_tensors_are_refused(tmp_path: Path, tensors: dict[str, torch.Tensor], match: str) -> None:
    with pytest.raises(RoutingError, match=match):
        RoutingTrace.load(_write(tmp_path, tensors, _meta()))


@pytest.mark.parametrize(
    ("meta", "match"),
    [
        (_meta(layer_ids=None), r"metadata has no `layer_ids`"),
        (_meta(top_k=None), r"metadata has no `top_k`"),
        (_meta(layer_ids="[0, 1"), r"metadata `layer_ids` is not valid JSON"),
        (_meta(layer_ids="[" * 100_000 + "]" * 100_000), r"metadata `layer_ids` is not valid JSON"),
        (_meta(layer_ids="[0, 1.5]"), r"`layer_ids` must be a list of non-negative integers; got \[0, 1.5\]"),
        (_meta(layer_ids="[0, true]"), r"`layer_ids` must be a list of non-negative integers"),
        (_meta(layer_ids='{"a": 1}'), r"`layer_ids` must be a list of non-negative integers"),
        (_meta(layer_ids="[0, -1]"), r"`layer_ids` must be a list of non-negative integers"),
        (_meta(top_k="true"), r"`top_k` must be a positive integer or null; got true"),
        (_meta(top_k="2.0"), r"`top_k` must be a positive integer or null"),
        (_meta(num_experts="0"), r"`num_experts` must be a positive integer or null"),
        (_meta(model_type="5"), r"`model_type` must be a string or null"),
        (_meta(layer_names='["a", 3]'), r"`layer_names` must be a list of strings"),
        (_meta(layer_names='["a"]'), r"`layer_names` has 1 names for 2 layers"),
        (_meta(batch_size='"2"'), r"`batch_size` must be a positive integer or null"),
        (_meta(format=None), r"is not a modelgraft routing trace"),
    ],
)
def test_bad_metadata_is_refused(tmp_path: Path, meta: dict[str, str], match: str) -> None:
    with pytest.raises(RoutingError, match=match):
        RoutingTrace.load(_write(tmp_path, _tensors(), meta))


def test_a_file_that_is_not_safetensors_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "routing.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(RoutingError, match=r"cannot be read as safetensors"):
        RoutingTrace.load(path)


def test_save_refuses_ids_that_int32_would_truncate(tmp_path: Path) -> None:
    trace = RoutingTrace([torch.tensor([[0, 2**31 + 3]])], top_k=2)
    with pytest.raises(RoutingError, match=r"layer `0` holds expert id 2147483651, which int32 cannot store"):
        trace.save(tmp_path / "routing.safetensors")
    assert not (tmp_path / "routing.safetensors").exists()


def test_constructor_refuses_bool_ids() -> None:
    with pytest.raises(RoutingError, match=r"layer `0` must be a 2-D integer tensor"):
        RoutingTrace([torch.ones(2, 2, dtype=torch.bool)])


def test_round_trip_keeps_the_batch_layout(tmp_path: Path) -> None:
    trace = RoutingTrace(
        [torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])], top_k=2, num_experts=8, batch_size=2
    )
    trace.save(tmp_path / "t.safetensors")
    loaded = RoutingTrace.load(tmp_path / "t.safetensors")
    assert loaded.batch_size == 2 and torch.equal(loaded[0], trace[0])
