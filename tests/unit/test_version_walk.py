"""The version walk's release lists agree with the declared range, the pins, CI and the docs."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from packaging.version import Version

from modelgraft import _compat
from modelgraft._compat._version import MINIMUM_V5

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import version_walk  # noqa: E402  (tools/ is not a package)


def _pin(constraints: str) -> Version:
    text = (ROOT / constraints).read_text()
    match = re.search(r"^transformers==(\S+)$", text, re.M)
    assert match, constraints
    return Version(match.group(1))


def _minors(releases: tuple[str, ...]) -> list[tuple[int, int]]:
    return [(Version(r).major, Version(r).minor) for r in releases]


def test_the_walk_covers_every_minor_of_the_declared_range_up_to_the_pin() -> None:
    newest = _pin("constraints.txt")
    expected = [(4, 57)] + [(5, minor) for minor in range(MINIMUM_V5[1], newest.minor + 1)]
    assert _minors(version_walk.SUPPORTED) == expected
    assert str(newest) in version_walk.SUPPORTED
    assert str(_pin("constraints-compat.txt")) in version_walk.SUPPORTED
    assert all(_compat.is_supported(release) for release in version_walk.SUPPORTED)


def test_every_minor_below_the_minimum_is_walked_as_a_refusal() -> None:
    assert _minors(version_walk.REFUSED) == [(5, minor) for minor in range(MINIMUM_V5[1])]
    assert not any(_compat.is_supported(release) for release in version_walk.REFUSED)


def test_ci_spread_holds_the_minimum_the_ecosystem_pins_and_a_refusal() -> None:
    spread = version_walk.CI_SPREAD
    assert set(spread) <= set(version_walk.SUPPORTED + version_walk.REFUSED)
    minors = _minors(spread)
    for needed in (MINIMUM_V5, (5, 17), (5, 19), (5, 22)):
        assert needed in minors, needed
    assert any(release in version_walk.REFUSED for release in spread)


def test_docs_table_names_every_walked_release() -> None:
    page = (ROOT / "docs" / "compat.md").read_text()
    for release in version_walk.SUPPORTED:
        assert release in page, release
    assert f"{version_walk.REFUSED[0]} to {version_walk.REFUSED[-1]}" in page


def test_the_table_prints_release_result_and_seconds() -> None:
    rows = [
        version_walk.Row("5.19.0", "smoke subset passes", "passed: 197 passed", 61.4),
        version_walk.Row("5.15.1", "refused at import", "FAILED: imported", 2.0),
    ]
    text = version_walk.table(rows)
    assert "| 5.19.0 | smoke subset passes | passed: 197 passed | 61 |" in text
    assert [row.ok for row in rows] == [True, False]
