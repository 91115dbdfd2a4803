"""Lookups into transformers' model catalogue and helpers that are not public API.

Each function imports what it needs when called: ``import modelgraft`` must not resolve
transformers' Auto classes or import any modeling module (a test checks it), and most programs
never call these.

Example:
    >>> from transformers import LlamaConfig
    >>> auto_model_class("causal_lm", LlamaConfig()).__name__
    'LlamaForCausalLM'
"""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping
from typing import Any, cast

import torch

from modelgraft._compat._features import FEATURES

HAS_BUILTIN_CONVERSION = FEATURES.builtin_conversion

__all__ = [
    "auto_model_class",
    "builtin_checkpoint_conversions",
    "builtin_conversion_exists",
    "causal_lm_loss",
    "default_apply_gate",
    "model_types_by_module",
    "modeling_files",
    "revert_builtin_conversion",
    "transformers_load_info_class",
]

#: What ``auto_model_class`` accepts, and the Auto class each kind stands for.
AUTO_KINDS = {"base": "AutoModel", "causal_lm": "AutoModelForCausalLM"}


def auto_model_class(kind: str, config: Any) -> type | None:
    """The class ``AutoModel`` (``kind="base"``) or ``AutoModelForCausalLM`` (``"causal_lm"``)
    builds for ``config``, without building it; ``None`` when that Auto class does not map it.

    Example:
        >>> from transformers import BertConfig
        >>> auto_model_class("base", BertConfig()).__name__, auto_model_class("causal_lm", BertConfig()).__name__
        ('BertModel', 'BertLMHeadModel')
    """
    import transformers  # lazy: resolving an Auto class imports `modeling_auto`

    auto = getattr(transformers, AUTO_KINDS[kind])
    try:
        return cast(type, auto._model_mapping[type(config)])
    except KeyError:
        return None


def causal_lm_loss() -> Any:
    """transformers' causal-LM loss function (``LOSS_MAPPING["ForCausalLM"]``).

    Example:
        >>> causal_lm_loss().__name__
        'ForCausalLMLoss'
    """
    from transformers.loss.loss_utils import LOSS_MAPPING  # lazy: only the chunked-loss graft needs it

    return LOSS_MAPPING["ForCausalLM"]


def default_apply_gate() -> object | None:
    """transformers' default MoE gate application (``integrations.moe``), or ``None`` where the
    installed transformers has no pluggable gate (then only the default exists).

    Example:
        >>> default_apply_gate() is None or callable(default_apply_gate())
        True
    """
    try:
        # lazy: MoE grafts only. 5.x only: `unused-ignore` lets the one line type-check on both lines.
        from transformers.integrations.moe import (  # type: ignore[import-not-found, unused-ignore]
            _default_apply_gate as found,
        )
    except ImportError:
        return None
    gate: object = found
    return gate


def revert_builtin_conversion(
    model: torch.nn.Module, state: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor] | None:
    """``state`` in the checkpoint layout, with transformers' own load-time conversions undone
    (5.x, for a ``PreTrainedModel``); ``None`` where there are none (4.57: the live layout is the
    checkpoint layout) or ``model`` is not a transformers model.

    Example:
        >>> revert_builtin_conversion(torch.nn.Linear(1, 1), {}) is None
        True
    """
    if not HAS_BUILTIN_CONVERSION:
        return None
    from transformers import PreTrainedModel

    # the unwrapped original; 5.x only (`unused-ignore`: the line type-checks on both lines)
    from transformers.core_model_loading import (  # type: ignore[import-not-found, unused-ignore]
        revert_weight_conversion,
    )

    if not isinstance(model, PreTrainedModel):
        return None
    return cast("dict[str, torch.Tensor]", revert_weight_conversion(model, dict(state)))


def builtin_conversion_exists(key: str) -> bool:
    """Whether the installed transformers converts checkpoints of ``key`` (a model type or class
    name) itself: a registration under that key then replaces transformers' own entry.

    Example:
        >>> builtin_conversion_exists("qwen2_moe") == HAS_BUILTIN_CONVERSION
        True
    """
    if not HAS_BUILTIN_CONVERSION:
        return False
    # 5.x only (`unused-ignore`: the lines type-check on both lines)
    from transformers.conversion_mapping import (  # type: ignore[import-not-found, unused-ignore]
        get_checkpoint_conversion_mapping,
    )

    return get_checkpoint_conversion_mapping(key) is not None  # type: ignore[no-untyped-call, unused-ignore]


def builtin_checkpoint_conversions(model_type: str) -> list[Any]:
    """transformers' own conversion entries for ``model_type`` (its ``WeightConverter``/``WeightRenaming``).

    Empty on 4.57, which converts no checkpoint layout, and for model types 5.x does not convert.

    Example:
        >>> (len(builtin_checkpoint_conversions("qwen2_moe")) > 0) == HAS_BUILTIN_CONVERSION
        True
        >>> builtin_checkpoint_conversions("llama")
        []
    """
    if not HAS_BUILTIN_CONVERSION:
        return []
    # 5.x only (`unused-ignore`: the lines type-check on both lines)
    from transformers.conversion_mapping import (  # type: ignore[import-not-found, unused-ignore]
        get_checkpoint_conversion_mapping,
    )

    return list(get_checkpoint_conversion_mapping(model_type) or [])  # type: ignore[no-untyped-call, unused-ignore]


def transformers_load_info_class() -> Any:
    """transformers' ``LoadStateDictInfo`` (what its state-dict loader returns), or ``None`` on 4.57.

    Example:
        >>> (transformers_load_info_class() is None) == (not HAS_BUILTIN_CONVERSION)
        True
    """
    if not HAS_BUILTIN_CONVERSION:
        return None
    try:
        from transformers.utils.loading_report import (  # type: ignore[import-not-found, unused-ignore]
            LoadStateDictInfo,  # 5.1 on
        )
    except ImportError:
        from transformers.modeling_utils import (  # type: ignore[attr-defined, unused-ignore]
            LoadStateDictInfo,  # 5.0
        )
    return LoadStateDictInfo


def model_types_by_module() -> dict[str, list[str]]:
    """``{name of a transformers.models sub-package: [its model types]}``.

    Example:
        >>> "llama" in model_types_by_module()["llama"]
        True
    """
    # lazy: family discovery only; CONFIG_MAPPING_NAMES is imported there, not re-exported (5.x;
    # 4.57's module declares it, hence `unused-ignore`)
    from transformers.models.auto.configuration_auto import (  # type: ignore[attr-defined, unused-ignore]
        CONFIG_MAPPING_NAMES,
        model_type_to_module_name,
    )

    by_module: dict[str, list[str]] = {}
    for model_type in CONFIG_MAPPING_NAMES:
        by_module.setdefault(model_type_to_module_name(model_type), []).append(model_type)
    return by_module


def modeling_files() -> list[str]:
    """Paths of the installed transformers' ``models/*/modeling_*.py`` files, sorted.

    Example:
        >>> any(path.endswith(os.path.join("llama", "modeling_llama.py")) for path in modeling_files())
        True
    """
    import transformers.models  # lazy: family discovery only

    root = os.path.dirname(transformers.models.__file__)
    return sorted(glob.glob(os.path.join(root, "*", "modeling_*.py")))
