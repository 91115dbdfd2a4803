"""The smoke subset that the version walk (``make test-versions``) runs on each transformers release.

The walk installs each release in its own environment and runs ``pytest --release-smoke``: of the
files named here, only the tests whose node id matches the file's pattern (every test of the file
where the pattern is ``None``). It covers what breaks first when a release moves transformers'
internals: import, the registry and ``apply_patches``, a patched load, output recorders, the
ready-made grafts' load and bit-exact save on a dense and a MoE family, replay on two MoE
families, porting on a few entries of transformers' own conversion table, and the CLI.

Example:
    >>> selected("tests/integration/test_grafts.py::test_x[fused_qkv-llama]")
    True
    >>> selected("tests/integration/test_grafts.py::test_x[fused_qkv-gemma]")
    False
    >>> selected("tests/unit/test_registry.py::test_overwrite_replaces_the_class")
    True
"""

from __future__ import annotations

import re

__all__ = ["SMOKE", "selected"]

_DENSE_AND_MOE = r"[\[-](llama|qwen3_moe)\]"

#: ``{test file: pattern its node ids must match (re.search), or None for the whole file}``.
SMOKE: dict[str, str | None] = {
    # import, the version layer and its wrapped attributes
    "tests/unit/test_compat.py": None,
    "tests/unit/test_compat_wraps.py": None,
    "tests/unit/test_hooks.py": None,
    # the registry and apply_patches
    "tests/unit/test_registry.py": None,
    "tests/unit/test_swap.py": None,
    "tests/integration/test_patching_load.py": None,
    "tests/integration/test_recorders.py": None,
    # the ready-made grafts: load equal to plain, save bit for bit
    "tests/integration/test_grafts.py": _DENSE_AND_MOE,
    "tests/integration/test_conversion_save.py": None,
    # replay on two MoE families
    "tests/integration/test_moe_families.py": r"\[(qwen3_moe|mixtral)\b|test_family_discovery",
    "tests/integration/test_moe_generate.py": None,
    # porting: entries of transformers' own table, against plain transformers
    "tests/integration/test_conversion_table_walk.py": r"\[(mixtral|qwen2_moe|olmoe|llava)\]",
    # the command line
    "tests/cli/test_cli.py": None,
}


def selected(nodeid: str) -> bool:
    """Whether the test ``nodeid`` belongs to the smoke subset."""
    path = nodeid.partition("::")[0]
    if path not in SMOKE:
        return False
    pattern = SMOKE[path]
    return pattern is None or re.search(pattern, nodeid) is not None
