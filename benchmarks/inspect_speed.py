"""How fast ``modelgraft inspect`` answers on a full-size config (a 70B Llama ``config.json``).

Prints, for a Llama 3 70B-shaped config written to a temporary folder:

* the in-process cost of ``inspect_architecture`` (first call, which includes importing the
  modeling module, and the median of warm calls), the target being well under 2 s;
* the wall time of the whole ``modelgraft inspect PATH --json`` command in a fresh process, for
  reference (it is dominated by importing torch and transformers).

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
    ok = first_s < TARGET_S
    print(f"target: inspect under {TARGET_S:.0f} s -> {'OK' if ok else 'MISSED'} ({first_s:.3f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
