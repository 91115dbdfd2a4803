"""The graft bundles' API and the behaviour of the fused and per-expert modules themselves."""

from __future__ import annotations

import copy
import io
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.llama.modeling_llama import LlamaAttention
from transformers.models.qwen2_moe import modeling_qwen2_moe

import modelgraft
from _versions import missing_model_type, requires_fused_experts
from families import family
from modelgraft import (
    ConversionError,
    PatchRegistrationError,
    get_checkpoint_conversion_mapping,
    register_checkpoint_conversion_mapping,
)
from modelgraft.grafts import (
    FusedSlice,
    Graft,
    GraftConflictError,
    LinearExpert,
    UnsupportedFamilyError,
    fused_gate_up,
    fused_qkv,
    fused_qkv_class,
    linear_experts,
    linear_experts_class,
)
from modelgraft.testing import tiny_config

# Fused 3D experts exist on transformers 5.x only (tests using them are marked requires_fused_experts).
Qwen2MoeExperts = getattr(modeling_qwen2_moe, "Qwen2MoeExperts", None)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("grafts-api-llama")
    family("llama").causal_lm().save_pretrained(path)
    return path


def _attn_type(model: nn.Module) -> str:
    return type(model.model.layers[0].self_attn).__name__


# --- bundle API ---------------------------------------------------------------------------------


def test_register_applies_globally_until_unregister(llama_dir: Path) -> None:
    graft = fused_qkv("llama")
    graft.register()
    try:
        assert get_checkpoint_conversion_mapping("llama") == graft.conversions["llama"]
        assert _attn_type(AutoModelForCausalLM.from_pretrained(llama_dir)) == "FusedQKVLlamaAttention"
    finally:
        graft.unregister()
    assert get_checkpoint_conversion_mapping("llama") is None
    assert modelgraft.get_patch_mapping() == {}
    assert _attn_type(AutoModelForCausalLM.from_pretrained(llama_dir)) == "LlamaAttention"


def test_register_is_all_or_nothing_when_a_class_is_already_patched() -> None:
    modelgraft.register_patch_mapping({"LlamaAttention": LlamaAttention})
    with pytest.raises(PatchRegistrationError, match="LlamaAttention"):
        fused_qkv("llama").register()
    assert get_checkpoint_conversion_mapping("llama") is None
    assert modelgraft.get_patch_mapping() == {"LlamaAttention": LlamaAttention}


def test_register_refuses_to_replace_a_users_conversion_without_overwrite() -> None:
    register_checkpoint_conversion_mapping("llama", [])
    try:
        with pytest.raises(ConversionError, match=r"already has conversions for `llama`.*overwrite=True"):
            fused_qkv("llama").register()
        assert modelgraft.get_patch_mapping() == {}
        graft = fused_qkv("llama")
        graft.register(overwrite=True)
        assert get_checkpoint_conversion_mapping("llama") == graft.conversions["llama"]
        graft.unregister()
    finally:
        if get_checkpoint_conversion_mapping("llama") is not None:
            modelgraft.unregister_checkpoint_conversion_mapping("llama")


def test_applied_is_scoped_to_the_block(llama_dir: Path) -> None:
    with fused_qkv("llama").applied():
        inside = AutoModelForCausalLM.from_pretrained(llama_dir)
    outside = AutoModelForCausalLM.from_pretrained(llama_dir)
    assert (_attn_type(inside), _attn_type(outside)) == ("FusedQKVLlamaAttention", "LlamaAttention")
    assert modelgraft.get_patch_mapping() == {}


def test_patched_with_mapping_and_conversions_is_the_same_as_applied(llama_dir: Path) -> None:
    graft = fused_qkv("llama") + fused_gate_up("llama")
    with modelgraft.patched(graft.mapping, conversions=graft.conversions, strict=True):
        model = AutoModelForCausalLM.from_pretrained(llama_dir)
    layer = model.model.layers[0]
    assert (type(layer.self_attn).__name__, type(layer.mlp).__name__) == (
        "FusedQKVLlamaAttention",
        "FusedGateUpLlamaMLP",
    )


@requires_fused_experts
def test_grafts_add_up_and_merge_conversions_per_model_type() -> None:
    graft = fused_qkv("qwen2_moe") + linear_experts("qwen2_moe")
    assert sorted(graft.mapping) == ["Qwen2MoeAttention", "Qwen2MoeExperts"]
    # the expert merge fused_qkv carries over from transformers is dropped by linear_experts
    (converter,) = graft.conversions["qwen2_moe"]
    assert converter.target_patterns == ("self_attn.qkv_proj",)
    # fused_qkv alone still merges the experts, as transformers would
    assert len(fused_qkv("qwen2_moe").conversions["qwen2_moe"]) == 3


def test_adding_grafts_that_replace_one_class_differently_is_an_error() -> None:
    other = Graft({"LlamaAttention": nn.Identity}, name="other")
    with pytest.raises(GraftConflictError, match=r"`LlamaAttention` is replaced by both"):
        fused_qkv("llama") + other


def _lacks(model_type: str) -> dict:
    why = missing_model_type(model_type)
    return {"condition": why is not None, "reason": why or ""}


@pytest.mark.parametrize(
    ("make", "model_type", "message"),
    [
        (fused_qkv, "phi3", r"No attention of `phi3` has plain `q_proj`, `k_proj` and `v_proj`"),
        (fused_gate_up, "gpt2", r"No MLP of `gpt2` has plain `gate_proj` and `up_proj`"),
        (linear_experts, "llama", r"`llama` has no fused experts that are sets of gated linear layers"),
        pytest.param(
            linear_experts,
            "kimi_linear",
            r"`kimi_linear` uses the regular expression",
            marks=[requires_fused_experts, pytest.mark.skipif(**_lacks("kimi_linear"))],
        ),
    ],
)
def test_unsupported_families_are_refused_when_the_graft_is_made(make, model_type: str, message: str) -> None:
    with pytest.raises(UnsupportedFamilyError, match=message):
        make(model_type)


def test_default_grafts_cover_their_families_lazily() -> None:
    graft = fused_qkv()
    assert "qwen3" in graft.model_types and "mixtral" in graft.model_types
    assert "Qwen3Attention" in graft.mapping


# --- fused modules ------------------------------------------------------------------------------


def _plain_and_grafted(model_type: str, *grafts: Graft) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    plain = family(model_type).causal_lm()
    grafted = copy.deepcopy(plain)
    graft = grafts[0]
    for other in grafts[1:]:
        graft = graft + other
    modelgraft.graft_model(grafted, graft)
    return plain, grafted


def test_gradients_of_fused_layers_are_the_concatenated_plain_gradients() -> None:
    plain, grafted = _plain_and_grafted("qwen2", fused_qkv("qwen2"), fused_gate_up("qwen2"))
    inputs = family("qwen2").inputs(plain.config)
    for model in (plain, grafted):
        model.train()
        model(**inputs).logits.pow(2).mean().backward()
    p_attn, g_attn = plain.model.layers[1].self_attn, grafted.model.layers[1].self_attn
    expected_w = torch.cat([p_attn.q_proj.weight.grad, p_attn.k_proj.weight.grad, p_attn.v_proj.weight.grad])
    expected_b = torch.cat([p_attn.q_proj.bias.grad, p_attn.k_proj.bias.grad, p_attn.v_proj.bias.grad])
    torch.testing.assert_close(g_attn.qkv_proj.weight.grad, expected_w, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(g_attn.qkv_proj.bias.grad, expected_b, atol=1e-6, rtol=1e-5)
    p_mlp, g_mlp = plain.model.layers[0].mlp, grafted.model.layers[0].mlp
    expected = torch.cat([p_mlp.gate_proj.weight.grad, p_mlp.up_proj.weight.grad])
    torch.testing.assert_close(g_mlp.gate_up_proj.weight.grad, expected, atol=1e-6, rtol=1e-5)


def test_gradient_checkpointing_recomputes_through_the_fused_layers() -> None:
    plain, grafted = _plain_and_grafted("llama", fused_qkv("llama"), fused_gate_up("llama"))
    inputs = family("llama").inputs(plain.config)
    for model in (plain, grafted):
        model.gradient_checkpointing_enable()
        model.train()
        model(**inputs, use_cache=False).logits.pow(2).mean().backward()
    p_attn, g_attn = plain.model.layers[0].self_attn, grafted.model.layers[0].self_attn
    expected = torch.cat([p_attn.q_proj.weight.grad, p_attn.k_proj.weight.grad, p_attn.v_proj.weight.grad])
    torch.testing.assert_close(g_attn.qkv_proj.weight.grad, expected, atol=1e-6, rtol=1e-5)


def test_torch_compile_traces_the_fused_layers_without_graph_breaks() -> None:
    import torch._dynamo

    plain, grafted = _plain_and_grafted("llama", fused_qkv("llama"), fused_gate_up("llama"))
    inputs = family("llama").inputs(plain.config)
    torch._dynamo.reset()
    compiled = torch.compile(grafted.eval(), backend="eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(
            compiled(**inputs).logits, plain.eval()(**inputs).logits, atol=1e-6, rtol=0
        )
        other = family("llama").inputs(plain.config, seed=1)
        torch.testing.assert_close(compiled(**other).logits, plain(**other).logits, atol=1e-6, rtol=0)
    torch._dynamo.reset()
    # nothing traced is left holding activations
    groups = {m._group for m in grafted.modules() if isinstance(m, FusedSlice)}
    assert groups and all(g._traced is None for g in groups)


def test_generation_with_a_kv_cache_matches_the_plain_model() -> None:
    plain, grafted = _plain_and_grafted("qwen3", fused_qkv("qwen3"), fused_gate_up("qwen3"))
    ids = family("qwen3").inputs(plain.config)["input_ids"]
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(plain.eval().generate(ids, **kwargs), grafted.eval().generate(ids, **kwargs))


def test_grafted_models_survive_deepcopy_and_torch_save() -> None:
    plain, grafted = _plain_and_grafted("llama", fused_qkv("llama"))
    inputs = family("llama").inputs(plain.config)
    buffer = io.BytesIO()
    torch.save(grafted, buffer)
    buffer.seek(0)
    restored = torch.load(buffer, weights_only=False)
    copied = copy.deepcopy(grafted)
    with torch.no_grad():
        expected = plain(**inputs).logits
        for model in (restored, copied):
            torch.testing.assert_close(model(**inputs).logits, expected, atol=1e-6, rtol=0)
    # the copy's stand-ins read the copy's fused layer, not the original's
    with torch.no_grad():
        copied.model.layers[0].self_attn.qkv_proj.weight.zero_()
        assert not torch.equal(copied(**inputs).logits, grafted(**inputs).logits)


def test_fused_slices_expose_views_of_the_fused_weights() -> None:
    plain, grafted = _plain_and_grafted("qwen2", fused_qkv("qwen2"))
    p, g = plain.model.layers[0].self_attn, grafted.model.layers[0].self_attn
    assert list(dict(g.named_parameters())) == ["o_proj.weight", "qkv_proj.weight", "qkv_proj.bias"]
    for name in ("q_proj", "k_proj", "v_proj"):
        assert torch.equal(getattr(g, name).weight, getattr(p, name).weight)
        assert torch.equal(getattr(g, name).bias, getattr(p, name).bias)
        assert getattr(g, name).out_features == getattr(p, name).out_features
    assert g.q_proj.out_features == 2 * g.k_proj.out_features  # grouped-query attention sizes


def test_fused_classes_are_cached_subclasses_of_the_original() -> None:
    cls = fused_qkv_class(LlamaAttention)
    assert cls is fused_qkv_class(LlamaAttention)
    assert issubclass(cls, LlamaAttention) and cls.__name__ == "FusedQKVLlamaAttention"


# --- per-expert experts -------------------------------------------------------------------------


@requires_fused_experts
def test_per_expert_experts_are_plain_linear_layers_for_quantizers() -> None:
    experts = linear_experts_class(Qwen2MoeExperts)(family("qwen2_moe").config())
    assert isinstance(experts, nn.ModuleList) and all(isinstance(e, LinearExpert) for e in experts)
    linears = [m for m in experts.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 3 * experts.num_experts
    assert not [n for n, p in experts.named_parameters() if p.dim() != 2]


@requires_fused_experts
def test_per_expert_forward_skips_the_expert_parallel_sentinel() -> None:
    torch.manual_seed(0)
    config = family("qwen2_moe").config()
    original = Qwen2MoeExperts(config)
    nn.init.normal_(original.gate_up_proj, std=0.1)
    nn.init.normal_(original.down_proj, std=0.1)
    model = family("qwen2_moe").causal_lm()
    model.model.layers[0].mlp.experts.load_state_dict(original.state_dict())
    grafted = modelgraft.graft_model(model, linear_experts("qwen2_moe"))  # takes the built experts over
    experts = grafted.model.layers[0].mlp.experts
    assert type(experts) is linear_experts_class(Qwen2MoeExperts)
    hidden = torch.randn(6, config.hidden_size)
    index = torch.tensor([[0, 1], [2, 3], [1, 4], [4, 0], [3, 2], [4, 4]])  # 4 == num_experts: skipped
    weights = torch.rand(6, 2)
    with torch.no_grad():
        torch.testing.assert_close(
            experts(hidden, index, weights), original(hidden, index, weights), atol=1e-6, rtol=0
        )
        assert torch.count_nonzero(experts(hidden, index, weights)[5]) == 0


@requires_fused_experts
def test_experts_that_end_in_a_norm_are_refused_with_the_reason() -> None:
    if (why := missing_model_type("muse_spark_text")) is not None:
        pytest.skip(why)
    from transformers.models.muse_spark.modeling_muse_spark import MuseSparkExperts

    with pytest.raises(
        UnsupportedFamilyError,
        match=r"`MuseSparkExperts` cannot become per-expert.*`has_post_expert_norm` is True",
    ):
        linear_experts_class(MuseSparkExperts)(tiny_config("muse_spark_text"))


@requires_fused_experts
def test_gpt_oss_experts_become_biased_linear_layers_with_its_clamped_swiglu() -> None:
    """Refused before (transposed, interleaved, biased); each expert now has biased layers and
    calls GPT-OSS's own `_apply_gate` (alpha/limit clamp)."""
    config = family("gpt_oss").config()
    experts = linear_experts_class(GptOssExperts)(config)
    assert experts[0].gate_proj.bias is not None and experts[0].down_proj.bias is not None
    assert experts[0]._gate.function is GptOssExperts._apply_gate
    assert (experts[0]._gate.settings.alpha, experts[0]._gate.settings.limit) == (
        config.swiglu_alpha,
        config.swiglu_limit,
    )


@requires_fused_experts
def test_mixtral_experts_keep_the_checkpoints_names() -> None:
    mapping = linear_experts("mixtral").mapping
    experts = mapping["MixtralExperts"](family("mixtral").config())
    assert sorted(n for n, _ in experts[0].named_parameters()) == ["w1.weight", "w2.weight", "w3.weight"]
