"""Peak memory of streaming a grafted model's weights in the original layout (weight sync).

Builds a ~150M-parameter Llama (grouped-query attention: 12 heads, 4 KV heads; fp32, random
weights), grafts fused QKV and fused gate/up into it in place (``modelgraft.graft_model``), makes
every weight resident, then iterates ``modelgraft.original_state_dict(model)`` the way an engine's
``load_weights`` consumes it (each tensor read, none kept). The peak resident memory of the process
during the iteration (Linux ``VmHWM``, reset right before) is reported against the model's own
size: ``(model bytes + peak - resident before) / model bytes``. Target: <= 1.10x.

For contrast it also reports a sync that first materialises a full copy of the original layout
(``{name: tensor.clone() ...}``), about 2x.

``--model qwen2_moe`` does the same on a ~190M Qwen2-MoE (32 experts) with fused QKV grafted in
place; on transformers 5.x its fused 3D experts are reverted to the checkpoint's per-expert tensors
(``experts.N.gate_proj.weight``) one layer at a time.

Run: ``.venv/bin/python benchmarks/weight_sync.py [--model llama|qwen2_moe]`` (Linux only).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import load_conversion  # benchmarks/ is on sys.path when a script here runs
import modelgraft
from modelgraft.grafts import fused_gate_up, fused_qkv

# The same models as the load benchmark (its table: cache folder name, config fields).
MODELS = {name: fields for name, (_cache, fields) in load_conversion.MODELS.items()}
TARGET = 1.10


def _status(field: str) -> int:
    """A ``/proc/self/status`` memory field, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no `{field}` in /proc/self/status (this benchmark needs Linux)")


def _reset_peak() -> int:
    """Reset the process's peak RSS to its current RSS (Linux ``clear_refs`` 5); return that RSS.

    Freed heap memory is returned to the system first (``malloc_trim``), so that allocations made
    while iterating show up in the peak instead of reusing pages that are already resident."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the peak may then read low, never high
        pass
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def _model_bytes(model: torch.nn.Module) -> int:
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model.state_dict().values()
    }
    return sum(storages.values())


def _build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(name, **MODELS[name])
    model = AutoModelForCausalLM.from_config(config).eval()
    modelgraft.graft_model(model, fused_qkv(name))
    if name == "llama":
        modelgraft.graft_model(model, fused_gate_up(name))
    with torch.no_grad():  # every weight resident before measuring
        for tensor in model.state_dict().values():
            tensor.sum()
    return model


def _measure(model: torch.nn.Module, keep_copies: bool) -> tuple[float, int, int, float]:
    """(ratio, extra bytes at peak, tensors yielded, seconds) of one sync."""
    size = _model_bytes(model)
    before = _reset_peak()
    start = time.perf_counter()
    count = 0
    kept: dict[str, torch.Tensor] = {}
    checksum = 0.0
    for name, tensor in modelgraft.original_state_dict(model):
        if keep_copies:
            kept[name] = tensor.clone()
        checksum += float(tensor.reshape(-1)[-1])  # read it, as a consumer would
        count += 1
    seconds = time.perf_counter() - start
    extra = max(_status("VmHWM") - before, 0)
    del kept
    return (size + extra) / size, extra, count, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="llama")
    args = parser.parse_args()
    model = _build(args.model)
    size = _model_bytes(model)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.model}: {params / 1e6:.0f}M parameters, {size / 2**20:.0f} MiB (fp32), grafted in place")
    ratio, extra, count, seconds = _measure(model, keep_copies=False)
    print(
        f"original_state_dict (streaming): peak {ratio:.3f}x the model's size (+{extra / 2**20:.1f} MiB), "
        f"{count} tensors in {seconds:.2f} s; target <= {TARGET:.2f}x: {'ok' if ratio <= TARGET else 'FAILED'}"
    )
    copy_ratio, copy_extra, _, _ = _measure(model, keep_copies=True)
    print(f"full copy first (for contrast): peak {copy_ratio:.3f}x (+{copy_extra / 2**20:.1f} MiB)")
    print(f"ratio {ratio:.3f}")


if __name__ == "__main__":
    main()
