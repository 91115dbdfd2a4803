"""The plain side of the conversion-table walk: run in a process that never imports modelgraft.

Reads ``jobs.json`` (one job per key of transformers' conversion table: the model class to build
and the folder holding its tiny ``config.json``), and for each job:

1. builds the model from the config with a fixed seed, writes its state dict (``built.pt``) and
   saves it with transformers' own ``save_pretrained`` into ``original/`` (the original
   checkpoint layout);
2. loads ``original/`` with plain ``from_pretrained(output_loading_info=True)``, writes the
   loaded state dict (``plain_loaded.pt``) and the loading report;
3. saves that model again into ``plain_saved/``.

Writes ``results.json``: per key ``{"status": "ok"}`` or ``{"status": "unbuildable", "reason": ...}``
with the loading report. Exits non-zero if modelgraft was imported.

Usage: python plain_worker.py WORKDIR
"""

from __future__ import annotations

import json
import sys
import time
import traceback
import warnings
from pathlib import Path

#: A family whose tiny config still builds a bigger model than this is skipped (memory and time).
MAX_PARAMETERS = 100_000_000


def _report(info: dict) -> dict[str, list[str]]:
    out = {}
    for name in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        value = info.get(name) or []
        out[name] = sorted(str(v[0] if isinstance(v, tuple) else v) for v in value)
    return out


def _model_class(name: str):
    import transformers

    return getattr(transformers, name)


def run_job(job: dict, folder: Path) -> dict:
    import torch
    import transformers

    cls = _model_class(job["class"])
    config = transformers.AutoConfig.from_pretrained(folder / "config")
    try:
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            size = sum(p.numel() for p in cls._from_config(config).parameters())
    except Exception as e:
        return {"status": "unbuildable", "reason": f"construction: {type(e).__name__}: {str(e)[:300]}"}
    if size > MAX_PARAMETERS:
        return {"status": "unbuildable", "reason": f"not tiny: {size:,} parameters with the tiny config"}
    torch.manual_seed(0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = cls._from_config(config)
    except Exception as e:
        return {"status": "unbuildable", "reason": f"construction: {type(e).__name__}: {str(e)[:300]}"}
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, folder / "built.pt")
    try:
        model.save_pretrained(folder / "original")
    except Exception as e:
        return {"status": "unbuildable", "reason": f"plain save: {type(e).__name__}: {str(e)[:300]}"}
    torch.manual_seed(1)  # as the modelgraft load: keys both leave missing get the same initial values
    try:
        loaded, info = cls.from_pretrained(folder / "original", output_loading_info=True)
    except Exception as e:
        return {"status": "unbuildable", "reason": f"plain load: {type(e).__name__}: {str(e)[:300]}"}
    state = {k: v.detach().clone() for k, v in loaded.state_dict().items()}
    torch.save(state, folder / "plain_loaded.pt")
    try:
        loaded.save_pretrained(folder / "plain_saved")
    except Exception as e:
        return {"status": "unbuildable", "reason": f"plain re-save: {type(e).__name__}: {str(e)[:300]}"}
    return {"status": "ok", "report": _report(info)}


def main(workdir: str) -> int:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    root = Path(workdir)
    jobs = json.loads((root / "jobs.json").read_text())
    results = {}
    for key, job in jobs.items():
        print(f"walking {key}", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            results[key] = run_job(job, root / job["folder"])
        except Exception:
            results[key] = {"status": "unbuildable", "reason": traceback.format_exc(limit=2)[-400:]}
        results[key]["seconds"] = round(time.perf_counter() - start, 2)
    (root / "results.json").write_text(json.dumps(results, indent=1, sort_keys=True))
    if "modelgraft" in sys.modules:
        print("modelgraft was imported by the plain worker", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
