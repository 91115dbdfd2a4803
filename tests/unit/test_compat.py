"""The compatibility layer: supported versions, facts about the installed transformers, and the
version-specific seams (construction site, per-instance output recorders, MoE router sites).

Runs on both legs (``make test`` on 5.x, ``make test-compat`` on 4.57); each fact is checked
against the installed transformers itself, so a wrong fact fails on the leg where it is wrong.

Unit tests of ``modelgraft._compat`` (their own file): they import it directly, the one exception to
tests using public names only (issue 14); everything else comes from the public namespaces.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import re
import sys
import threading
from pathlib import Path

import pytest
import torch
import transformers
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaModel, PreTrainedModel

from _versions import IS_V5, requires_v4
from modelgraft import UnsupportedTransformersError, _compat
from modelgraft._compat import _version
from modelgraft.testing import tiny_config

ROOT = Path(__file__).resolve().parents[2]


def _llama_config(**overrides: object) -> LlamaConfig:
    """The family table's tiny Llama, narrower still (the recorder tests count its 2 layers)."""
    sizes: dict[str, object] = dict(hidden_size=16, intermediate_size=32, num_attention_heads=2, head_dim=8)
    sizes |= dict(num_key_value_heads=1, vocab_size=32, attn_implementation="eager")
    config = tiny_config("llama", **(sizes | overrides))
    assert isinstance(config, LlamaConfig) and config.num_hidden_layers == overrides.get(
        "num_hidden_layers", 2
    )
    return config


# --- supported versions -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "version",
    ["4.57.0", "4.57.6", "4.57.0.dev0", "5.13.0", "5.13.1", "5.15.1", "5.17.0", "5.19.0", "5.25.0", "5.99.1"],
)
def test_supported_versions_pass(version: str) -> None:
    _compat.check_supported(Version(version))
    assert _compat.is_supported(version)


@pytest.mark.parametrize(
    "version",
    [
        "4.56.0",
        "4.56.2",
        "4.58.0",
        "4.46.3",
        "3.5.1",
        "5.0.0",
        "5.0.0rc1",
        "5.5.4",
        "5.12.1",
        "6.0.0",
        "6.0.0.dev0",
    ],
)
def test_unsupported_versions_raise_with_the_supported_ranges(version: str) -> None:
    with pytest.raises(
        UnsupportedTransformersError,
        match=rf"supports transformers >=4\.57,<4\.58 or >=5\.13,<6; found `{re.escape(version)}`",
    ):
        _compat.check_supported(Version(version))
    assert not _compat.is_supported(version)


def test_unsupported_error_is_an_import_error() -> None:
    with pytest.raises(ImportError, match="pip install"):
        _compat.check_supported("4.40.0")


def test_importing_the_compat_module_under_an_unsupported_transformers_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Execute a fresh copy of the module that checks the version when `_compat` is imported, so
    # the real one (already imported) stays untouched.
    # (The module object in sys.modules is the one an import statement sees.)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.56.0")
    spec = importlib.util.spec_from_file_location("_modelgraft_compat_probe", _version.__file__)
    assert spec is not None and spec.loader is not None
    probe = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, probe)  # dataclasses look their module up there
    with pytest.raises(UnsupportedTransformersError, match=r"found `4\.56\.0`"):
        spec.loader.exec_module(probe)


def test_installed_version_is_supported_and_flags_agree() -> None:
    assert _compat.is_supported(transformers.__version__)
    assert _compat.TRANSFORMERS_VERSION == Version(transformers.__version__)
    assert _compat.IS_V5 == (_compat.TRANSFORMERS_MAJOR == 5)


def test_package_metadata_declares_the_supported_versions() -> None:
    requirements = importlib.metadata.requires("modelgraft") or []
    (spec,) = [r for r in requirements if re.match(r"transformers\b", r) and "extra" not in r]
    specifiers = SpecifierSet(spec.removeprefix("transformers").strip())
    # The metadata and the import-time check agree on every release either could be asked about.
    for release in ("4.46.0", "4.56.2", "4.57.0", "4.57.6", "5.0.0", "5.5.4", "5.12.1", "5.13.0", "5.15.1", "5.16.0",
                    "5.16.1", "5.17.0", "5.19.0", "5.22.2", "5.25.0", "5.99.0", "6.0.0"):  # fmt: skip
        assert (release in specifiers) == _compat.is_supported(release), (release, spec)


def test_readme_and_docs_state_the_supported_ranges() -> None:
    for doc in (ROOT / "README.md", ROOT / "docs" / "compat.md"):
        assert _compat.SUPPORTED_RANGES in doc.read_text(), doc


# --- facts, checked against the installed transformers -----------------------------------------


def test_feature_flags_match_the_installed_modules() -> None:
    assert _compat.HAS_BUILTIN_PATCHING == (
        importlib.util.find_spec("transformers.monkey_patching") is not None
    )
    assert _compat.HAS_BUILTIN_CONVERSION == (
        importlib.util.find_spec("transformers.core_model_loading") is not None
    )


def test_the_construction_sites_match_the_installed_source() -> None:
    # From 5.3 transformers enters its own `apply_patches()` around `cls(config)` in both loaders
    # (the construction site wrapped there); 4.57 and 5.0-5.2 have none and build inside
    # `get_init_context()`'s contexts.
    around_apply_patches = _compat.FEATURES.construction == "apply_patches"
    init_ctx = PreTrainedModel.get_init_context
    assert ("apply_patches" in inspect.getsource(init_ctx)) == around_apply_patches
    assert ("init_contexts = [apply_patches()]" in inspect.getsource(PreTrainedModel._from_config)) == (
        around_apply_patches
    )
    assert ("revert_weight_conversion" in inspect.getsource(PreTrainedModel.save_pretrained)) == (
        _compat.HAS_BUILTIN_CONVERSION
    )
    registry_module = importlib.import_module(_compat.FEATURES.recorder_holders[0])
    assert hasattr(registry_module, "_CAN_RECORD_REGISTRY")


# --- per-instance output recorders ---------------------------------------------------------------


def _attentions(model: torch.nn.Module) -> int:
    out = model(torch.tensor([[1, 2, 3, 4]]), output_attentions=True)
    return len(out.attentions) if out.attentions is not None else 0


def _output_recorder_class() -> type:
    return importlib.import_module(_compat.FEATURES.recorder_holders[0]).OutputRecorder


def _bind_instance_recorders(model: torch.nn.Module, recorders: dict) -> None:
    """Record outputs of ``model`` (and of no other model) with ``recorders``, as
    ``recorders.patch_output_recorders`` does: on the instance, looked up and tracked."""
    object.__setattr__(model, "_can_record_outputs", dict(recorders))
    _compat.RECORDERS.install(_compat.TRANSFORMERS.recorder_wrappers())
    _compat.TRANSFORMERS.track_instance_recorders(model)


def _only_layer0_attention() -> dict:
    recorder = _output_recorder_class()
    attn_cls = type(LlamaModel(_llama_config(num_hidden_layers=1)).layers[0].self_attn)
    return {"attentions": recorder(attn_cls, index=1, layer_name="layers.0")}


def test_bound_recorders_apply_to_that_instance_only() -> None:
    config = _llama_config()
    bound, plain = LlamaModel(config), LlamaModel(config)
    class_dict = LlamaModel._can_record_outputs
    class_items = dict(class_dict)
    _bind_instance_recorders(bound, _only_layer0_attention())
    assert _attentions(bound) == 1
    assert _attentions(plain) == 2
    assert _attentions(LlamaModel(config)) == 2  # built after the binding
    assert LlamaModel._can_record_outputs is class_dict and dict(class_dict) == class_items
    assert "_can_record_outputs" not in plain.__dict__
    assert set(bound.__dict__["_can_record_outputs"]) == {"attentions"}
    assert dict(type(bound)._can_record_outputs) == class_items


def test_bound_recorders_survive_an_exception_in_forward() -> None:
    config = _llama_config()
    bound, plain = LlamaModel(config), LlamaModel(config)
    _bind_instance_recorders(bound, _only_layer0_attention())
    with pytest.raises((IndexError, RuntimeError)):
        bound(torch.tensor([[1, 2, 99]]), output_attentions=True)  # id 99 outside the vocabulary
    assert _attentions(plain) == 2
    assert _attentions(bound) == 1


def test_bound_recorders_are_per_thread_while_running() -> None:
    config = _llama_config()
    bound, plain = LlamaModel(config), LlamaModel(config)
    _bind_instance_recorders(bound, _only_layer0_attention())
    barrier = threading.Barrier(2)
    counts: dict[str, list[int]] = {"bound": [], "plain": []}

    def run(name: str, model: torch.nn.Module) -> None:
        barrier.wait()
        for _ in range(3):
            counts[name].append(_attentions(model))

    threads = [threading.Thread(target=run, args=(n, m)) for n, m in (("bound", bound), ("plain", plain))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counts == {"bound": [1, 1, 1], "plain": [2, 2, 2]}


@requires_v4
def test_v4_registry_replacement_keeps_later_registrations() -> None:
    from transformers import modeling_utils
    from transformers.utils import generic

    _bind_instance_recorders(LlamaModel(_llama_config()), {})
    assert generic._CAN_RECORD_REGISTRY is modeling_utils._CAN_RECORD_REGISTRY
    from transformers import MistralConfig, MistralModel

    MistralModel(
        MistralConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=32,
        )
    )
    assert str(MistralModel) in generic._CAN_RECORD_REGISTRY


# --- MoE router sites ------------------------------------------------------------------------------

_MOE = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        decoder_sparse_step=1,
    ),
    "qwen3_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1, head_dim=8
    ),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
}


@pytest.mark.parametrize("model_type", sorted(_MOE))
def test_moe_router_candidates(model_type: str) -> None:
    config = AutoConfig.for_model(
        model_type,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=32,
        **_MOE[model_type],
    )
    model = AutoModelForCausalLM.from_config(config)
    found = list(_compat.TRANSFORMERS.moe_router_candidates(dict(model.named_modules())))
    if IS_V5:
        assert found == []  # 5.x routers have their own classes, found by name in modelgraft.moe
        return
    assert [name.rsplit(".", 2)[0] for name, _, _ in found] == [f"model.layers.{i}" for i in range(2)]
    assert all(name.endswith(".gate") for name, _, _ in found)
    for _, router, parent in found:
        assert isinstance(router, torch.nn.Linear) and router.out_features == 4
        assert parent.gate is router and len(parent.experts) == 4


@requires_v4
def test_v4_has_no_builtin_conversion_so_registering_needs_no_overwrite() -> None:
    from modelgraft import (
        Concatenate,
        WeightConverter,
        get_checkpoint_conversion_mapping,
        register_checkpoint_conversion_mapping,
        unregister_checkpoint_conversion_mapping,
    )

    qkv = WeightConverter(["q_proj", "k_proj", "v_proj"], ["qkv_proj"], [Concatenate(dim=0)])
    assert not _compat.builtin_conversion_exists("qwen2_moe")
    register_checkpoint_conversion_mapping("qwen2_moe", [qkv])
    try:
        assert get_checkpoint_conversion_mapping("qwen2_moe") == [qkv]
    finally:
        unregister_checkpoint_conversion_mapping("qwen2_moe")


def test_construction_step_is_installed_with_modelgraft_and_fully_removable() -> None:
    from transformers import modeling_utils

    from modelgraft import hooks
    from modelgraft._compat._wrapping import is_wrapped as marked

    before_v5 = modeling_utils.__dict__.get("apply_patches")
    assert _compat.CONSTRUCTION.installed
    hooks.uninstall()
    try:
        assert not _compat.CONSTRUCTION.installed
        for name in ("get_init_context", "_from_config", "from_pretrained"):
            assert not marked(PreTrainedModel.__dict__[name]), name
        if _compat.FEATURES.construction == "apply_patches":
            assert not marked(modeling_utils.apply_patches)
            assert modeling_utils.apply_patches is not before_v5
        model = LlamaModel(_llama_config())  # plain construction still works
        assert type(model.layers[0].self_attn).__name__ == "LlamaAttention"
    finally:
        hooks.install()
    assert _compat.CONSTRUCTION.installed
    assert marked(PreTrainedModel.__dict__["_from_config"])


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_a_patched_attention_is_built_whatever_the_attention_implementation(attn_implementation: str) -> None:
    from transformers import BertConfig, BertModel
    from transformers.models.bert import modeling_bert

    import modelgraft

    class MySelfAttention(modeling_bert.BertSelfAttention):
        pass

    # 4.57 picks BERT's self-attention from BERT_SELF_ATTENTION_CLASSES (absent on 5.x).
    tables = {k: v for k, v in vars(modeling_bert).items() if k.endswith("_CLASSES") and isinstance(v, dict)}
    before = {k: dict(v) for k, v in tables.items()}
    config = BertConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, vocab_size=32
    )
    with modelgraft.patched({"BertSelfAttention": MySelfAttention}):
        model = BertModel._from_config(config, attn_implementation=attn_implementation)
    assert all(type(layer.attention.self) is MySelfAttention for layer in model.encoder.layer)
    assert {k: dict(v) for k, v in tables.items()} == before  # restored on exit
    plain = BertModel._from_config(config, attn_implementation=attn_implementation)
    assert type(plain.encoder.layer[0].attention.self) is not MySelfAttention
