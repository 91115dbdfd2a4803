"""Load and save cost of checkpoint conversion: modelgraft vs plain transformers vs its built-in.

Generates once (cached under ``.bench-cache/``) a Llama-shaped checkpoint of about 150M
parameters with random weights (grouped-query attention: 12 heads, 4 KV heads), then measures,
each in its own subprocess (peak RSS from ``resource.getrusage``):

* ``plain``: ``AutoModelForCausalLM.from_pretrained`` with nothing registered, then a plain save;
* ``modelgraft``: fused QKV and fused gate/up replacements with their converters
  (``modelgraft.patched``), then a save to the original layout (the default);
* ``builtin``: the same replacements and conversions registered through transformers' own
  ``transformers.monkey_patching`` / ``transformers.conversion_mapping`` (modelgraft not imported).

Run: ``.venv/bin/python benchmarks/load_conversion.py [--repeats 3] [--model qwen2_moe]``.
``--model qwen2_moe`` loads a ~190M-parameter Qwen2-MoE checkpoint (32 experts) plainly (transformers
merges the per-expert tensors itself) and with modelgraft's fused QKV graft, whose entry runs that
merge through modelgraft. Targets: modelgraft load
<= 1.25x plain time and <= 1.15x plain peak memory, not slower than the built-in; save <= 1.25x a
plain save.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
MODELS = {
    "llama": (
        "llama-150m",
        dict(
            hidden_size=768,
            intermediate_size=2560,
            num_hidden_layers=14,
            num_attention_heads=12,
            num_key_value_heads=4,
            vocab_size=32000,
            tie_word_embeddings=False,
        ),
    ),
    # transformers 5 merges the per-expert checkpoint tensors into 3D experts on load (its own
    # conversion); with a graft, modelgraft's entry carries that merge and runs it itself.
    "qwen2_moe": (
        "qwen2-moe-190m",
        dict(
            hidden_size=512,
            intermediate_size=1024,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=1024,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=4,
            num_experts=32,
            num_experts_per_tok=4,
            vocab_size=32000,
            tie_word_embeddings=False,
        ),
    ),
}


def _cache(model: str) -> Path:
    return ROOT / ".bench-cache" / MODELS[model][0]


# ---- replacement classes (no modelgraft import, so the built-in mode can use them too) ----------
def _replacements():
    from transformers.models.llama import modeling_llama as ml

    class FusedQKVAttention(ml.LlamaAttention):
        def __init__(self, config, layer_idx):
            super().__init__(config, layer_idx)
            del self.q_proj, self.k_proj, self.v_proj
            kv = config.num_key_value_heads * self.head_dim
            self.sizes = [config.num_attention_heads * self.head_dim, kv, kv]
            self.qkv_proj = nn.Linear(config.hidden_size, sum(self.sizes), bias=config.attention_bias)

        def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
            shape = (*hidden_states.shape[:-1], -1, self.head_dim)
            q, k, v = (
                t.view(shape).transpose(1, 2) for t in self.qkv_proj(hidden_states).split(self.sizes, -1)
            )
            q, k = ml.apply_rotary_pos_emb(q, k, *position_embeddings)
            out, w = ml.eager_attention_forward(self, q, k, v, attention_mask, scaling=self.scaling)
            return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), w

    class FusedGateUpMLP(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
            self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
            self.act_fn = nn.SiLU()

        def forward(self, x):
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(self.act_fn(gate) * up)

    return {"LlamaAttention": FusedQKVAttention, "LlamaMLP": FusedGateUpMLP}


def _generate(model_type: str) -> None:
    cache = _cache(model_type)
    if (cache / "config.json").exists():
        return
    from transformers import AutoConfig, AutoModelForCausalLM

    print(f"generating a {model_type} checkpoint with random weights in {cache} (once)", flush=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **MODELS[model_type][1]))
    print(f"  {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters", flush=True)
    model.save_pretrained(cache)


# ---- one measurement, in a fresh process --------------------------------------------------------
def _child(mode: str, model_type: str) -> dict:
    from transformers import AutoModelForCausalLM

    cache = _cache(model_type)
    if model_type != "llama":
        scope = None
        if mode == "modelgraft":
            from modelgraft.grafts import fused_qkv

            scope = fused_qkv(model_type).applied()
    elif mode == "modelgraft":
        import modelgraft

        qkv = modelgraft.WeightConverter(
            ["q_proj", "k_proj", "v_proj"], "qkv_proj", [modelgraft.Concatenate(0)]
        )
        gate_up = modelgraft.WeightConverter(
            ["gate_proj", "up_proj"], "gate_up_proj", [modelgraft.Concatenate(0)]
        )
        scope = modelgraft.patched(_replacements(), conversions={"llama": [qkv, gate_up]})
    elif mode == "builtin":
        from transformers import Concatenate, WeightConverter
        from transformers.conversion_mapping import register_checkpoint_conversion_mapping
        from transformers.monkey_patching import register_patch_mapping

        register_patch_mapping(_replacements())
        register_checkpoint_conversion_mapping(
            "llama",
            [
                WeightConverter(["q_proj", "k_proj", "v_proj"], "qkv_proj", [Concatenate(dim=0)]),
                WeightConverter(["gate_proj", "up_proj"], "gate_up_proj", [Concatenate(dim=0)]),
            ],
            overwrite=True,
        )
        scope = None
    else:
        scope = None

    # Every mode imports the same transformers modules before the clock starts.
    import transformers.conversion_mapping
    import transformers.core_model_loading
    import transformers.models.llama.modeling_llama
    import transformers.models.qwen2_moe.modeling_qwen2_moe  # noqa: F401

    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    if scope is not None:
        with scope:
            model = AutoModelForCausalLM.from_pretrained(cache)
    else:
        model = AutoModelForCausalLM.from_pretrained(cache)
    load_s = time.perf_counter() - t0
    # A plain load leaves most weights as lazy views of the mmapped file (nothing read yet), while a
    # converted weight must be read to be built; touching every weight gives each mode's time to a
    # model in memory ("load+touch") and a peak that counts the model once.
    with torch.no_grad():
        checksum = sum(float(p.float().sum()) for p in model.parameters())
    touch_s = time.perf_counter() - t0
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    fused = hasattr(model.model.layers[0].self_attn, "qkv_proj")
    save_s = None
    # The built-in writes wrong shapes for GQA on save (shared/reference, 2.j), so only its load is timed.
    if mode != "builtin":
        with tempfile.TemporaryDirectory() as out:
            t0 = time.perf_counter()
            model.save_pretrained(out)
            save_s = time.perf_counter() - t0
            keys: set[str] = set()
            for f in Path(out).glob("*.safetensors"):
                with safe_open(f, framework="pt") as fh:
                    keys.update(fh.keys())
        if "model.layers.0.self_attn.k_proj.weight" not in keys:
            raise RuntimeError(f"{mode}: the original layout was not written")
    return {
        "load_s": load_s,
        "touch_s": touch_s,
        "peak_mib": peak_kib / 1024,
        "base_mib": base_rss / 1024,
        "save_s": save_s,
        "fused": fused,
        "checksum": checksum,
    }


def _run(mode: str, model_type: str) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", mode, "--model", model_type],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", choices=["plain", "modelgraft", "builtin"])
    parser.add_argument("--model", choices=sorted(MODELS), default="llama")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.model)))
        return
    _generate(args.model)
    # The MoE run compares modelgraft running transformers' expert merge itself (fused QKV graft)
    # with transformers running it: the built-in fused-QKV registration would replace that merge.
    modes = ("plain", "modelgraft", "builtin") if args.model == "llama" else ("plain", "modelgraft")
    results: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(args.repeats):  # interleaved, so that machine noise hits every mode alike
        for mode in results:
            results[mode].append(_run(mode, args.model))
    fields = ("load_s", "touch_s", "peak_mib", "save_s")
    med = {
        m: {k: statistics.median(r[k] for r in rs) for k in fields if rs[0][k] is not None}
        for m, rs in results.items()
    }
    plain = med["plain"]

    def cell(mode: str, key: str, digits: int = 2) -> str:
        m = med[mode]
        if key not in m:
            return f"{'-':>9}{'-':>8}"
        return f"{m[key]:>9.{digits}f}{m[key] / plain[key]:>8.2f}x"

    title = {
        "llama": "Llama ~150M fp32, GQA 12/4 heads",
        "qwen2_moe": "Qwen2-MoE ~190M fp32, 32 experts, GQA 8/4 (plain = transformers merging the experts)",
    }[args.model]
    print(f"\n{title}; median of {args.repeats} fresh processes per mode")
    print(f"{'mode':<12}{'load s':>18}{'load+touch s':>18}{'peak MiB':>18}{'save s':>18}")
    for mode in med:
        print(
            f"{mode:<12}{cell(mode, 'load_s')}{cell(mode, 'touch_s')}{cell(mode, 'peak_mib', 0)}{cell(mode, 'save_s')}"
        )
    print(f"fused layout loaded: { {m: rs[0]['fused'] for m, rs in results.items()} }")
    # fp32 sums over differently fused parameters differ in the last digits; 3 decimals do not.
    same = {m: round(rs[0]["checksum"], 3) for m, rs in results.items()}
    print(f"weight checksums (equal = same weights): {same}")
    mg = med["modelgraft"]
    checks = {
        "load+touch time <= 1.25x plain": mg["touch_s"] <= 1.25 * plain["touch_s"],
        "load call alone <= 1.25x plain (plain reads nothing yet)": mg["load_s"] <= 1.25 * plain["load_s"],
        "peak memory <= 1.15x plain": mg["peak_mib"] <= 1.15 * plain["peak_mib"],
        "save <= 1.25x plain save": mg["save_s"] <= 1.25 * plain["save_s"],
    }
    if "builtin" in med:
        checks["load not slower than built-in"] = mg["load_s"] <= med["builtin"]["load_s"]
    for name, ok in checks.items():
        print(f"  [{'ok' if ok else 'MISSED'}] {name}")


if __name__ == "__main__":
    main()
