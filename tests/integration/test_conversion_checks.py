"""No silent wrong numbers on load: checkpoint tensors that do not fit the original model are refused
with a ConversionShapeError naming the key, the converter and both shapes, whatever the operation and
whichever read path runs; and a load from ``state_dict=`` converts exactly like a load from files."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from _versions import IS_V5
from families import family, family_params
from modelgraft import (
    Chunk,
    Concatenate,
    ConversionOperation,
    ConversionShapeError,
    MergeModulelist,
    WeightConverter,
    patched,
    report,
)
from modelgraft.grafts import fused_gate_up, fused_qkv, linear_experts

DENSE = family_params(model_types=["llama", "qwen2"])  # grouped-query attention; qwen2 has q/k/v biases


def _save(model_type: str, path: Path, **overrides) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    family(model_type).causal_lm(**overrides).save_pretrained(path)
    return load_file(path / "model.safetensors")


def _rewrite(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _move_rows(tensors: dict[str, torch.Tensor], short: str, long: str, rows: int = 2) -> None:
    """Move ``rows`` rows from the end of ``short`` to the start of ``long``: both keep their total."""
    joined = torch.cat([tensors[short], tensors[long]])
    cut = tensors[short].shape[0] - rows
    tensors[short], tensors[long] = joined[:cut].clone(), joined[cut:].clone()


def _shape(t: torch.Tensor | tuple) -> str:
    return re.escape(str(tuple(t.shape if isinstance(t, torch.Tensor) else t)))


# ---- 5. fused rows that add up ------------------------------------------------------------------
@pytest.mark.parametrize("strict", [False, True], ids=["lenient", "strict"])
@pytest.mark.parametrize(
    ("graft", "short", "long"),
    [(fused_qkv, "self_attn.q_proj", "self_attn.k_proj"), (fused_gate_up, "mlp.gate_proj", "mlp.up_proj")],
    ids=["fused_qkv", "fused_gate_up"],
)
@pytest.mark.parametrize("fam", DENSE)
def test_rows_moved_between_fused_sources_are_refused(fam, graft, short, long, strict, tmp_path):
    tensors = _save(fam.model_type, tmp_path)
    q = f"model.layers.1.{short}.weight"
    expected = tensors[q].shape
    _move_rows(tensors, q, f"model.layers.1.{long}.weight")
    _rewrite(tmp_path, tensors)
    g = graft(fam.model_type)
    with (
        patched(g.mapping, conversions=g.conversions, strict=strict),
        pytest.raises(
            ConversionShapeError,
            match=rf"Checkpoint key `{re.escape(q)}` has shape {_shape(tensors[q])}, but converter "
            rf"WeightConverter\(\[.*\]\) expects {_shape(expected)} there \(its shape in the original "
            rf"`{type(fam.causal_lm()).__name__}`\)",
        ),
    ):
        AutoModelForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("fam", family_params(model_types=["llava"]))
def test_rows_that_add_up_in_a_sub_model_of_a_composite_model_are_refused(fam, tmp_path):
    """The original is built outside the load: its language model is original too, not grafted."""
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(fam.config()).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    # transformers writes llava's legacy layout; the message names the key as the checkpoint has it.
    q = "language_model.model.layers.0.self_attn.q_proj.weight"
    expected = tensors[q].shape
    _move_rows(tensors, q, q.replace("q_proj", "k_proj"))
    _rewrite(tmp_path, tensors)
    g = fused_qkv("llama")
    with (
        patched(g.mapping, conversions=g.conversions),
        pytest.raises(
            ConversionShapeError,
            match=rf"Checkpoint key `{re.escape(q)}` has shape {_shape(tensors[q])}, but converter .* expects "
            rf"{_shape(expected)} there \(its shape in the original `LlavaForConditionalGeneration`\)",
        ),
    ):
        AutoModelForImageTextToText.from_pretrained(tmp_path)


def _moe_merge_graft() -> tuple[dict, dict]:
    """A graft whose conversions merge per-expert checkpoint keys into fused experts.

    On transformers 5.x that is any graft of ``qwen2_moe`` (it carries transformers' own expert merge);
    4.57 keeps per-expert layers, so a block with fused experts and a merge converter stands in."""
    if IS_V5:
        g = fused_qkv("qwen2_moe")
        return g.mapping, g.conversions
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    class FusedExperts(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            e, i, h = config.num_experts, config.moe_intermediate_size, config.hidden_size
            self.gate_up_proj = torch.nn.Parameter(torch.empty(e, 2 * i, h))
            self.down_proj = torch.nn.Parameter(torch.empty(e, h, i))

    class FusedExpertsBlock(Qwen2MoeSparseMoeBlock):
        def __init__(self, config):
            super().__init__(config)
            self.experts = FusedExperts(config)

    merge = [
        WeightConverter(
            ["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"],
            "mlp.experts.gate_up_proj",
            [MergeModulelist(dim=0), Concatenate(dim=1)],
        ),
        WeightConverter("mlp.experts.*.down_proj.weight", "mlp.experts.down_proj", [MergeModulelist(dim=0)]),
    ]
    return {"Qwen2MoeSparseMoeBlock": FusedExpertsBlock}, {"qwen2_moe": merge}


def test_the_moe_expert_merge_loads_a_fitting_checkpoint_exactly(tmp_path):
    tensors = _save("qwen2_moe", tmp_path)
    mapping, conversions = _moe_merge_graft()
    with patched(mapping, conversions=conversions):
        model = AutoModelForCausalLM.from_pretrained(tmp_path)
    experts = model.model.layers[0].mlp.experts
    expected = torch.stack(
        [
            torch.cat([tensors[f"model.layers.0.mlp.experts.{e}.{n}_proj.weight"] for n in ("gate", "up")])
            for e in range(family("qwen2_moe").config().num_experts)
        ]
    )
    assert torch.equal(experts.gate_up_proj, expected)


@pytest.mark.parametrize("strict", [False, True], ids=["lenient", "strict"])
def test_rows_moved_between_gate_and_up_of_every_expert_are_refused(strict, tmp_path):
    tensors = _save("qwen2_moe", tmp_path)
    num_experts = family("qwen2_moe").config().num_experts
    gate0 = "model.layers.0.mlp.experts.0.gate_proj.weight"
    expected = tensors[gate0].shape
    for e in range(num_experts):  # every expert alike, so the stacked experts still fit together
        _move_rows(
            tensors,
            f"model.layers.0.mlp.experts.{e}.gate_proj.weight",
            f"model.layers.0.mlp.experts.{e}.up_proj.weight",
        )
    _rewrite(tmp_path, tensors)
    mapping, conversions = _moe_merge_graft()
    with (
        patched(mapping, conversions=conversions, strict=strict),
        pytest.raises(
            ConversionShapeError,
            match=rf"Checkpoint key `{re.escape(gate0)}` has shape {_shape(tensors[gate0])}, but converter "
            rf"WeightConverter\(\['mlp\.experts\.\*\.gate_proj\.weight'.* expects {_shape(expected)} there",
        ),
    ):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_per_expert_linear_layers_are_size_checked_by_transformers_itself(tmp_path):
    # linear_experts loads the per-expert keys as they are (no conversion), so transformers' own
    # size check refuses them; nothing loads silently.
    if not IS_V5:
        pytest.skip("transformers 4.57 keeps per-expert layers: linear_experts replaces nothing there")
    tensors = _save("qwen2_moe", tmp_path)
    _move_rows(
        tensors,
        "model.layers.0.mlp.experts.0.gate_proj.weight",
        "model.layers.0.mlp.experts.0.up_proj.weight",
    )
    _rewrite(tmp_path, tensors)
    with linear_experts("qwen2_moe").applied(), pytest.raises(RuntimeError, match=r"ignore_mismatched_sizes"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


# ---- 12. mis-shaped sources, on every read path -------------------------------------------------
def _transposed(tensors, key):
    tensors[key] = tensors[key].t().contiguous()


def _flattened(tensors, key):
    tensors[key] = tensors[key].flatten().clone()


def _to_bf16(tensors, key):
    tensors[key] = tensors[key].to(torch.bfloat16)


@pytest.mark.parametrize("file_mapping", ["1", "0"], ids=["mapped", "read"])
@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            _transposed,
            r"`model\.layers\.0\.self_attn\.k_proj\.weight` has shape \(64, 32\).* expects \(32, 64\)",
        ),
        (
            _flattened,
            r"`model\.layers\.0\.self_attn\.k_proj\.weight` has shape \(2048,\).* expects \(32, 64\)",
        ),
        (
            _to_bf16,
            r"`model\.layers\.0\.self_attn\.q_proj\.weight` is torch\.float32 but "
            r"`model\.layers\.0\.self_attn\.k_proj\.weight` is torch\.bfloat16",
        ),
    ],
    ids=["transposed", "1-D", "dtype"],
)
def test_mis_shaped_fused_sources_are_shape_errors(damage, message, file_mapping, tmp_path, monkeypatch):
    monkeypatch.setenv("MODELGRAFT_FILE_MAPPING", file_mapping)
    tensors = _save("llama", tmp_path)
    damage(tensors, "model.layers.0.self_attn.k_proj.weight")
    _rewrite(tmp_path, tensors)
    g = fused_qkv("llama")
    with patched(g.mapping, conversions=g.conversions), pytest.raises(ConversionShapeError, match=message):
        AutoModelForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("file_mapping", ["1", "0"], ids=["mapped", "read"])
def test_a_missing_expert_up_proj_is_a_shape_error(file_mapping, tmp_path, monkeypatch):
    monkeypatch.setenv("MODELGRAFT_FILE_MAPPING", file_mapping)
    tensors = _save("qwen2_moe", tmp_path)
    last = family("qwen2_moe").config().num_experts - 1
    del tensors[f"model.layers.1.mlp.experts.{last}.up_proj.weight"]
    _rewrite(tmp_path, tensors)
    mapping, conversions = _moe_merge_graft()
    with (
        patched(mapping, conversions=conversions),
        pytest.raises(
            ConversionShapeError,
            match=rf"found `mlp\.experts\.\*\.up_proj\.weight` under `model\.layers\.1` for indices "
            rf"\[{', '.join(map(str, range(last)))}\] \(another source pattern has {last + 1}\): "
            rf"`model\.layers\.1\.mlp\.experts\.{last}\.up_proj\.weight` is missing from the checkpoint",
        ),
    ):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def _rename_qkv(tensors: dict[str, torch.Tensor]) -> None:
    """Another layout (wq, wk, wv): keys the original model does not hold, so nothing says what shape
    they should have and the operations meet the tensors as they are."""
    for n in "qkv":
        for layer in range(2):
            key = f"model.layers.{layer}.self_attn.{n}_proj.weight"
            tensors[key.replace(f"{n}_proj", f"w{n}")] = tensors.pop(key)


@pytest.mark.parametrize("file_mapping", ["1", "0"], ids=["mapped", "read"])
def test_keys_of_another_layout_that_do_not_join_are_a_shape_error(file_mapping, tmp_path, monkeypatch):
    monkeypatch.setenv("MODELGRAFT_FILE_MAPPING", file_mapping)
    tensors = _save("llama", tmp_path)
    _rename_qkv(tensors)
    _transposed(tensors, "model.layers.1.self_attn.wk.weight")
    _rewrite(tmp_path, tensors)
    g = fused_qkv("llama")
    conv = WeightConverter(
        ["self_attn.wq", "self_attn.wk", "self_attn.wv"], "self_attn.qkv_proj", [Concatenate(dim=0)]
    )
    with (
        patched(g.mapping, conversions={"llama": [conv]}),
        pytest.raises(
            ConversionShapeError,
            match=r"could not run `Concatenate\(dim=0\)` on checkpoint key\(s\) `model\.layers\.1\.self_attn\.wq\.weight` "
            r"\(64, 64\) float32, `model\.layers\.1\.self_attn\.wk\.weight` \(64, 32\) float32.*must produce "
            r"`model\.layers\.1\.self_attn\.qkv_proj\.weight` \(128, 64\)",
        ),
    ):
        AutoModelForCausalLM.from_pretrained(tmp_path)


class _TransposedTwice(ConversionOperation):
    """A user operation (an identity on 2-D weights) that torch refuses on a 1-D tensor."""

    def convert(self, tensors, context):
        return [[t.transpose(0, 1).transpose(0, 1) for t in g] for g in tensors]

    def reverse(self, tensors, context):
        return tensors


def test_a_user_operation_raising_a_torch_error_is_a_shape_error(tmp_path):
    tensors = _save("llama", tmp_path)
    _rename_qkv(tensors)
    _flattened(tensors, "model.layers.0.self_attn.wv.weight")
    _rewrite(tmp_path, tensors)
    g = fused_qkv("llama")
    conv = WeightConverter(
        ["self_attn.wq", "self_attn.wk", "self_attn.wv"],
        "self_attn.qkv_proj",
        [_TransposedTwice(), Concatenate(dim=0)],
    )
    with (
        patched(g.mapping, conversions={"llama": [conv]}),
        pytest.raises(
            ConversionShapeError,
            match=r"could not run `_TransposedTwice.*`model\.layers\.0\.self_attn\.wv\.weight` \(2048,\)",
        ),
    ):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_a_chunk_of_a_mis_sized_fused_checkpoint_is_a_shape_error(tmp_path):
    """The other direction: a checkpoint saved in the fused layout, loaded by a plain model."""
    torch.manual_seed(0)
    g = fused_qkv("llama")
    with patched(g.mapping, conversions=g.conversions):
        grafted = family("llama").causal_lm()
    grafted.save_pretrained(tmp_path, save_original_format=False)
    tensors = load_file(tmp_path / "model.safetensors")
    key = "model.layers.0.self_attn.qkv_proj.weight"
    tensors[key] = torch.cat([tensors[key], tensors[key][:2]])
    _rewrite(tmp_path, tensors)
    split = WeightConverter(
        "self_attn.qkv_proj", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], [Chunk(dim=0)]
    )
    with (
        patched({}, conversions={"llama": [split]}),
        pytest.raises(
            ConversionShapeError, match=rf"`{re.escape(key)}` has shape \(130, 64\).* expects \(128, 64\)"
        ),
    ):
        AutoModelForCausalLM.from_pretrained(tmp_path)


# ---- 8. loads from state_dict= ------------------------------------------------------------------
def _grafts(model_type: str):
    if model_type == "qwen2_moe":
        return fused_qkv(model_type)  # and, on 5.x, transformers' expert merge
    return fused_qkv(model_type) + fused_gate_up(model_type)


@pytest.mark.parametrize("fam", family_params(model_types=["llama", "qwen2", "qwen2_moe"]))
def test_a_state_dict_load_converts_exactly_like_a_file_load(fam, tmp_path):
    # (transformers refuses a model path together with `state_dict=`, plain loads too: path=None.)
    tensors = _save(fam.model_type, tmp_path)
    config = family(fam.model_type).config()
    model_class = type(fam.causal_lm())
    g = _grafts(fam.model_type)
    with g.applied():
        from_files = AutoModelForCausalLM.from_pretrained(tmp_path)
        from_dict = model_class.from_pretrained(None, config=config, state_dict=tensors)
    expected, got = from_files.state_dict(), from_dict.state_dict()
    assert list(got) == list(expected)
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
        assert torch.equal(got[key], value), key
    rep = report(from_dict)
    assert not rep.unloaded_parameters and not rep.dropped_checkpoint_keys, rep.problems
    assert len(rep.conversions) == len(report(from_files).conversions) > 0


def test_a_state_dict_with_rows_that_add_up_is_refused_too(tmp_path):
    tensors = _save("llama", tmp_path)
    _move_rows(tensors, "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.v_proj.weight")
    g = fused_qkv("llama")
    with (
        g.applied(),
        pytest.raises(
            ConversionShapeError, match=r"`model\.layers\.0\.self_attn\.q_proj\.weight` has shape \(62, 64\)"
        ),
    ):
        type(family("llama").causal_lm()).from_pretrained(
            None, config=family("llama").config(), state_dict=tensors
        )
