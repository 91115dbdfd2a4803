"""transformers' own ``tests/test_monkey_patching.py``, with only its imports pointed at modelgraft.

The file is not copied into this repository: it is taken at test time from the sdist of the
installed transformers on PyPI (``pip download --no-deps --no-binary :all: transformers==<version>``,
kept in a cache folder), its ``from transformers.monkey_patching import (...)`` line is rewritten
to ``from modelgraft import (...)``, and it runs under pytest in a subprocess. Every upstream test
must pass, except the deliberate differences named in ``DELIBERATE`` (each explained in
docs/porting.md). Skipped with the reason printed when the sdist cannot be obtained, and on
transformers 4.57 (which has no ``monkey_patching``).

``MODELGRAFT_TRANSFORMERS_SDIST`` may name a local copy of the sdist (an offline machine).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import transformers

from _versions import IS_V5

pytestmark = pytest.mark.skipif(not IS_V5, reason="transformers 4.57 has no `monkey_patching` (5.x only)")

UPSTREAM = "tests/test_monkey_patching.py"
IMPORT_FROM = "from transformers.monkey_patching import ("
IMPORT_TO = "from modelgraft import ("

# Upstream tests that fail by design, with the reason (kept in sync with docs/porting.md).
DELIBERATE = {
    "test_apply_patches_context_manager": (
        "swaps a class in a made-up module `transformers.test_module`: modelgraft swaps only modeling and "
        "integrations modules of transformers (plus prefixes added with `add_scope_prefix`)"
    ),
    "test_pattern_matching_wildcard": "same scope difference (`transformers.test_pattern`)",
    "test_exact_match_precedence_over_pattern": "same scope difference (`transformers.test_precedence`)",
}


def _cache_dir() -> Path:
    base = Path(os.environ.get("TMPDIR") or tempfile.gettempdir())
    folder = base / "modelgraft-upstream-cache"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _sdist() -> Path:
    version = transformers.__version__
    given = os.environ.get("MODELGRAFT_TRANSFORMERS_SDIST")
    if given:
        if not Path(given).is_file():
            pytest.skip(f"MODELGRAFT_TRANSFORMERS_SDIST={given} is not a file")
        return Path(given)
    cache = _cache_dir()
    name = f"transformers-{version}.tar.gz"
    if (cache / name).is_file():
        return cache / name
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "--timeout",
            "30",
            "--retries",
            "1",
            "-d",
            str(cache),
            f"transformers=={version}",
        ],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0 or not (cache / name).is_file():
        pytest.skip(
            f"could not obtain the transformers {version} sdist from the package index (pip exit "
            f"{result.returncode}): {result.stderr.strip().splitlines()[-1:] or ''}"
        )
    return cache / name


def _ported_test_file(folder: Path) -> Path:
    archive = _sdist()
    with tarfile.open(archive) as tar:
        member = next((m for m in tar.getmembers() if m.name.endswith("/" + UPSTREAM)), None)
        if member is None:
            pytest.skip(f"{archive.name} holds no {UPSTREAM}")
        text = tar.extractfile(member).read().decode()
    assert text.count(IMPORT_FROM) == 1, (
        f"upstream {UPSTREAM} no longer has one `{IMPORT_FROM}` line to rewrite"
    )
    path = folder / "test_monkey_patching.py"
    path.write_text(text.replace(IMPORT_FROM, IMPORT_TO))
    return path


def _outcomes(report: Path) -> dict[str, str]:
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        outcome = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
        outcomes[case.get("name")] = outcome
    return outcomes


def test_upstream_monkey_patching_tests_pass_with_modelgraft(tmp_path):
    path = _ported_test_file(tmp_path)
    report = tmp_path / "report.xml"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            "-c",
            os.devnull,
            f"--junitxml={report}",
            str(path),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert report.is_file(), f"the upstream tests did not run:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    outcomes = _outcomes(report)
    failed = {name for name, outcome in outcomes.items() if outcome == "failed"}
    passed = [name for name, outcome in outcomes.items() if outcome == "passed"]
    print(
        f"\nupstream test_monkey_patching.py (transformers {transformers.__version__}): {len(outcomes)} tests, "
        f"{len(passed)} passed, {len(failed)} failed (deliberate: {sorted(failed & set(DELIBERATE))})"
    )
    assert len(outcomes) >= 14, f"too few upstream tests ran:\n{run.stdout[-3000:]}"
    unexpected = failed - set(DELIBERATE)
    assert not unexpected, (
        f"upstream tests failing against modelgraft: {sorted(unexpected)}\n{run.stdout[-6000:]}"
    )
    assert "skipped" not in outcomes.values(), run.stdout[-3000:]
    # A deliberate difference that passes means docs/porting.md and DELIBERATE are out of date.
    assert failed == set(DELIBERATE) & set(outcomes), (
        f"deliberate differences that now pass: {sorted(set(DELIBERATE) - failed)}"
    )
