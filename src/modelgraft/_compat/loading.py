"""The seam between transformers' load and save steps and modelgraft's conversion engine.

The version layer knows *where* transformers loads and saves (the ``conversion`` sites of
:mod:`modelgraft._compat.wraps`); the engine (:mod:`modelgraft.conversion`) knows *what* to do
there. The engine is passed in, as a :class:`~modelgraft._compat.engine.ConversionEngine`, when it installs itself
(:func:`install`), so nothing here imports it: the dependency points down, from the engine to
this layer. :mod:`modelgraft._compat._conversion_v5` wires it into 5.x and
:mod:`modelgraft._compat._conversion_v4` into 4.57; exactly one of them is imported.

Example:
    >>> builtin_conversion_exists("qwen2_moe") == HAS_BUILTIN_CONVERSION
    True
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from modelgraft._compat._version import HAS_BUILTIN_CONVERSION, IS_V5
from modelgraft._compat.engine import ConversionEngine, Reversed

__all__ = [
    "ConversionEngine",
    "Reversed",
    "builtin_checkpoint_conversions",
    "builtin_conversion_exists",
    "install",
    "installed",
    "transformers_load_info_class",
    "uninstall",
]

if IS_V5 or TYPE_CHECKING:  # both lines share one interface; the checker reads the 5.x one
    from modelgraft._compat import _conversion_v5 as _wiring
else:
    from modelgraft._compat import _conversion_v4 as _wiring


def install(engine: ConversionEngine) -> None:
    """Wire ``engine`` into the installed transformers' load and save steps (idempotent)."""
    _wiring.install(engine)


def uninstall() -> None:
    """Remove what :func:`install` wired in (idempotent)."""
    _wiring.uninstall()


def installed() -> bool:
    """Whether an engine is wired in.

    Example:
        >>> import modelgraft  # wires its engine in
        >>> installed()
        True
    """
    return _wiring.installed()


def builtin_conversion_exists(key: str) -> bool:
    """Whether the installed transformers converts checkpoints of ``key`` (a model type or class
    name) itself: a registration under that key then replaces transformers' own entry."""
    return _wiring.builtin_conversion_exists(key)


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
    return _wiring.builtin_checkpoint_conversions(model_type)


def transformers_load_info_class() -> Any:
    """transformers' ``LoadStateDictInfo`` (what its state-dict loader returns), or ``None`` on 4.57.

    Example:
        >>> (transformers_load_info_class() is None) == (not HAS_BUILTIN_CONVERSION)
        True
    """
    try:
        from transformers.utils.loading_report import LoadStateDictInfo  # 5.x only
    except ImportError:
        return None
    return LoadStateDictInfo
