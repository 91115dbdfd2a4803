"""Install and release hygiene (issue 30, point 3): LICENSE, CHANGELOG, one version, the install section.

What a new user reads before the first ``import``: the files are checked against what the package
metadata declares, so that the two cannot drift apart.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10: the same parser under its old name, where installed
    tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml on Python 3.10 needs tomli")
from packaging.requirements import Requirement
from packaging.version import Version

import modelgraft
from modelgraft._compat._version import SUPPORTED_RANGES, is_supported

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]


def _section(markdown: str, title: str) -> str:
    """The text of the ``## title`` section of ``markdown``, up to the next ``## `` heading."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", markdown, re.MULTILINE | re.DOTALL)
    assert match, f"no `## {title}` section"
    return match.group(1)


def test_the_license_file_is_the_apache_2_text_the_metadata_declares() -> None:
    assert PROJECT["license"] == "Apache-2.0"
    assert PROJECT["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    for clause in (
        "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION",
        "2. Grant of Copyright License.",
        "3. Grant of Patent License.",
        "9. Accepting Warranty or Additional Liability.",
        "END OF TERMS AND CONDITIONS",
    ):
        assert clause in text, clause
    assert len(text.split()) > 1500  # the full text, not a one-line notice


def test_the_version_is_written_once() -> None:
    init = (ROOT / "src" / "modelgraft" / "__init__.py").read_text()
    # no version number written in the package (the fallback of a never-installed tree is `0+unknown`)
    assert not re.search(r"__version__\s*=\s*['\"]\d+\.\d", init), "__version__ must come from the metadata"
    assert PROJECT["version"] not in init
    assert modelgraft.__version__ == importlib.metadata.version("modelgraft")
    assert "version" not in PROJECT.get("dynamic", [])
    Version(PROJECT["version"])  # a valid PEP 440 version


def test_the_installed_metadata_is_this_checkouts_version() -> None:
    dist = importlib.metadata.distribution("modelgraft")
    url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
    if url != ROOT.as_uri():
        pytest.skip(f"modelgraft is installed from {url or 'an index'}, not from this checkout ({ROOT})")
    assert dist.version == PROJECT["version"]


def test_the_changelog_follows_keep_a_changelog_and_names_this_version() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    assert text.startswith("# Changelog\n")
    assert "https://keepachangelog.com/" in text
    versions = re.findall(r"^## \[([^\]]+)\]", text, re.MULTILINE)
    assert versions[0] == "Unreleased"
    assert PROJECT["version"] in versions
    kinds = set(re.findall(r"^### (\w+)", text, re.MULTILINE))
    assert kinds and kinds <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}


def test_the_readme_install_section_matches_the_metadata() -> None:
    install = _section((ROOT / "README.md").read_text(), "Install")
    assert "pip install modelgraft" in install
    assert "pip install 'modelgraft[trl]'" in install
    assert set(PROJECT["optional-dependencies"]) == {"trl", "dev"}
    assert all(f"`{extra}`" in install for extra in PROJECT["optional-dependencies"])
    assert "pip install ." in install  # from source
    requirements = {r.name: r for r in map(Requirement, PROJECT["dependencies"])}
    assert f"`{requirements['torch'].specifier}`" in install
    assert f"`{PROJECT['requires-python']}`" in install
    # the transformers range the README states is the one modelgraft checks at import ...
    assert f"`{SUPPORTED_RANGES}`" in install
    # ... and the one pip is told: both agree on every release around the range's edges (pip's
    # range also admits 4.58 to 4.99, which were never released: see the comment in pyproject.toml)
    pip_range = requirements["transformers"].specifier
    for release in (
        "4.56.2",
        "4.57.0",
        "4.57.6",
        "5.0.0",
        "5.12.1",
        "5.13.0",
        "5.15.1",
        "5.16.1",
        "5.25.0",
        "6.0.0",
    ):
        assert pip_range.contains(release) == is_supported(release), release
