"""Peak memory and time of a causal-LM training step with and without the chunked-loss graft.

Run: ``python benchmarks/chunked_loss.py`` (``make bench`` runs it). Defaults: a 2-layer Llama,
hidden 512, vocabulary 65536, one sequence of 4096 tokens, fp32 on the CPU; a step is forward with
labels plus backward. Targets: grafted / plain peak memory at most 0.5, time at most 1.1.

Memory: each variant runs in a fresh subprocess (nothing shared: allocator, caches, the other
variant's buffers). After a warm-up step the process's peak resident set size is reset
(``/proc/self/clear_refs``) and one step runs; the step's memory is the new peak (``VmHWM``) minus
the resident size before it, and the process peak is reported too. With ``--device cuda``, CUDA's
``max_memory_allocated`` is used instead. Time: both variants in one process, same weights, timed
alternately after a warm-up so that drift in machine load hits both alike; medians of wall time.

Both variants' losses and the gradient of ``lm_head.weight`` are compared before timing.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from modelgraft.grafts import graft_chunked_lm_loss


def _config(args: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.tokens,
        attn_implementation="sdpa",
    )


def _model(args: argparse.Namespace, grafted: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(_config(args)).to(args.device).train()
    return graft_chunked_lm_loss(model, chunk_size=args.chunk_size) if grafted else model


def _batch(args: argparse.Namespace) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, args.vocab, (1, args.tokens), generator=generator).to(args.device)


def _step(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _measure_memory(args: argparse.Namespace, grafted: bool) -> dict[str, Any]:
    """One step's memory in this (fresh) process."""
    torch.set_num_threads(args.threads)
    model = _model(args, grafted)
    ids = _batch(args)
    _step(model, ids)  # warm-up: lazy initialisation, allocator pools
    model.zero_grad(set_to_none=True)
    _sync(args.device)
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        _step(model, ids)
        _sync(args.device)
        peak = torch.cuda.max_memory_allocated()
        return {"step_mib": (peak - before) / 2**20, "peak_mib": peak / 2**20, "measure": "cuda allocator"}
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS (VmHWM) to the current RSS
    _step(model, ids)
    peak = _status_kib("VmHWM")
    return {"step_mib": (peak - before) / 1024, "peak_mib": peak / 1024, "measure": "peak RSS"}


def _memory_in_subprocess(args: argparse.Namespace, grafted: bool) -> dict[str, Any]:
    command = [sys.executable, __file__, "--memory-child", "grafted" if grafted else "plain", *args.forward]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _time(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    plain = _model(args, grafted=False)
    grafted = graft_chunked_lm_loss(copy.deepcopy(plain), chunk_size=args.chunk_size)
    ids = _batch(args)
    loss_plain = _step(plain, ids)
    grad_plain = plain.lm_head.weight.grad.clone()
    loss_grafted = _step(grafted, ids)
    grad_grafted = grafted.lm_head.weight.grad
    check = {
        "loss_diff": abs(loss_plain.item() - loss_grafted.item()),
        "lm_head_grad_max_diff": (grad_plain - grad_grafted).abs().max().item(),
    }
    del grad_plain
    for _ in range(args.warmup):
        _step(plain, ids)
        _step(grafted, ids)
    times: dict[str, list[float]] = {"plain": [], "grafted": []}
    for i in range(args.repeats):
        order = ("plain", "grafted") if i % 2 == 0 else ("grafted", "plain")
        for name in order:
            model = plain if name == "plain" else grafted
            _sync(args.device)
            start = time.perf_counter()
            _step(model, ids)
            _sync(args.device)
            times[name].append(time.perf_counter() - start)
    return {**check, **{name: statistics.median(values) for name, values in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1376)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument(
        "--chunk-size", type=int, default=None, help="tokens per chunk (default: the graft's)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--memory-child", choices=("plain", "grafted"), help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args()
    args.forward = [a for a in sys.argv[1:] if a not in ("--memory-child", "plain", "grafted")]

    if args.memory_child:
        print(json.dumps(_measure_memory(args, args.memory_child == "grafted")))
        return

    memory = {name: _memory_in_subprocess(args, name == "grafted") for name in ("plain", "grafted")}
    timing = _time(args)
    print(
        f"chunked LM loss: Llama, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, "
        f"{args.tokens} tokens, {args.device}, {args.threads} threads, chunk "
        f"{args.chunk_size or 'default'}"
    )
    print(
        f"  check: |loss diff| {timing['loss_diff']:.2e}, max |lm_head grad diff| {timing['lm_head_grad_max_diff']:.2e}"
    )
    measure = memory["plain"]["measure"]
    for name in ("plain", "grafted"):
        print(
            f"  {name:8s} step memory {memory[name]['step_mib']:8.1f} MiB (process peak "
            f"{memory[name]['peak_mib']:8.1f} MiB, {measure})   step time {timing[name] * 1000:8.1f} ms"
        )
    step_ratio = memory["grafted"]["step_mib"] / memory["plain"]["step_mib"]
    peak_ratio = memory["grafted"]["peak_mib"] / memory["plain"]["peak_mib"]
    time_ratio = timing["grafted"] / timing["plain"]
    print(f"  grafted / plain: step memory {step_ratio:.3f}, process peak {peak_ratio:.3f} (target <= 0.5)")
    print(
        f"  grafted / plain: step time {time_ratio:.3f} (target <= 1.1; medians of {args.repeats}, alternated)"
    )


if __name__ == "__main__":
    main()
