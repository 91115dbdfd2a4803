"""Issue 2, point 5: the load hooks can be removed and put back.

Unit tests of ``modelgraft.hooks`` (their own file): they import it directly, the one exception to
tests using public names only (issue 14); everything else comes from the public namespaces. (Moved
from tests/integration/test_patching_load.py.)
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaMLP

from modelgraft import hooks, register_patch_mapping


def test_hooks_can_be_removed_and_reinstalled(tiny_llama_dir: Path) -> None:
    register_patch_mapping({"LlamaMLP": type("MyMLP", (LlamaMLP,), {})})
    hooks.uninstall()
    try:
        assert not hooks.installed()
        plain = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
        assert type(plain.model.layers[0].mlp) is LlamaMLP
    finally:
        hooks.install()
        hooks.install()  # idempotent
    assert hooks.installed()
    patched_model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert type(patched_model.model.layers[0].mlp).__name__ == "MyMLP"
