"""``graft_model`` keeps the state of what it replaces, per parameter and per module, or refuses.

Per parameter: ``requires_grad``, dtype and device as they were (an untouched parameter is the very
same object); a parameter fused from originals that disagree is refused. Per module: train/eval
mode; hooks carried over where they can be exactly, refused with the module and hook named where
they cannot. A refusal leaves the model exactly as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

from _versions import requires_fused_experts
from families import family
from modelgraft import GraftError, graft_model, patched, report
from modelgraft.grafts import fused_qkv, linear_experts
from modelgraft.testing import tiny_config

IDS = torch.arange(14).reshape(2, 7) % 100


def _llama() -> nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("llama")).eval()


def _fingerprint(model: nn.Module) -> dict[str, Any]:
    """Everything a graft could change: module and parameter objects, values, flags, hooks, attributes."""
    out: dict[str, Any] = {"attrs": sorted(model.__dict__)}
    for path, module in model.named_modules(remove_duplicate=False):
        hooks = {
            name: list(getattr(module, name).items())
            for name in (
                "_forward_hooks",
                "_forward_pre_hooks",
                "_backward_hooks",
                "_state_dict_hooks",
                "_state_dict_pre_hooks",
                "_load_state_dict_pre_hooks",
            )
        }
        out[f"module {path}"] = (module, type(module), module.training, hooks)
    for name, p in model.named_parameters(remove_duplicate=False):
        out[f"param {name}"] = (p, p.dtype, p.device, p.requires_grad, p.detach().clone(), p.grad)
    return out


def _assert_unchanged(model: nn.Module, before: dict[str, Any]) -> None:
    after = _fingerprint(model)
    assert sorted(after) == sorted(before)
    for key, value in before.items():
        if key.startswith("param "):
            p, dtype, device, requires_grad, data, grad = value
            q, *rest = after[key]
            assert q is p and (dtype, device, requires_grad) == tuple(rest[:3]) and rest[4] is grad, key
            assert q.is_meta or torch.equal(q.detach(), data), key
        else:
            assert after[key] == value, key


def _qkv(model: nn.Module, layer: int) -> nn.Module:
    return model.model.layers[layer].self_attn


# ---- requires_grad --------------------------------------------------------------------------------
def test_frozen_parameters_stay_frozen_and_untouched_ones_are_the_same_objects() -> None:
    model = _llama()
    model.model.layers[0].self_attn.o_proj.requires_grad_(False)
    for name in ("q_proj", "k_proj", "v_proj"):
        getattr(model.model.layers[1].self_attn, name).requires_grad_(False)
    o_proj_0 = model.model.layers[0].self_attn.o_proj.weight

    graft_model(model, fused_qkv("llama"))

    attn0, attn1 = _qkv(model, 0), _qkv(model, 1)
    assert attn0.o_proj.weight is o_proj_0 and not attn0.o_proj.weight.requires_grad
    assert attn0.qkv_proj.weight.requires_grad
    assert not attn1.qkv_proj.weight.requires_grad and attn1.o_proj.weight.requires_grad
    assert [n for n, p in model.named_parameters() if not p.requires_grad] == [
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.1.self_attn.qkv_proj.weight",
    ]


def test_a_fused_parameter_from_frozen_and_trainable_originals_is_refused() -> None:
    model = _llama()
    model.model.layers[1].self_attn.q_proj.requires_grad_(False)  # k and v stay trainable
    before = _fingerprint(model)
    with pytest.raises(
        GraftError,
        match=r"`model\.layers\.1\.self_attn`.*`qkv_proj\.weight`.*"
        r"`q_proj\.weight`: False, `k_proj\.weight`: True.*differ in `requires_grad`",
    ):
        graft_model(model, fused_qkv("llama"))
    _assert_unchanged(model, before)


def test_a_fused_parameter_with_a_gradient_is_refused() -> None:
    model = _llama()
    model(IDS).logits.sum().backward()
    before = _fingerprint(model)
    with pytest.raises(
        GraftError, match=r"`model\.layers\.0\.self_attn`.*`q_proj\.weight` has a `\.grad`.*zero_grad"
    ):
        graft_model(model, fused_qkv("llama"))
    _assert_unchanged(model, before)


def test_the_gradient_of_an_untouched_parameter_is_kept() -> None:
    model = _llama()
    model.model.layers[0].self_attn.o_proj.weight.grad = torch.ones_like(
        model.model.layers[0].self_attn.o_proj.weight
    )
    graft_model(model, fused_qkv("llama"))
    assert torch.equal(_qkv(model, 0).o_proj.weight.grad, torch.ones_like(_qkv(model, 0).o_proj.weight))


# ---- dtype and device -----------------------------------------------------------------------------
def _t5_feed_forward_class(model: nn.Module) -> type[nn.Module]:
    return type(model.encoder.block[0].layer[1].DenseReluDense)


def test_t5_keeps_wo_in_fp32_as_a_load_time_swap_does(tmp_path: Path) -> None:
    t5 = family("t5")
    torch.manual_seed(0)
    AutoModelForSeq2SeqLM.from_config(t5.config()).save_pretrained(tmp_path)
    model = AutoModelForSeq2SeqLM.from_pretrained(tmp_path, dtype=torch.float16).eval()
    original = _t5_feed_forward_class(model)
    traced = type(f"Traced{original.__name__}", (original,), {})
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["encoder.block.0.layer.1.DenseReluDense.wo.weight"] == torch.float32  # kept by transformers
    inputs = t5.inputs(model.config)
    with torch.no_grad():
        before = model(**inputs).logits

    graft_model(model, {original.__name__: traced})

    assert isinstance(model.encoder.block[0].layer[1].DenseReluDense, traced)
    assert {n: p.dtype for n, p in model.named_parameters()} == dtypes
    with torch.no_grad():
        after = model(**inputs).logits
    assert after.dtype == before.dtype and torch.isfinite(after).all()
    assert torch.equal(after, before)
    with patched({original.__name__: traced}):
        at_load = AutoModelForSeq2SeqLM.from_pretrained(tmp_path, dtype=torch.float16)
    assert {n: p.dtype for n, p in at_load.named_parameters()} == dtypes


@requires_fused_experts
def test_per_expert_layers_take_the_state_of_the_fused_tensor_they_come_from() -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen2_moe")).eval()
    experts = model.model.layers[0].mlp.experts
    experts.down_proj.requires_grad_(False)  # gate_up_proj stays trainable
    graft_model(model, linear_experts("qwen2_moe"))
    expert = model.model.layers[0].mlp.experts[1]
    assert not expert.down_proj.weight.requires_grad
    assert expert.gate_proj.weight.requires_grad and expert.up_proj.weight.requires_grad
    assert model.model.layers[1].mlp.experts[0].down_proj.weight.requires_grad


def test_fused_parameters_get_the_dtype_of_their_originals() -> None:
    model = _llama().to(torch.bfloat16)
    model.model.layers[1].self_attn.to(torch.float32)  # one layer kept in fp32
    graft_model(model, fused_qkv("llama"))
    assert _qkv(model, 0).qkv_proj.weight.dtype == torch.bfloat16
    assert _qkv(model, 1).qkv_proj.weight.dtype == torch.float32
    assert _qkv(model, 1).o_proj.weight.dtype == torch.float32


def test_a_fused_parameter_from_originals_of_different_dtypes_is_refused() -> None:
    model = _llama()
    model.model.layers[0].self_attn.k_proj.to(torch.bfloat16)
    before = _fingerprint(model)
    with pytest.raises(
        GraftError,
        match=r"`model\.layers\.0\.self_attn`.*`qkv_proj\.weight`.*"
        r"`q_proj\.weight`: torch\.float32, `k_proj\.weight`: torch\.bfloat16.*differ in `dtype`",
    ):
        graft_model(model, fused_qkv("llama"))
    _assert_unchanged(model, before)


def test_each_parameter_stays_on_its_device() -> None:
    model = _llama()
    attn = model.model.layers[0].self_attn
    attn.o_proj.to("meta")  # a module split over two devices
    graft_model(model, fused_qkv("llama"))
    attn = _qkv(model, 0)
    assert attn.o_proj.weight.device.type == "meta" and attn.qkv_proj.weight.device.type == "cpu"


def test_a_fused_parameter_from_originals_on_different_devices_is_refused() -> None:
    model = _llama()
    model.model.layers[0].self_attn.v_proj.to("meta")
    before = _fingerprint(model)
    with pytest.raises(
        GraftError,
        match=r"`model\.layers\.0\.self_attn`.*`qkv_proj\.weight`.*`q_proj\.weight`: cpu.*"
        r"`v_proj\.weight`: meta.*differ in `device`",
    ):
        graft_model(model, fused_qkv("llama"))
    _assert_unchanged(model, before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")
def test_a_model_split_over_cpu_and_cuda_keeps_every_parameter_where_it_was() -> None:
    model = _llama()
    model.model.layers[1].to("cuda")
    devices = {n: p.device for n, p in model.named_parameters()}
    graft_model(model, fused_qkv("llama"))
    for name, p in model.named_parameters():
        source = name.replace("qkv_proj", "q_proj")
        assert p.device == devices[source], name


# ---- train/eval mode ------------------------------------------------------------------------------
def test_train_mode_is_kept_per_submodule() -> None:
    model = _llama().train()
    model.model.layers[0].self_attn.o_proj.eval()
    model.model.layers[1].self_attn.eval()
    model.model.layers[1].self_attn.o_proj.train()
    graft_model(model, fused_qkv("llama"))
    attn0, attn1 = _qkv(model, 0), _qkv(model, 1)
    assert (attn0.training, attn0.o_proj.training, attn0.qkv_proj.training) == (True, False, True)
    assert (attn1.training, attn1.o_proj.training, attn1.qkv_proj.training) == (False, True, False)


def test_gradient_checkpointing_stays_enabled_on_replaced_layers() -> None:
    model = _llama().train()
    # `activation_checkpointing_enable` on transformers 5 (the old name warns there), the old one on 4.57
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    layer_class = type(model.model.layers[0])
    traced = type(f"Traced{layer_class.__name__}", (layer_class,), {})
    func = model.model.layers[0]._gradient_checkpointing_func

    graft_model(model, {layer_class.__name__: traced})

    assert [type(layer) for layer in model.model.layers] == [traced, traced]
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    assert all(layer._gradient_checkpointing_func is func for layer in model.model.layers)


# ---- hooks ----------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:Full backward hook is firing when gradients are computed")
def test_hooks_on_the_replaced_module_and_on_kept_children_are_carried_over() -> None:
    model = _llama()
    calls: list[str] = []
    attn = model.model.layers[0].self_attn
    handles = [
        attn.register_forward_pre_hook(lambda m, args, kwargs: calls.append("pre"), with_kwargs=True),
        attn.register_forward_hook(lambda m, args, out: calls.append("forward")),
        attn.register_full_backward_hook(lambda m, gin, gout: calls.append("backward")),
        attn.o_proj.register_forward_hook(lambda m, args, out: calls.append("o_proj")),
    ]
    with torch.no_grad():
        before = model(IDS).logits
    assert calls == ["pre", "o_proj", "forward"]
    calls.clear()

    graft_model(model, fused_qkv("llama"))

    attn = _qkv(model, 0)
    assert type(attn).__name__.startswith("FusedQKV")
    logits = model(IDS).logits
    logits.sum().backward()
    assert calls == ["pre", "o_proj", "forward", "backward"]
    torch.testing.assert_close(logits.detach(), before, atol=1e-5, rtol=0)
    for handle in handles:  # the caller's handles still remove them
        handle.remove()
    calls.clear()
    model(IDS).logits.sum().backward()
    assert calls == []


def _named_hook(module: nn.Module, args: object, out: object) -> None:
    pass


def _named_pre_hook(module: nn.Module, args: object) -> None:
    pass


def test_a_hook_on_a_child_the_replacement_does_not_keep_is_refused() -> None:
    model = _llama()
    model.model.layers[1].self_attn.q_proj.register_forward_hook(_named_hook)
    before = _fingerprint(model)
    with pytest.raises(
        GraftError,
        match=r"`model\.layers\.1\.self_attn\.q_proj`.*forward hook `_named_hook`.*no `Linear` at that place.*remove\(\)",
    ):
        graft_model(model, fused_qkv("llama"))
    _assert_unchanged(model, before)


def test_a_state_dict_hook_on_a_module_whose_layout_changes_is_refused() -> None:
    model = _llama()
    model.model.layers[0].self_attn.register_state_dict_pre_hook(lambda m, prefix, keep_vars: None)
    before = _fingerprint(model)
    with pytest.raises(GraftError, match=r"`model\.layers\.0\.self_attn`.*state-dict pre-hook.*layout"):
        graft_model(model, fused_qkv("llama"))
    _assert_unchanged(model, before)


def test_a_state_dict_hook_on_an_unchanged_child_is_carried_over() -> None:
    model = _llama()
    seen: list[str] = []

    def hook(module: nn.Module, state: dict, prefix: str, local_metadata: dict) -> None:
        seen.append(prefix)

    model.model.layers[0].self_attn.o_proj._register_state_dict_hook(hook)
    graft_model(model, fused_qkv("llama"))
    model.state_dict()
    assert seen == ["model.layers.0.self_attn.o_proj."]


def test_a_hook_on_a_fused_parameter_is_refused_and_on_an_untouched_one_kept() -> None:
    model = _llama()
    grads: list[str] = []
    model.model.layers[0].self_attn.o_proj.weight.register_hook(lambda g: grads.append("o_proj"))
    graft_model(model, fused_qkv("llama"))
    model(IDS).logits.sum().backward()
    assert grads == ["o_proj"]

    model = _llama()
    model.model.layers[0].self_attn.k_proj.weight.register_hook(lambda g: g)
    before = _fingerprint(model)
    with pytest.raises(
        GraftError, match=r"`model\.layers\.0\.self_attn`.*`k_proj\.weight` has a tensor hook"
    ):
        graft_model(model, fused_qkv("llama"))
    _assert_unchanged(model, before)


def test_a_forward_replaced_on_the_instance_is_refused() -> None:
    model = _llama()
    attn = model.model.layers[0].self_attn
    attn.forward = attn.forward  # what accelerate and other wrappers do
    before = _fingerprint(model)
    with pytest.raises(
        GraftError, match=r"`model\.layers\.0\.self_attn`.*`forward` replaced on the instance"
    ):
        graft_model(model, fused_qkv("llama"))
    _assert_unchanged(model, before)


def test_an_accelerate_hook_is_refused() -> None:
    hooks = pytest.importorskip("accelerate.hooks", reason="accelerate is not installed")
    model = _llama()
    hooks.add_hook_to_module(model.model.layers[1].self_attn.o_proj, hooks.ModelHook())
    before_modules = [m for m in model.modules()]
    with pytest.raises(
        GraftError, match=r"`model\.layers\.1\.self_attn\.o_proj`.*accelerate hook `ModelHook`"
    ):
        graft_model(model, fused_qkv("llama"))
    assert [m for m in model.modules()] == before_modules
    assert report(model).replaced == []


class _SelfSavingLinear(nn.Linear):
    """Writes its own state dict entries, as quantized layers do."""

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "scale"] = torch.ones(1)


def test_a_layer_that_writes_its_own_state_dict_is_refused() -> None:
    model = _llama()
    old = model.model.layers[0].self_attn.o_proj
    custom = _SelfSavingLinear(old.in_features, old.out_features, bias=False)
    model.model.layers[0].self_attn.o_proj = custom
    before = _fingerprint(model)
    with pytest.raises(
        GraftError,
        match=r"`model\.layers\.0\.self_attn\.o_proj` \(`_SelfSavingLinear`\) writes state of its own",
    ):
        graft_model(model, fused_qkv("llama"))
    _assert_unchanged(model, before)


class _SpecialParameter(nn.Parameter):
    pass


def test_a_special_parameter_that_a_conversion_would_read_is_refused() -> None:
    model = _llama()
    q_proj = model.model.layers[0].self_attn.q_proj
    q_proj.weight = _SpecialParameter(q_proj.weight.detach().clone())
    before = _fingerprint(model)
    with pytest.raises(
        GraftError, match=r"`model\.layers\.0\.self_attn`.*`q_proj\.weight` is a `_SpecialParameter`"
    ):
        graft_model(model, fused_qkv("llama"))
    _assert_unchanged(model, before)


# ---- all or nothing -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spoil",
    [
        pytest.param(lambda m: m.model.layers[1].self_attn.v_proj.requires_grad_(False), id="requires_grad"),
        pytest.param(lambda m: m.model.layers[1].self_attn.v_proj.to(torch.float64), id="dtype"),
        pytest.param(
            lambda m: m.model.layers[1].self_attn.k_proj.register_forward_pre_hook(_named_pre_hook), id="hook"
        ),
        pytest.param(lambda m: setattr(m.model.layers[1].self_attn, "v_proj", nn.Linear(64, 8)), id="shape"),
    ],
)
def test_a_refusal_on_the_last_layer_leaves_the_whole_model_as_it_was(
    spoil: Callable[[nn.Module], object],
) -> None:
    model = _llama()
    model.model.layers[0].self_attn.register_forward_hook(_named_hook)  # carried, were it not refused
    model.model.layers[0].self_attn.o_proj.requires_grad_(False)
    spoil(model)
    before = _fingerprint(model)
    with pytest.raises(GraftError, match=r"`model\.layers\.1\.self_attn"):
        graft_model(model, fused_qkv("llama"))
    _assert_unchanged(model, before)
    assert "_modelgraft_report" not in model.__dict__
