"""``linear_experts`` on every fused-experts family of the installed transformers (issue 13, point 1).

Each family of :data:`LINEAR_EXPERTS_FAMILIES` is checked with routers set to random values (the
initialisers often zero them, which would route every token to the same experts): a tiny plain
checkpoint loads into the grafted model with the same outputs (ids, shapes, dtypes, finite, fp32
atol 1e-5), the experts are per-expert ``nn.Linear`` layers, and the save writes the original file
bit for bit. Every other MoE family is refused with its reason, or not decided yet with what stands
in the way, both pinned below; one that cannot be built tiny is printed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import AutoConfig

from _versions import FUSED_MOE_EXPERTS, TRANSFORMERS_VERSION, missing_model_type
from families import BY_TYPE, auto_class, family, randomise_routers
from modelgraft import UnsupportedFamilyError
from modelgraft.grafts import LINEAR_EXPERTS_FAMILIES, LinearExpert, linear_experts
from moe_families import moe_model_types

ATOL = 1e-5

#: Families refused before this change, and where each sits now.
NEWLY_SUPPORTED = (
    "qwen3_5_moe_text",
    "qwen3_vl_moe_text",
    "gemma4_text",
    "llama4_text",
    "gpt_oss",
    "granitemoe",
    "granitemoeshared",
    "granitemoehybrid",
    "granitemoe_swa",
    "aria_text",
    "dbrx",
)

#: MoE families whose experts are not (or cannot be loaded as) sets of linear layers: the reason.
REFUSED = {
    "jetmoe": r"`JetMoeParallelExperts`: it has no 3D `gate_up_proj` and `down_proj` parameters",
    "nemotron_h": r"`NemotronHExperts`: it has no 3D `gate_up_proj` and `down_proj` parameters",
    "muse_spark_text": r"`MuseSparkExperts`: `has_post_expert_norm` is True",
    "longcat_flash": r"`LongcatFlashExperts`: its router also selects zero \(identity\) experts",
    "ergo": r"`ErgoExperts`: it has no 3D `gate_up_proj` and `down_proj` parameters",
    "beam": r"no module holds 3D expert parameters",
    "flint": r"no module holds 3D expert parameters",
    "step3p7": r"no module holds 3D expert parameters",
    "switch_transformers": r"no module holds 3D expert parameters",
    "nllb-moe": r"no module holds 3D expert parameters",
    "bailing_hybrid": r"regular expression `\^model\\\.word_embeddings\\\.`",
    "deepseek_v4": r"regular expression `\^embed\\\.weight`",
    "kimi_linear": r"regular expression `\\\.experts\.\*\.w1\.weight`",
    "mistral_large4_text": r"regular expression `\\\.ssmax_scaling\.s`",
    "hy_v4": r"regular expression `\\\.hc_pre\\\.hc_`, whose target `hc_` is not a run of whole key segments",
    "inkling2_text": r"with `Inkling2UnpadVocab`, which grafts cannot carry over",
    "inkling2_loop_text": r"with `Inkling2LoopMergeMessageQueries`, which grafts cannot carry over",
    "lara_mini": r"with `Split`, which grafts cannot carry over",
    "qwen4_exp_text": r"with `Concatenate`, which grafts cannot carry over",
    "deepseek_ocr2_text": r"no base model class",
    "ernie4_5_vl_moe_text": r"no base model class",
    "hy_v4_vl_text": r"regular expression `\\\.hc_pre\\\.hc_`, whose target `hc_` is not a run of whole key segments",
    "diffusion_gemma_text": r"no base model class",
    "qwen3_omni_moe_text": r"no base model class",
    "unlimited_ocr_text": r"no base model class",
}


#: MoE families whose experts are linear layers but are not grafted yet: what stands in the way,
#: pinned as the error they get today (docs/grafts.md lists them as not decided, with the reason).
#: None today: DBRX, the last one, is grafted from its 2D stacks (`StackedLayout`).
NOT_DECIDED: dict[str, str] = {}


def _fused_here(model_type: str) -> str | None:
    """Why ``model_type`` is not grafted on this transformers line (``None`` when it is)."""
    missing = missing_model_type(model_type)
    if missing is not None:
        return missing
    if not FUSED_MOE_EXPERTS and model_type not in ("gpt_oss", "llama4_text", "dbrx"):
        return (
            f"transformers {TRANSFORMERS_VERSION} has no fused experts in `{model_type}` "
            "(per-expert layers or a layout of its own); only GPT-OSS, Llama 4 (3D) and DBRX (2D stacks) "
            "are fused there"
        )
    return None


def _outputs(model: nn.Module, model_type: str) -> torch.Tensor:
    with torch.no_grad():
        out = model(**family(model_type).inputs(model.config))
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


@pytest.fixture(scope="module")
def plain_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    made: dict[str, tuple[Path, nn.Module]] = {}

    def make(model_type: str) -> tuple[Path, nn.Module]:
        if model_type not in made:
            torch.manual_seed(0)
            model = family(model_type).model().eval()
            randomise_routers(model)
            path = tmp_path_factory.mktemp(f"experts-{model_type}")
            model.save_pretrained(path)
            made[model_type] = (path, model)
        return made[model_type]

    return make


ALL_TYPES = tuple(dict.fromkeys((*NEWLY_SUPPORTED, *LINEAR_EXPERTS_FAMILIES)))


@pytest.mark.parametrize("model_type", ALL_TYPES)
def test_grafted_experts_give_the_plain_outputs_and_save_the_plain_checkpoint(
    model_type: str, plain_checkpoint, tmp_path: Path
) -> None:
    why = _fused_here(model_type)
    if why is not None:
        pytest.skip(why)
    path, plain = plain_checkpoint(model_type)
    with linear_experts(model_type).applied(strict=True):
        grafted = auto_class(plain.config).from_pretrained(path).eval()
    experts = [m for m in grafted.modules() if isinstance(m, LinearExpert)]
    assert experts, "no per-expert layers in the grafted model"
    assert all(isinstance(getattr(e, n), nn.Linear) for e in experts for n in e._names)
    assert not any(
        n.endswith((".experts.gate_up_proj", ".experts.down_proj")) for n, _ in grafted.named_parameters()
    )

    expected, got = _outputs(plain, model_type), _outputs(grafted, model_type)
    assert got.shape == expected.shape and got.dtype == expected.dtype == torch.float32
    assert torch.isfinite(expected).all() and torch.isfinite(got).all()
    if expected.shape[-1] == plain.config.get_text_config().vocab_size:
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)

    grafted.save_pretrained(tmp_path)
    original = load_file(path / "model.safetensors")
    saved = load_file(tmp_path / "model.safetensors")
    assert sorted(saved) == sorted(original)
    for key, tensor in original.items():
        assert saved[key].dtype == tensor.dtype and torch.equal(saved[key], tensor), key
    reloaded = auto_class(AutoConfig.from_pretrained(tmp_path)).from_pretrained(tmp_path)
    for name, tensor in plain.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


def test_the_families_refused_before_are_supported_now() -> None:
    present = [t for t in NEWLY_SUPPORTED if _fused_here(t) is None]
    assert set(present) <= set(LINEAR_EXPERTS_FAMILIES)
    if FUSED_MOE_EXPERTS:
        assert present == list(NEWLY_SUPPORTED)
        assert len(LINEAR_EXPERTS_FAMILIES) >= 45


@pytest.mark.parametrize("model_type", sorted(NOT_DECIDED))
def test_families_not_decided_yet_are_refused_with_what_stands_in_the_way(model_type: str) -> None:
    if (why := missing_model_type(model_type)) is not None:
        pytest.skip(why)
    if not FUSED_MOE_EXPERTS:
        pytest.skip(f"the refusals are pinned for transformers 5.x (installed: {TRANSFORMERS_VERSION})")
    with pytest.raises(UnsupportedFamilyError, match=NOT_DECIDED[model_type]):
        linear_experts(model_type)


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_families_whose_experts_are_not_linear_layers_are_refused_with_the_reason(model_type: str) -> None:
    if (why := missing_model_type(model_type)) is not None:
        pytest.skip(why)
    if not FUSED_MOE_EXPERTS:
        pytest.skip(f"the refusals are pinned for transformers 5.x (installed: {TRANSFORMERS_VERSION})")
    with pytest.raises(UnsupportedFamilyError, match=REFUSED[model_type]):
        linear_experts(model_type)


def test_every_moe_family_of_the_installed_transformers_is_supported_or_refused() -> None:
    """Walks the installed library: each MoE family is in the default list, or refused with a
    reason, or not decided yet (pinned above), or cannot be built tiny (printed; none on 5.24)."""
    not_tiny = []
    unaccounted = []
    for model_type in moe_model_types():
        if model_type in LINEAR_EXPERTS_FAMILIES or model_type in REFUSED or model_type in NOT_DECIDED:
            continue
        try:
            linear_experts(model_type)
        except UnsupportedFamilyError as exc:
            if FUSED_MOE_EXPERTS:
                unaccounted.append(f"{model_type}: {exc}")
        except Exception as exc:  # a tiny config the family's own validation rejects
            not_tiny.append(f"{model_type}: {type(exc).__name__}")
        else:
            if FUSED_MOE_EXPERTS:
                unaccounted.append(f"{model_type}: supported but not in LINEAR_EXPERTS_FAMILIES")
    print("not buildable tiny:", not_tiny)
    assert not unaccounted, unaccounted


def test_new_families_are_in_the_family_table() -> None:
    assert set(LINEAR_EXPERTS_FAMILIES) <= set(BY_TYPE)
