"""Tiny local checkpoints for the examples (no hub access needed).

``tiny_checkpoint("llama")`` returns the path of a small checkpoint of that family, built once
from :func:`modelgraft.testing.tiny_config` with plain transformers and cached on disk
(``$MODELGRAFT_EXAMPLES_CACHE``, default: a ``modelgraft-examples`` folder in the temp dir).
The examples pass that path where the documentation names a hub model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from modelgraft.testing import tiny_config


def cache_dir() -> Path:
    """Where tiny checkpoints are cached."""
    default = Path(tempfile.gettempdir()) / "modelgraft-examples"
    return Path(os.environ.get("MODELGRAFT_EXAMPLES_CACHE", default))


def tiny_checkpoint(model_type: str, **overrides: object) -> str:
    """Return the folder of a tiny ``model_type`` checkpoint (built on first use, then cached)."""
    import transformers

    tag = hashlib.sha1(
        json.dumps([model_type, overrides, transformers.__version__], sort_keys=True, default=str).encode()
    )
    folder = cache_dir() / f"{model_type}-{tag.hexdigest()[:10]}"
    if (folder / "config.json").is_file():
        return str(folder)
    config = tiny_config(model_type, **overrides)
    model_class = transformers.AutoModelForCausalLM._model_mapping[type(config)]
    torch.manual_seed(0)
    # The constructor is never patched (only loads are), so this is always the plain model.
    model = model_class(config)
    staging = Path(tempfile.mkdtemp(prefix=f".{model_type}-", dir=_ensure(cache_dir())))
    model.save_pretrained(staging)
    try:
        staging.rename(folder)  # atomic: a concurrent run either wins or finds the folder complete
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return str(folder)


def _ensure(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path
