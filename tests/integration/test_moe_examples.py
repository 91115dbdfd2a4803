"""The MoE examples run and print their checks (issue 4, point 8)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from _versions import requires_v5_because

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

EXPECTED = {
    "seed_moe_replay.py": [
        "recorded 2 layers of (12, 2) expert ids",
        "replayed output equals recorded: True",
        "modelgraft.moe records the same experts: True",
        "modelgraft.moe replays the recipe's routing bit-identically: True",
    ],
    "vllm_to_trainer.py": [
        "MoE layers: [1, 2] of 3 (layer 0 is dense)",
        "engine: 7 tokens, routed_experts (6, 3, 2) int32",
        "trace: layers [1, 2], 27 rows each (batch 3 x seq 9)",
        "real tokens replay the engine's experts: True",
        "padding rows use 8 distinct experts",
        "router weights received gradients: True",
    ],
}


# The seed's recipe subclasses `Qwen3MoeTopKRouter` and uses `output_capturing`: transformers 5.x only.
_V5_ONLY = {"seed_moe_replay.py"}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=requires_v5_because("the seed's recipe subclasses `Qwen3MoeTopKRouter`"))
        if n in _V5_ONLY
        else n
        for n in sorted(EXPECTED)
    ],
)
def test_moe_example_runs(name: str) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    for expected in EXPECTED[name]:
        assert expected in lines, f"{expected!r} not printed by {name}:\n{done.stdout}"
