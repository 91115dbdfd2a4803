"""Every key of transformers' own conversion table, loaded and saved through modelgraft (issue 18).

For each key of the installed transformers' built-in conversion table (``transformers.
conversion_mapping`` on 5.x; on 4.57 the ``_checkpoint_conversion_mapping`` each model class
declares, which its loader applies and its save reverses), a tiny model of the key's class is built, saved in its original checkpoint layout and loaded with plain
transformers, all in a process that never imports modelgraft (``table_walk/plain_worker.py``).
Here the same checkpoint is loaded with the entry re-expressed in :mod:`modelgraft.porting`'s
classes inside ``patched({}, conversions={key: entry})``, and compared with the plain load:

- the loaded state dict, bit for bit (keys, dtypes, shapes, values, NaN positions);
- the loading report (missing, unexpected and mismatched keys);
- the saved files, bit for bit (file names, tensor names, dtypes, shapes, values).

A key whose model plain transformers cannot build here is skipped with its reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from table_walk import jobs
from table_walk.translate import to_porting_entry

import modelgraft as mg

WORKER = Path(__file__).parent / "table_walk" / "plain_worker.py"
TABLE = jobs.table()

pytestmark = pytest.mark.slow

# Families whose own round trip transformers gets wrong: its save writes names its load does not
# read back, so a plain load of its own save leaves keys missing. For these, modelgraft is held to
# the truth instead of to transformers: its load equals the model that was saved, with a clean
# report, and its save writes the original checkpoint bit for bit.
TRANSFORMERS_DEFECTS: dict[str, str] = {
    "shieldgemma2": "transformers saves `model.model.language_model.model.*` and its load leaves 29 keys missing",
}


@pytest.fixture(scope="session")
def plain_walk(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], dict[str, str]]:
    root = tmp_path_factory.mktemp("table_walk")
    skipped = jobs.write_jobs(root, sorted(TABLE))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSTARTUP"}
    env["HF_HUB_OFFLINE"] = "1"
    done = subprocess.run(
        [sys.executable, str(WORKER), str(root)], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, f"the plain worker failed:\n{done.stderr[-3000:]}"
    results = json.loads((root / "results.json").read_text())
    return root, results, skipped


def _keys() -> list[Any]:
    if not TABLE:
        return [
            pytest.param(None, marks=pytest.mark.skip(reason="this transformers has no conversion table"))
        ]
    return sorted(TABLE)


def _compare_tensors(kind: str, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    problems = []
    if set(got) != set(want):
        problems.append(
            f"{kind}: keys differ; only in modelgraft's {sorted(set(got) - set(want))[:8]}, "
            f"only in plain transformers' {sorted(set(want) - set(got))[:8]}"
        )
    for key in sorted(set(got) & set(want)):
        a, b = got[key], want[key]
        if a.dtype != b.dtype or a.shape != b.shape:
            problems.append(
                f"{kind}: `{key}` is {a.dtype} {tuple(a.shape)}, plain {b.dtype} {tuple(b.shape)}"
            )
        elif not torch.equal(torch.isnan(a), torch.isnan(b)) if a.is_floating_point() else False:
            problems.append(f"{kind}: `{key}` has NaN where plain has none (or the other way)")
        elif (
            not torch.equal(a.nan_to_num(), b.nan_to_num())
            if a.is_floating_point()
            else not torch.equal(a, b)
        ):
            problems.append(f"{kind}: `{key}` values differ")
    return problems


def _saved(folder: Path) -> tuple[list[str], dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    files = sorted(p.name for p in folder.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(str(folder / name)))
    return files, tensors


def _report(info: dict[str, Any]) -> dict[str, list[str]]:
    out = {}
    for name in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        value = info.get(name) or []
        out[name] = sorted(str(v[0] if isinstance(v, tuple) else v) for v in value)
    return out


@pytest.mark.parametrize("key", _keys())
def test_table_entry_loads_and_saves_like_transformers(key: str, plain_walk, tmp_path: Path) -> None:
    import transformers

    root, results, skipped = plain_walk
    if key in skipped:
        pytest.skip(f"`{key}`: {skipped[key]}")
    result = results[key]
    if result["status"] != "ok":
        pytest.skip(f"`{key}` cannot be built by plain transformers here: {result['reason']}")
    job = json.loads((root / "jobs.json").read_text())[key]
    folder = root / job["folder"]
    cls = getattr(transformers, job["class"])
    entry = to_porting_entry(TABLE[key])
    torch.manual_seed(1)  # as the plain load: keys both leave missing get the same initial values
    with mg.patched({}, conversions={key: entry}):
        loaded, info = cls.from_pretrained(folder / "original", output_loading_info=True)
    defect = key in TRANSFORMERS_DEFECTS
    if defect:  # held to the model that was saved, not to transformers' lossy round trip
        want_state, want_report = torch.load(folder / "built.pt"), _report({})
        want_folder = folder / "original"
        assert result["report"] != want_report, (
            f"transformers' round trip of `{key}` is fixed: drop it from the list"
        )
    else:
        want_state, want_report = torch.load(folder / "plain_loaded.pt"), result["report"]
        want_folder = folder / "plain_saved"
    state = {k: v.detach() for k, v in loaded.state_dict().items()}
    problems = _compare_tensors("loaded state dict", state, want_state)
    if _report(info) != want_report:
        problems.append(f"loading report: modelgraft {_report(info)}, expected {want_report}")
    loaded.save_pretrained(tmp_path / "saved")
    files, saved = _saved(tmp_path / "saved")
    plain_files, plain_saved = _saved(want_folder)
    if files != plain_files:
        problems.append(f"saved files: modelgraft {files}, plain {plain_files}")
    problems += _compare_tensors("saved checkpoint", saved, plain_saved)
    assert not problems, f"`{key}` ({job['class']}) differs from plain transformers:\n" + "\n".join(problems)
