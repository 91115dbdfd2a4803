"""graft_model: patch a model that is already built and loaded, in place."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP

import modelgraft
from _versions import requires_fused_experts, requires_fused_experts_unless_fused_on_both_lines
from families import Family, family, family_params
from modelgraft import ConversionError, GraftError, GraftStateError, ReplacementTypeError, graft_model, report
from modelgraft.grafts import FUSED_QKV_FAMILIES, LINEAR_EXPERTS_FAMILIES, fused_qkv, linear_experts
from modelgraft.testing import tiny_config


def _model(model_type: str, **overrides: object) -> nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides)).eval()


def _logits(model: nn.Module) -> torch.Tensor:
    ids = torch.arange(14).reshape(2, 7) % 128
    with torch.no_grad():
        return model(ids).logits


def _classes(model: nn.Module) -> list[str]:
    return [type(m).__name__ for m in model.modules()]


def test_fused_qkv_on_a_built_llama_keeps_outputs_and_reports_changes() -> None:
    model = _model("llama")
    before = _logits(model)
    graft = fused_qkv("llama")

    assert graft_model(model, graft.mapping, conversions=graft.conversions) is model

    attn = model.model.layers[1].self_attn
    assert type(attn).__name__.startswith("FusedQKV")
    assert "qkv_proj.weight" in attn.state_dict() and "q_proj.weight" not in attn.state_dict()
    assert attn.layer_idx == 1  # constructor arguments recovered per layer
    torch.testing.assert_close(_logits(model), before, atol=1e-5, rtol=0)
    rep = report(model)
    assert [r.path for r in rep.replaced] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert rep.replaced[0].original.endswith("LlamaAttention") and rep.replaced[0].key == "LlamaAttention"
    # one conversion group per layer, from the three projections to the fused one
    fused_targets = [r.target_keys for r in rep.conversions if any("qkv_proj" in k for k in r.target_keys)]
    assert ("model.layers.0.self_attn.qkv_proj.weight",) in fused_targets
    assert len(fused_targets) == 2


def test_registered_patches_are_used_when_no_mapping_is_given() -> None:
    model = _model("llama")
    before = _logits(model)
    graft = fused_qkv("llama")
    graft.register()
    try:
        graft_model(model)
    finally:
        graft.unregister()
    assert "LlamaAttention" not in _classes(model)
    torch.testing.assert_close(_logits(model), before, atol=1e-5, rtol=0)


@requires_fused_experts
def test_moe_experts_and_attention_on_a_built_qwen2_moe() -> None:
    # The live experts are fused 3D tensors; the per-expert Linear layout is reached through the
    # checkpoint layout (transformers' own merge undone first).
    model = _model("qwen2_moe")
    before = _logits(model)
    graft = fused_qkv("qwen2_moe") + linear_experts("qwen2_moe")

    graft_model(model, graft.mapping, conversions=graft.conversions)

    experts = model.model.layers[0].mlp.experts
    assert "Qwen2MoeExperts" not in _classes(model)
    assert any(isinstance(m, nn.Linear) for m in experts.modules())
    torch.testing.assert_close(_logits(model), before, atol=1e-5, rtol=0)
    assert len(report(model).replaced) == 4


def test_dtype_device_and_train_mode_are_kept() -> None:
    model = _model("llama").to(torch.bfloat16).train()
    model.model.layers[0].eval()  # a mixed mode must survive per module
    graft = fused_qkv("llama")
    graft_model(model, graft.mapping, conversions=graft.conversions)

    layer0, layer1 = model.model.layers[0].self_attn, model.model.layers[1].self_attn
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert (layer0.training, layer1.training) == (False, True)


def test_subclass_replacement_needs_no_conversion() -> None:
    class TracedMLP(LlamaMLP):
        pass

    model = _model("llama")
    before = _logits(model)
    graft_model(model, {"LlamaMLP": TracedMLP})
    assert type(model.model.layers[0].mlp) is TracedMLP
    assert torch.equal(_logits(model), before)
    assert report(model).conversions == []


def test_a_layout_without_conversion_fails_and_leaves_the_model_unchanged() -> None:
    graft = fused_qkv("llama")
    model = _model("llama")
    before = _logits(model)
    with pytest.raises(ConversionError, match=r"`model\.layers\.0\.self_attn`.*no weight fills `.*qkv_proj"):
        graft_model(model, graft.mapping)  # the fused layout needs graft.conversions
    assert _classes(model).count("LlamaAttention") == 2
    assert torch.equal(_logits(model), before)
    assert report(model).replaced == []


def test_a_constructor_that_fails_on_a_later_layer_changes_nothing() -> None:
    class FailsOnLayerOne(LlamaAttention):
        def __init__(self, config: object, layer_idx: int) -> None:
            if layer_idx == 1 and not torch.empty(0).is_meta:
                raise RuntimeError("layer one is not supported")
            super().__init__(config, layer_idx)

    model = _model("llama")
    with pytest.raises(GraftError, match=r"`FailsOnLayerOne` for `model\.layers\.1\.self_attn`.*unchanged"):
        graft_model(model, {"LlamaAttention": FailsOnLayerOne})
    assert [type(layer.self_attn) for layer in model.model.layers] == [LlamaAttention, LlamaAttention]


def test_grafting_twice_is_a_no_op() -> None:
    class TracedMLP(LlamaMLP):
        pass

    model = _model("llama")
    graft_model(model, {"LlamaMLP": TracedMLP})
    first = model.model.layers[0].mlp
    graft_model(model, {"LlamaMLP": TracedMLP})
    assert model.model.layers[0].mlp is first
    assert len(report(model).replaced) == 2


class _Block(nn.Module):
    def __init__(self, width: int, scale: float = 1.0) -> None:
        super().__init__()
        self.width, self.scale = width, scale
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.scale


class _DoubledBlock(_Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


def test_a_plain_module_without_config_uses_its_attributes() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_Block(4, scale=3.0), nn.ReLU(), _Block(4))
    x = torch.randn(2, 4)
    originals = [model[0], model[2]]
    graft_model(model, {"_Block": _DoubledBlock})
    assert [type(m) for m in model] == [_DoubledBlock, nn.ReLU, _DoubledBlock]
    assert model[0].scale == 3.0  # recovered from the attribute named like the argument
    for new, old in zip([model[0], model[2]], originals):
        assert torch.equal(new.proj.weight, old.proj.weight)
        assert torch.equal(new(x), 2 * old(x))


def test_unmatched_keys_are_reported() -> None:
    class TracedMLP(LlamaMLP):
        pass

    model = _model("llama")
    graft_model(model, {"LlamaMLP": TracedMLP, "MistralMLP": TracedMLP})
    assert report(model).unmatched_keys == ["MistralMLP"]
    assert modelgraft.get_patch_mapping() == {}  # the mapping was scoped to the call


def _graft_live_and_compare(family: Family, graft: object) -> None:
    torch.manual_seed(0)
    model = family.model().eval()  # the base model where a text tower has no causal-LM class
    inputs = family.inputs(model.config)

    def outputs() -> torch.Tensor:
        with torch.no_grad():
            out = model(**inputs)
        return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state

    before = outputs()
    graft_model(model, graft.mapping, conversions=graft.conversions)
    assert report(model).replaced, "nothing was grafted"
    after = outputs()
    torch.testing.assert_close(after, before, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", family_params(model_types=FUSED_QKV_FAMILIES))
def test_fused_qkv_live_on_every_family(family: Family) -> None:
    _graft_live_and_compare(family, fused_qkv(family.model_type))


@pytest.mark.parametrize(
    "family",
    [
        pytest.param(
            *p.values, id=p.id, marks=[*p.marks, *requires_fused_experts_unless_fused_on_both_lines(p.id)]
        )
        for p in family_params(model_types=LINEAR_EXPERTS_FAMILIES)
    ],
)
def test_linear_experts_live_on_every_family(family: Family) -> None:
    _graft_live_and_compare(family, linear_experts(family.model_type))


def test_conversions_registered_under_the_class_name_are_used() -> None:
    graft = fused_qkv("llama")
    model = _model("llama")
    before = _logits(model)
    graft_model(model, graft.mapping, conversions={"LlamaForCausalLM": graft.conversions["llama"]})
    torch.testing.assert_close(_logits(model), before, atol=1e-5, rtol=0)


def test_the_language_model_inside_a_vision_language_model() -> None:
    llava = family("llava")
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(llava.config()).eval()
    inputs = llava.inputs(model.config)
    with torch.no_grad():
        before = model(**inputs).logits
    text_type = model.config.text_config.model_type
    graft = fused_qkv(text_type)
    graft_model(model, graft.mapping, conversions=graft.conversions)
    paths = [r.path for r in report(model).replaced]
    assert paths and all(".language_model." in p for p in paths)
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, before, atol=1e-5, rtol=0)


class _Inner(nn.Module):
    def __init__(self, width: int, layer_idx: int) -> None:
        super().__init__()
        self.width, self.layer_idx = width, layer_idx
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class _TracedInner(_Inner):
    pass


_IMPLEMENTATIONS = {"default": _Inner}  # bound at import: a swap of the module global cannot reach it


class _Outer(nn.Module):
    def __init__(self, config: SimpleNamespace) -> None:
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(_IMPLEMENTATIONS["default"](config.width, i) for i in range(2))


def test_modules_the_rebuild_cannot_reach_are_replaced_by_name() -> None:
    torch.manual_seed(0)
    model = _Outer(SimpleNamespace(width=4))
    x = torch.randn(3, 4)
    before = [block(x) for block in model.blocks]
    graft_model(model, {"_Inner": _TracedInner})
    assert [type(b) for b in model.blocks] == [_TracedInner, _TracedInner]
    assert [b.layer_idx for b in model.blocks] == [0, 1]
    for block, expected in zip(model.blocks, before):
        assert torch.equal(block(x), expected)


def test_a_model_on_the_meta_device_stays_there() -> None:
    graft = fused_qkv("llama")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    graft_model(model, graft.mapping, conversions=graft.conversions)
    assert "LlamaAttention" not in _classes(model)
    assert {p.device.type for p in model.parameters()} == {"meta"}


class _Opaque(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)  # `width` is not kept under its own name


class _OpaqueReplacement(_Opaque):
    pass


def test_unrecoverable_constructor_arguments_are_a_clear_error() -> None:
    model = nn.Sequential(_Opaque(4))
    with pytest.raises(
        GraftError, match=r"`_Opaque` as `_OpaqueReplacement`: its constructor argument `width`"
    ):
        graft_model(model, {"_Opaque": _OpaqueReplacement})
    assert type(model[0]) is _Opaque


def test_a_ready_made_graft_can_be_passed_whole() -> None:
    model = _model("llama")
    before = _logits(model)
    graft_model(model, fused_qkv("llama"))  # mapping and conversions from the bundle
    assert "LlamaAttention" not in _classes(model)
    torch.testing.assert_close(_logits(model), before, atol=1e-5, rtol=0)


# ---- a key that names the model's own class (issue 14, point 4) -----------------------------------
class _TracedMLP(LlamaMLP):
    pass


class _LoudCausalLM(LlamaForCausalLM):
    """Adds no constructor state: the model object can become one by a class switch."""

    def forward(self, *args: object, **kwargs: object) -> object:
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out


class _CausalLMWithState(LlamaForCausalLM):
    def __init__(self, config: object) -> None:
        super().__init__(config)
        self.extra = nn.Linear(4, 4)


def test_a_key_naming_the_models_own_class_switches_the_model_object() -> None:
    model = _model("llama")
    before = _logits(model)
    weights = {name: p for name, p in model.named_parameters()}
    assert graft_model(model, {"LlamaForCausalLM": _LoudCausalLM, "LlamaMLP": _TracedMLP}) is model
    assert type(model) is _LoudCausalLM
    assert type(model.model.layers[0].mlp) is _TracedMLP
    assert all(p is weights[name] for name, p in model.named_parameters())  # the same parameters
    torch.testing.assert_close(_logits(model), 2 * before, atol=0, rtol=0)
    replaced = [(r.path, r.key, r.replacement.rsplit(".", 1)[-1]) for r in report(model).replaced]
    assert replaced[0] == ("", "LlamaForCausalLM", "_LoudCausalLM") and len(replaced) == 3
    assert report(model).unmatched_keys == []


@pytest.mark.parametrize(
    ("replacement", "error", "match"),
    [
        (
            nn.Identity,
            ReplacementTypeError,
            r"`LlamaForCausalLM` matches the model's own class `LlamaForCausalLM`, but its replacement "
            r"`Identity` is not a subclass of it.*unchanged",
        ),
        (
            _CausalLMWithState,
            GraftStateError,
            r"`_CausalLMWithState` has a constructor \(or instance layout\) of its own.*unchanged",
        ),
    ],
    ids=["not-a-subclass", "own-constructor"],
)
def test_a_replacement_of_the_models_own_class_that_cannot_be_exact_is_refused(
    replacement, error, match
) -> None:
    model = _model("llama")
    before = _logits(model)
    with pytest.raises(error, match=match):
        graft_model(model, {"LlamaForCausalLM": replacement, "LlamaMLP": _TracedMLP})
    assert type(model) is LlamaForCausalLM and "_TracedMLP" not in _classes(model)  # nothing half-applied
    assert torch.equal(_logits(model), before) and report(model).replaced == []
