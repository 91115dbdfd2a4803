"""The conversion wiring: ``modelgraft.conversion.install``/``uninstall`` and the hooks they place.

Unit tests of the wiring (``modelgraft.conversion``'s install/uninstall, ``modelgraft._compat``'s
``CONVERSION`` wrap group, ``modelgraft._compat._wrapping``'s ``is_wrapped``), in their own file: they
import those private modules directly, the one exception to tests using public names only (issue 14);
everything else comes from the public namespaces.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, modeling_utils
from transformers.models.llama.modeling_llama import LlamaAttention

from modelgraft import Concatenate, WeightConverter, _compat, conversion, patched, report
from modelgraft._compat._wrapping import is_wrapped
from modelgraft.grafts import fused_qkv_class
from modelgraft.testing import tiny_config

#: The tiny llama of tests/integration/test_conversion_load.py: the family table's, with q/k/v biases.
TINY_LLAMA = {"attention_bias": True}
QKV = WeightConverter(["q_proj", "k_proj", "v_proj"], ["qkv_proj"], [Concatenate(dim=0)])
FUSED = {"LlamaAttention": fused_qkv_class(LlamaAttention)}


def _save_tiny_llama(path: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", **TINY_LLAMA)).eval()
    model.save_pretrained(path)
    return model


def test_conversion_hooks_can_be_removed_and_reinstalled(tmp_path):
    _save_tiny_llama(tmp_path)
    assert _compat.CONVERSION.installed  # the wiring for the installed transformers (4.57 or 5.x)
    conversion.uninstall()
    try:
        assert not _compat.CONVERSION.installed
        wrapped = [modeling_utils.PreTrainedModel.__dict__["post_init"]]
        if _compat.HAS_BUILTIN_CONVERSION:
            wrapped.append(modeling_utils.get_model_conversion_mapping)
        assert not any(is_wrapped(f) for f in wrapped)
        with patched(FUSED, conversions={"llama": [QKV]}):
            model = AutoModelForCausalLM.from_pretrained(tmp_path)
        assert not report(model).conversions  # nothing converted without the hooks
    finally:
        conversion.install()
        conversion.install()  # idempotent
    assert _compat.CONVERSION.installed
    with patched(FUSED, conversions={"llama": [QKV]}):
        model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert len(report(model).conversions) == 4
    assert isinstance(model.model.layers[0].self_attn.qkv_proj.weight, torch.nn.Parameter)
