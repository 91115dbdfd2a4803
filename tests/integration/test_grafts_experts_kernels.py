"""``linear_experts`` refuses an ``experts_implementation`` it cannot run, clearly.

Any implementation other than ``grouped_mm`` (the default) and ``eager`` (``batched_mm``) is refused
at load time and when set later, never silently replaced. That ``grouped_mm`` and ``eager`` each run
the path they name with the plain model's logits and gradients is tested by counting calls on the
private path functions, in tests/unit/test_grafts_grouped_experts.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from _versions import requires_fused_experts
from families import family
from modelgraft.grafts import ExpertsImplementationError, linear_experts

pytestmark = requires_fused_experts


@pytest.fixture
def checkpoint(tiny_checkpoint: Callable[[str], Path]) -> Callable[[str], Path]:
    """The session's tiny causal-LM checkpoints (tests/conftest.py), read only here."""
    return tiny_checkpoint


def _load(path: Path, model_type: str | None = None, **kwargs: object) -> torch.nn.Module:
    if model_type is None:
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)
    with linear_experts(model_type).applied(strict=True):
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_batched_mm_is_refused_at_load_time_and_when_set_later(model_type: str, checkpoint) -> None:
    source = checkpoint(model_type)
    with pytest.raises(
        ExpertsImplementationError, match=r"cannot run `experts_implementation='batched_mm'`.*grouped_mm"
    ):
        _load(source, model_type, experts_implementation="batched_mm")
    grafted = _load(source, model_type).eval()
    grafted.set_experts_implementation("batched_mm")
    with pytest.raises(
        ExpertsImplementationError, match=r"`Linear\w+Experts` cannot run `experts_implementation="
    ):
        grafted(**family(model_type).inputs(grafted.config))
    assert isinstance(ExpertsImplementationError("x"), ValueError)
