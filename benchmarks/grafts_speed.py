"""Forward+backward speed of a Llama-shaped model with and without the fused QKV and gate/up grafts.

Run: ``python benchmarks/grafts_speed.py`` (``make bench`` runs it). Prints the median step time of
each variant and the ratio grafted / plain; the target is a ratio of at most 1.0.

Both models hold the same weights (the grafted one is a copy of the plain one, grafted in place with
``modelgraft.graft_model``), run in fp32 on the CPU with a fixed thread count, and are timed alternately,
after a warm-up, so that drift in machine load affects both alike.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from modelgraft import graft_model
from modelgraft.grafts import fused_gate_up, fused_qkv


def _config(args: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.tokens,
        attn_implementation="sdpa",
    )


def _step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, float]:
    """One forward+backward; returns (wall seconds, process CPU seconds)."""
    model.zero_grad(set_to_none=True)
    start, start_cpu = time.perf_counter(), time.process_time()
    logits = model(input_ids=ids).logits
    logits.float().pow(2).mean().backward()
    return time.perf_counter() - start, time.process_time() - start_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=min(4, torch.get_num_threads()))
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = _config(args)
    plain = LlamaForCausalLM(config).train()
    graft = fused_qkv("llama") + fused_gate_up("llama")
    grafted = graft_model(copy.deepcopy(plain), graft).train()
    ids = torch.randint(0, args.vocab, (1, args.tokens))

    with torch.no_grad():
        diff = (plain(input_ids=ids).logits - grafted(input_ids=ids).logits).abs().max().item()
    for _ in range(args.warmup):
        _step(plain, ids)
        _step(grafted, ids)
    times: dict[str, list[float]] = {"plain": [], "grafted": []}
    cpu: dict[str, list[float]] = {"plain": [], "grafted": []}
    for i in range(args.repeats):
        # Alternate which variant goes first so that neither always follows the other.
        order = ("plain", "grafted") if i % 2 == 0 else ("grafted", "plain")
        for name in order:
            wall, used = _step(plain if name == "plain" else grafted, ids)
            times[name].append(wall)
            cpu[name].append(used)

    plain_s = statistics.median(times["plain"])
    grafted_s = statistics.median(times["grafted"])
    print(
        f"grafts_speed: Llama hidden={args.hidden} layers={args.layers} heads={args.heads}/{args.kv_heads} "
        f"tokens={args.tokens} fp32 cpu threads={args.threads} repeats={args.repeats}"
    )
    print(f"  max |logits diff| grafted vs plain: {diff:.2e}")
    print(f"  plain   forward+backward median: {plain_s * 1e3:8.1f} ms")
    print(f"  grafted forward+backward median: {grafted_s * 1e3:8.1f} ms  (fused QKV + fused gate/up)")
    # Each pair ran back to back, so its ratio cancels slow drift in machine load.
    paired = statistics.median(g / p for g, p in zip(times["grafted"], times["plain"], strict=True))
    best = min(times["grafted"]) / min(times["plain"])
    print(f"  ratio grafted/plain: {grafted_s / plain_s:.3f}  (target <= 1.0)")
    print(f"  median of paired ratios: {paired:.3f}; ratio of fastest runs: {best:.3f}")
    # CPU time is less sensitive than wall time to other processes competing for the cores.
    cpu_ratio = statistics.median(cpu["grafted"]) / statistics.median(cpu["plain"])
    print(f"  ratio of median process CPU time: {cpu_ratio:.3f}")


if __name__ == "__main__":
    main()
