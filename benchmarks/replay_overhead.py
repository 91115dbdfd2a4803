"""Cost of MoE routing record and replay on a training step.

A forward and backward of a small Qwen3-MoE (4 layers, 16 experts, top-2, 512 tokens) run plain,
under ``record_routing`` and under ``replay_routing``; the three are interleaved round by round so
machine load hits them alike, and the median of each is compared. Targets: both ratios <= 1.10.
``--model deepseek_v3`` runs the same sizes on a group-limited router (4 groups, 2 kept), where
replay also steers the group pick.

Run: ``python benchmarks/replay_overhead.py [--model qwen3_moe|deepseek_v3] [--rounds N] [--threads N]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from modelgraft.moe import moe_layers, record_routing, replay_routing

_SIZES = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
}
_FAMILY = {
    "qwen3_moe": {"head_dim": 64, "num_experts": 16},
    "deepseek_v3": {
        "n_routed_experts": 16,
        "n_group": 4,
        "topk_group": 2,
        "first_k_dense_replace": 0,
        "n_shared_experts": 1,
        "kv_lora_rank": 64,
        "q_lora_rank": 64,
        "qk_rope_head_dim": 32,
        "qk_nope_head_dim": 32,
        "v_head_dim": 64,
    },
}


def _model(model_type: str) -> torch.nn.Module:
    config = AutoConfig.for_model(model_type, **_SIZES, **_FAMILY[model_type])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).train()
    with torch.no_grad():
        for layer in moe_layers(model):
            layer.router.weight.normal_(std=0.1)
    return model


def _step(model: torch.nn.Module, ids: torch.Tensor, context: Callable[[], AbstractContextManager]) -> float:
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    with context():
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(_FAMILY), default="qwen3_moe")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier timings)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model = _model(args.model)
    ids = torch.randint(0, 1024, (2, 256), generator=torch.Generator().manual_seed(0))  # 512 tokens
    with record_routing(model) as trace:
        model(input_ids=ids, use_cache=False)
    contexts: dict[str, Callable[[], AbstractContextManager]] = {
        "plain": nullcontext,
        "record": lambda: record_routing(model),
        "replay": lambda: replay_routing(model, trace),
    }
    for context in contexts.values():  # warm-up
        _step(model, ids, context)
    times: dict[str, list[float]] = {name: [] for name in contexts}
    for _ in range(args.rounds):
        for name, context in contexts.items():
            times[name].append(_step(model, ids, context))

    plain = statistics.median(times["plain"])
    print(f"{args.model}: 4 layers, 16 experts, top-2, 512 tokens; forward+backward, median of {args.rounds}")
    print(f"  plain : {plain * 1e3:8.1f} ms")
    for name in ("record", "replay"):
        median = statistics.median(times[name])
        print(f"  {name}: {median * 1e3:8.1f} ms  ratio {median / plain:.3f}x (target <= 1.10x)")


if __name__ == "__main__":
    main()
