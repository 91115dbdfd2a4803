"""Forward+backward speed of grafted models against plain ones: a Llama-shaped model with and
without the fused QKV and gate/up grafts, and a Qwen3-MoE-like sparse MoE layer (64 experts, top-8,
4096 tokens) with fused 3D experts against the same layer with ``linear_experts``' per-expert
``nn.Linear`` experts (transformers 5, ``experts_implementation="grouped_mm"`` on both sides).

Run: ``python benchmarks/grafts_speed.py`` (``make bench`` runs it; ``--only llama`` or
``--only moe`` runs one part). Prints the median step time of each variant and the ratio grafted /
plain; the target is a ratio of at most 1.0.

Both models hold the same weights (the grafted one is a copy of the plain one, grafted in place with
``modelgraft.graft_model``), run in fp32 on the CPU with a fixed thread count, and are timed alternately,
after a warm-up, so that drift in machine load affects both alike.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from modelgraft import _compat, graft_model
from modelgraft.grafts import fused_gate_up, fused_qkv, linear_experts_class


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


def _timed(
    variants: dict[str, Callable[[], float]], repeats: int, warmup: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Run each variant's step alternately; (wall seconds, process CPU seconds) per variant."""
    for _ in range(warmup):
        for step in variants.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for i in range(repeats):
        # Alternate which variant goes first so that neither always follows the other.
        for name in names if i % 2 == 0 else names[::-1]:
            start, start_cpu = time.perf_counter(), time.process_time()
            variants[name]()
            times[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    return times, cpu


def _print_ratios(times: dict[str, list[float]], cpu: dict[str, list[float]], label: str) -> None:
    plain_s, grafted_s = statistics.median(times["plain"]), statistics.median(times["grafted"])
    print(f"  plain   forward+backward median: {plain_s * 1e3:8.1f} ms")
    print(f"  grafted forward+backward median: {grafted_s * 1e3:8.1f} ms  ({label})")
    # Each pair ran back to back, so its ratio cancels slow drift in machine load.
    paired = statistics.median(g / p for g, p in zip(times["grafted"], times["plain"], strict=True))
    best = min(times["grafted"]) / min(times["plain"])
    print(f"  ratio grafted/plain: {grafted_s / plain_s:.3f}  (target <= 1.0)")
    print(f"  median of paired ratios: {paired:.3f}; ratio of fastest runs: {best:.3f}")
    # CPU time is less sensitive than wall time to other processes competing for the cores.
    cpu_ratio = statistics.median(cpu["grafted"]) / statistics.median(cpu["plain"])
    print(f"  ratio of median process CPU time: {cpu_ratio:.3f}")


def moe_layer(args: argparse.Namespace) -> None:
    """A Qwen3-MoE sparse block with fused experts against the same block with per-expert layers."""
    if not _compat.FUSED_MOE_EXPERTS:
        print("grafts_speed moe: skipped, this transformers stores experts per expert (no fused 3D experts)")
        return
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts, Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_size=args.moe_hidden,
        moe_intermediate_size=args.moe_intermediate,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        experts_implementation="grouped_mm",
    )
    torch.manual_seed(0)
    plain = Qwen3MoeSparseMoeBlock(config).train()
    grafted = copy.deepcopy(plain)
    experts = linear_experts_class(Qwen3MoeExperts)(config)
    inter = args.moe_intermediate
    with torch.no_grad():  # the same weights, expert by expert
        for index, expert in enumerate(experts):
            expert.gate_proj.weight.copy_(plain.experts.gate_up_proj[index, :inter])
            expert.up_proj.weight.copy_(plain.experts.gate_up_proj[index, inter:])
            expert.down_proj.weight.copy_(plain.experts.down_proj[index])
    grafted.experts = experts
    x = torch.randn(1, args.moe_tokens, args.moe_hidden)

    with torch.no_grad():
        expected, got = plain(x), grafted(x)
    finite = bool(torch.isfinite(expected).all() and torch.isfinite(got).all())
    diff = (expected - got).abs().max().item()

    def step(block: torch.nn.Module) -> Callable[[], float]:
        def run() -> float:
            block.zero_grad(set_to_none=True)
            inputs = x.detach().requires_grad_(True)
            out = block(inputs)
            out.pow(2).mean().backward()
            return float(out.detach().sum())

        return run

    times, cpu = _timed({"plain": step(plain), "grafted": step(grafted)}, args.moe_repeats, args.warmup)
    print(
        f"grafts_speed moe: Qwen3-MoE-like layer experts={args.experts} top_k={args.top_k} "
        f"hidden={args.moe_hidden} intermediate={args.moe_intermediate} tokens={args.moe_tokens} fp32 cpu "
        f"threads={args.threads} repeats={args.moe_repeats} experts_implementation=grouped_mm"
    )
    print(f"  max |output diff| grafted vs plain: {diff:.2e} (finite: {finite})")
    _print_ratios(times, cpu, "per-expert nn.Linear experts, linear_experts")


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
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--moe-hidden", type=int, default=256)
    parser.add_argument("--moe-intermediate", type=int, default=96)
    parser.add_argument("--moe-tokens", type=int, default=4096)
    parser.add_argument("--moe-repeats", type=int, default=6)
    parser.add_argument("--only", choices=("llama", "moe"), default=None)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    if args.only != "moe":
        llama(args)
    if args.only != "llama":
        moe_layer(args)


def llama(args: argparse.Namespace) -> None:
    """The Llama-shaped model with and without the fused QKV and gate/up grafts."""
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
