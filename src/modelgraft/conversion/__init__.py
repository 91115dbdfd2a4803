"""Checkpoint weight conversion: load checkpoints into grafted layouts and save them back.

Public names are re-exported from :mod:`modelgraft`. :func:`install` wires the engine into the
installed transformers (idempotent; :func:`uninstall` removes it); importing :mod:`modelgraft`
calls it.

Example:
    >>> from modelgraft.conversion import Concatenate, WeightConverter
    >>> WeightConverter(["q_proj", "k_proj", "v_proj"], ["qkv_proj"], [Concatenate(dim=0)]).is_reversible
    True
"""

from __future__ import annotations

from modelgraft import _compat
from modelgraft.conversion._engine import ENGINE
from modelgraft.conversion.ops import (
    Chunk,
    Concatenate,
    ConversionContext,
    ConversionOperation,
    MergeModulelist,
    SplitModulelist,
    Transpose,
)
from modelgraft.conversion.rules import (
    WeightConverter,
    WeightRenaming,
    get_checkpoint_conversion_mapping,
    register_checkpoint_conversion_mapping,
    unregister_checkpoint_conversion_mapping,
)

__all__ = [
    "Chunk",
    "Concatenate",
    "ConversionContext",
    "ConversionOperation",
    "MergeModulelist",
    "SplitModulelist",
    "Transpose",
    "WeightConverter",
    "WeightRenaming",
    "get_checkpoint_conversion_mapping",
    "install",
    "installed",
    "register_checkpoint_conversion_mapping",
    "uninstall",
    "unregister_checkpoint_conversion_mapping",
]


def install() -> None:
    """Wire the conversion engine into transformers' load and save paths (idempotent)."""
    _compat.CONVERSION.install(_compat.TRANSFORMERS.conversion_wrappers(ENGINE))


def uninstall() -> None:
    """Remove what :func:`install` wired in (idempotent)."""
    _compat.CONVERSION.uninstall()


def installed() -> bool:
    """Whether the conversion engine is wired into transformers."""
    return _compat.CONVERSION.installed
