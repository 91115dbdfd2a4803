"""Every example in examples/ runs as a script and prints what the documentation says happens."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from _versions import requires_v5_because

pytestmark = pytest.mark.slow  # one fresh interpreter per example

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

#: example -> lines its output must contain (in this order)
EXPECTED: dict[str, list[str]] = {
    "quick_start.py": ["<class '__main__.CustomLlamaAttention'>"],
    "global_registration.py": [
        "{'Qwen2MoeExperts': 'SequentialExperts', 'Qwen2MoeAttention': 'CustomAttention'}"
    ],
    "pattern_matching.py": [
        "with `.*Attention`: CustomAttention",
        "with `LlamaAttention` too: ExactLlamaAttention",
    ],
    "unregister_clear_get.py": [
        "registered: ['.*Attention', 'Qwen2MoeAttention', 'Qwen2MoeExperts']",
        "after unregistering one: ['.*Attention', 'Qwen2MoeAttention']",
        "after unregistering all three: []",
        "{}",
    ],
    "manual_construction.py": [
        "inside apply_patches: CustomAttention",
        "without it: LlamaAttention",
        "from_pretrained: CustomAttention",
    ],
    "troubleshooting_not_applied.py": [
        "{'LlamaAttention': <class '__main__.CustomAttention'>, '.*Attention': <class '__main__.CustomAttention'>}",
    ],
    "troubleshooting_is_it_working.py": [
        "<class '__main__.CustomAttention'>",
        "GraftReport for LlamaForCausalLM: 2 module(s) replaced",
        "  model.layers.0.self_attn: transformers.models.llama.modeling_llama.LlamaAttention -> "
        "__main__.CustomAttention (key `LlamaAttention`)",
    ],
    "troubleshooting_weight_shapes.py": ["FusedQKVLlamaAttention qkv_proj (128, 64)"],
    "troubleshooting_cleanup.py": ["inside: CustomAttention", "after cleanup: LlamaAttention"],
    "complete_qwen2_moe.py": [
        "attention: FusedQKVAttention (192, 64)",
        "experts: ModuleListExperts 4 x MoeMLP",
    ],
    "api_reference.py": [
        "register_patch_mapping: CustomAttention",
        "unregister_patch_mapping: Qwen2MoeExperts",
        "clear_patch_mapping: {}",
        "apply_patches, inside: CustomExperts",
        "apply_patches, outside: Qwen2MoeExperts",
    ],
    "trl_grpo_routing_replay.py": [
        "training forwards checked: 6 (old-policy log-probs in 2 chunks, 2 steps x 2 micro-batches)",
    ],
}

#: examples whose last line must start with this (the example exits 1 otherwise)
LAST_LINE = {"trl_grpo_routing_replay.py": "replay: exact ("}

#: examples whose last line reports the largest logits difference against the plain model
COMPARED = {"troubleshooting_weight_shapes.py", "complete_qwen2_moe.py"}

#: examples of 5.x-only classes (the documentation is written for transformers 5: `Qwen2MoeExperts`,
#: attention classes that load-time patching can reach); skipped, with this reason, on 4.57
NEEDS_V5 = {"api_reference.py", "complete_qwen2_moe.py", "pattern_matching.py"}
_V5_REASON = "the documentation's example uses classes of transformers 5.x (`Qwen2MoeExperts`, ...)"

#: examples owned and tested elsewhere, and helpers that are not examples
NOT_HERE = {"_tiny.py", "demo.py", "seed_moe_replay.py", "vllm_to_trainer.py"}  # demo.py: test_demo below


@pytest.fixture(scope="module")
def example_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    cache = tmp_path_factory.mktemp("examples-cache")
    return dict(os.environ, MODELGRAFT_EXAMPLES_CACHE=str(cache), HF_HUB_OFFLINE="1")


def test_every_example_is_covered() -> None:
    present = {p.name for p in EXAMPLES.glob("*.py")} - NOT_HERE
    assert present == set(EXPECTED)


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=requires_v5_because(_V5_REASON) if n in NEEDS_V5 else ())
        for n in sorted(EXPECTED)
    ],
)
def test_example_runs_and_prints_what_the_docs_say(name: str, example_env: dict[str, str]) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, env=example_env, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    position = -1
    for expected in EXPECTED[name]:
        assert expected in lines[position + 1 :], (
            f"{expected!r} not printed (in order) by {name}:\n{done.stdout}"
        )
        position = lines.index(expected, position + 1)
    if name in LAST_LINE:
        assert lines[-1].startswith(LAST_LINE[name]), done.stdout
    if name in COMPARED:
        found = re.search(r"max \|logits difference\| = (\S+)$", done.stdout.rstrip())
        assert found is not None, done.stdout
        assert float(found.group(1)) <= 1e-5


@requires_v5_because("the demo grafts the fused 3D experts of transformers 5.x")
def test_demo_runs_the_complete_example_and_says_everything_matched(example_env: dict[str, str]) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "demo.py")],
        capture_output=True,
        text=True,
        env=example_env,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert re.fullmatch(r"demo: everything matched \((\d+)/\1 checks\)", lines[-1]), lines[-1]
    for step in ("logits", "hidden states", "saved files", "plain reload", "graft_model", "verify"):
        assert any(line.startswith(f"  [ok] {step}:") for line in lines), step
    assert "GraftReport for Qwen2MoeForCausalLM: 4 module(s) replaced" in done.stdout
    # A newcomer's first screen is the demo: the import-time noise of packages the demo does not use
    # (torchao's "Failed to load" of its CUDA kernels, torch's register_constant deprecation that
    # torchao triggers) must not reach either stream (issue 20 point 8).
    assert lines[0].startswith("1. tiny qwen2_moe checkpoint"), lines[:5]
    assert done.stderr == "", done.stderr[-3000:]
