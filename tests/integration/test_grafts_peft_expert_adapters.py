"""Expert LoRA adapters move between a ``linear_experts`` model and the plain one, every family.

Issue 19, point 2: an adapter trained on the per-expert layers of a grafted model, saved, and
loaded with ``PeftModel.from_pretrained`` on the plain model (whose experts are fused 3D
parameters on transformers 5, and for GPT-OSS and Llama 4 on 4.57 too) gave other outputs without
a word. Now the save writes the experts' LoRA in the layout PEFT uses for fused experts
(``target_parameters``), and for every family of :data:`LINEAR_EXPERTS_FAMILIES`:

* the plain model takes the saved adapter with the grafted model's outputs;
* the grafted model takes it back bit for bit (the same LoRA tensors, the same outputs);
* an adapter of the plain model's fused experts loads on the grafted model with its outputs;
* or the save is refused before anything is written, naming the layer (pinned below).

Compared on shapes, dtypes, finiteness and fp32 values against the model that trained the adapter.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from _versions import TRANSFORMERS_VERSION, missing_model_type
from families import auto_class, family, randomise_routers
from modelgraft.grafts import LINEAR_EXPERTS_FAMILIES, ExpertsAdapterError, linear_experts

peft = pytest.importorskip("peft", reason=f"peft is not installed (transformers {TRANSFORMERS_VERSION})")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

ATOL = 1e-5

#: Families whose expert adapters are refused at save: why.
REFUSED_AT_SAVE = {
    "dbrx": r"`DbrxExperts` keeps no 3D `gate_up_proj`/`down_proj` for PEFT to adapt",
}


def _outputs(model: nn.Module, model_type: str) -> torch.Tensor:
    with torch.no_grad():
        out = model(**family(model_type).inputs(model.config))
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def _same(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.shape == expected.shape and got.dtype == expected.dtype == torch.float32
    assert torch.isfinite(got).all() and torch.isfinite(expected).all()
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def _eager_double(model: nn.Module) -> nn.Module:
    """A float64 copy that runs the experts' eager loop (grouped matmuls take no float64)."""
    copied = copy.deepcopy(model).double()
    for module in copied.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_experts_implementation"):
            config._experts_implementation = "eager"
    return copied


def _same_up_to_rounding(plain: nn.Module, model: nn.Module, model_type: str, adapted: torch.Tensor) -> None:
    """The plain model with the saved adapter against the model that trained it: within ``ATOL`` in
    fp32, or, where the two matmul orders (PEFT's fused-experts delta against per-expert LoRA
    layers) round apart by more than that, equal to 1e-9 in float64, which a wrong adapter cannot be."""
    got = _outputs(plain, model_type)
    try:
        _same(got, adapted)
    except AssertionError:
        got64 = _outputs(_eager_double(plain), model_type)
        expected64 = _outputs(_eager_double(model), model_type)
        assert got64.dtype == expected64.dtype == torch.float64 and got64.shape == adapted.shape
        assert torch.isfinite(got64).all() and torch.isfinite(expected64).all()
        torch.testing.assert_close(got64, expected64, atol=1e-9, rtol=0)


def _randomise(model: nn.Module, seed: int) -> None:
    """Non-zero LoRA weights (``lora_B`` starts at zero, which would hide a dropped adapter)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    made: dict[str, Path] = {}

    def make(model_type: str) -> Path:
        if model_type not in made:
            torch.manual_seed(0)
            model = family(model_type).model().eval()
            randomise_routers(model, seed=3)
            path = tmp_path_factory.mktemp(f"experts-lora-{model_type}")
            model.save_pretrained(path)
            made[model_type] = path
        return made[model_type]

    return make


def _load(path: Path, model_type: str, grafted: bool) -> nn.Module:
    from transformers import AutoConfig

    auto = auto_class(AutoConfig.from_pretrained(path))
    if not grafted:
        return auto.from_pretrained(path).eval()
    with linear_experts(model_type).applied(strict=True):
        return auto.from_pretrained(path).eval()


def _experts_only(model: nn.Module) -> str:
    """A regex naming the per-expert layers of ``model`` and nothing else (not shared or dense ones)."""
    lists = {n: type(m)._expert_names for n, m in model.named_modules() if hasattr(type(m), "_expert_names")}
    assert lists, "no grafted experts"
    paths = "|".join(re.escape(n) for n in lists)
    names = "|".join(sorted({x for v in lists.values() for x in v}))
    return rf"(?:{paths})\.\d+\.(?:{names})"


def _grafted_here(model_type: str) -> str | None:
    missing = missing_model_type(model_type)
    if missing is not None:
        return missing
    if not linear_experts(model_type).mapping:
        return f"`{model_type}` keeps per-expert layers on transformers {TRANSFORMERS_VERSION}: nothing is grafted"
    return None


@pytest.mark.parametrize("model_type", LINEAR_EXPERTS_FAMILIES)
def test_an_expert_adapter_of_the_grafted_model_loads_on_the_plain_model_and_back(
    model_type: str, checkpoint, tmp_path: Path
) -> None:
    if (why := _grafted_here(model_type)) is not None:
        pytest.skip(why)
    path = checkpoint(model_type)
    grafted = _load(path, model_type, grafted=True)
    before = _outputs(grafted, model_type)  # the plain model's outputs (the graft changes none)
    config = LoraConfig(r=2, lora_alpha=4, target_modules=_experts_only(grafted), init_lora_weights=False)
    model = get_peft_model(grafted, config)
    _randomise(model, 1)
    adapted = _outputs(model, model_type)
    assert not torch.allclose(adapted, before, atol=1e-3), "the adapter changes nothing"

    if model_type in REFUSED_AT_SAVE:
        with pytest.raises(ExpertsAdapterError, match=REFUSED_AT_SAVE[model_type]):
            model.save_pretrained(tmp_path / "adapter")
        assert not (tmp_path / "adapter").exists() or not any((tmp_path / "adapter").iterdir())
        return
    model.save_pretrained(tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["target_parameters"], "the experts' LoRA is not in the plain model's layout"

    plain = PeftModel.from_pretrained(_load(path, model_type, grafted=False), tmp_path / "adapter").eval()
    _same_up_to_rounding(plain, model, model_type, adapted)

    again = PeftModel.from_pretrained(_load(path, model_type, grafted=True), tmp_path / "adapter").eval()
    trained = {n: p for n, p in model.named_parameters() if "lora_" in n}
    loaded = {n: p for n, p in again.named_parameters() if "lora_" in n}
    assert sorted(loaded) == sorted(trained)
    for name, tensor in trained.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    assert torch.equal(_outputs(again, model_type), adapted)


@pytest.mark.parametrize("model_type", LINEAR_EXPERTS_FAMILIES)
def test_an_adapter_of_the_plain_fused_experts_loads_on_the_grafted_model(
    model_type: str, checkpoint, tmp_path: Path
) -> None:
    if (why := _grafted_here(model_type)) is not None:
        pytest.skip(why)
    if model_type in REFUSED_AT_SAVE:
        pytest.skip(f"`{model_type}` has no 3D expert parameters for PEFT to adapt on the plain model")
    path = checkpoint(model_type)
    plain = _load(path, model_type, grafted=False)
    fused = sorted(
        {
            ".".join(n.split(".")[-2:])
            for n, _ in plain.named_parameters()
            if n.endswith(("experts.gate_up_proj", "experts.down_proj"))
        }
    )
    assert fused, "the plain model has no fused experts"
    model = get_peft_model(
        plain,
        LoraConfig(r=2, lora_alpha=4, target_modules=[], target_parameters=fused, init_lora_weights=False),
    )
    _randomise(model, 2)
    adapted = _outputs(model, model_type)
    model.save_pretrained(tmp_path / "adapter")
    grafted = PeftModel.from_pretrained(_load(path, model_type, grafted=True), tmp_path / "adapter").eval()
    assert not any(n.endswith("gate_up_proj") for n, _ in grafted.named_parameters())
    _same(_outputs(grafted, model_type), adapted)


def test_a_shared_expert_named_like_the_experts_is_refused_at_save_where_peft_would_drop_it(
    tmp_path: Path,
) -> None:
    """PEFT converts every target named ``gate_proj`` of a DeepSeek-V3 model into the fused experts
    when it loads an adapter on the plain model: the dense and shared layers' LoRA would be lost."""
    if (why := missing_model_type("deepseek_v3")) is not None or not linear_experts("deepseek_v3").mapping:
        pytest.skip(why or f"nothing is grafted in deepseek_v3 on transformers {TRANSFORMERS_VERSION}")
    torch.manual_seed(0)
    family("deepseek_v3").model().save_pretrained(tmp_path / "ckpt")
    model = get_peft_model(
        _load(tmp_path / "ckpt", "deepseek_v3", grafted=True),
        LoraConfig(r=2, target_modules=["gate_proj", "up_proj", "down_proj"]),
    )
    with pytest.raises(
        ExpertsAdapterError, match=r"adapts `model\.layers\.0\.mlp\.gate_proj`.*would be dropped"
    ):
        model.save_pretrained(tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()


def _peft_section_examples() -> list[str]:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "grafts.md").read_text()
    section = doc.split("## PEFT and LoRA", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_the_peft_examples_of_the_docs_run_and_check_what_they_say() -> None:
    examples = _peft_section_examples()
    assert len(examples) == 2 and any("linear_experts" in e for e in examples)
    for source in examples:
        exec(
            compile(source, "docs/grafts.md", "exec"), {}
        )  # each ends in an assert_close against the plain model


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_lora_dropout_on_the_experts_is_refused_at_save_before_anything_is_written(
    model_type: str, checkpoint, tmp_path: Path
) -> None:
    """Issue 28, point 6: PEFT's fused-experts wrapper (``ParamWrapper``) refuses a non-zero
    ``lora_dropout`` when the plain model loads the adapter, so the save must not write one."""
    if (why := _grafted_here(model_type)) is not None:
        pytest.skip(why)
    grafted = _load(checkpoint(model_type), model_type, grafted=True)
    model = get_peft_model(grafted, LoraConfig(r=2, target_modules=_experts_only(grafted), lora_dropout=0.1))
    with pytest.raises(ExpertsAdapterError, match=r"lora_dropout=0\.1.*experts.*merge_and_unload"):
        model.save_pretrained(tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()
    # With dropout 0 the same adapter saves and loads on the plain model.
    model = get_peft_model(
        _load(checkpoint(model_type), model_type, grafted=True),
        LoraConfig(r=2, target_modules=_experts_only(grafted), lora_dropout=0.0),
    )
    _randomise(model, seed=1)
    model.save_pretrained(tmp_path / "adapter")
    plain = PeftModel.from_pretrained(
        _load(checkpoint(model_type), model_type, grafted=False), tmp_path / "adapter"
    )
    _same(_outputs(plain.eval(), model_type), _outputs(model.eval(), model_type))
