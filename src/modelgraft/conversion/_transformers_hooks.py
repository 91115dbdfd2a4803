"""The transformers-version-specific wiring of the conversion engine (transformers 5.x).

Everything that names a transformers internal lives here, so that supporting another version
means adding one module like this one.

Example:
    >>> from modelgraft.conversion import _transformers_hooks
    >>> _transformers_hooks.builtin_conversion_exists("qwen2_moe")
    True
"""

from __future__ import annotations

from transformers import conversion_mapping as _tcm


def builtin_conversion_exists(key: str) -> bool:
    """Whether the installed transformers has its own conversion entry for ``key``."""
    return _tcm.get_checkpoint_conversion_mapping(key) is not None


def install() -> None:
    """Install the load/save wrappers (idempotent)."""


def uninstall() -> None:
    """Remove the load/save wrappers (idempotent)."""
