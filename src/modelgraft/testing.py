"""Helpers for tests and examples: tiny, valid configs of real model families.

:func:`tiny_config` turns any model type of the installed transformers into a config small enough
to build and run in milliseconds on a CPU (hidden size 64, 2 layers, 4 heads with 2 key/value heads
where the family has them, vocabulary 128, 4 experts with top-2 routing for MoE families). Composite
models (vision-language, encoder-decoder with sub-configs) get every sub-config shrunk the same way.
The sizes, and what single families need beyond them, come from modelgraft's one table of model
families (the same one that says which families each ready-made graft covers).

Example:
    >>> from modelgraft.testing import tiny_config
    >>> cfg = tiny_config("llama")
    >>> (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads)
    (64, 2, 4, 2)
    >>> tiny_config("qwen2_moe", hidden_size=32).hidden_size
    32
"""

from __future__ import annotations

from modelgraft._families import UnknownModelTypeError, tiny_config, tiny_overrides

__all__ = ["UnknownModelTypeError", "tiny_config", "tiny_overrides"]
