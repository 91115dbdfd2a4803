"""Markers and helpers for tests that cannot apply to every supported transformers version.

The suite runs on transformers 5.x (``make test``) and 4.57 (``make test-compat``). A test that
cannot apply to one of them is skipped *with a reason* through these helpers, so ``pytest -ra``
lists it; never drop a test silently. ``tests`` is on ``sys.path`` (``pythonpath`` in
pyproject.toml), so test files import this module as ``from _versions import requires_v5``.

Example:
    >>> from _versions import requires_v5, requires_v4
    >>> requires_v5.name, requires_v4.name
    ('skipif', 'skipif')
"""

from __future__ import annotations

import pytest
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

# Test infrastructure, not a test: the version skips read the version layer's own facts, which no
# public name states.
from modelgraft import _compat

IS_V5 = _compat.IS_V5
TRANSFORMERS_VERSION = str(_compat.TRANSFORMERS_VERSION)
#: Whether the installed transformers stores MoE experts as fused 3D tensors (5.x).
FUSED_MOE_EXPERTS = _compat.FUSED_MOE_EXPERTS

#: Tests of behaviour that only transformers 5.x has.
requires_v5 = pytest.mark.skipif(
    not IS_V5, reason=f"needs transformers 5.x (installed: {TRANSFORMERS_VERSION})"
)
#: Tests of the 4.57 code paths.
requires_v4 = pytest.mark.skipif(IS_V5, reason=f"needs transformers 4.57 (installed: {TRANSFORMERS_VERSION})")
#: Comparisons against ``transformers.monkey_patching`` (the built-in patching of 5.x).
requires_builtin_patching = pytest.mark.skipif(
    not _compat.HAS_BUILTIN_PATCHING,
    reason=f"transformers {TRANSFORMERS_VERSION} has no built-in `transformers.monkey_patching` (5.x only)",
)
#: Comparisons against transformers' own checkpoint conversion (``WeightConverter`` etc.).
requires_builtin_conversion = pytest.mark.skipif(
    not _compat.HAS_BUILTIN_CONVERSION,
    reason=f"transformers {TRANSFORMERS_VERSION} has no built-in checkpoint conversion (5.x only)",
)
#: Tests of fused 3D MoE expert parameters (5.x); 4.57 already stores experts per expert.
requires_fused_experts = pytest.mark.skipif(
    not _compat.FUSED_MOE_EXPERTS,
    reason=f"transformers {TRANSFORMERS_VERSION} stores MoE experts as a per-expert ModuleList, not fused 3D tensors",
)

#: Families whose experts stay fused on 4.57 too (3D for GPT-OSS and Llama 4, 2D stacks for DBRX):
#: ``linear_experts`` replaces them on both lines.
FUSED_ON_BOTH_LINES = ("gpt_oss", "llama4_text", "dbrx")


def requires_fused_experts_unless_fused_on_both_lines(model_type: str) -> list[pytest.MarkDecorator]:
    """``requires_fused_experts``, except for the families of :data:`FUSED_ON_BOTH_LINES`."""
    return [] if model_type in FUSED_ON_BOTH_LINES else [requires_fused_experts]


def requires_v5_because(why: str) -> pytest.MarkDecorator:
    """``requires_v5`` with a reason that says why the test is 5.x-only.

    Example:
        >>> requires_v5_because("fusion_config is 5.x API").kwargs["reason"].startswith("needs transformers 5.x")
        True
    """
    return pytest.mark.skipif(
        not IS_V5, reason=f"needs transformers 5.x: {why} (installed: {TRANSFORMERS_VERSION})"
    )


def missing_model_type(model_type: str) -> str | None:
    """The skip reason when the installed transformers has no ``model_type``, else ``None``.

    For parametrised family tables: ``if (why := missing_model_type(t)): pytest.skip(why)``.

    Example:
        >>> missing_model_type("llama") is None, missing_model_type("no_such_model") is not None
        (True, True)
    """
    if model_type in CONFIG_MAPPING:
        return None
    return f"model type `{model_type}` does not exist in transformers {TRANSFORMERS_VERSION}"


def skip_if_missing_model_type(model_type: str) -> None:
    """Skip the running test, with the reason, when the installed transformers lacks ``model_type``."""
    why = missing_model_type(model_type)
    if why is not None:
        pytest.skip(why)


#: MoE families the installed transformers has (routing found at run time), and how many of them
#: at least run record/replay at tiny size (floors set on 5.23: 36 and 30). Found/running: 74 and 69
#: on 5.24 (the 5 others refused: no router, hash or non-top-k routing); 25 and 19 on 4.57.6 (its
#: Jamba needs CUDA Mamba kernels; GraniteMoeHybrid, Qwen3-Omni cannot be built tiny; Phi-MoE selects
#: with sparsemixer; GLM-4V-MoE and JetMoE fail their own plain forward at tiny size).
MIN_MOE_FAMILIES = 36 if IS_V5 else 25
MIN_MOE_FAMILIES_RUNNING = 30 if IS_V5 else 17
