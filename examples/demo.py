"""End-to-end demo, offline: patch a tiny Llama at load time and print what was grafted.

Builds a tiny Llama checkpoint in a temporary folder, registers a custom attention exactly as the
quick start of the seed documentation does (with the import line changed to modelgraft), loads it
with ``AutoModelForCausalLM.from_pretrained`` and prints the type of the first attention block and
the graft report. Run: ``make demo`` (or ``python examples/demo.py``).
"""

from __future__ import annotations

import tempfile

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaAttention
from transformers.utils import logging

from modelgraft import clear_patch_mapping, register_patch_mapping, report


class CustomLlamaAttention(LlamaAttention):
    """The seed's quick-start replacement: announces itself, then runs the original attention."""

    announced = False

    def forward(self, *args: object, **kwargs: object) -> tuple:
        if not CustomLlamaAttention.announced:
            print("Using custom attention!")
            CustomLlamaAttention.announced = True
        return super().forward(*args, **kwargs)


def build_tiny_llama(folder: str) -> None:
    """Save a tiny random Llama (hidden 64, 2 layers, vocab 128) to ``folder``."""
    config = AutoConfig.for_model(
        "llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)


def main() -> None:
    logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as folder:
        build_tiny_llama(folder)

        # --- the seed's quick start, importing from modelgraft ---
        register_patch_mapping(mapping={"LlamaAttention": CustomLlamaAttention})
        try:
            model = AutoModelForCausalLM.from_pretrained(folder)
            print(type(model.model.layers[0].self_attn))
            model(torch.tensor([[1, 2, 3, 4]]))
            print(report(model).summary())
        finally:
            clear_patch_mapping()


if __name__ == "__main__":
    main()
