"""``modelgraft --help`` and usage errors answer before torch or transformers load (issue 30, point 4).

Each scenario runs in a fresh interpreter and reports which heavy modules ``sys.modules`` holds once
``main()`` returned. The CLI module is checked on its own (a bare package object stands in for
``modelgraft/__init__.py``, which loads torch for the library API), then through the real entry
points.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

#: What an answer about arguments alone must not have imported.
HEAVY = ("torch", "transformers", "safetensors", "numpy")

_PROBE = """
import importlib.util, json, sys, types
if {bare_package!r}:
    spec = importlib.util.find_spec("modelgraft")  # finds the package without running its __init__
    package = types.ModuleType("modelgraft")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["modelgraft"] = package
from modelgraft.cli import main
code = main({argv!r})
print(json.dumps({{"code": code, "heavy": [m for m in {heavy!r} if m in sys.modules]}}))
"""


def _probe(argv: list[str], *, bare_package: bool) -> tuple[int, list[str], str, str]:
    code = _PROBE.format(argv=argv, heavy=HEAVY, bare_package=bare_package)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ), check=False
    )
    assert done.returncode == 0, done.stderr
    *printed, last = done.stdout.splitlines()
    report = json.loads(last)
    return report["code"], report["heavy"], "\n".join(printed), done.stderr


ARGUMENT_ONLY = [
    pytest.param(["--help"], 0, "usage: modelgraft", id="help"),
    pytest.param(["inspect", "--help"], 0, "MODEL_TYPE_OR_PATH", id="inspect-help"),
    pytest.param(["compare-routing", "--help"], 0, "--max-rate", id="compare-routing-help"),
    pytest.param(["inspect"], 2, "required: MODEL_TYPE_OR_PATH", id="missing-argument"),
    pytest.param(["inspect", "llama", "--bogus"], 2, "unrecognized arguments: --bogus", id="bad-option"),
    pytest.param(["no-such-command"], 2, "invalid choice", id="bad-command"),
    pytest.param(["verify", "llama", "--atol", "x"], 2, "invalid float value", id="bad-value"),
]


@pytest.mark.parametrize(("argv", "code", "says"), ARGUMENT_ONLY)
def test_the_cli_module_answers_arguments_without_torch(argv: list[str], code: int, says: str) -> None:
    got, heavy, out, err = _probe(argv, bare_package=True)
    assert got == code, out + err
    assert says in (out if code == 0 else err)
    assert heavy == []


def test_a_usage_error_under_json_is_json_without_torch() -> None:
    got, heavy, out, _ = _probe(["inspect", "--json"], bare_package=True)
    assert got == 2 and heavy == []
    assert json.loads(out)["error"].startswith("UsageError: ")


@pytest.mark.slow  # this one loads torch and transformers in its fresh interpreter
def test_commands_still_load_what_they_need() -> None:
    # the same probe runs a command for real: the bare package is enough for the CLI's own imports
    got, heavy, out, err = _probe(["explain", "LlamaAttention", "--key", "Llama.*"], bare_package=True)
    assert got == 0, err
    assert out.splitlines()[0] == "`LlamaAttention` is replaced: key `Llama.*` wins."
    assert "torch" in heavy and "transformers" in heavy


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="`import modelgraft` (the package's __init__) still imports torch and transformers eagerly; "
    "the lazy package import is the other half of issue 30 point 4. Remove this mark when it lands.",
)
@pytest.mark.parametrize(("argv", "code", "says"), ARGUMENT_ONLY[:1] + ARGUMENT_ONLY[4:5])
def test_the_entry_point_answers_arguments_without_torch(argv: list[str], code: int, says: str) -> None:
    got, heavy, out, err = _probe(argv, bare_package=False)
    assert got == code, out + err
    assert heavy == []
