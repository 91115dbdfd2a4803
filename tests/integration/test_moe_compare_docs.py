"""docs/moe.md's ``compare_routing`` recipe runs as written and reports 0 mismatch on identical
routings (issue 28 point 4: it reported 16.7%, the filler ids of each sequence's last token).

The vLLM stand-in (``tests/engine_payloads.py``) serves the policy itself, so the engine's routes are
the policy's own: every compared token must agree, and exactly the tokens the engine forwarded (all
but each request's last) are compared.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from engine_payloads import fake_vllm_module, qwen3_moe

DOC = Path(__file__).resolve().parents[2] / "docs" / "moe.md"
_RECIPE = re.compile(r"<!-- recipe: compare-routing -->\n```python\n(.*?)\n```", re.S)
PROMPTS = [[5, 9, 17, 33], [7, 40, 2], [11, 3, 8, 21, 60], [14, 6]]


def test_the_compare_routing_recipe_reports_no_mismatch_on_identical_routings(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    found = _RECIPE.findall(DOC.read_text())
    assert len(found) == 1, "docs/moe.md has one compare-routing recipe"
    policy = qwen3_moe(num_hidden_layers=3, dense=(0,))
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm_module(policy))
    namespace = {"policy": policy, "prompts": [list(p) for p in PROMPTS]}
    exec(compile(found[0], "docs/moe.md [compare-routing]", "exec"), namespace)
    result, sequences = namespace["result"], namespace["sequences"]
    forwarded = sum(len(s) - 1 for s in sequences)  # the engine never forwarded each last token
    assert result.mismatched == [0, 0] and result.exact, result.summary()
    assert result.compared == [forwarded, forwarded] and result.tokens_compared == forwarded
    assert result.mismatch_rate == 0.0 and result.token_rate == 0.0
    assert capsys.readouterr().out.startswith(
        f"routing mismatch: 0 of {2 * forwarded} token routes differ (0.0%) over 2 MoE layers"
    )
    mask = namespace["attention_mask"]
    assert torch.equal(namespace["engine"].routed.reshape(mask.shape).sum(-1), mask.sum(-1) - 1)
