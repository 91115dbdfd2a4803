"""Loading checkpoints into grafted layouts: lookup, file layouts, dtype, no random init, report."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conversion_helpers import GATE_UP, QKV, FusedGateUpLlamaMLP, fused_qkv_class
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from _file_backing import backing_files, needs_proc_maps
from _versions import IS_V5
from modelgraft import Concatenate, WeightConverter, patched, report
from modelgraft.testing import tiny_config

#: One row per family: what this test needs beyond the family table's tiny config (grouped-query
#: shapes, q/k/v biases) and the attention class the fused QKV replaces.
FAMILIES = {
    "llama": ({"num_attention_heads": 4, "num_key_value_heads": 2, "attention_bias": True}, "LlamaAttention"),
    "mistral": ({"num_attention_heads": 4, "num_key_value_heads": 2}, "MistralAttention"),
    "qwen2": ({"num_attention_heads": 4, "num_key_value_heads": 1}, "Qwen2Attention"),
}


def _config(family: str, **overrides):
    return tiny_config(family, **{**FAMILIES[family][0], **overrides})


def _attention_class(family: str) -> type:
    import importlib

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    return getattr(module, FAMILIES[family][1])


def _save_plain(family: str, path: Path, **save_kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(family)).eval()
    model.save_pretrained(path, **save_kwargs)
    return model


def _load_fused(family: str, path, strict: bool = False, **kwargs):
    attn = _attention_class(family)
    with patched({attn.__name__: fused_qkv_class(attn)}, conversions={family: [QKV]}, strict=strict):
        return AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


def _checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _hub_cache(src: Path, cache: Path, repo: str = "tiny-org/tiny-model") -> str:
    """Lay ``src`` out as the hub cache does: blobs, a snapshot folder of symlinks, refs/main."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    (root / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)
    for i, f in enumerate(sorted(src.iterdir())):
        blob = root / "blobs" / f"blob{i}"
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(blob)
    return repo


X = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("layout", ["single", "shards", "hub_cache"])
def test_fused_qkv_loads_from_every_file_layout(family, layout, tmp_path):
    src = tmp_path / "ckpt"
    plain = _save_plain(family, src, **({"max_shard_size": "20KB"} if layout == "shards" else {}))
    if layout == "shards":
        assert len(list(src.glob("*.safetensors"))) > 1 and (src / "model.safetensors.index.json").exists()
    where, kwargs = str(src), {}
    if layout == "hub_cache":
        where = _hub_cache(src, tmp_path / "cache")
        kwargs = {"cache_dir": str(tmp_path / "cache"), "local_files_only": True}
    model = _load_fused(family, where, **kwargs)
    attn = model.model.layers[0].self_attn
    assert type(attn).__name__.startswith("FusedQKV") and not hasattr(attn, "q_proj")
    ckpt = _checkpoint_tensors(src)
    for i in range(2):
        p = f"model.layers.{i}.self_attn."
        expected = torch.cat([ckpt[p + f"{n}.weight"] for n in ("q_proj", "k_proj", "v_proj")])
        # Bit-equal to the checkpoint: nothing was randomly initialised over the converted values.
        assert torch.equal(model.get_parameter(p + "qkv_proj.weight"), expected)
    torch.testing.assert_close(model(X).logits, plain(X).logits, atol=1e-5, rtol=0)


def test_converted_targets_are_never_randomly_initialised(tmp_path, monkeypatch):
    _save_plain("llama", tmp_path)
    from transformers import modeling_utils

    touched: list[str] = []
    original = modeling_utils.PreTrainedModel._init_weights
    config = _config("llama")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    qkv_shape = ((config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim, config.hidden_size)

    def spy(self, module):
        if hasattr(module, "weight") and module.weight is not None and module.weight.shape == qkv_shape:
            touched.append(type(module).__name__)
        return original(self, module)

    monkeypatch.setattr(modeling_utils.PreTrainedModel, "_init_weights", spy)
    model = _load_fused("llama", tmp_path)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert getattr(qkv.weight, "_is_hf_initialized", False)
    ckpt = _checkpoint_tensors(tmp_path)
    assert torch.equal(qkv.bias, torch.cat([ckpt[f"model.layers.0.self_attn.{n}_proj.bias"] for n in "qkv"]))


def test_targets_are_cast_to_the_parameter_dtype(tmp_path):
    _save_plain("llama", tmp_path)
    model = _load_fused("llama", tmp_path, dtype=torch.bfloat16)
    ckpt = _checkpoint_tensors(tmp_path)
    assert ckpt["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float32
    w = model.model.layers[0].self_attn.qkv_proj.weight
    assert w.dtype == torch.bfloat16 and w.device.type == "cpu"
    expected = torch.cat([ckpt[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv"]).to(
        torch.bfloat16
    )
    assert torch.equal(w, expected)


def test_fused_qkv_and_gate_up_together_with_a_clean_load_report(tmp_path):
    plain = _save_plain("llama", tmp_path)
    mapping = {"LlamaAttention": fused_qkv_class(_attention_class("llama")), "LlamaMLP": FusedGateUpLlamaMLP}
    with patched(mapping, conversions={"llama": [QKV, GATE_UP]}):
        model, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert info["missing_keys"] == set() or not info["missing_keys"]
    assert not info["unexpected_keys"]
    torch.testing.assert_close(model.eval()(X).logits, plain(X).logits, atol=1e-5, rtol=0)


def test_report_lists_each_conversion_with_source_and_target_keys(tmp_path):
    _save_plain("llama", tmp_path)
    model = _load_fused("llama", tmp_path, strict=True)  # a complete conversion is no problem for strict mode
    records = report(model).conversions
    assert len(records) == 4  # weight and bias of 2 layers
    rec = next(r for r in records if r.target_keys == ("model.layers.0.self_attn.qkv_proj.weight",))
    assert rec.source_keys == tuple(f"model.layers.0.self_attn.{n}_proj.weight" for n in "qkv")
    assert rec.direction == "load" and "Concatenate(dim=0)" in rec.converter
    assert not report(model).unloaded_parameters


def test_class_name_entry_wins_over_model_type_entry(tmp_path):
    plain = _save_plain("llama", tmp_path)
    decoy = WeightConverter(["wq", "wk", "wv"], ["qkv_proj"], [Concatenate(dim=0)])
    attn = _attention_class("llama")
    conversions = {"llama": [decoy], "LlamaForCausalLM": [QKV]}
    with patched({attn.__name__: fused_qkv_class(attn)}, conversions=conversions):
        model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert {r.converter for r in report(model).conversions} == {repr(QKV)}
    torch.testing.assert_close(model(X).logits, plain(X).logits, atol=1e-5, rtol=0)
    # With only the model_type entry, that one is the whole mapping: the decoy finds no sources.
    with patched({attn.__name__: fused_qkv_class(attn)}, conversions={"llama": [decoy]}):
        model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not report(model).conversions
    assert "model.layers.0.self_attn.qkv_proj.weight" in report(model).unloaded_parameters


def test_base_model_loads_from_a_checkpoint_with_a_head(tmp_path):
    from transformers import AutoModel

    plain = _save_plain("llama", tmp_path)
    attn = _attention_class("llama")
    with patched({attn.__name__: fused_qkv_class(attn)}, conversions={"llama": [QKV]}):
        base = AutoModel.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(base(X).last_hidden_state, plain.model(X).last_hidden_state, atol=1e-5, rtol=0)


def test_a_plain_load_ignores_a_registered_conversion(tmp_path):
    plain = _save_plain("llama", tmp_path)
    with patched({}, conversions={"llama": [QKV]}):
        model, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not report(model).conversions
    torch.testing.assert_close(model.eval()(X).logits, plain(X).logits, atol=0, rtol=0)


def test_concurrent_loads_see_only_their_own_scoped_conversions(tmp_path):
    import sys
    import threading

    plain = _save_plain("llama", tmp_path)
    attn = _attention_class("llama")
    barrier = threading.Barrier(4)
    results: dict[int, object] = {}
    errors: list[BaseException] = []

    def load(i: int) -> None:
        try:
            barrier.wait()
            if i % 2:
                with patched({attn.__name__: fused_qkv_class(attn)}, conversions={"llama": [QKV]}):
                    results[i] = AutoModelForCausalLM.from_pretrained(tmp_path)
            else:
                results[i] = AutoModelForCausalLM.from_pretrained(tmp_path)
        except BaseException as exc:  # surfaced below, with its traceback
            errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    if errors:
        raise errors[0]
    for i, model in results.items():
        fused = hasattr(model.model.layers[0].self_attn, "qkv_proj")
        assert fused == bool(i % 2)
        assert len(report(model).conversions) == (4 if i % 2 else 0)
        torch.testing.assert_close(model.eval()(X).logits, plain(X).logits, atol=1e-5, rtol=0)


@needs_proc_maps
@pytest.mark.parametrize("file_mapping", ["1", "0"])
def test_fused_targets_are_lazy_private_file_views_and_survive_a_save_over_their_checkpoint(
    tmp_path, monkeypatch, file_mapping
):
    """Like a plain load, a fused target reads nothing until used (file-backed, copy-on-write);
    training it never writes the checkpoint, and saving over the checkpoint keeps the weights."""
    monkeypatch.setenv("MODELGRAFT_FILE_MAPPING", file_mapping)
    torch.manual_seed(0)
    config = _config("llama", hidden_size=64, intermediate_size=256)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    ckpt_file = str(tmp_path / "model.safetensors")
    original = _checkpoint_tensors(tmp_path)
    raw_before = Path(ckpt_file).read_bytes()
    mapping = {"LlamaAttention": fused_qkv_class(_attention_class("llama")), "LlamaMLP": FusedGateUpLlamaMLP}
    with patched(mapping, conversions={"llama": [QKV, GATE_UP]}):
        model = AutoModelForCausalLM.from_pretrained(tmp_path)
    layer = model.model.layers[1]
    qkv, gate_up = layer.self_attn.qkv_proj.weight, layer.mlp.gate_up_proj.weight
    expected = torch.cat([original[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(qkv, expected)
    assert torch.equal(
        gate_up, torch.cat([original[f"model.layers.1.mlp.{n}_proj.weight"] for n in ("gate", "up")])
    )
    assert (ckpt_file in backing_files(qkv) and ckpt_file in backing_files(gate_up)) == (file_mapping == "1")

    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert Path(ckpt_file).read_bytes() == raw_before
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    model.save_pretrained(tmp_path)  # over the checkpoint the weights came from
    assert all(torch.equal(v, trained[k]) for k, v in model.state_dict().items())
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    split = reloaded.model.layers[1].self_attn
    assert torch.equal(torch.cat([split.q_proj.weight, split.k_proj.weight, split.v_proj.weight]), qkv)


@needs_proc_maps
def test_moe_expert_merges_run_through_modelgraft_are_file_backed_too(tmp_path):
    """A graft's entry for qwen2_moe carries transformers' expert merge (stack, then gate|up join);
    that is a row rearrangement, so the merged experts are mapped from the file like fused QKV."""
    from modelgraft.grafts import fused_qkv

    if not IS_V5:
        pytest.skip("transformers 4.57 keeps per-expert layers: there is no expert merge to run")
    torch.manual_seed(0)
    config = tiny_config("qwen2_moe", hidden_size=64, moe_intermediate_size=64, num_experts=4)
    plain = AutoModelForCausalLM.from_config(config).eval()
    plain.save_pretrained(tmp_path)
    graft = fused_qkv("qwen2_moe")
    with graft.applied(strict=True):
        grafted = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    experts = grafted.model.layers[0].mlp.experts
    assert str(tmp_path / "model.safetensors") in backing_files(experts.gate_up_proj)
    assert torch.equal(experts.gate_up_proj, plain.model.layers[0].mlp.experts.gate_up_proj)
    ids = torch.randint(0, 100, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(grafted(ids).logits, plain(ids).logits, atol=1e-5, rtol=0)
