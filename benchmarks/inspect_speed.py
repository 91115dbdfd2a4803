"""How fast ``modelgraft inspect`` answers on a full-size config (a 70B Llama ``config.json``).

Prints, for a Llama 3 70B-shaped config written to a temporary folder:

* the in-process cost of ``inspect_architecture`` (first call, which includes importing the
  modeling module, and the median of warm calls), the target being well under 2 s;
* the wall time of the whole ``modelgraft inspect PATH --json`` command in a fresh process, for
  reference (it is dominated by importing torch and transformers);
* modelgraft's own share of ``import modelgraft`` in a fresh process: ``python -X importtime``
  parsed, the self time of every ``modelgraft.*`` module against the whole import (the rest is
  torch, transformers and their dependencies), and whether transformers' Auto model classes were
  resolved (they must not be: ``import modelgraft`` leaves ``modeling_auto`` unimported).

Run: ``.venv/bin/python benchmarks/inspect_speed.py``
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_S = 2.0
LLAMA_70B = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
}


def import_share(python: str = sys.executable) -> dict[str, float | bool]:
    """Seconds of a fresh ``import modelgraft``: in total, in modelgraft's own modules, in torch
    and in transformers (each cumulative, as first imported), from ``python -X importtime``.
    """
    probe = "import sys, modelgraft; print('transformers.models.auto.modeling_auto' in sys.modules)"
    done = subprocess.run(
        [python, "-X", "importtime", "-c", probe], capture_output=True, text=True, check=True
    )
    found: dict[str, float | bool] = dict(parse_importtime(done.stderr.splitlines()))
    found["auto_classes_resolved"] = done.stdout.strip().endswith("True")
    return found


def parse_importtime(lines: list[str]) -> dict[str, float]:
    """``total_s`` (cumulative of ``modelgraft``), ``own_s`` (self time of ``modelgraft.*``) and
    ``torch_s``/``transformers_s`` (cumulative where first imported) from ``-X importtime`` lines.

    Example (the parser on two lines of ``-X importtime`` output):
        >>> parse_importtime(["import time:       100 |        100 |   modelgraft.errors",
        ...                   "import time:       250 |       1350 | modelgraft"])["own_s"]
        0.00035
    """
    own_us, cumulative = 0, {}
    for line in lines:
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        self_us, cumulative_us, name = (part.strip() for part in line[len("import time:") :].split("|"))
        if name == "modelgraft" or name.startswith("modelgraft."):
            own_us += int(self_us)
        cumulative.setdefault(name, int(cumulative_us))
    return {
        "total_s": cumulative.get("modelgraft", 0) / 1e6,
        "own_s": own_us / 1e6,
        "torch_s": cumulative.get("torch", 0) / 1e6,
        "transformers_s": cumulative.get("transformers", 0) / 1e6,
    }


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="modelgraft-inspect-") as tmp:
        folder = Path(tmp)
        (folder / "config.json").write_text(json.dumps(LLAMA_70B))

        start = time.perf_counter()
        from modelgraft.cli import inspect_architecture

        import_s = time.perf_counter() - start
        start = time.perf_counter()
        info = inspect_architecture(str(folder))
        first_s = time.perf_counter() - start
        warm = []
        for _ in range(5):
            start = time.perf_counter()
            inspect_architecture(str(folder))
            warm.append(time.perf_counter() - start)

        script = Path(sys.executable).with_name("modelgraft")
        command = [str(script)] if script.exists() else [sys.executable, "-m", "modelgraft"]
        start = time.perf_counter()
        done = subprocess.run([*command, "inspect", str(folder), "--json"], capture_output=True, text=True)
        process_s = time.perf_counter() - start
        reported = json.loads(done.stdout)["seconds"] if done.returncode == 0 else float("nan")

    params = info["num_parameters"] / 1e9
    print(f"config: Llama 70B shape ({params:.1f}B parameters, {len(info['classes'])} module classes)")
    print(f"import modelgraft:                      {import_s:7.3f} s")
    print(f"inspect, in process, first call:        {first_s:7.3f} s")
    print(f"inspect, in process, warm (median of 5): {statistics.median(warm):6.3f} s")
    print(
        f"`modelgraft inspect --json` process:    {process_s:7.3f} s wall (inspect itself: {reported:.3f} s)"
    )
    share = import_share()
    own, total = float(share["own_s"]), float(share["total_s"])
    print(
        f"import modelgraft, fresh process:       {total:7.3f} s; modelgraft's own modules {own:.3f} s "
        f"({100 * own / total if total else 0:.1f}%), torch {float(share['torch_s']):.3f} s, "
        f"transformers {float(share['transformers_s']):.3f} s (cumulative, self-reported by -X importtime)"
    )
    print(
        f"transformers' Auto model classes resolved by `import modelgraft`: {share['auto_classes_resolved']}"
    )
    ok = first_s < TARGET_S
    print(f"target: inspect under {TARGET_S:.0f} s -> {'OK' if ok else 'MISSED'} ({first_s:.3f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
