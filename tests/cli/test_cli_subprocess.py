"""The installed ``modelgraft`` console script, run as a real subprocess (one per scenario)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import LlamaConfig

pytestmark = pytest.mark.slow  # each scenario starts a fresh interpreter (torch + transformers)

_SCRIPT = Path(sys.executable).with_name("modelgraft")


def _cli(
    *argv: str, cwd: Path | None = None, extra_path: Path | None = None
) -> subprocess.CompletedProcess[str]:
    # The console script when installed (make setup / pip install -e .), else the module entry point.
    command = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "modelgraft"]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(extra_path), env.get("PYTHONPATH")) if p)
    return subprocess.run([*command, *argv], capture_output=True, text=True, cwd=cwd, env=env, check=False)


@pytest.fixture(scope="module")
def llama_70b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A full-size 70B Llama config.json (no weights)."""
    folder = tmp_path_factory.mktemp("llama-70b")
    LlamaConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(folder)
    return folder


def test_inspect_a_full_size_config_json(llama_70b: Path) -> None:
    done = _cli("inspect", str(llama_70b), "--json", "--key", ".*Attention$", "--key", "LlamaMLP")
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["num_parameters"] == 70_553_706_496
    counts = {c["class"]: c["count"] for c in info["classes"]}
    assert counts["LlamaDecoderLayer"] == 80 and counts["LlamaRMSNorm"] == 161
    attn = next(c for c in info["classes"] if c["class"] == "LlamaAttention")
    assert attn["parameters"]["k_proj.weight"] == [1024, 8192]  # 8 KV heads of 128
    assert attn["winner"]["key"] == ".*Attention$"


def test_explain_prints_the_rules_table() -> None:
    done = _cli("explain", "LlamaAttention", "--key", ".*Attention", "--key", "LlamaAttention")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "`LlamaAttention` is replaced: key `LlamaAttention` wins."
    assert "pattern matches but exact key `LlamaAttention` wins" in done.stdout


def test_verify_passes_with_a_ready_made_graft() -> None:
    done = _cli("verify", "llama", "--graft", "modelgraft.grafts:fused_qkv")
    assert done.returncode == 0, done.stdout + done.stderr
    for name in ("builds", "all_weights_loaded", "logits_match", "hidden_states_match", "save_roundtrip"):
        assert any(line.startswith(name) and " PASS " in line for line in done.stdout.splitlines()), name
    assert done.stdout.rstrip().endswith("all 5 checks passed")


def test_verify_exits_1_when_a_check_fails(tmp_path: Path) -> None:
    (tmp_path / "half_graft.py").write_text(
        "from modelgraft.grafts import fused_qkv\n\nMAPPING_ONLY = fused_qkv('llama').mapping\n"
    )
    done = _cli("verify", "llama", "--graft", "half_graft:MAPPING_ONLY", "--json", extra_path=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    result = json.loads(done.stdout)
    verdicts = {c["name"]: c["passed"] for c in result["checks"]}
    assert result["passed"] is False
    assert verdicts["builds"] is True and verdicts["all_weights_loaded"] is False


def test_a_bad_target_exits_2() -> None:
    done = _cli("inspect", "not_a_model_type", "--json")
    assert done.returncode == 2
    assert "`not_a_model_type` is neither a local path nor a model type" in json.loads(done.stdout)["error"]


def _module_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """``python -m modelgraft``: the other entry point, same program."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-m", "modelgraft", *argv], capture_output=True, text=True, env=env, check=False
    )


def test_usage_errors_under_json_are_one_json_line_and_exit_2() -> None:
    for done in (_cli("--json"), _module_cli("inspect", "--json", "--bogus", "x")):
        assert done.returncode == 2, done.stdout + done.stderr
        assert "Traceback" not in done.stderr
        assert done.stdout.count("\n") == 1
        assert json.loads(done.stdout)["error"].startswith("UsageError: ")


def test_a_refused_config_exits_2_without_a_traceback(tmp_path: Path) -> None:
    LlamaConfig(num_hidden_layers=1, hidden_size=32, architectures=["Trainer"]).save_pretrained(tmp_path)
    done = _cli("verify", str(tmp_path))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == "" and "Traceback" not in done.stderr
    # the last line of stderr is ours (a library may log above it while importing)
    assert done.stderr.splitlines()[-1].startswith(
        "modelgraft verify: error: `Trainer` (named in the config's"
    )
    done = _cli("inspect", str(tmp_path / "missing"), "--json")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert json.loads(done.stdout)["error"].endswith(
        "does not exist; expected a checkpoint folder, a "
        "`config.json` file, or a model type such as `llama` "
        "(only local paths are read)."
    )
