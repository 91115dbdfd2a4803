"""Operations written against transformers' protocol, next to modelgraft's own (issue 12, point 2)."""

from __future__ import annotations

import pickle

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

import modelgraft as mg
from modelgraft import MergeModulelist, WeightConverter, WeightRenaming, porting


class Scale(porting.ConversionOps):
    """A user operation written for transformers (its `ConversionOps` base, now from modelgraft)."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def convert(self, input_dict, source_patterns=None, target_patterns=None, **kwargs):
        return {key: [t * self.factor for t in tensors] for key, tensors in input_dict.items()}

    @property
    def reverse_op(self):
        return Scale(1 / self.factor)


class NoReverse:
    def convert(self, input_dict, source_patterns=None, target_patterns=None, **kwargs):
        return {target_patterns[0]: next(iter(input_dict.values()))[0]}


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.zeros(3, 2, 4))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = Experts()
        self.proj = nn.Linear(4, 4, bias=False)


class TinyMoe(PreTrainedModel):
    config_class = PretrainedConfig
    base_model_prefix = "model"

    def __init__(self, config):
        super().__init__(config)
        self.layers = nn.ModuleList([Block(), Block()])
        self.post_init()

    def _init_weights(self, module):
        pass


def _checkpoint():
    torch.manual_seed(0)
    ckpt = {}
    for layer in range(2):
        for e in range(3):
            ckpt[f"layers.{layer}.experts.{e}.w1.weight"] = torch.randn(2, 4)
        ckpt[f"layers.{layer}.old_proj.weight"] = torch.randn(4, 4)
    return ckpt


def _load(tmp_path, mapping):
    folder = tmp_path / "ckpt"
    PretrainedConfig().save_pretrained(folder)
    save_file(_checkpoint(), str(folder / "model.safetensors"), {"format": "pt"})
    with mg.patched({}, conversions={"TinyMoe": mapping}):
        return TinyMoe.from_pretrained(folder, output_loading_info=True)


def test_transformers_protocol_op_runs_next_to_modelgraft_ops_both_ways(tmp_path):
    mapping = [
        WeightConverter(".experts.*.w1.weight", ".experts.gate_proj", [MergeModulelist(dim=0), Scale(2.0)]),
        WeightRenaming(["old_proj"], ["proj"]),
    ]
    model, info = _load(tmp_path, mapping)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ckpt = _checkpoint()
    for layer in range(2):
        expected = torch.stack([ckpt[f"layers.{layer}.experts.{e}.w1.weight"] for e in range(3)]) * 2
        got = model.layers[layer].experts.gate_proj
        assert got.dtype == expected.dtype and torch.isfinite(got).all() and torch.equal(got, expected)
        assert torch.equal(model.layers[layer].proj.weight, ckpt[f"layers.{layer}.old_proj.weight"])
    model.save_pretrained(tmp_path / "saved")
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert set(saved) == set(ckpt)
    for key, value in ckpt.items():
        assert torch.allclose(saved[key], value, rtol=0, atol=1e-7), key  # x2 then /2: exact in fp32


def test_op_without_reverse_op_loads_but_refuses_the_original_layout(tmp_path):
    mapping = [
        WeightConverter(".experts.*.w1.weight", ".experts.gate_proj", [MergeModulelist(dim=0), NoReverse()])
    ]
    model, info = _load(tmp_path, mapping)
    assert not [k for k in info["missing_keys"] if "gate_proj" in k]
    with pytest.raises(mg.IrreversibleConversionError, match="`NoReverse` has no `reverse_op`"):
        model.save_pretrained(tmp_path / "saved")


def test_op_returning_a_non_dict_is_a_clear_error():
    class Bad:
        def convert(self, input_dict, source_patterns=None, target_patterns=None, **kwargs):
            return [1]

    (op,) = WeightConverter("a.w", "b.w", [Bad()]).operations
    with pytest.raises(mg.ConversionError, match="`Bad` returned a list"):
        op.convert([[torch.ones(1)]], mg.ConversionContext())


def test_scope_prefix_is_settable_compared_and_pickled():
    rename = WeightRenaming("^old_q", "q")
    rename.scope_prefix = "vision_model"
    other = WeightRenaming("^old_q", "q")
    assert rename != other
    other.scope_prefix = "vision_model"
    assert rename == other and hash(rename) == hash(other)
    back = pickle.loads(pickle.dumps(rename))
    assert back == rename and back.scope_prefix == "vision_model"
    assert porting.rename_source_key("vision_model.old_q.weight", [back], [])[0] == "vision_model.q.weight"
    assert (
        porting.rename_source_key("language_model.old_q.weight", [back], [])[0]
        == "language_model.old_q.weight"
    )
    with pytest.raises(mg.ConversionError, match="`scope_prefix` must be a string or None"):
        rename.scope_prefix = 3
    with pytest.raises(AttributeError, match="immutable"):
        rename.source_patterns = ["x"]


def test_prefix_change_and_group_rename_pickle():
    change = porting.PrefixChange(prefix_to_remove="bad", model_prefix="model")
    assert pickle.loads(pickle.dumps(change)) == change
    group = porting.GroupWeightRename(["norm0", "norm1"], ["norm1", "norm2"])
    assert pickle.loads(pickle.dumps(group)) == group
    with pytest.raises(mg.ConversionError, match="exactly one of `prefix_to_add` and `prefix_to_remove`"):
        porting.PrefixChange()
    with pytest.raises(mg.ConversionError, match="two lists of the same length"):
        porting.GroupWeightRename(["a"], ["b", "c"])


def test_invalid_regex_is_refused_at_construction():
    with pytest.raises(
        mg.ConversionError, match=r"Pattern `\.experts\.\(w1` is not a valid regular expression"
    ):
        WeightConverter(r".experts.(w1", ".experts.w", [MergeModulelist(dim=0)])
