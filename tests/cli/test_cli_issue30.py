"""The CLI fixes of issue 30, point 5: hints that name what exists, clear refusals, 100 columns.

Unit tests of ``modelgraft.cli`` run in process through ``main(argv)``, like tests/cli/test_cli.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import modelgraft.grafts
from families import Family, family_params
from modelgraft.cli import main
from modelgraft.moe import RoutingTrace

#: The width a terminal has at least (issue 30: the inspect table was 145-172 columns wide).
COLUMNS = 100


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_a_bare_graft_name_gets_a_hint_that_exists(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, command, "llama", "--graft", "fused_qkv")
    assert code == 2
    assert "`modelgraft.grafts:fused_qkv`" in err
    assert "FUSED_QKV`" not in err  # a name modelgraft.grafts does not have
    # every `modelgraft.grafts:NAME` the message suggests resolves to a graft factory
    suggested = [part.split("`")[0] for part in err.split("`modelgraft.grafts:")[1:]]
    assert suggested and all(callable(getattr(modelgraft.grafts, name)) for name in suggested)


def test_an_unknown_bare_name_suggests_the_ready_made_grafts(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "inspect", "llama", "--graft", "no_such_graft")
    assert code == 2
    assert "`no_such_graft` is not a `package.module:NAME` reference" in err
    assert "`modelgraft.grafts:fused_qkv`" in err and "FUSED_QKV`" not in err


@pytest.mark.parametrize("as_json", [False, True])
def test_verify_says_clearly_that_a_family_is_not_supported(
    as_json: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["verify", "bert", "--graft", "modelgraft.grafts:fused_qkv", *(["--json"] if as_json else [])]
    code, out, err = _run(capsys, *argv)
    with pytest.raises(modelgraft.UnsupportedFamilyError) as api:
        modelgraft.grafts.fused_qkv("bert")  # what the Python API says
    assert code == 2  # the graft cannot apply: not a failed check of a graft that ran
    message = json.loads(out)["error"] if as_json else err.strip()
    assert str(api.value) in message
    assert "no attention of `bert`" in message.lower()
    assert "LlamaAttention" not in message  # not the 37 keys of the other families


def test_inspect_keeps_refusing_a_family_a_graft_cannot_apply_to(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "inspect", "bert", "--graft", "modelgraft.grafts:fused_qkv")
    assert code == 2
    assert "the fused QKV graft cannot apply" in err


def _inspect_both(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[dict, list[str]]:
    code, out, err = _run(capsys, "inspect", *argv, "--json")
    assert code == 0, out + err
    info = json.loads(out)
    code, out, err = _run(capsys, "inspect", *argv)
    assert code == 0, err
    return info, out.splitlines()


def _table(lines: list[str]) -> list[dict[str, str]]:
    """The inspect table read back: a row per class, its wrapped cells joined again.

    Columns start where the header's words start; a line with an empty CLASS cell continues the
    row above it.
    """
    at = next(i for i, line in enumerate(lines) if line.startswith("CLASS "))
    header = lines[at]
    names = header.split()
    starts = [header.index(name) for name in names]
    rows: list[dict[str, list[str]]] = []
    for line in lines[at + 1 :]:
        if not line.startswith(" ") and len(line.split()) < 2:
            break  # the table ended (a line after it)
        if line.startswith("keys matching no class here"):
            break
        cells = [line[a:b].strip() for a, b in zip(starts, [*starts[1:], None])]
        if cells[0]:
            rows.append({n: [c] for n, c in zip(names, cells)})
        else:
            for n, c in zip(names, cells):
                rows[-1][n].append(c)
    # A cell continues either after a space (dropped by strip) or mid-word: both are joined by
    # the reader; the test compares without spaces.
    return [{n: "".join("".join(parts).split()) for n, parts in row.items()} for row in rows]


@pytest.mark.parametrize("family", family_params(kinds={"decoder", "moe"}))
def test_inspect_fits_in_100_columns(
    family: Family, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    keys = ["--key", ".*Attention$", "--key", ".*(MLP|Experts|SparseMoeBlock)$", "--key", ".*Norm"]
    # The full-size default config (the widest shapes a user sees); a few transformers defaults
    # cannot be built at all (a None that the model's code divides by), for those the tiny config.
    target = family.model_type
    if main(["inspect", target, "--json"]) == 2 and "could not be built" in capsys.readouterr().out:
        family.config().save_pretrained(tmp_path)
        target = str(tmp_path)
        if main(["inspect", target, "--json"]) == 2:
            # granitemoehybrid on 4.57: its constructor sets data on parameters the meta build made
            pytest.skip(f"inspect cannot build `{family.model_type}` here: {capsys.readouterr().out}")
    capsys.readouterr()
    info, lines = _inspect_both(capsys, target, *keys)
    too_wide = [line for line in lines if len(line) > COLUMNS]
    assert not too_wide, f"{len(too_wide)} lines over {COLUMNS} columns, widest {max(map(len, too_wide))}"
    table = _table(lines)
    # one row per class, in order, with its count, first path and keys: nothing of the JSON dropped
    assert [row["CLASS"] for row in table] == [c["class"] for c in info["classes"]]
    for row, c in zip(table, info["classes"]):
        assert row["COUNT"] == str(c["count"])
        assert row["EXAMPLE"] == c["examples"][0]
        for key in c["matching_keys"]:
            assert key in row["KEYS"], (c["class"], key)
        if c["winner"] is not None:
            assert f"{c['winner']['key']}(wins)" in row["KEYS"]
        if c["parameters"]:
            name, shape = next(iter(c["parameters"].items()))
            assert row["PARAMETERS"].startswith(f"{name}{'x'.join(map(str, shape))}")


def test_inspect_wraps_long_cells_instead_of_cutting_them(capsys: pytest.CaptureFixture[str]) -> None:
    long_keys = [f"(Llama|QuiteALongPatternNumber{i})Attention$" for i in range(6)]
    argv = ["llama", *(a for key in long_keys for a in ("--key", key))]
    info, lines = _inspect_both(capsys, *argv)
    assert max(map(len, lines)) <= COLUMNS
    attn = next(c for c in info["classes"] if c["class"] == "LlamaAttention")
    assert attn["matching_keys"] == long_keys  # --json keeps every key whole
    row = next(r for r in _table(lines) if r["CLASS"] == "LlamaAttention")
    assert row["KEYS"] == "".join(f"{k}(wins)," if i == 0 else f"{k}," for i, k in enumerate(long_keys))[:-1]


@pytest.fixture
def traces(tmp_path: Path) -> tuple[str, str]:
    """Two traces of 3 tokens over 2 layers: layer 1 differs on 1 token of 3, layer 2 on none."""
    a = RoutingTrace(
        [torch.tensor([[0, 1], [2, 3], [4, 5]]), torch.tensor([[1, 2], [3, 4], [5, 6]])],
        layer_ids=[1, 2],
        top_k=2,
        num_experts=8,
    )
    b = RoutingTrace(
        [torch.tensor([[0, 1], [2, 7], [4, 5]]), torch.tensor([[1, 2], [3, 4], [5, 6]])],
        layer_ids=[1, 2],
        top_k=2,
        num_experts=8,
    )
    a.save(tmp_path / "a.safetensors")
    b.save(tmp_path / "b.safetensors")
    return str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")


def test_compare_routing_json_names_the_largest_layer_rate_and_the_threshold_apart(
    traces: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _run(capsys, "compare-routing", *traces, "--json", "--max-rate", "0.25")
    data = json.loads(out)
    assert code == 0  # 1 of 6 routes differ: 0.167 <= 0.25
    assert "max_rate" not in data  # ambiguous next to --max-rate
    assert data["max_layer_rate"] == pytest.approx(1 / 3)  # layer 1: 1 of 3
    assert data["max_rate_threshold"] == 0.25
    assert data["mismatch_rate"] == pytest.approx(1 / 6)
    assert data["threshold_exceeded"] is False
    code, out, _ = _run(capsys, "compare-routing", *traces, "--json", "--max-rate", "0.1")
    data = json.loads(out)
    assert code == 1 and data["max_rate_threshold"] == 0.1 and data["threshold_exceeded"] is True
    code, out, _ = _run(capsys, "compare-routing", *traces, "--json")
    data = json.loads(out)
    assert code == 0 and data["max_rate_threshold"] is None and data["threshold_exceeded"] is None
