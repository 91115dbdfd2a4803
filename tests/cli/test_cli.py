"""The modelgraft command line, run in process through ``main(argv)`` (output and exit codes).

Unit tests of ``modelgraft.cli`` (their own file): they import it directly, the one exception to
tests using public names only (issue 14); everything else comes from the public namespaces.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

import modelgraft
from modelgraft import get_checkpoint_conversion_mapping
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
    # the first line names the target (folded to 100 columns when its path is long), then the table
    header = next(line for line in out.splitlines() if line.startswith("CLASS ")).split()
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


def test_verify_adds_several_grafts_together(capsys: pytest.CaptureFixture[str]) -> None:
    # Each --graft is one graft; verify gets their sum, as `verify(target, a + b)` (issue 21: 1).
    argv = [
        "verify",
        "llama",
        "--graft",
        "modelgraft.grafts:fused_qkv",
        "--graft",
        "modelgraft.grafts:fused_gate_up",
    ]
    code, out, _ = _run(capsys, *argv, "--json")
    assert code == 0
    builds = json.loads(out)["checks"][0]
    assert builds["name"] == "builds" and builds["passed"] is True
    assert "LlamaAttention -> FusedQKVLlamaAttention x2" in builds["detail"]
    assert "LlamaMLP -> FusedGateUpLlamaMLP x2" in builds["detail"]
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


# ---- bad input: exit 2, one line, valid JSON under --json, never a traceback (issue 10, item 14) ---------


def _assert_refused(code: int, out: str, err: str, json_mode: bool, match: str) -> str:
    """Exit code 2 and exactly one line saying why: a JSON object on stdout, or text on stderr."""
    assert code == 2, (out, err)
    assert "Traceback" not in out + err
    if json_mode:
        assert out.endswith("\n") and out.count("\n") == 1, out
        message = json.loads(out)["error"]
    else:
        assert out == ""
        assert err.endswith("\n") and err.count("\n") == 1, err
        message = err
        assert message.startswith("modelgraft")
    assert re.search(match, message), message
    return message


def _tiny_folder(folder: Path, **edits: object) -> Path:
    """A folder holding only a config.json: the tiny llama config with ``edits`` applied (None removes)."""
    from modelgraft.testing import tiny_config

    data = tiny_config("llama").to_dict()
    for key, value in edits.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(data))
    return folder


def _bad_targets(root: Path) -> dict[str, tuple[Path, str]]:
    """name -> (target, pattern its error message matches)."""
    (root / "no-config").mkdir(parents=True)
    (root / "malformed").mkdir()
    (root / "malformed" / "config.json").write_text('{"model_type": "llama", ')
    (root / "file.json").write_text('{"model_type": "llama", "hidden_size": ')
    not_model = r"not a transformers model class \(a `PreTrainedModel` subclass\)"
    # the config loads but the model cannot be built from it (where depends on the transformers line)
    unbuildable = (
        r"`(LlamaForCausalLM|BertForMaskedLM)` could not be built|is not a valid transformers config"
    )
    return {
        "missing": (root / "does" / "not" / "exist", r"`[^`]*does/not/exist` does not exist"),
        "no-config": (root / "no-config", r"folder without a `config.json`"),
        "malformed-json": (root / "malformed", r"config"),
        "malformed-json-file": (root / "file.json", r"not a readable JSON config"),
        # 5.x validates config values when it reads them, 4.57 only when the model is built
        "string-value": (_tiny_folder(root / "str", hidden_size="abc"), unbuildable),
        "zero-heads": (_tiny_folder(root / "zero", num_attention_heads=0), unbuildable),
        "negative-vocab": (_tiny_folder(root / "neg", vocab_size=-5), unbuildable),
        "other-family": (_tiny_folder(root / "other", architectures=["BertForMaskedLM"]), unbuildable),
        "unknown-model-type": (_tiny_folder(root / "unk", model_type="no_such_type"), r"no_such_type"),
        "no-model-type": (_tiny_folder(root / "nomt", model_type=None), r"model_type"),
        "trainer": (_tiny_folder(root / "tr", architectures=["Trainer"]), rf"`Trainer`.*{not_model}"),
        "tokenizer": (
            _tiny_folder(root / "tok", architectures=["AutoTokenizer"]),
            rf"`AutoTokenizer`.*{not_model}",
        ),
        "auto-class": (
            _tiny_folder(root / "auto", architectures=["AutoModel"]),
            rf"`AutoModel`.*{not_model}",
        ),
        "function": (_tiny_folder(root / "fn", architectures=["pipeline"]), rf"`pipeline`.*{not_model}"),
        "dunder": (_tiny_folder(root / "dunder", architectures=["__class__"]), rf"`__class__`.*{not_model}"),
        "architectures-string": (
            _tiny_folder(root / "archstr", architectures="LlamaForCausalLM"),
            r"`architectures`.*expected a list of class names",
        ),
    }


@pytest.fixture(scope="module")
def bad_targets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    targets = _bad_targets(tmp_path_factory.mktemp("bad-targets"))
    assert sorted(targets) == sorted(_BAD_TARGET_NAMES)  # the parametrisation below covers each one
    return targets


_BAD_TARGET_NAMES = [
    "missing",
    "no-config",
    "malformed-json",
    "malformed-json-file",
    "string-value",
    "zero-heads",
    "negative-vocab",
    "other-family",
    "unknown-model-type",
    "no-model-type",
    "trainer",
    "tokenizer",
    "auto-class",
    "function",
    "dunder",
    "architectures-string",
]


@pytest.mark.parametrize("json_mode", [False, True], ids=["text", "json"])
@pytest.mark.parametrize("command", ["inspect", "verify"])
@pytest.mark.parametrize("case", _BAD_TARGET_NAMES)
def test_a_bad_target_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str],
    bad_targets: dict[str, tuple[Path, str]],
    case: str,
    command: str,
    json_mode: bool,
) -> None:
    target, match = bad_targets[case]
    argv = [command, str(target), *(["--json"] if json_mode else [])]
    code, out, err = _run(capsys, *argv)
    _assert_refused(code, out, err, json_mode, match)
    assert modelgraft.get_patch_mapping() == {}


@pytest.mark.parametrize("json_mode", [False, True], ids=["text", "json"])
@pytest.mark.parametrize(
    ("argv", "match"),
    [
        ([], r"required: COMMAND"),
        (["nosuchcommand"], r"invalid choice: 'nosuchcommand'"),
        (["inspect"], r"required: MODEL_TYPE_OR_PATH"),
        (["explain"], r"required: CLASS_NAME"),
        (["verify"], r"required: MODEL_TYPE_OR_PATH"),
        (["inspect", "llama", "--bogus"], r"unrecognized arguments: --bogus"),
        (["verify", "llama", "--atol", "abc"], r"argument --atol: invalid float value: 'abc'"),
        (["verify", "llama", "--seed", "1.5"], r"argument --seed: invalid int value: '1.5'"),
        (["explain", "LlamaAttention", "--key"], r"argument --key: expected one argument"),
        (["inspect", "llama", "--js"], r"unrecognized arguments: --js"),  # no abbreviations
    ],
    ids=[
        "nothing",
        "unknown-command",
        "inspect",
        "explain",
        "verify",
        "unknown-flag",
        "atol",
        "seed",
        "key-value",
        "abbreviation",
    ],
)
def test_usage_errors_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], match: str, json_mode: bool
) -> None:
    code, out, err = _run(capsys, *argv, *(["--json"] if json_mode else []))
    message = _assert_refused(code, out, err, json_mode, match)
    assert "--help" in message


@pytest.mark.parametrize("json_mode", [False, True], ids=["text", "json"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1e-5"])
def test_verify_refuses_a_non_finite_or_negative_atol(
    capsys: pytest.CaptureFixture[str], value: str, json_mode: bool
) -> None:
    argv = ["verify", "llama", "--graft", "modelgraft.grafts:fused_qkv", f"--atol={value}"]
    code, out, err = _run(capsys, *argv, *(["--json"] if json_mode else []))
    _assert_refused(code, out, err, json_mode, r"`atol` must be a finite number >= 0")


_GRAFT_MODULES = {
    "syntax_error_graft": "def broken(:\n",
    "raising_graft": "raise RuntimeError('boom at import')\n",
    "exiting_graft": "import sys\nsys.exit(1)\n",
    "odd_grafts": (
        "def factory_that_raises():\n    raise RuntimeError('factory boom')\n\n"
        "NOT_A_GRAFT = 42\n"
        "BAD_VALUES = {'LlamaAttention': 3}\n"
        "BAD_KEY = {'(': __import__('torch').nn.Identity}\n"
    ),
}


@pytest.fixture
def graft_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, source in _GRAFT_MODULES.items():
        (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize("json_mode", [False, True], ids=["text", "json"])
@pytest.mark.parametrize("command", ["inspect", "explain", "verify"])
@pytest.mark.parametrize(
    ("flag", "reference", "match"),
    [
        ("--graft", "no_such_module_xyz:GRAFT", r"Could not import module `no_such_module_xyz`"),
        ("--graft", "modelgraft.grafts:no_such_graft", r"has no attribute `no_such_graft`"),
        ("--graft", "no_colon_here", r"not a `package.module:NAME` reference"),
        ("--graft", "syntax_error_graft:X", r"Could not import `syntax_error_graft:X`: SyntaxError"),
        ("--graft", "raising_graft:X", r"Could not import `raising_graft:X`: RuntimeError: boom at import"),
        ("--graft", "exiting_graft:X", r"Could not import `exiting_graft:X`: SystemExit"),
        ("--graft", "odd_grafts:factory_that_raises", r"`odd_grafts:factory_that_raises`.*factory boom"),
        ("--graft", "odd_grafts:NOT_A_GRAFT", r"`odd_grafts:NOT_A_GRAFT` is a `int`"),
        ("--graft", "odd_grafts:BAD_VALUES", r"LlamaAttention"),
        ("--graft", "odd_grafts:BAD_KEY", r"not a valid regular expression"),
        ("--import", "no_such_module_xyz", r"Could not import `no_such_module_xyz` \(from --import\)"),
        ("--import", "raising_graft", r"Could not import `raising_graft` \(from --import\).*boom at import"),
        ("--import", "syntax_error_graft", r"Could not import `syntax_error_graft` \(from --import\)"),
    ],
    ids=[
        "no-module",
        "no-attribute",
        "no-colon",
        "syntax-error",
        "raises",
        "sys-exit",
        "factory-raises",
        "not-a-graft",
        "bad-values",
        "bad-key",
        "import-missing",
        "import-raises",
        "import-syntax",
    ],
)
def test_a_bad_graft_or_import_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str],
    graft_modules: None,
    command: str,
    flag: str,
    reference: str,
    match: str,
    json_mode: bool,
) -> None:
    target = "LlamaAttention" if command == "explain" else "llama"
    code, out, err = _run(capsys, command, target, flag, reference, *(["--json"] if json_mode else []))
    _assert_refused(code, out, err, json_mode, match)
    assert modelgraft.get_patch_mapping() == {}


def test_json_output_stays_one_document_when_a_graft_module_prints(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "chatty_graft.py").write_text(
        "print('hello from a graft module')\nfrom modelgraft.grafts import fused_qkv\nGRAFT = fused_qkv('llama')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, err = _run(capsys, "verify", "llama", "--graft", "chatty_graft:GRAFT", "--json")
    assert code == 0, out + err
    assert json.loads(out)["passed"] is True
    assert "hello from a graft module" in err


_NAN_GRAFT = (
    "from transformers.models.llama.modeling_llama import LlamaAttention\n\n\n"
    "class NaNAttention(LlamaAttention):\n"
    "    def forward(self, *args, **kwargs):\n"
    "        out, weights = super().forward(*args, **kwargs)\n"
    "        out = out.clone()\n"
    "        out[0, 3, 5] = float('nan')\n"
    "        return out, weights\n\n\n"
    "GRAFT = {'LlamaAttention': NaNAttention}\n"
)


def test_verify_fails_on_nan_with_exit_1(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "nan_graft.py").write_text(_NAN_GRAFT)
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, _ = _run(capsys, "verify", "llama", "--graft", "nan_graft:GRAFT", "--json")
    assert code == 1
    result = json.loads(out)
    checks = {c["name"]: c for c in result["checks"]}
    assert result["passed"] is False
    assert checks["logits_match"]["passed"] is False and checks["hidden_states_match"]["passed"] is False
    assert "NaN where the plain model is finite" in checks["logits_match"]["detail"]
    assert "`hidden_states[1]`" in checks["hidden_states_match"]["detail"]

    code, out, _ = _run(capsys, "verify", "llama", "--graft", "nan_graft:GRAFT")
    assert code == 1
    assert re.search(r"^logits_match +FAIL +`logits`: \d+ NaN where the plain model is finite", out, re.M)
    assert "max |diff| 0.00e+00" not in out
    assert out.rstrip().endswith("FAILED: logits_match, hidden_states_match")


# ---- one graft value through --graft (issue 14, point 1; was in tests/integration/test_grafts_value.py)
def test_the_cli_verifies_a_users_graft(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "users_graft.py").write_text(
        "from transformers.models.llama.modeling_llama import LlamaAttention\n"
        "from modelgraft import Concatenate, Graft, WeightConverter\n"
        "from modelgraft.grafts import fused_qkv_class\n\n"
        "NAMES = ['self_attn.q_proj', 'self_attn.k_proj', 'self_attn.v_proj']\n"
        "FUSE = WeightConverter(NAMES, ['self_attn.qkv_proj'], [Concatenate(dim=0)])\n"
        "GRAFT = Graft({'LlamaAttention': fused_qkv_class(LlamaAttention)}, {'llama': [FUSE]})\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["verify", "llama", "--graft", "users_graft:GRAFT", "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    checks = {c["name"]: c["passed"] for c in json.loads(out)["checks"]}
    assert checks and all(checks.values()), checks
    assert modelgraft.get_patch_mapping() == {} and get_checkpoint_conversion_mapping("llama") is None
