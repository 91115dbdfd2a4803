"""transformers' own conversion table, expressed with modelgraft (issue 12, point 1).

Every source and target pattern of ``transformers.conversion_mapping`` (5.x) must be accepted by
modelgraft's ``WeightConverter``/``WeightRenaming``, and rename the keys of tiny models of the
families in tests/families.py exactly as transformers renames them. A family whose entry modelgraft
loads end to end (MoE experts merged from per-expert checkpoint keys) must give the plain model's
weights bit for bit, and save the original checkpoint back bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import modelgraft as mg
from _versions import IS_V5
from families import FAMILIES, family
from modelgraft import porting

pytestmark = pytest.mark.skipif(
    not IS_V5, reason="transformers 4.57 has no conversion_mapping table (transformers 5.x only)"
)

# Renamings whose behaviour is their own code, not their patterns (modelgraft.porting has both; the
# table walk, tests/integration/test_conversion_table_walk.py, loads dory's); no family of
# tests/families.py uses them.
CUSTOM_RENAMINGS = {"LayerPairCollapse", "Inkling2IndexOffsetWeightRename"}


def _table() -> dict[str, list]:
    from transformers import conversion_mapping as tcm

    tcm.get_checkpoint_conversion_mapping("llama")  # builds the cache
    return {
        key: tcm.get_checkpoint_conversion_mapping(key) for key in tcm._checkpoint_conversion_mapping_cache
    }


def to_modelgraft(transform):
    """The modelgraft transform for one of transformers' (same patterns, operations, scope)."""
    name = type(transform).__name__
    sources = list(transform._original_source_patterns)
    targets = list(transform._original_target_patterns)
    if name == "PrefixChange":
        ours = porting.PrefixChange(
            transform.prefix_to_add, transform.prefix_to_remove, transform.model_prefix or None
        )
    elif name == "GroupWeightRename":
        ours = porting.GroupWeightRename(sources, targets)
    elif hasattr(transform, "operations"):
        ours = mg.WeightConverter(sources, targets, list(transform.operations))
    else:
        ours = mg.WeightRenaming(sources, targets)
    if transform.scope_prefix is not None:
        ours.scope_prefix = transform.scope_prefix
        ours.base_model_prefix = transform.base_model_prefix
    return ours


def test_every_builtin_pattern_is_accepted():
    table = _table()
    rejected, patterns, transforms = [], 0, 0
    for key, entry in table.items():
        for transform in entry or []:
            transforms += 1
            patterns += len(transform._original_source_patterns) + len(transform._original_target_patterns)
            try:
                to_modelgraft(transform)
            except mg.GraftError as e:
                rejected.append((key, repr(transform), str(e)))
    print(
        f"\nbuilt-in table: {len(table)} entries, {transforms} transforms, {patterns} patterns, rejected {len(rejected)}"
    )
    assert transforms > 1000 and patterns > 2000  # the whole table was walked
    assert rejected == []


def _split(transforms):
    from transformers import core_model_loading as tcore

    renamings = [t for t in transforms if isinstance(t, tcore.WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, tcore.WeightConverter)]
    return renamings, converters


def _ours(transforms):
    ours = [to_modelgraft(t) for t in transforms]
    return [t for t in ours if not t.operations], [t for t in ours if t.operations]


def _meta_model(fam):
    # a text tower without a causal-LM class of its own (qwen3_vl_moe_text) builds its base model
    with torch.device("meta"):
        return fam.model() if fam.has_lm_head else fam.base_model()


def _covered_families() -> list:
    """Every family: transformers adds its `legacy` renamings to every model, and its own entry if any."""
    if not IS_V5:
        return [pytest.param(None, marks=pytest.mark.skip(reason="transformers 5.x only"))]
    return [
        pytest.param(fam, id=fam.model_type, marks=[pytest.mark.skip(reason=fam.skip)] if fam.skip else [])
        for fam in FAMILIES
    ]


@pytest.mark.parametrize("fam", _covered_families())
def test_builtin_entry_renames_like_transformers(fam):
    """Model keys and the checkpoint keys transformers would save them as, renamed both ways."""
    from transformers import conversion_mapping as tcm
    from transformers import core_model_loading as tcore

    model = _meta_model(fam)
    transforms = tcm.get_model_conversion_mapping(model, add_legacy=True)
    assert transforms, f"`{fam.model_type}` is in the table but transformers lists no transform for it"
    assert not any(type(t).__name__ in CUSTOM_RENAMINGS for t in transforms)
    keys = list(model.state_dict())
    reverse = [t.reverse_transform() for t in transforms[::-1]]
    rev_renamings, rev_converters = _split(reverse)
    saved = set()
    for key in keys:
        old, _ = tcore.rename_source_key(key, rev_renamings, rev_converters, reverse=True)
        saved.update({old.replace("*", "0"), old.replace("*", "1")})
    hf_renamings, hf_converters = _split(transforms)
    our_renamings, our_converters = _ours(transforms)
    differ = []
    inputs = sorted(set(keys) | saved)
    for key in inputs:
        theirs = tcore.rename_source_key(key, hf_renamings, hf_converters)
        ours = porting.rename_source_key(key, our_renamings, our_converters)
        if ours != theirs:
            differ.append((key, theirs, ours))
    print(
        f"\n{fam.model_type}: {len(transforms)} transforms, {len(inputs)} keys, {len(saved - set(keys))} legacy keys"
    )
    assert differ == []
    if fam.model_type in _table():
        assert saved - set(keys), "the entry renames nothing in this model"


def _save_legacy(model, folder: Path) -> dict[str, torch.Tensor]:
    """The model saved as transformers writes its original (pre-conversion) checkpoint."""
    from safetensors.torch import save_file
    from transformers import core_model_loading as tcore

    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    legacy = tcore.revert_weight_conversion(model, dict(state))
    legacy = {k: v.contiguous().clone() for k, v in legacy.items()}
    folder.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(folder)
    save_file(legacy, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return legacy


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "phimoe"])
def test_builtin_moe_entry_loads_and_saves_exactly_through_modelgraft(model_type, tmp_path):
    """transformers' entry, run by modelgraft's engine instead of transformers': exact both ways."""
    from transformers import AutoModelForCausalLM
    from transformers import conversion_mapping as tcm

    fam = family(model_type)
    torch.manual_seed(0)
    plain = fam.causal_lm().eval()
    legacy = _save_legacy(plain, tmp_path / "legacy")
    assert set(legacy) != set(plain.state_dict())  # really the per-expert layout
    entry = [to_modelgraft(t) for t in tcm.get_checkpoint_conversion_mapping(model_type)]
    with mg.patched({}, conversions={model_type: entry}):
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "legacy").eval()
    rep = mg.report(loaded)
    assert rep.conversions, "modelgraft's engine did not run the entry"
    assert not rep.unloaded_parameters
    for key, value in plain.state_dict().items():
        got = loaded.state_dict()[key]
        assert got.dtype == value.dtype and got.shape == value.shape, key
        assert torch.equal(got, value), key
    ids = torch.arange(10).unsqueeze(0) % plain.config.vocab_size
    with torch.no_grad():
        a, b = plain(ids).logits, loaded(ids).logits
    assert torch.isfinite(a).all() and torch.equal(a, b)
    loaded.save_pretrained(tmp_path / "saved")
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert set(saved) == set(legacy)
    for key, value in legacy.items():
        assert saved[key].dtype == value.dtype and torch.equal(saved[key], value), key
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["model_type"] == model_type
