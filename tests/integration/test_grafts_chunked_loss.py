"""The chunked-loss graft against the plain model: loss and every parameter gradient, per family.

Plain and grafted models hold the same weights (the grafted one is a deep copy switched with
``graft_chunked_lm_loss``) and run in fp32; each forward starts from the same seed, so dropout and
router noise draw alike. Chunks of 5 tokens make every batch span several chunks.
"""

from __future__ import annotations

import copy
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import modelgraft
from _versions import skip_if_missing_model_type
from families import family, family_params
from modelgraft.grafts import (
    CHUNKED_LM_LOSS_FAMILIES,
    DoubleBackwardError,
    LossInputError,
    UnsupportedFamilyError,
    chunked_lm_loss,
    chunked_lm_loss_class,
    fused_qkv,
    graft_chunked_lm_loss,
)

ATOL, RTOL = 1e-6, 1e-5
CHUNK = 5


def _pair(model_type: str, **overrides: Any) -> tuple[torch.nn.Module, torch.nn.Module]:
    skip_if_missing_model_type(model_type)
    torch.manual_seed(0)
    plain = family(model_type).causal_lm(**overrides).train()
    grafted = graft_chunked_lm_loss(copy.deepcopy(plain), chunk_size=CHUNK)
    return plain, grafted


def _batch(model: torch.nn.Module, model_type: str) -> tuple[dict[str, Any], torch.Tensor]:
    inputs = family(model_type).inputs(model.config)
    labels = inputs["input_ids"].clone()
    labels[0, :4] = -100  # a prompt that does not count
    labels[1, -2] = -100
    return inputs, labels


def _step(
    model: torch.nn.Module, backward: bool = True, **kwargs: Any
) -> tuple[Any, dict[str, torch.Tensor | None]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    out = model(**kwargs)
    if backward:
        out.loss.backward()
    return out, {name: p.grad for name, p in model.named_parameters()}


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, name: str = "", atol: float = ATOL) -> None:
    assert actual.shape == expected.shape, name
    assert actual.dtype == expected.dtype, name
    assert torch.equal(actual.isfinite(), expected.isfinite()), f"{name}: non-finite entries differ"
    torch.testing.assert_close(actual, expected, atol=atol, rtol=RTOL, msg=lambda m: f"{name}: {m}")


def _assert_same_gradients(actual: dict, expected: dict, atol: float = ATOL) -> None:
    assert actual.keys() == expected.keys()
    for name, want in expected.items():
        got = actual[name]
        assert (got is None) == (want is None), name
        if want is not None:
            _assert_close(got, want, name, atol)


# --- every claimed family -----------------------------------------------------------------------


@pytest.mark.parametrize("fam", family_params(model_types=CHUNKED_LM_LOSS_FAMILIES))
def test_loss_and_every_gradient_equal_plain(fam) -> None:
    plain, grafted = _pair(fam.model_type)
    inputs, labels = _batch(plain, fam.model_type)
    moe = {"output_router_logits": True} if fam.kind == "moe" else {}
    want, want_grads = _step(plain, **inputs, labels=labels, **moe)
    got, got_grads = _step(grafted, **inputs, labels=labels, **moe)

    assert type(grafted).__name__ == f"ChunkedLoss{type(plain).__name__}"
    assert got.logits is None and want.logits is not None
    assert got.loss.dim() == 0 and got.loss.dtype == torch.float32 and got.loss.isfinite()
    _assert_close(got.loss, want.loss, "loss")
    assert set(got.keys()) == set(want.keys()) - {"logits"}
    aux = getattr(want, "aux_loss", None)
    if aux is not None:  # the router auxiliary loss is part of the loss, as in plain
        assert torch.equal(got.aux_loss, aux)
        assert abs(plain.router_aux_loss_coef * aux.item()) > 100 * ATOL
    _assert_same_gradients(got_grads, want_grads)
    assert any(g is not None and g.abs().sum() > 0 for g in got_grads.values())


@pytest.mark.parametrize("fam", family_params(model_types=CHUNKED_LM_LOSS_FAMILIES))
def test_the_graft_resolves_for_every_claimed_family(fam) -> None:
    skip_if_missing_model_type(fam.model_type)
    graft = chunked_lm_loss(fam.model_type)
    ((name, cls),) = graft.mapping.items()
    assert name == type(family(fam.model_type).causal_lm()).__name__
    assert cls is chunked_lm_loss_class(getattr(__import__("transformers"), name))


# --- when logits are materialised ---------------------------------------------------------------


def test_eval_mode_with_labels_is_the_plain_forward_bit_for_bit() -> None:
    plain, grafted = _pair("llama")
    plain.eval(), grafted.eval()
    inputs, labels = _batch(plain, "llama")
    want, want_grads = _step(plain, **inputs, labels=labels)
    got, got_grads = _step(grafted, **inputs, labels=labels)
    assert torch.equal(got.logits, want.logits) and torch.equal(got.loss, want.loss)
    assert all(torch.equal(got_grads[k], v) for k, v in want_grads.items())


def test_without_labels_logits_are_the_plain_ones_bit_for_bit() -> None:
    plain, grafted = _pair("qwen3")
    inputs, _ = _batch(plain, "qwen3")
    want, _ = _step(plain, backward=False, **inputs)
    got, _ = _step(grafted, backward=False, **inputs)
    assert got.loss is None and torch.equal(got.logits, want.logits)


def test_skip_logits_false_in_training_is_the_plain_forward() -> None:
    plain, grafted = _pair("gemma2")
    inputs, labels = _batch(plain, "gemma2")
    want, want_grads = _step(plain, **inputs, labels=labels)
    got, got_grads = _step(grafted, **inputs, labels=labels, skip_logits=False)
    assert torch.equal(got.logits, want.logits) and torch.equal(got.loss, want.loss)
    assert all(torch.equal(got_grads[k], v) for k, v in want_grads.items())


def test_skip_logits_true_in_eval_without_grad_chunks_the_loss() -> None:
    plain, grafted = _pair("mixtral")
    plain.eval(), grafted.eval()
    inputs, labels = _batch(plain, "mixtral")
    with torch.no_grad():
        want = plain(**inputs, labels=labels)
        got = grafted(**inputs, labels=labels, skip_logits=True)
    assert got.logits is None and not got.loss.requires_grad
    _assert_close(got.loss, want.loss, "loss")


def test_skip_logits_without_labels_is_a_clear_error() -> None:
    _, grafted = _pair("llama")
    inputs, _ = _batch(grafted, "llama")
    with pytest.raises(LossInputError, match=r"called with `skip_logits=True` but no `labels`"):
        grafted(**inputs, skip_logits=True)


def test_the_signature_advertises_the_plain_parameters_and_skip_logits() -> None:
    import inspect

    plain, grafted = _pair("llama")
    params = inspect.signature(grafted.forward).parameters
    assert list(params)[:-2] == list(inspect.signature(plain.forward).parameters)[:-1]
    assert params["skip_logits"].kind is inspect.Parameter.KEYWORD_ONLY
    assert "labels" in params and "logits_to_keep" in params


def test_return_dict_false_gives_the_tuple_of_the_chunked_output() -> None:
    plain, grafted = _pair("qwen2_moe")
    inputs, labels = _batch(plain, "qwen2_moe")
    as_dict, _ = _step(grafted, backward=False, **inputs, labels=labels, output_router_logits=True)
    as_tuple, _ = _step(
        grafted, backward=False, **inputs, labels=labels, output_router_logits=True, return_dict=False
    )
    assert isinstance(as_tuple, tuple) and len(as_tuple) == len(as_dict.to_tuple())
    assert torch.equal(as_tuple[0], as_dict.loss) and torch.equal(as_tuple[1], as_dict.aux_loss)


# --- the loss semantics of transformers ---------------------------------------------------------


def test_every_label_ignored_gives_nan_like_plain_and_zero_gradients_like_plain() -> None:
    plain, grafted = _pair("llama")
    inputs, labels = _batch(plain, "llama")
    labels = torch.full_like(labels, -100)
    want, want_grads = _step(plain, **inputs, labels=labels)
    got, got_grads = _step(grafted, **inputs, labels=labels)
    assert want.loss.isnan() and got.loss.isnan()
    for name, grad in want_grads.items():
        assert torch.equal(grad, torch.zeros_like(grad)), name
        assert torch.equal(got_grads[name], grad), name


@pytest.mark.parametrize("num_items", [7, torch.tensor(31)], ids=["int", "tensor"])
@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_num_items_in_batch_divides_the_summed_loss_like_plain(model_type, num_items) -> None:
    plain, grafted = _pair(model_type)
    inputs, labels = _batch(plain, model_type)
    moe = {"output_router_logits": True} if family(model_type).kind == "moe" else {}
    want, want_grads = _step(plain, **inputs, labels=labels, num_items_in_batch=num_items, **moe)
    got, got_grads = _step(grafted, **inputs, labels=labels, num_items_in_batch=num_items, **moe)
    _assert_close(got.loss, want.loss, "loss")
    _assert_same_gradients(got_grads, want_grads)
    mean, _ = _step(plain, backward=False, **inputs, labels=labels, **moe)
    assert abs(mean.loss.item() - want.loss.item()) > 1e-3  # num_items_in_batch changed the loss


def test_gradient_accumulation_over_two_micro_batches_matches_plain() -> None:
    plain, grafted = _pair("qwen2")
    inputs, labels = _batch(plain, "qwen2")
    total = int((labels[:, 1:] != -100).sum())
    grads = []
    for model in (plain, grafted):
        model.zero_grad(set_to_none=True)
        for row in range(2):
            torch.manual_seed(1)
            part = {k: v[row : row + 1] for k, v in inputs.items()}
            model(**part, labels=labels[row : row + 1], num_items_in_batch=total).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    _assert_same_gradients(grads[1], grads[0])


def test_shift_labels_are_used_as_given_like_plain() -> None:
    plain, grafted = _pair("llama")
    inputs, labels = _batch(plain, "llama")
    shift = labels.roll(-3, dims=1)
    want, want_grads = _step(plain, **inputs, labels=labels, shift_labels=shift)
    got, got_grads = _step(grafted, **inputs, labels=labels, shift_labels=shift)
    _assert_close(got.loss, want.loss, "loss")
    _assert_same_gradients(got_grads, want_grads)


def test_a_custom_ignore_index_like_plain() -> None:
    plain, grafted = _pair("llama")
    inputs, labels = _batch(plain, "llama")
    labels = torch.where(labels == -100, 0, labels)
    want, want_grads = _step(plain, **inputs, labels=labels, ignore_index=0)
    got, got_grads = _step(grafted, **inputs, labels=labels, ignore_index=0)
    _assert_close(got.loss, want.loss, "loss")
    _assert_same_gradients(got_grads, want_grads)


@pytest.mark.parametrize(
    ("model_type", "overrides", "neutral"),
    [
        ("gemma2", {"final_logit_softcapping": 0.5}, {"final_logit_softcapping": None}),
        ("gemma3_text", {"final_logit_softcapping": 0.5}, {"final_logit_softcapping": None}),
        ("cohere", {"logit_scale": 0.25}, {"logit_scale": 1.0}),
        ("granite", {"logits_scaling": 4.0}, {"logits_scaling": 1.0}),
        ("granitemoe", {"logits_scaling": 4.0}, {"logits_scaling": 1.0}),
    ],
    ids=[
        "gemma2-softcap",
        "gemma3-softcap",
        "cohere-logit_scale",
        "granite-logits_scaling",
        "granitemoe-scaling",
    ],
)
def test_soft_capping_and_logit_scales_are_reproduced(model_type, overrides, neutral) -> None:
    plain, grafted = _pair(model_type, **overrides)
    inputs, labels = _batch(plain, model_type)
    want, want_grads = _step(plain, **inputs, labels=labels)
    got, got_grads = _step(grafted, **inputs, labels=labels)
    _assert_close(got.loss, want.loss, "loss")
    _assert_same_gradients(got_grads, want_grads)
    # the setting matters at this size, so a graft that ignored it would fail above
    other, _ = _pair(model_type, **neutral)
    other.load_state_dict(plain.state_dict())
    without, _ = _step(other, backward=False, **inputs, labels=labels)
    assert abs(without.loss.item() - want.loss.item()) > 1e-3


@pytest.mark.parametrize("model_type", ["llama", "gemma"])
def test_tied_embeddings_receive_both_gradients_like_plain(model_type) -> None:
    plain, grafted = _pair(model_type, tie_word_embeddings=True)
    assert grafted.lm_head.weight is grafted.get_input_embeddings().weight
    inputs, labels = _batch(plain, model_type)
    want, want_grads = _step(plain, **inputs, labels=labels)
    got, got_grads = _step(grafted, **inputs, labels=labels)
    _assert_close(got.loss, want.loss, "loss")
    _assert_same_gradients(got_grads, want_grads)


def test_an_lm_head_bias_gets_its_gradient_like_plain() -> None:
    plain, grafted = _pair("phi")
    assert grafted.lm_head.bias is not None
    inputs, labels = _batch(plain, "phi")
    _, want_grads = _step(plain, **inputs, labels=labels)
    _, got_grads = _step(grafted, **inputs, labels=labels)
    assert got_grads["lm_head.bias"].abs().sum() > 0
    _assert_close(got_grads["lm_head.bias"], want_grads["lm_head.bias"], "lm_head.bias")


def test_a_frozen_lm_head_gets_no_gradient_and_the_rest_match() -> None:
    plain, grafted = _pair("qwen2")
    for model in (plain, grafted):
        model.lm_head.weight.requires_grad_(False)
    inputs, labels = _batch(plain, "qwen2")
    want, want_grads = _step(plain, **inputs, labels=labels)
    got, got_grads = _step(grafted, **inputs, labels=labels)
    assert got_grads["lm_head.weight"] is None
    _assert_close(got.loss, want.loss, "loss")
    _assert_same_gradients(got_grads, want_grads)


def test_bfloat16_weights_stay_within_bfloat16_rounding_of_plain() -> None:
    plain, grafted = _pair("llama")
    plain.to(torch.bfloat16), grafted.to(torch.bfloat16)
    inputs, labels = _batch(plain, "llama")
    want, want_grads = _step(plain, **inputs, labels=labels)
    got, got_grads = _step(grafted, **inputs, labels=labels)
    assert got.loss.dtype == want.loss.dtype == torch.float32
    torch.testing.assert_close(got.loss, want.loss, atol=2e-2, rtol=1e-2)
    for name, want_grad in want_grads.items():
        got_grad = got_grads[name]
        assert got_grad.dtype == torch.bfloat16 and got_grad.isfinite().all(), name
        scale = want_grad.abs().max().item()
        assert (got_grad.float() - want_grad.float()).abs().max().item() <= 0.05 * scale + 1e-4, name


def test_logits_to_keep_with_labels_for_the_kept_positions_like_plain() -> None:
    plain, grafted = _pair("llama")
    inputs, labels = _batch(plain, "llama")
    kept = labels[:, -5:]
    want, want_grads = _step(plain, **inputs, labels=kept, logits_to_keep=5)
    got, got_grads = _step(grafted, **inputs, labels=kept, logits_to_keep=5)
    _assert_close(got.loss, want.loss, "loss")
    _assert_same_gradients(got_grads, want_grads)


def test_labels_that_do_not_fit_the_kept_positions_are_a_clear_error() -> None:
    plain, grafted = _pair("llama")
    inputs, labels = _batch(plain, "llama")
    with pytest.raises((ValueError, RuntimeError)):  # plain fails too, with a torch error
        plain(**inputs, labels=labels, logits_to_keep=5)
    with pytest.raises(LossInputError, match=r"The head sees 10 tokens .* but the shifted labels hold 24"):
        grafted(**inputs, labels=labels, logits_to_keep=5)


def test_labels_outside_the_vocabulary_are_a_clear_error() -> None:
    _, grafted = _pair("llama")
    inputs, labels = _batch(grafted, "llama")
    labels[1, 3] = grafted.config.vocab_size
    with pytest.raises(
        LossInputError, match=r"Label 128 at flattened position 14 is outside the vocabulary \[0, 128\)"
    ):
        grafted(**inputs, labels=labels)


def test_second_derivatives_are_refused() -> None:
    _, grafted = _pair("llama")
    inputs, labels = _batch(grafted, "llama")
    loss = grafted(**inputs, labels=labels).loss
    with pytest.raises(DoubleBackwardError, match=r"skip_logits=False"):
        torch.autograd.grad(loss, grafted.lm_head.weight, create_graph=True)


# --- when the plain forward runs instead ----------------------------------------------------------


def test_a_hooked_lm_head_runs_the_plain_forward_with_a_warning() -> None:
    plain, grafted = _pair("llama")
    calls = []
    grafted.lm_head.register_forward_hook(lambda *_: calls.append(1))
    inputs, labels = _batch(plain, "llama")
    want, _ = _step(plain, backward=False, **inputs, labels=labels)
    with pytest.warns(RuntimeWarning, match=r"plain forward \(full logits in memory\): `lm_head` has hooks"):
        got, _ = _step(grafted, backward=False, **inputs, labels=labels)
    assert calls == [1]
    assert torch.equal(got.logits, want.logits) and torch.equal(got.loss, want.loss)


def test_a_replaced_loss_function_runs_the_plain_forward_with_a_warning() -> None:
    _, grafted = _pair("qwen2")
    seen = []

    def my_loss(logits, labels, vocab_size, **kwargs):
        seen.append(tuple(logits.shape))
        return logits.float().mean()

    grafted.loss_function = my_loss
    inputs, labels = _batch(grafted, "qwen2")
    with pytest.warns(RuntimeWarning, match=r"`loss_function` is not transformers' `ForCausalLMLoss`"):
        out = grafted(**inputs, labels=labels)
    assert seen == [(2, 12, grafted.config.vocab_size)]
    assert torch.equal(out.loss, out.logits.float().mean())


# --- the graft: classes, in-place switch, refusals, save and load -----------------------------------


def test_graft_chunked_lm_loss_is_reported_and_can_change_the_chunk_size() -> None:
    plain, grafted = _pair("llama")
    (entry,) = modelgraft.report(grafted).replaced
    assert (
        entry.path == "" and entry.original.endswith("LlamaForCausalLM") and entry.key == "LlamaForCausalLM"
    )
    assert entry.replacement.endswith("ChunkedLossLlamaForCausalLM")
    graft_chunked_lm_loss(grafted, chunk_size=3)
    assert type(grafted)._modelgraft_chunk_size == 3 and len(modelgraft.report(grafted).replaced) == 1
    inputs, labels = _batch(plain, "llama")
    want, _ = _step(plain, **inputs, labels=labels)
    got, _ = _step(grafted, **inputs, labels=labels)
    _assert_close(got.loss, want.loss, "loss")


def test_graft_model_switches_a_built_model_to_the_chunked_loss() -> None:
    """``graft_model`` is the one way to graft a built model: a key naming the model's own class
    switches the model object (``graft_chunked_lm_loss`` is this, with the graft alone)."""
    plain = family("llama").causal_lm().train()
    grafted = modelgraft.graft_model(copy.deepcopy(plain), chunked_lm_loss("llama", chunk_size=CHUNK))
    assert type(grafted) is chunked_lm_loss_class(LlamaForCausalLM, chunk_size=CHUNK)
    assert [(r.path, r.key) for r in modelgraft.report(grafted).replaced] == [("", "LlamaForCausalLM")]
    inputs, labels = _batch(plain, "llama")
    want, want_grads = _step(plain, **inputs, labels=labels)
    got, got_grads = _step(grafted, **inputs, labels=labels)
    assert got.logits is None
    _assert_close(got.loss, want.loss, "loss")
    _assert_same_gradients(got_grads, want_grads)


def test_graft_model_applies_the_chunked_loss_with_other_grafts() -> None:
    plain = family("qwen3").causal_lm().train()
    graft = fused_qkv("qwen3") + chunked_lm_loss("qwen3", chunk_size=CHUNK)
    grafted = modelgraft.graft_model(copy.deepcopy(plain), graft)
    assert type(grafted).__name__ == "ChunkedLossQwen3ForCausalLM"
    assert type(grafted.model.layers[0].self_attn).__name__ == "FusedQKVQwen3Attention"
    inputs, labels = _batch(plain, "qwen3")
    want, _ = _step(plain, backward=False, **inputs, labels=labels)
    got, _ = _step(grafted, backward=False, **inputs, labels=labels)
    _assert_close(got.loss, want.loss, "loss")


def test_models_that_are_not_causal_lms_are_refused_and_left_alone() -> None:
    bert = family("bert").base_model()
    with pytest.raises(
        UnsupportedFamilyError, match=r"`BertModel` is not a transformers causal LM with an `lm_head`"
    ):
        graft_chunked_lm_loss(bert)
    assert type(bert).__name__ == "BertModel"
    opt = family("opt").causal_lm()
    with pytest.raises(
        UnsupportedFamilyError, match=r"`OPTForCausalLM.forward` does not call `lm_head` exactly once"
    ):
        graft_chunked_lm_loss(opt)
    assert type(opt).__name__ == "OPTForCausalLM"


def test_the_graft_refuses_unsupported_model_types_and_bad_chunk_sizes() -> None:
    with pytest.raises(UnsupportedFamilyError, match=r"`distilbert` has no causal-LM class"):
        chunked_lm_loss("distilbert")
    with pytest.raises(UnsupportedFamilyError, match=r"`OPTForCausalLM.forward`"):
        chunked_lm_loss("opt")
    with pytest.raises(
        LossInputError, match=r"`chunk_size` must be a positive number of tokens or None; received 0"
    ):
        chunked_lm_loss("llama", chunk_size=0)


def test_save_writes_the_plain_checkpoint_and_config_bit_for_bit(tmp_path: Path) -> None:
    plain, grafted = _pair("qwen2_moe")
    plain.save_pretrained(tmp_path / "plain")
    grafted.save_pretrained(tmp_path / "grafted")
    assert type(grafted).__name__ == "ChunkedLossQwen2MoeForCausalLM"  # the class is restored after saving
    want = load_file(tmp_path / "plain" / "model.safetensors")
    got = load_file(tmp_path / "grafted" / "model.safetensors")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], v) for k, v in want.items())
    config = json.loads((tmp_path / "grafted" / "config.json").read_text())
    assert config == json.loads((tmp_path / "plain" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2MoeForCausalLM"]


@pytest.mark.parametrize("model_type", ["llama", "qwen2_moe"])
def test_the_grafted_class_loads_a_plain_checkpoint(model_type: str, tmp_path: Path) -> None:
    plain, _ = _pair(model_type)
    plain.save_pretrained(tmp_path)
    cls = chunked_lm_loss_class(type(plain), chunk_size=CHUNK)
    with chunked_lm_loss(model_type, chunk_size=CHUNK).applied(strict=True):
        loaded = cls.from_pretrained(tmp_path).train()
    assert type(loaded) is cls
    assert [(r.path, r.key) for r in modelgraft.report(loaded).replaced] == [("", type(plain).__name__)]
    expected = plain.state_dict()
    assert sorted(loaded.state_dict()) == sorted(expected)
    assert all(torch.equal(v, expected[k]) for k, v in loaded.state_dict().items())
    inputs, labels = _batch(plain, model_type)
    want, _ = _step(plain, backward=False, **inputs, labels=labels)
    got, _ = _step(loaded, backward=False, **inputs, labels=labels)
    _assert_close(got.loss, want.loss, "loss")


def test_an_auto_model_load_under_the_graft_builds_the_grafted_class(tmp_path: Path) -> None:
    """``AutoModelForCausalLM`` resolves transformers' class before the load; the graft still applies."""
    plain, _ = _pair("llama")
    plain.save_pretrained(tmp_path)
    with chunked_lm_loss("llama", chunk_size=CHUNK).applied(strict=True):
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path).train()
    assert type(loaded) is chunked_lm_loss_class(type(plain), chunk_size=CHUNK)
    inputs, labels = _batch(plain, "llama")
    want, _ = _step(plain, backward=False, **inputs, labels=labels)
    got, _ = _step(loaded, backward=False, **inputs, labels=labels)
    assert got.logits is None
    _assert_close(got.loss, want.loss, "loss")


def test_pickle_round_trip_keeps_the_class_and_the_loss() -> None:
    plain, grafted = _pair("llama")
    twin = pickle.loads(pickle.dumps(grafted))
    assert type(twin) is type(grafted)
    inputs, labels = _batch(plain, "llama")
    want, _ = _step(plain, backward=False, **inputs, labels=labels)
    got, _ = _step(twin, backward=False, **inputs, labels=labels)
    assert got.logits is None
    _assert_close(got.loss, want.loss, "loss")


def test_generation_is_unchanged() -> None:
    plain, grafted = _pair("llama")
    plain.eval(), grafted.eval()
    ids = family("llama").inputs(plain.config)["input_ids"]
    want = plain.generate(ids, max_new_tokens=4, do_sample=False)
    got = grafted.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, want)


def test_the_grafted_class_can_be_built_directly() -> None:
    config = family("llama").config()
    torch.manual_seed(0)
    built = chunked_lm_loss_class(LlamaForCausalLM)(config).train()
    torch.manual_seed(0)
    plain = LlamaForCausalLM(config).train()
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in built.state_dict().items())
    inputs, labels = _batch(plain, "llama")
    want, _ = _step(plain, backward=False, **inputs, labels=labels)
    got, _ = _step(built, backward=False, **inputs, labels=labels)
    assert got.logits is None
    _assert_close(got.loss, want.loss, "loss")
