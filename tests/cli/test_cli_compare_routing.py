"""`modelgraft compare-routing A B`: two trace files of the same tokens, per layer (issue 20, point 7)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from modelgraft.cli import main
from modelgraft.moe import RoutingTrace


@pytest.fixture
def traces(tmp_path: Path) -> tuple[str, str]:
    engine = RoutingTrace(
        [torch.tensor([[0, 1], [2, 3], [4, 5]]), torch.tensor([[1, 2], [3, 4], [5, 6]])],
        layer_ids=[1, 2],
        top_k=2,
        num_experts=8,
        batch_size=1,
    ).compact()
    trainer = RoutingTrace(
        [torch.tensor([[1, 0], [2, 7], [4, 5]]), torch.tensor([[1, 2], [3, 4], [5, 6]])],
        layer_ids=[1, 2],
        top_k=2,
        num_experts=8,
        batch_size=1,
    ).compact()
    a, b = tmp_path / "engine.safetensors", tmp_path / "trainer.safetensors"
    engine.save(a)
    trainer.save(b)
    return str(a), str(b)


def test_text_report(traces: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare-routing", *traces]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("routing mismatch: 1 of 6 token routes differ (16.7%) over 2 MoE layers")
    assert out[1] == "  layer 1: 1/3 differ (33.3%), overlap 0.833 at (0, 1)"
    assert out[2] == "  layer 2: 0/3 differ (0.0%), overlap 1.000"


def test_json_and_max_rate(traces: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare-routing", *traces, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["mismatch_rate"] == pytest.approx(1 / 6)
    assert [layer["mismatched"] for layer in data["layers"]] == [1, 0]
    assert data["layers"][0]["where"] == [[0, 1]]
    assert main(["compare-routing", *traces, "--max-rate", "0.1"]) == 1
    capsys.readouterr()
    assert main(["compare-routing", *traces, "--max-rate", "0.2"]) == 0


def test_a_bad_file_exits_2_with_one_line(
    traces: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a trace")
    assert main(["compare-routing", traces[0], str(bad), "--json"]) == 2
    data = json.loads(capsys.readouterr().out)
    assert data["error"].startswith("RoutingError: ")
    other = RoutingTrace([torch.zeros(4, 2, dtype=torch.long) + torch.tensor([0, 1])], top_k=2, num_experts=8)
    path = tmp_path / "other.safetensors"
    other.save(path)
    assert main(["compare-routing", traces[0], str(path)]) == 2
    assert "cover different MoE layers" in capsys.readouterr().err
