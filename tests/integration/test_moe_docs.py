"""The per-stack examples of docs/moe.md run as written (issue 11, "Docs and examples").

Each ``<!-- example: NAME -->`` block of the docs is executed on a tiny Qwen3-MoE ``policy``; the
engines are stand-ins that build their output exactly as vLLM and SGLang do
(``tests/engine_payloads.py``). After each run the test reads what the experts received in the
training forwards and checks it against the trace, and the trace against the engine's routes.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from moe_helpers import ExpertInputs

from engine_payloads import engine_routes, fake_post_json, fake_vllm_module, qwen3_moe
from modelgraft.moe import RoutingTrace, moe_layers, pack_routes

DOC = Path(__file__).resolve().parents[2] / "docs" / "moe.md"
_BLOCK = re.compile(r"<!-- example: ([\w-]+) -->\n```python\n(.*?)\n```", re.S)
STACKS = ["vllm-offline", "vllm-server", "sglang", "hf-generate", "packed-micro-batches"]
PROMPTS = [[5, 9, 17, 33], [7, 40, 2], [11, 3, 8, 21, 60], [14, 6]]
MOE = [1, 2]  # layer 0 of the policy is dense


def _examples() -> dict[str, str]:
    return dict(_BLOCK.findall(DOC.read_text()))


def test_every_stack_has_one_example() -> None:
    assert sorted(_examples()) == sorted(STACKS)


@pytest.fixture
def run(monkeypatch: pytest.MonkeyPatch) -> Any:
    def run(name: str, *, without: tuple[str, ...] = ()) -> tuple[dict[str, Any], ExpertInputs]:
        """Run the example on a fresh policy, less its lines that contain any of ``without``."""
        policy = qwen3_moe(num_hidden_layers=3, dense=(0,))
        monkeypatch.setitem(sys.modules, "vllm", fake_vllm_module(policy))
        source = _examples()[name]
        kept = [line for line in source.splitlines() if not any(part in line for part in without)]
        assert len(kept) == len(source.splitlines()) - len(without), without  # each part is one line
        namespace = {
            "policy": policy,
            "prompts": [list(p) for p in PROMPTS],
            "post_json": fake_post_json(policy),
        }
        with ExpertInputs(policy) as seen:
            exec(compile("\n".join(kept), f"docs/moe.md [{name}]", "exec"), namespace)
        return namespace, seen

    return run


def _last_forward_replayed(seen: ExpertInputs, trace: RoutingTrace) -> None:
    """The experts got exactly the trace's ids in the training forward (the last one of the example)."""
    for calls in seen.calls.values():
        del calls[:-1]
    seen.assert_matches(trace)


def _router_gradients(policy: torch.nn.Module) -> None:
    for layer in moe_layers(policy):
        grad = layer.router.weight.grad
        assert grad is not None and bool(torch.isfinite(grad).all()) and bool(grad.abs().sum() > 0), (
            layer.name
        )


def _engine_rows(policy: torch.nn.Module, trace: RoutingTrace, sequences: list[list[int]]) -> None:
    """Each sequence's real rows are the engine's routes of that sequence (right padding)."""
    width = trace.seq_len
    assert trace.batch_size == len(sequences) and trace.layer_ids == MOE
    for row, tokens in enumerate(sequences):
        expected = torch.from_numpy(engine_routes(policy, tokens)[:, MOE].astype(np.int64))
        got = torch.stack([t.reshape(-1, width, 2)[row, : len(tokens) - 1] for t in trace], dim=1)
        assert torch.equal(got, expected), row


@pytest.mark.parametrize("name", ["vllm-offline", "vllm-server", "sglang"])
def test_engine_examples_replay_the_engine_routes(run, name: str) -> None:
    namespace, seen = run(name)
    policy, trace, sequences = namespace["policy"], namespace["trace"], namespace["sequences"]
    rows_per_prompt = 2 if name == "vllm-offline" else 1  # n=2 in the offline example
    assert len(sequences) == rows_per_prompt * len(PROMPTS)
    assert all(len(s) == len(PROMPTS[i // rows_per_prompt]) + 4 for i, s in enumerate(sequences))
    assert trace.layers[0].dtype == torch.uint8  # compact: 8 experts
    _engine_rows(policy, trace, sequences)
    _last_forward_replayed(seen, trace)
    _router_gradients(policy)


def test_hf_generate_example_replays_what_generate_used(run) -> None:
    namespace, seen = run("hf-generate")
    sequences, trace = namespace["sequences"], namespace["trace"]
    assert sequences.shape == (len(PROMPTS), 5 + 4) and trace.batch_size == len(PROMPTS)
    assert trace.num_tokens == sequences.numel()
    assert torch.isfinite(namespace["loss"]) and namespace["loss"].dtype == torch.float32
    _last_forward_replayed(seen, trace)
    _router_gradients(namespace["policy"])


def test_packed_micro_batch_example_replays_each_micro_batch_and_its_recompute(run) -> None:
    namespace, seen = run("packed-micro-batches")
    policy, trace, mask = namespace["policy"], namespace["trace"], namespace["attention_mask"]
    assert any(getattr(m, "gradient_checkpointing", False) for m in policy.modules())
    assert trace.batch_size == len(PROMPTS)
    expected = [pack_routes(trace.select(mb), mask[mb]) for mb in namespace["micro_batches"]]
    calls = {name: c[-4:] for name, c in seen.calls.items()}  # earlier calls: the stand-in engine
    for i, which in enumerate((0, 0, 1, 1)):  # forward 1, recompute 1, forward 2, recompute 2
        for name in calls:
            seen.calls[name] = [calls[name][i]]
        seen.assert_matches(expected[which])
    assert torch.isfinite(namespace["loss"])


@pytest.mark.parametrize(
    "without",
    [("gradient_checkpointing_enable",), ("gradient_checkpointing_enable", "use_cache=")],
    ids=["no-checkpointing", "no-checkpointing-no-use_cache"],
)
def test_packed_example_loss_does_not_depend_on_checkpointing_or_the_cache(run, without) -> None:
    """Without gradient checkpointing the config's use_cache=True used to join the packed sequences
    (transformers 5.24: loss 4.8220 instead of 4.8232); the example passes use_cache=False and the
    replay block sets it when a packed forward leaves it out (issue 20 point 4)."""
    written, _ = run("packed-micro-batches")
    reference = written["loss"].detach()
    variant, _ = run("packed-micro-batches", without=without)
    assert not any(getattr(m, "gradient_checkpointing", False) for m in variant["policy"].modules())
    loss = variant["loss"].detach()
    assert torch.isfinite(loss) and loss.dtype == reference.dtype and torch.equal(loss, reference), (
        float(loss),
        float(reference),
    )
