"""The modelgraft command line, run in process through ``main(argv)`` (output and exit codes)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

import modelgraft
from modelgraft.cli import main


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_inspect_json_lists_classes_counts_paths_shapes_and_matching_keys(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = _run(
        capsys,
        "inspect",
        "llama",
        "--json",
        "--key",
        ".*Attention",
        "--key",
        "LlamaAttention",
        "--key",
        "Nope$",
    )
    assert code == 0
    info = json.loads(out)
    assert info["model_class"] == "LlamaForCausalLM"
    by_class = {c["class"]: c for c in info["classes"]}
    attn = by_class["LlamaAttention"]
    assert attn["count"] == LlamaConfig().num_hidden_layers
    assert attn["examples"][0] == "model.layers.0.self_attn"
    assert attn["parameters"]["q_proj.weight"] == [4096, 4096]
    assert attn["matching_keys"] == ["LlamaAttention", ".*Attention"]
    assert attn["winner"]["key"] == "LlamaAttention"  # exact beats pattern
    assert by_class["LlamaMLP"]["matching_keys"] == []
    assert by_class["Linear"]["patchable"] is False and by_class["Linear"]["matching_keys"] == []
    assert by_class["SiLUActivation"]["patchable"] is False  # transformers.activations: not swapped at load
    assert info["keys_matching_nothing"] == ["Nope$"]


def test_inspect_reads_a_config_json_folder(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    LlamaConfig(
        num_hidden_layers=3, hidden_size=64, intermediate_size=128, num_attention_heads=4
    ).save_pretrained(tmp_path)
    code, out, _ = _run(capsys, "inspect", str(tmp_path))
    assert code == 0
    assert re.search(r"^LlamaDecoderLayer +3 +model\.layers\.0 ", out, re.MULTILINE)
    header = out.splitlines()[1].split()
    assert header == ["CLASS", "COUNT", "EXAMPLE", "PARAMETERS", "KEYS"]


def test_inspect_sees_registered_patches(capsys: pytest.CaptureFixture[str]) -> None:
    modelgraft.register_patch_mapping({".*MLP$": torch.nn.Identity})
    code, out, _ = _run(capsys, "inspect", "llama", "--json")
    assert code == 0
    mlp = next(c for c in json.loads(out)["classes"] if c["class"] == "LlamaMLP")
    assert mlp["winner"] == {"key": ".*MLP$", "replacement": "torch.nn.modules.linear.Identity"}


def test_explain_says_which_key_wins_and_why(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(
        capsys, "explain", "MistralAttention", "--key", ".*Attention", "--key", "Mistral.*", "--json"
    )
    assert code == 0
    info = json.loads(out)
    assert info["winner"]["key"] == ".*Attention"
    reasons = {c["key"]: c["reason"] for c in info["candidates"]}
    assert reasons[".*Attention"] == "first matching pattern"
    assert "`.*Attention` is tried first" in reasons["Mistral.*"]

    code, out, _ = _run(capsys, "explain", "MT5Attention", "--key", "T5Attention")
    assert code == 0
    assert "`MT5Attention` is not replaced" in out
    assert "exact name differs" in out


def test_explain_with_a_graft_bundle(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "my_grafts.py").write_text(
        "from modelgraft.grafts import fused_qkv\n\nQWEN2 = fused_qkv('qwen2')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, _ = _run(capsys, "explain", "Qwen2Attention", "--graft", "my_grafts:QWEN2")
    assert code == 0
    assert "is replaced by modelgraft.grafts._fused.FusedQKVQwen2Attention: key `Qwen2Attention` wins" in out


def test_bad_input_exits_2_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "inspect", "no_such_model")
    assert code == 2
    assert "`no_such_model` is neither a local path nor a model type" in err

    code, out, _ = _run(capsys, "explain", "LlamaAttention", "--key", "(", "--json")
    assert code == 2
    assert "not a valid regular expression" in json.loads(out)["error"]

    code, _, err = _run(capsys, "verify", "llama", "--graft", "modelgraft.grafts:no_such_graft")
    assert code == 2
    assert "has no attribute `no_such_graft`" in err
    assert modelgraft.get_patch_mapping() == {}


def test_verify_failure_exits_1(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "broken_graft.py").write_text(
        "from transformers.models.llama.modeling_llama import LlamaAttention\n\n\n"
        "class Scaled(LlamaAttention):\n"
        "    def forward(self, *args, **kwargs):\n"
        "        out, weights = super().forward(*args, **kwargs)\n"
        "        return out * 2, weights\n\n\n"
        "GRAFT = {'LlamaAttention': Scaled}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, _ = _run(capsys, "verify", "llama", "--graft", "broken_graft:GRAFT", "--json")
    assert code == 1
    verdicts = {c["name"]: c["passed"] for c in json.loads(out)["checks"]}
    assert verdicts["logits_match"] is False and verdicts["builds"] is True
