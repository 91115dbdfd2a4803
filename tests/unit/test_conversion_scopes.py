"""Which conversion entry each sub-model of a composite model uses (``resolve_scopes``).

Unit tests of ``modelgraft.conversion.scopes`` (their own file): they import it directly, the one
exception to tests using public names only (issue 14); everything else comes from the public
namespaces. (Moved from tests/integration/test_conversion_load.py, with its tiny inputs and
checkpoint reader; the fused attention is the public ``fused_qkv_class``, as in test_conversion_wiring.py.)
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers.models.llama.modeling_llama import LlamaAttention

from modelgraft import Concatenate, WeightConverter, patched, report
from modelgraft.grafts import fused_qkv_class
from modelgraft.testing import tiny_config

#: tests/integration/conversion_helpers.py's fused QKV converter and test_conversion_load.py's inputs.
QKV = WeightConverter(["q_proj", "k_proj", "v_proj"], ["qkv_proj"], [Concatenate(dim=0)])
X = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))


def _checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_composite_model_resolves_the_entry_per_sub_model(tmp_path):
    from transformers import AutoModelForImageTextToText

    from modelgraft.conversion.scopes import resolve_scopes

    torch.manual_seed(0)
    plain = AutoModelForImageTextToText.from_config(tiny_config("llava")).eval()
    plain.save_pretrained(tmp_path / "src")
    # transformers writes llava's legacy layout (`language_model.model.*`); the converter must see through it.
    assert "language_model.model.layers.0.self_attn.q_proj.weight" in _checkpoint_tensors(tmp_path / "src")
    attn = LlamaAttention
    with patched({attn.__name__: fused_qkv_class(attn)}, conversions={"llama": [QKV]}):
        model, info = AutoModelForImageTextToText.from_pretrained(tmp_path / "src", output_loading_info=True)
        scopes = resolve_scopes(model)
    assert [(s.path, s.key) for s in scopes] == [("model.language_model", "llama")]
    assert not info["missing_keys"] and not info["unexpected_keys"]
    targets = {r.target_keys[0] for r in report(model).conversions}
    assert "model.language_model.layers.1.self_attn.qkv_proj.weight" in targets
    ids = X.clamp(max=120)
    torch.testing.assert_close(
        model.eval()(input_ids=ids).logits, plain(input_ids=ids).logits, atol=1e-5, rtol=0
    )
    model.save_pretrained(tmp_path / "out")
    written, original = _checkpoint_tensors(tmp_path / "out"), _checkpoint_tensors(tmp_path / "src")
    assert sorted(written) == sorted(original)
    assert all(torch.equal(written[k], original[k]) for k in original)
