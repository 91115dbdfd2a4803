"""Which tiny model each key of transformers' conversion table is walked with.

A key is a model type or a model class name (transformers looks entries up by class name first,
then by ``model_type``, for the model and each of its sub-models). A class-name key is built as
that class. A model-type key is built as the most complete class the Auto mappings list for it:
one with a language-model head where there is one (the entries move ``lm_head`` around), else
another head, else the base model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: Auto mappings in order of preference for a model-type key.
_PREFERRED_MAPPINGS = (
    "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
    "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES",
    "MODEL_FOR_VISION_2_SEQ_MAPPING_NAMES",
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "MODEL_FOR_PRETRAINING_MAPPING_NAMES",
)


class WeightRenaming:
    """One ``_checkpoint_conversion_mapping`` item of transformers 4.57, shaped like 5.x's renaming
    (what :mod:`table_walk.translate` reads), so that both tables walk the same way."""

    scope_prefix = None
    base_model_prefix = None

    def __init__(self, source: str, target: str) -> None:
        self._original_source_patterns = [source]
        self._original_target_patterns = [target]


def _table_v4() -> dict[str, list[Any]]:
    """transformers 4.57's conversion table: the ``_checkpoint_conversion_mapping`` of each model
    class that declares one (renamings of legacy checkpoint layouts, applied by its loader)."""
    import transformers

    found: dict[str, list[Any]] = {}
    for name in dir(transformers):
        if not name[:1].isupper():
            continue
        try:
            cls = getattr(transformers, name)
        except Exception:
            continue
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            mapping = cls.__dict__.get("_checkpoint_conversion_mapping")
            if mapping:
                found[name] = [WeightRenaming(k, v) for k, v in mapping.items()]
    return found


def table() -> dict[str, list[Any]]:
    """The installed transformers' conversion table, every key: 5.x's ``conversion_mapping``, or
    4.57's per-class ``_checkpoint_conversion_mapping``."""
    try:
        from transformers import conversion_mapping as tcm
    except ImportError:
        return _table_v4()
    tcm.get_checkpoint_conversion_mapping("llama")  # fills the cache
    return {
        k: tcm.get_checkpoint_conversion_mapping(k) or [] for k in tcm._checkpoint_conversion_mapping_cache
    }


def _mapping_classes(model_type: str) -> list[str]:
    from transformers.models.auto import modeling_auto

    found: list[str] = []
    names = [*_PREFERRED_MAPPINGS]
    names += sorted(
        n
        for n in dir(modeling_auto)
        if n.startswith("MODEL_") and n.endswith("_MAPPING_NAMES") and n not in names
    )
    names.append("MODEL_MAPPING_NAMES")
    for name in names:
        value = getattr(modeling_auto, name, None)
        if isinstance(value, dict) and isinstance(value.get(model_type), str):
            found.append(value[model_type])
    return found


def model_class_for(key: str) -> tuple[str, str] | str:
    """``(class name, model type)`` to build for ``key``, or the reason there is none."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = getattr(transformers, key, None) if key[:1].isupper() else None
    if cls is not None:
        config_class = getattr(cls, "config_class", None)
        model_type = getattr(config_class, "model_type", None)
        if not model_type:
            return f"class `{key}` names no config model type"
        return key, model_type
    if key not in CONFIG_MAPPING:
        return f"`{key}` is neither a model type nor a model class of this transformers"
    for name in _mapping_classes(key):
        candidate = getattr(transformers, name, None)
        if isinstance(candidate, type) and issubclass(candidate, transformers.PreTrainedModel):
            return name, key
    return f"no Auto mapping lists a model class for model type `{key}`"


def write_jobs(root: Path, keys: list[str]) -> dict[str, str]:
    """Write ``jobs.json`` and each job's tiny config under ``root``; return the keys with no job."""
    from modelgraft.testing import tiny_config

    jobs: dict[str, dict[str, str]] = {}
    skipped: dict[str, str] = {}
    for i, key in enumerate(keys):
        found = model_class_for(key)
        if isinstance(found, str):
            skipped[key] = found
            continue
        class_name, model_type = found
        try:
            config = tiny_config(model_type)
        except Exception as e:
            skipped[key] = f"no tiny config: {type(e).__name__}: {str(e)[:200]}"
            continue
        folder = f"{i:03d}"
        config.save_pretrained(root / folder / "config")
        jobs[key] = {"class": class_name, "folder": folder}
    (root / "jobs.json").write_text(json.dumps(jobs, indent=1))
    return skipped
