"""modelgraft.verify: one verdict per check, passing for sound grafts and failing for broken ones."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaModel

import modelgraft
from _versions import requires_fused_experts
from modelgraft import VerifyReport, verify
from modelgraft.grafts import fused_qkv, linear_experts
from modelgraft.testing import tiny_config

ALL = ["builds", "all_weights_loaded", "logits_match", "hidden_states_match", "save_roundtrip"]


def _verdicts(result: VerifyReport) -> dict[str, bool]:
    return {c.name: c.passed for c in result.checks}


def test_a_sound_graft_passes_every_check_on_a_model_type() -> None:
    result = verify("llama", fused_qkv("llama"))
    assert [c.name for c in result.checks] == ALL
    assert result.passed, result.format_table()
    assert "2 modules replaced: LlamaAttention -> FusedQKVLlamaAttention x2" in result["builds"].detail
    assert "bit-identical" in result["save_roundtrip"].detail
    data = json.loads(json.dumps(result.to_dict()))
    assert data["passed"] is True and [c["name"] for c in data["checks"]] == ALL


@requires_fused_experts
def test_moe_experts_and_fused_attention_together() -> None:
    result = verify("qwen2_moe", fused_qkv("qwen2_moe") + linear_experts("qwen2_moe"))
    assert result.passed, result.format_table()
    assert "Qwen2MoeExperts -> LinearQwen2MoeExperts x2" in result["builds"].detail


class _ScaledAttention(LlamaAttention):
    """Changes the outputs (keeps every weight)."""

    def forward(self, *args: object, **kwargs: object) -> tuple:
        out, weights = super().forward(*args, **kwargs)
        return out * 1.5, weights


def test_changed_outputs_fail_the_output_checks_only() -> None:
    result = verify("llama", {"LlamaAttention": _ScaledAttention})
    assert _verdicts(result) == {
        "builds": True,
        "all_weights_loaded": True,
        "logits_match": False,
        "hidden_states_match": False,
        "save_roundtrip": True,
    }
    assert "max |diff|" in result["logits_match"].detail
    assert result.passed is False
    assert "FAILED: logits_match, hidden_states_match" in result.format_table()


class _MLPWithGate(LlamaMLP):
    """Adds a parameter that no checkpoint holds."""

    def __init__(self, config: object) -> None:
        super().__init__(config)
        self.extra_gate = nn.Linear(config.hidden_size, config.hidden_size, bias=False)


def test_parameters_left_at_random_init_are_caught() -> None:
    result = verify("llama", {"LlamaMLP": _MLPWithGate})
    verdicts = _verdicts(result)
    assert verdicts["builds"] is True
    assert verdicts["all_weights_loaded"] is False
    assert "extra_gate.weight" in result["all_weights_loaded"].detail
    assert verdicts["save_roundtrip"] is False  # the extra parameter is written as an unexpected key
    assert "unexpected" in result["save_roundtrip"].detail


def test_fused_layout_without_its_conversion_is_not_loaded() -> None:
    graft = fused_qkv("llama")
    result = verify("llama", graft.mapping)  # conversions forgotten
    assert result["all_weights_loaded"].passed is False
    assert "qkv_proj" in result["all_weights_loaded"].detail
    assert result["logits_match"].passed is False


def test_a_key_that_matches_nothing_fails_builds() -> None:
    result = verify("llama", {"MistralAttention": _ScaledAttention})
    assert result["builds"].passed is False
    assert "no module was replaced" in result["builds"].detail
    assert "`MistralAttention`" in result["builds"].detail


def test_registered_patches_are_verified_when_nothing_is_given() -> None:
    graft = fused_qkv("llama")
    graft.register()
    try:
        result = verify("llama")
    finally:
        graft.unregister()
    assert result.passed, result.format_table()


def test_a_local_checkpoint_folder(tmp_path: Path) -> None:
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(tiny_config("qwen2")).save_pretrained(tmp_path / "ckpt")
    result = verify(tmp_path / "ckpt", fused_qkv("qwen2"), workdir=tmp_path / "work")
    assert result.passed, result.format_table()
    assert result.model_class == "Qwen2ForCausalLM"
    assert (tmp_path / "work" / "resaved").is_dir()


def test_a_checkpoint_folder_with_the_graft_registered_globally(tmp_path: Path) -> None:
    """The plain reference and the plain reload run unpatched, so a global graft is verified fully."""
    torch.manual_seed(4)
    AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(tmp_path / "ckpt")
    graft = fused_qkv("llama")
    graft.register()
    try:
        result = verify(tmp_path / "ckpt", workdir=tmp_path / "work")
    finally:
        graft.unregister()
    assert result.passed, result.format_table()
    assert (
        "plain reload equals the plain model" in {c.name: c for c in result.checks}["save_roundtrip"].detail
    )


def test_tolerance_is_applied() -> None:
    class TinyShift(LlamaAttention):
        def forward(self, *args: object, **kwargs: object) -> tuple:
            out, weights = super().forward(*args, **kwargs)
            return out + 1e-4, weights

    loose = verify("llama", {"LlamaAttention": TinyShift}, atol=1.0)
    strict = verify("llama", {"LlamaAttention": TinyShift}, atol=1e-6)
    assert loose["logits_match"].passed is True
    assert strict["logits_match"].passed is False


def test_unknown_target_is_a_clear_error() -> None:
    with pytest.raises(modelgraft.GraftError, match=r"`no_such_model`"):
        verify("no_such_model", {"LlamaAttention": _ScaledAttention})
    assert modelgraft.get_patch_mapping() == {}


@pytest.mark.parametrize(
    ("model_type", "class_path", "model_class"),
    [
        # (4.57 BERT picks its self-attention from BERT_SELF_ATTENTION_CLASSES; the swap follows it.)
        ("bert", "transformers.models.bert.modeling_bert:BertSelfAttention", "BertForMaskedLM"),
        ("t5", "transformers.models.t5.modeling_t5:T5LayerFF", "T5ForConditionalGeneration"),
        ("llava", "transformers.models.llama.modeling_llama:LlamaAttention", "LlavaForConditionalGeneration"),
    ],
    ids=["encoder", "seq2seq", "vision-language"],
)
def test_other_kinds_of_models(model_type: str, class_path: str, model_class: str) -> None:
    import importlib

    module, name = class_path.split(":")
    original = getattr(importlib.import_module(module), name)
    subclass = type(f"Traced{name}", (original,), {})
    result = verify(model_type, {name: subclass})
    assert result.model_class == model_class
    assert result.passed, result.format_table()
    assert f"{name} -> Traced{name}" in result["builds"].detail


def test_a_bf16_checkpoint_folder_round_trips_bit_for_bit(tmp_path: Path) -> None:
    torch.manual_seed(4)
    model = AutoModelForCausalLM.from_config(tiny_config("llama")).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    result = verify(tmp_path / "bf16", fused_qkv("llama"))
    assert result.passed, result.format_table()
    assert "bit-identical" in result["save_roundtrip"].detail


def test_the_graft_goes_in_the_mapping_place_only() -> None:
    # One way to hand a graft over, as `patched` and `graft_model` take it (issue 21: 1).
    with pytest.raises(
        modelgraft.UnexpectedArgumentError, match=r"second argument.*`verify\(target, graft\)`"
    ):
        verify("llama", graft=fused_qkv("llama"))
    with pytest.raises(TypeError, match=r"add grafts together with `\+`"):
        verify("llama", graft=[fused_qkv("llama")])
    with pytest.raises(modelgraft.GraftError, match=r"unexpected keyword arguments `atoll`"):
        verify("llama", fused_qkv("llama"), atoll=1.0)
    assert modelgraft.get_patch_mapping() == {}


# ---- non-finite values, tolerances, shapes and dtypes (issue 10: no silent wrong numbers) -----------

NAN, INF = float("nan"), float("inf")


def _tampered_model(tamper: Callable[[Any], None]) -> type[nn.Module]:
    """A ``LlamaModel`` that computes the plain outputs, then lets ``tamper`` edit them."""

    def forward(self: nn.Module, *args: object, **kwargs: object) -> Any:
        out = LlamaModel.forward(self, *args, **kwargs)
        tamper(out)
        return out

    return type("TamperedLlamaModel", (LlamaModel,), {"forward": forward})


def _set_hidden(index: int, edit: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Any], None]:
    def tamper(out: Any) -> None:
        states = list(out.hidden_states)
        states[index] = edit(states[index].clone())
        out.hidden_states = tuple(states)

    return tamper


def _poke(value: float, at: tuple[int, ...] = (0, 3, 5)) -> Callable[[torch.Tensor], torch.Tensor]:
    def edit(t: torch.Tensor) -> torch.Tensor:
        t[at] = value
        return t

    return edit


class _NaNAttention(LlamaAttention):
    """Writes NaN into one value of its output: everything after it goes NaN."""

    def forward(self, *args: object, **kwargs: object) -> tuple:
        out, weights = super().forward(*args, **kwargs)
        out = out.clone()
        out[0, 3, 5] = NAN
        return out, weights


def test_nan_in_the_grafted_outputs_fails_and_names_them() -> None:
    result = verify("llama", {"LlamaAttention": _NaNAttention})
    verdicts = _verdicts(result)
    assert verdicts["logits_match"] is False and verdicts["hidden_states_match"] is False
    assert verdicts["builds"] is True and verdicts["all_weights_loaded"] is True
    assert "`logits`" in result["logits_match"].detail
    assert "NaN where the plain model is finite" in result["logits_match"].detail
    # layer 0 writes it into token 3; its MLP's norm spreads it over the token's row of hidden state 1
    assert "`hidden_states[1]`: 64 NaN where the plain model is finite (first at index (0, 3, 0))" in (
        result["hidden_states_match"].detail
    )
    assert "`hidden_states[0]`" not in result["hidden_states_match"].detail  # the embeddings are intact
    assert "max |diff| 0.00e+00" not in result.format_table()
    assert result.passed is False


def test_inf_in_the_grafted_logits_fails() -> None:
    def tamper(out: Any) -> None:
        out.last_hidden_state = _poke(INF, (1, 7, 0))(out.last_hidden_state.clone())

    result = verify("llama", {"LlamaModel": _tampered_model(tamper)})
    assert result["logits_match"].passed is False
    assert "inf where the plain model is finite" in result["logits_match"].detail
    assert "first at index (1, 7," in result["logits_match"].detail


@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
def test_a_non_finite_hidden_state_alone_fails_that_check_only(value: float) -> None:
    result = verify("llama", {"LlamaModel": _tampered_model(_set_hidden(1, _poke(value)))})
    assert result["logits_match"].passed is True, result.format_table()
    assert result["hidden_states_match"].passed is False
    detail = result["hidden_states_match"].detail
    assert detail.startswith("`hidden_states[1]`: 1 ")
    assert ("NaN" if value != value else "inf") in detail
    assert "`hidden_states[0]`" not in detail and "`hidden_states[2]`" not in detail


@pytest.mark.parametrize("bad", [NAN, INF, -INF, -1e-5, "1e-5", None, True], ids=repr)
def test_a_non_finite_or_negative_tolerance_is_refused(bad: object) -> None:
    for name in ("atol", "rtol"):
        with pytest.raises(modelgraft.GraftError, match=rf"`{name}` must be a finite number >= 0"):
            verify("llama", {"LlamaAttention": _ScaledAttention}, **{name: bad})
    with pytest.raises(ValueError, match=r"received `nan`"):
        verify("llama", {"LlamaAttention": _ScaledAttention}, atol=NAN)
    assert modelgraft.get_patch_mapping() == {}


def test_zero_tolerance_means_bit_identical() -> None:
    exact = verify("llama", fused_qkv("llama"), atol=0.0)
    assert exact["logits_match"].passed is True and "max |diff| 0.00e+00" in exact["logits_match"].detail
    shifted = verify("llama", {"LlamaAttention": _ScaledAttention}, atol=0.0)
    assert shifted["logits_match"].passed is False


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda t: t[:1], r"`hidden_states\[1\]`: expected shape \(2, 8, 64\), received \(1, 8, 64\)"),
        (lambda t: t[:, :, :1], r"`hidden_states\[1\]`: expected shape \(2, 8, 64\), received \(2, 8, 1\)"),
        (lambda t: t.double(), r"`hidden_states\[1\]`: expected dtype torch.float32, received torch.float64"),
        (lambda t: t.half(), r"`hidden_states\[1\]`: expected dtype torch.float32, received torch.float16"),
    ],
    ids=["broadcastable-batch", "broadcastable-hidden", "float64", "float16"],
)
def test_shape_and_dtype_mismatches_fail_never_broadcast(edit: Callable, expected: str) -> None:
    result = verify("llama", {"LlamaModel": _tampered_model(_set_hidden(1, edit))})
    assert result["hidden_states_match"].passed is False
    assert re.search(expected, result["hidden_states_match"].detail), result["hidden_states_match"].detail
    assert result["logits_match"].passed is True


def test_a_broadcastable_logits_shape_fails() -> None:
    def tamper(out: Any) -> None:
        out.last_hidden_state = out.last_hidden_state[:, -1:]  # (2, 1, 64) broadcasts against (2, 8, 64)

    result = verify("llama", {"LlamaModel": _tampered_model(tamper)})
    assert result["logits_match"].passed is False
    assert "`logits`: expected shape (2, 8, 128), received (2, 1, 128)" in result["logits_match"].detail


def test_a_missing_hidden_state_fails() -> None:
    def tamper(out: Any) -> None:
        out.hidden_states = out.hidden_states[:-1]

    result = verify("llama", {"LlamaModel": _tampered_model(tamper)})
    assert result["hidden_states_match"].passed is False
    assert "expected 3 hidden states, received 2" in result["hidden_states_match"].detail


def test_an_invalid_graft_is_an_error_not_a_failed_check() -> None:
    with pytest.raises(modelgraft.ReplacementTypeError, match=r"`LlamaAttention`"):
        verify("llama", {"LlamaAttention": int})
    with pytest.raises(modelgraft.PatchRegistrationError, match=r"not a valid regular expression"):
        verify("llama", {"(": _ScaledAttention})
    assert modelgraft.get_patch_mapping() == {}


@pytest.mark.parametrize("bad", [transformers.Trainer, transformers.AutoModel, transformers.pipeline, 3])
def test_only_model_classes_are_built(bad: object) -> None:
    with pytest.raises(modelgraft.GraftError, match=r"not a transformers model class \(a `PreTrainedModel`"):
        verify("llama", {"LlamaAttention": _ScaledAttention}, model_class=bad)
    config = tiny_config("llama", architectures=[getattr(bad, "__name__", "Trainer")])
    with pytest.raises(ValueError, match=r"named in the config's `architectures`"):
        verify(config, {"LlamaAttention": _ScaledAttention})


def test_a_missing_path_says_it_does_not_exist(tmp_path: Path) -> None:
    for missing in (tmp_path / "nowhere", str(tmp_path / "nowhere"), "./nowhere", "nowhere/config.json"):
        with pytest.raises(modelgraft.GraftError, match=r"`[^`]*nowhere[^`]*` does not exist"):
            verify(missing, fused_qkv("llama"))


def test_a_plain_model_that_cannot_be_built_is_an_error(tmp_path: Path) -> None:
    tiny_config("llama", vocab_size=-5).save_pretrained(tmp_path)
    with pytest.raises(
        ValueError, match=r"The plain `LlamaForCausalLM` could not be built from `.*`: RuntimeError"
    ):
        verify(tmp_path, fused_qkv("llama"))


@pytest.fixture
def nan_head_checkpoint(tmp_path: Path) -> Path:
    """A llama checkpoint whose LM head has one NaN weight: the plain model's logits hold NaN."""
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    with torch.no_grad():
        model.lm_head.weight[3, 0] = NAN
    model.save_pretrained(tmp_path / "nan-head")
    return tmp_path / "nan-head"


def test_nan_in_the_plain_model_too_fails_the_comparison(nan_head_checkpoint: Path) -> None:
    """A NaN in the reference hides any difference there: the check fails, saying why."""
    result = verify(nan_head_checkpoint, fused_qkv("llama"))
    logits = result["logits_match"]
    assert logits.passed is False
    assert "`logits`: the plain model itself gives 16 NaN" in logits.detail
    assert "first at index (0, 0, 3)" in logits.detail
    # the NaN weight is a checkpoint tensor like any other: loaded identically twice, written back bit for bit
    assert result["all_weights_loaded"].passed is True, result["all_weights_loaded"].detail
    assert result["save_roundtrip"].passed is True, result["save_roundtrip"].detail
    assert result["hidden_states_match"].passed is True  # the LM head comes after the hidden states
    assert result.passed is False


class _SignFlipZeroSave(LlamaAttention):
    """Identical forward; what it saves turns +0.0 into -0.0 in ``o_proj`` (equal under ==, not bitwise)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._register_state_dict_hook(_flip_zero_sign)


def _flip_zero_sign(module: nn.Module, state: dict, prefix: str, local_metadata: Any) -> None:
    key = prefix + "o_proj.weight"
    state[key] = state[key].clone()
    state[key][0, 0] = -0.0


def test_save_roundtrip_compares_bits_not_values(tmp_path: Path) -> None:
    torch.manual_seed(6)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0, 0] = 0.0
    model.save_pretrained(tmp_path / "zeros")
    result = verify(tmp_path / "zeros", {"LlamaAttention": _SignFlipZeroSave})
    assert result["logits_match"].passed is True
    assert result["save_roundtrip"].passed is False
    assert "o_proj.weight" in result["save_roundtrip"].detail


# -- property: random NaN/inf injections fail naming the output, and nothing else passes inexactly ----

_SPOT = st.tuples(
    st.integers(0, 1),  # layer (tiny llama has 2)
    st.integers(0, 1),  # batch row
    st.integers(0, 7),  # token
    st.integers(0, 63),  # hidden unit
    st.sampled_from([NAN, INF, -INF]),
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spots=st.lists(_SPOT, max_size=3))
def test_injected_non_finite_values_always_fail_naming_the_output(spots: list[tuple]) -> None:
    def forward(self: LlamaAttention, *args: object, **kwargs: object) -> tuple:
        out, weights = LlamaAttention.forward(self, *args, **kwargs)
        mine = [s for s in spots if s[0] == self.layer_idx]
        if mine:
            out = out.clone()
            for _, b, t, h, value in mine:
                out[b, t, h] = value
        return out, weights

    injected = type("InjectingAttention", (LlamaAttention,), {"forward": forward})
    result = verify("llama", {"LlamaAttention": injected})
    assert result["builds"].passed and result["all_weights_loaded"].passed
    if not spots:  # nothing injected: the same computation, so an exact pass
        assert result.passed, result.format_table()
        assert "max |diff| 0.00e+00" in result["logits_match"].detail
        assert "max |diff| 0.00e+00" in result["hidden_states_match"].detail
        return
    first = min(s[0] for s in spots) + 1  # layer l's output is hidden state l + 1
    hidden, logits = result["hidden_states_match"], result["logits_match"]
    assert not hidden.passed and not logits.passed, result.format_table()
    assert f"`hidden_states[{first}]`" in hidden.detail
    assert "`logits`" in logits.detail
    for check in (hidden, logits):
        assert "where the plain model is finite" in check.detail
        assert "max |diff| nan" not in check.detail and "max |diff| 0.00e+00" not in check.detail
