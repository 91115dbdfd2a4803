"""Create (once, cached) one environment per transformers release for the version walk.

Each environment is a small venv under ``.venv-versions/<release>`` that holds only that
transformers release (and whatever of its dependencies the base venv does not satisfy); everything
else (torch, safetensors, pytest, ...) comes from the base venv through a ``.pth`` line, so a
release costs seconds and ~150 MB, not a full install. The base venv is the one running this script.

Usage:
    python tools/version_envs.py 5.17.0 5.19.0      # create what is missing, print each env's python
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENVS = ROOT / ".venv-versions"


def _constraints_without_transformers() -> Path:
    """The project's pins (torch==2.13.0 above all: any other torch request downloads a CUDA
    build), minus the transformers pin that each environment replaces."""
    ENVS.mkdir(exist_ok=True)
    out = ENVS / "constraints-base.txt"
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    out.write_text("\n".join(line for line in lines if not line.startswith("transformers")) + "\n")
    return out


def _link_base(folder: Path) -> None:
    """Make the base venv's packages importable after the release's own site-packages (which
    therefore wins). ``site.addsitedir`` rather than a bare path, so that the base venv's own
    ``.pth`` files run too (the editable install of modelgraft is one)."""
    purelib = Path(sysconfig.get_paths(vars={"base": str(folder), "platbase": str(folder)})["purelib"])
    base = sysconfig.get_paths()["purelib"]
    (purelib / "_modelgraft_base.pth").write_text(f"import site; site.addsitedir({base!r})\n")


def env_python(release: str) -> Path:
    return ENVS / release / "bin" / "python"


def _pin(constraints: str) -> str:
    for line in (ROOT / constraints).read_text().splitlines():
        if line.startswith("transformers=="):
            return line.removeprefix("transformers==").strip()
    raise SystemExit(f"{constraints} pins no transformers")


def ensure(release: str) -> Path:
    """The python of ``release``'s environment, created when missing or incomplete.

    The 4.57 pin of ``constraints-compat.txt`` uses ``.venv-compat`` (``make setup-compat``): 4.57
    needs older releases of the hub client and of ``datasets`` than the base venv holds, so it
    cannot share the base venv's packages.
    """
    if release == _pin("constraints-compat.txt"):
        subprocess.run(["make", "-s", "setup-compat"], cwd=ROOT, check=True)
        return ROOT / ".venv-compat" / "bin" / "python"
    folder = ENVS / release
    stamp = folder / ".installed"
    python = env_python(release)
    if stamp.exists() and python.exists():
        _link_base(folder)
        return python
    print(f"[version-envs] creating {folder} (transformers=={release})", flush=True)
    venv.EnvBuilder(clear=True, with_pip=True).create(folder)
    _link_base(folder)
    subprocess.run(
        [
            str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
            "-c", str(_constraints_without_transformers()), f"transformers=={release}",
        ],
        check=True,
    )  # fmt: skip
    stamp.touch()
    return python


def main(argv: list[str]) -> int:
    for release in argv:
        print(ensure(release))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
