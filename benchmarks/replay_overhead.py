"""Cost of MoE routing record and replay on a training step, and the bytes a trace takes.

A forward and backward of a small Qwen3-MoE (4 layers, 16 experts, top-2, 512 tokens) run plain,
under ``record_routing`` and under ``replay_routing``; the three are interleaved round by round so
machine load hits them alike, and the median of each is compared. Targets: both ratios <= 1.10.
The same is measured for a packed, micro-batched step: a rollout batch of 4 sequences of 256, 192,
128 and 224 real tokens (right padding to 256), trained as 2 micro-batches each packed into one
padding-free row, replayed from the one trace of the rollout batch with ``micro_batch``.
``--model deepseek_v3`` runs the same sizes on a group-limited router (4 groups, 2 kept), where
replay also steers the group pick.

It first prints the bytes of a trace of 32k tokens x 48 layers x top-8 (128 experts): compact
(``uint8`` ids, as kept in memory, on disk and by ``to_bytes``) against ``int64``.

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

from modelgraft.moe import RoutingTrace, moe_layers, pack_sequences, record_routing, replay_routing

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


def _trace_bytes() -> None:
    tokens, layers, top_k, experts = 32 * 1024, 48, 8, 128
    ids = torch.randint(0, experts, (tokens, top_k), generator=torch.Generator().manual_seed(0))
    wide = RoutingTrace([ids] * layers, top_k=top_k, num_experts=experts)  # int64, one tensor shared
    compact = wide.compact()
    print(f"trace of {tokens} tokens x {layers} layers x top-{top_k} ({experts} experts):")
    print(f"  int64   : {wide.nbytes:>12,} bytes")
    print(
        f"  compact : {compact.nbytes:>12,} bytes ({compact.layers[0].dtype}), {wide.nbytes / compact.nbytes:.0f}x smaller"
    )
    print(f"  to_bytes: {len(compact.to_bytes()):>12,} bytes (safetensors, with metadata)")


def _packed_step(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, mode: str, trace: RoutingTrace
) -> float:
    """Two micro-batches, each packed into one padding-free row; gradients accumulate."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    outer: AbstractContextManager = nullcontext()
    if mode == "record":
        outer = record_routing(model)
    elif mode == "replay":
        outer = replay_routing(model, trace)
    with outer as session:
        for mb in ([0, 2], [1, 3]):
            packed = pack_sequences(ids[mb], mask[mb])
            labels = packed["input_ids"].masked_fill(packed["position_ids"] == 0, -100)
            inner = session.micro_batch(mb, attention_mask=mask) if mode == "replay" else nullcontext()
            with inner:
                loss = model(
                    input_ids=packed["input_ids"], position_ids=packed["position_ids"], labels=labels
                ).loss
                (loss / 2).backward()
    return time.perf_counter() - start


def _report(title: str, times: dict[str, list[float]], rounds: int) -> None:
    plain = statistics.median(times["plain"])
    print(f"{title}; forward+backward, median of {rounds}")
    print(f"  plain : {plain * 1e3:8.1f} ms")
    for name in ("record", "replay"):
        median = statistics.median(times[name])
        print(f"  {name}: {median * 1e3:8.1f} ms  ratio {median / plain:.3f}x (target <= 1.10x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(_FAMILY), default="qwen3_moe")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier timings)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    _trace_bytes()

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

    _report(f"{args.model}: 4 layers, 16 experts, top-2, 512 tokens", times, args.rounds)

    lengths = torch.tensor([256, 192, 128, 224])
    mask = (torch.arange(256) < lengths[:, None]).long()
    padded = torch.randint(1, 1024, (4, 256), generator=torch.Generator().manual_seed(1)) * mask
    # Right padding does not change what causal attention gives the real tokens, so the rollout is
    # recorded without the mask (DeepSeek-V3's sdpa path fails on a padding mask at these sizes).
    with torch.no_grad(), record_routing(model) as rollout:
        model(input_ids=padded, use_cache=False)
    modes = ("plain", "record", "replay")
    for mode in modes:  # warm-up
        _packed_step(model, padded, mask, mode, rollout)
    packed_times: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(args.rounds):
        for mode in modes:
            packed_times[mode].append(_packed_step(model, padded, mask, mode, rollout))
    _report(
        f"{args.model}: packed, 2 micro-batches of 2 sequences (800 real tokens)", packed_times, args.rounds
    )


if __name__ == "__main__":
    main()
