"""End-to-end demo, offline: the documentation's complete qwen2_moe example, checked step by step.

1. Write a tiny ``qwen2_moe`` checkpoint with plain transformers (grouped-query attention: 4 query
   heads, 2 key/value heads, and 4 experts in the checkpoint's per-expert layout).
2. Register, as the complete example does, a fused-QKV attention and per-expert ``nn.Linear``
   experts together with their checkpoint conversion (``overwrite=True`` replaces transformers' own
   expert merge); the classes are modelgraft's ready-made grafts, which also handle grouped-query
   attention.
3. Load it with ``AutoModelForCausalLM.from_pretrained`` and print the graft report.
4. Compare logits and hidden states with the plain model (fp32, atol 1e-5).
5. Save the grafted model (original layout by default), check the files against the original
   checkpoint, reload them with plain transformers and compare with the plain model.
6. Graft the plain model, already loaded, in place with ``graft_model``; outputs stay the same.
7. Ask the same questions through ``modelgraft.verify``.

The last line says whether everything matched; the exit code is 1 if not.
Run: ``make demo`` (or ``.venv/bin/python examples/demo.py``).
"""

# ruff: noqa: E402  (the noise filters below must be installed before torch is imported)

from __future__ import annotations

import logging as std_logging
import sys
import tempfile
from pathlib import Path


def quiet_unused_import_noise() -> None:
    """Drop the two import-time messages of packages this demo never calls, and nothing else.

    transformers 5 imports torchao (its quantizer table) whenever a model class is imported. torchao
    then logs "Failed to load .../_C_*.so" for its CUDA kernels and, by registering two enums,
    makes torch log a ``register_constant()`` deprecation. Each filter matches one logger and one
    message, so any other warning (including one from modelgraft) still shows.
    """
    dropped = {
        "torchao": "Failed to load ",
        "torch.utils._pytree": "%s is an Enum subclass and is now natively supported",
    }
    for name, start in dropped.items():

        def keep(record: std_logging.LogRecord, start: str = start) -> bool:
            return not str(record.msg).startswith(start)

        std_logging.getLogger(name).addFilter(keep)


quiet_unused_import_noise()  # before torch and transformers are imported

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from transformers.utils import logging

from modelgraft import (
    clear_patch_mapping,
    graft_model,
    register_checkpoint_conversion_mapping,
    register_patch_mapping,
    report,
    unregister_checkpoint_conversion_mapping,
    verify,
)
from modelgraft.grafts import fused_qkv, linear_experts
from modelgraft.testing import tiny_config

ATOL = 1e-5
results: list[tuple[str, bool, str]] = []


def check(name: str, ok: bool, detail: str) -> None:
    results.append((name, ok, detail))
    print(f"  [{'ok' if ok else 'MISMATCH'}] {name}: {detail}")


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        found.update(load_file(str(file)))
    return found


def main() -> int:
    logging.disable_progress_bar()
    logging.set_verbosity_error()
    with tempfile.TemporaryDirectory(prefix="modelgraft-demo-") as tmp:
        original, resaved = Path(tmp) / "original", Path(tmp) / "resaved"

        print("1. tiny qwen2_moe checkpoint, written by plain transformers")
        config = tiny_config("qwen2_moe")
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(original)
        plain = AutoModelForCausalLM.from_pretrained(original).eval()
        print(
            f"   {sum(p.numel() for p in plain.parameters()):,} parameters, "
            f"{config.num_attention_heads} query heads / {config.num_key_value_heads} key-value heads, "
            f"{config.num_experts} experts (top-{config.num_experts_per_tok})"
        )

        print("2. register the fused-QKV attention and per-expert experts, and their conversion")
        graft = fused_qkv("qwen2_moe") + linear_experts("qwen2_moe")
        register_patch_mapping(mapping=graft.mapping)
        register_checkpoint_conversion_mapping(
            model_type_or_class_name="qwen2_moe", mapping=graft.conversions["qwen2_moe"], overwrite=True
        )
        try:
            print("3. load the checkpoint: the patches and conversions apply automatically")
            model = AutoModelForCausalLM.from_pretrained(original).eval()
            print("   " + report(model).summary().replace("\n", "\n   "))
            layer = model.model.layers[0]
            experts = [m for m in layer.mlp.experts.modules() if isinstance(m, torch.nn.Linear)]
            check(
                "grafted",
                "qkv_proj.weight" in layer.self_attn.state_dict()
                and len(experts) == 3 * config.num_experts
                and all(p.dim() <= 2 for p in layer.mlp.experts.parameters()),
                f"{type(layer.self_attn).__name__} with qkv_proj {tuple(layer.self_attn.qkv_proj.weight.shape)}, "
                f"{type(layer.mlp.experts).__name__} with {len(experts)} nn.Linear",
            )
            check(
                "weights loaded",
                report(model).ok,
                "no dropped, missing or uninitialised parameters"
                if report(model).ok
                else "; ".join(report(model).problems),
            )

            print("4. same input through the plain and the grafted model")
            ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                ref = plain(ids, output_hidden_states=True)
                out = model(ids, output_hidden_states=True)
            diff = (ref.logits - out.logits).abs().max().item()
            check("logits", diff <= ATOL, f"max |difference| {diff:.2e} (atol {ATOL:g})")
            hdiff = max((a - b).abs().max().item() for a, b in zip(ref.hidden_states, out.hidden_states))
            check(
                "hidden states",
                hdiff <= ATOL,
                f"max |difference| {hdiff:.2e} over {len(ref.hidden_states)} tensors",
            )

            print("5. save in the original layout, reload with plain transformers")
            model.save_pretrained(resaved)
        finally:
            clear_patch_mapping()
            unregister_checkpoint_conversion_mapping("qwen2_moe")

        before, after = tensors(original), tensors(resaved)
        same_keys = set(before) == set(after)
        changed = [k for k in before if k in after and not torch.equal(before[k], after[k])]
        check(
            "saved files",
            same_keys and not changed,
            f"{len(after)} tensors, keys {'identical' if same_keys else 'DIFFER'}, "
            f"{len(before) - len(changed) if same_keys else 0} bit-identical to the original checkpoint",
        )
        reloaded = AutoModelForCausalLM.from_pretrained(resaved)
        expected, got = plain.state_dict(), reloaded.state_dict()
        differ = [k for k in expected if k not in got or not torch.equal(expected[k], got[k])]
        check(
            "plain reload",
            not differ and type(reloaded.model.layers[0].self_attn).__name__ == "Qwen2MoeAttention",
            f"{type(reloaded).__name__} with {type(reloaded.model.layers[0].self_attn).__name__}; "
            f"{len(expected) - len(differ)}/{len(expected)} tensors equal to the plain model's",
        )

    print("6. graft the plain model of step 1 in place (graft_model), outputs unchanged")
    graft_model(plain, graft)
    with torch.no_grad():
        live = plain(ids).logits
    gdiff = (live - ref.logits).abs().max().item()
    check(
        "graft_model",
        gdiff <= ATOL and len(report(plain).replaced) == len(report(model).replaced),
        f"{len(report(plain).replaced)} modules replaced in place, max |logits difference| {gdiff:.2e}",
    )

    print("7. the same questions through modelgraft.verify")
    verdict = verify("qwen2_moe", graft, seed=1)
    print("   " + verdict.format_table().replace("\n", "\n   "))
    check(
        "verify",
        verdict.passed,
        f"{sum(c.passed for c in verdict.checks)}/{len(verdict.checks)} checks passed",
    )

    failed = [name for name, ok, _ in results if not ok]
    if failed:
        print(
            f"demo: MISMATCH in {', '.join(failed)} ({len(results) - len(failed)}/{len(results)} checks matched)"
        )
        return 1
    print(f"demo: everything matched ({len(results)}/{len(results)} checks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
