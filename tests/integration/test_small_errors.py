"""Small errors that were torch's, Python's or the wrong ones (issue 28 point 7).

Each names what failed and the fix, and is a modelgraft error that is also the builtin a caller
would catch.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

import modelgraft as mg
from modelgraft import porting
from modelgraft.grafts import fused_qkv
from modelgraft.moe import RoutingTrace
from modelgraft.testing import tiny_config


# ---- load_original_state_dict ---------------------------------------------------------------------
def test_a_meta_tensor_in_the_state_is_refused_naming_it() -> None:
    layer = nn.Linear(2, 1)
    before = layer.weight.detach().clone()
    state = {"weight": torch.ones(1, 2, device="meta"), "bias": torch.zeros(1)}
    with pytest.raises(mg.ConversionError, match=r"`weight` is a meta tensor.*no values") as info:
        mg.load_original_state_dict(layer, state)
    assert isinstance(info.value, ValueError)
    assert torch.equal(layer.weight.detach(), before)  # nothing loaded


def test_a_model_on_the_meta_device_is_refused_not_loaded_into_nothing() -> None:
    with torch.device("meta"):
        layer = nn.Linear(2, 1)
    with pytest.raises(
        mg.ConversionError, match=r"`weight` of the model is on the meta device.*to_empty"
    ) as info:
        mg.load_original_state_dict(layer, {"weight": torch.ones(1, 2), "bias": torch.zeros(1)})
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "state",
    [{("weight",): torch.ones(1, 2)}, [(("weight",), torch.ones(1, 2))], {1: torch.ones(1, 2)}],
    ids=["mapping-tuple-key", "pairs-tuple-name", "mapping-int-key"],
)
def test_a_name_that_is_not_a_string_is_named_as_such(state) -> None:
    with pytest.raises(
        mg.ConversionError, match=r"names must be strings; got the name .* of type `(tuple|int)`"
    ):
        mg.load_original_state_dict(nn.Linear(2, 1), state)


# ---- graft_model on a PEFT wrapper ------------------------------------------------------------------
def test_graft_model_of_a_peft_model_names_the_wrapper_and_the_fix() -> None:
    peft = pytest.importorskip("peft")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = AutoModelForCausalLM.from_config(tiny_config("llama"))
        wrapped = peft.get_peft_model(base, peft.LoraConfig(target_modules=["q_proj", "v_proj"], r=2))
    classes = [type(m) for m in wrapped.modules()]
    for target in (wrapped, wrapped.base_model):  # the PeftModel and its tuner (LoraModel)
        with pytest.raises(mg.WrappedModelError, match=r"PEFT") as info:
            mg.graft_model(target, fused_qkv("llama"))
        message = str(info.value)
        assert type(target).__name__ in message and "get_base_model()" in message
        assert "before" in message and "get_peft_model" in message
        assert isinstance(info.value, TypeError) and isinstance(info.value, mg.GraftError)
    assert [type(m) for m in wrapped.modules()] == classes  # unchanged


# ---- verify ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", [42, None, 3.5, b"llama"], ids=["int", "none", "float", "bytes"])
def test_verify_of_a_target_that_is_no_name_path_or_config(target) -> None:
    with pytest.raises(mg.TargetTypeError, match=r"`verify` takes a model type") as info:
        mg.verify(target, fused_qkv("llama"))
    assert isinstance(info.value, TypeError) and isinstance(info.value, mg.TargetError)
    assert type(target).__name__ in str(info.value)


# ---- compare-routing on a folder or a missing file --------------------------------------------------
def test_loading_a_folder_or_a_missing_trace_is_a_routing_error(tmp_path) -> None:
    with pytest.raises(mg.RoutingFileError, match=r"is a folder, not a routing trace file") as info:
        RoutingTrace.load(tmp_path)
    assert isinstance(info.value, mg.RoutingError) and isinstance(info.value, OSError)
    missing = tmp_path / "nope.safetensors"
    with pytest.raises(mg.RoutingFileError, match=r"does not exist") as info:
        RoutingTrace.load(missing)
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, ValueError)
    assert "os error" not in str(info.value)


def test_the_cli_says_what_the_path_is(tmp_path, capsys) -> None:
    from modelgraft.cli import main

    trace = RoutingTrace([torch.tensor([[0, 1]])], num_experts=4, batch_size=1)
    good = tmp_path / "a.safetensors"
    trace.save(good)
    assert main(["compare-routing", str(tmp_path), str(good)]) == 2
    err = capsys.readouterr().err
    assert "is a folder, not a routing trace file" in err and "No such device" not in err
    assert main(["compare-routing", str(good), str(tmp_path / "missing.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "FileNotFoundError" not in err


# ---- a transformers operation that reads the model ---------------------------------------------------
class _QK(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(4, 3, bias=False)
        self.k = nn.Linear(4, 2, bias=False)


class TinyQK(PreTrainedModel):
    config_class = PretrainedConfig
    base_model_prefix = "model"

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.attn = _QK()
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        pass


class SplitLikeTransformers:
    """A user operation written for transformers' protocol as its ``Split`` is (4.57 has no such module)."""

    def __init__(self, dim: int = 0) -> None:
        self.dim = dim

    def convert(self, input_dict, source_patterns, target_patterns, full_layer_name, model, **kwargs):
        tensor = next(iter(input_dict.values()))[0]
        sizes = [
            model.get_parameter(full_layer_name.replace(target_patterns[0], t)).shape[self.dim]
            for t in target_patterns
        ]
        return dict(zip(target_patterns, torch.split(tensor, sizes, dim=self.dim)))

    @property
    def reverse_op(self):
        return porting.Concatenate(self.dim)


def _split(which: str):
    if which == "user":
        return SplitLikeTransformers
    return pytest.importorskip("transformers.core_model_loading").Split  # transformers 5.x


@pytest.mark.parametrize("which", ["transformers", "user"])
def test_transformers_split_in_a_porting_converter_is_sized_from_the_target_parameters(
    tmp_path, which
) -> None:
    Split = _split(which)
    torch.manual_seed(0)
    fused = torch.randn(5, 4)
    folder = tmp_path / "ckpt"
    PretrainedConfig().save_pretrained(folder)
    save_file({"attn.qk.weight": fused}, str(folder / "model.safetensors"), {"format": "pt"})
    conv = porting.WeightConverter("attn.qk.weight", ["attn.q.weight", "attn.k.weight"], [Split(dim=0)])
    with mg.patched({}, conversions={"TinyQK": [conv]}):
        model, info = TinyQK.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    for got, want in ((model.attn.q.weight, fused[:3]), (model.attn.k.weight, fused[3:])):
        assert got.shape == want.shape and got.dtype == want.dtype and torch.equal(got, want)
    model.save_pretrained(tmp_path / "saved")
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert set(saved) == {"attn.qk.weight"} and torch.equal(saved["attn.qk.weight"], fused)


@pytest.mark.parametrize("which", ["transformers", "user"])
def test_a_transformers_op_that_reads_the_model_where_none_is_known_is_refused_naming_it(which) -> None:
    Split = _split(which)
    (op,) = porting.WeightConverter("qk", ["q", "k"], [Split(dim=0)]).operations
    with pytest.raises(mg.OperationModelError, match=rf"`{Split.__name__}`.*model\.get_parameter") as info:
        op.convert([[torch.ones(5, 4)]], mg.ConversionContext(num_targets=2))
    assert ("modelgraft.porting.Split" in str(info.value)) == (which == "transformers")
    assert isinstance(info.value, AttributeError) and isinstance(info.value, mg.ConversionError)


def test_the_ported_operation_names_are_porting_names() -> None:
    from modelgraft.conversion._hf_ops import PORTED_OPERATIONS

    assert set(PORTED_OPERATIONS) <= set(porting.__all__)
