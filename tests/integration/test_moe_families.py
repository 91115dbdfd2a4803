"""Record/replay contract on every MoE family of the installed transformers (issue 4, points 1-2).

Families are found at run time (``moe_model_types``); each is built tiny. A family that cannot be
built tiny, or whose router does not select with a top-k, is skipped with the reason (``-ra``).

The replay contract itself (``test_replay_contract``) spies on the top-k interception
(``modelgraft.moe._intercept``) to see what each family's code gets back from its selection, so it
lives in that module's own unit file, tests/unit/test_moe_intercept.py (issue 14, point 5).
"""

from __future__ import annotations

import pytest
import torch
from moe_helpers import ExpertInputs

from _versions import MIN_MOE_FAMILIES, MIN_MOE_FAMILIES_RUNNING
from families import Family, family_params
from modelgraft import RoutingError
from modelgraft.moe import moe_layers, record_routing, replay_routing
from moe_families import (
    BATCH,
    SEQ,
    model_output,
    moe_model_types,
    plain_failure,
    tiny_or_skip,
    tiny_with_random_routers,
)

FAMILIES = moe_model_types()


def test_family_discovery_finds_the_installed_families() -> None:
    assert len(FAMILIES) >= MIN_MOE_FAMILIES  # 36 on transformers 5.23, 25 on 4.57
    assert {"qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"} <= set(FAMILIES)


def test_at_least_30_families_run() -> None:
    # Families whose plain forward fails at tiny size are skipped in test_replay_contract too
    # (tests/unit/test_moe_intercept.py).
    skipped = {t: tiny_with_random_routers(t)[1] or plain_failure(t) for t in FAMILIES}
    skipped = {t: why for t, why in skipped.items() if why}
    usable = [t for t in FAMILIES if t not in skipped]
    print(f"{len(usable)} MoE families run, {len(skipped)} skipped:")
    for model_type, reason in skipped.items():
        print(f"  {model_type}: {reason}")
    assert len(usable) >= MIN_MOE_FAMILIES_RUNNING  # 30 on transformers 5.23, 17 on 4.57


def _group_size(layer) -> int:
    """Experts per group of a group-limited router (DeepSeek-V3 style), else the expert count."""
    groups = next(
        (
            getattr(module, attr)
            for module in (layer.router, layer.scope)
            for attr in ("num_group", "n_group")
            if isinstance(getattr(module, attr, None), int)
        ),
        1,
    )
    return layer.num_experts // groups


def shifted(layers, routes: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every token sent to other experts than natively, within the router's group limit: each id moves
    by one group (group-limited routers with several groups) or by one expert."""
    out = []
    for layer, ids in zip(layers, routes, strict=True):
        size = _group_size(layer)
        step = size if size < layer.num_experts else 1
        out.append((ids + step) % layer.num_experts)
    return out


def _check_forced_ids_reach_the_experts(model: torch.nn.Module, ids: torch.Tensor, name: str) -> None:
    layers = moe_layers(model)
    try:
        with record_routing(model) as native, torch.no_grad():
            reference = model_output(model, ids)
    except RoutingError:
        raise
    except Exception as exc:
        with torch.no_grad():
            try:
                model_output(model, ids)
            except Exception as plain:
                pytest.skip(f"{name}: plain forward fails when tiny: {type(plain).__name__}: {plain}"[:300])
        raise AssertionError(f"{name} runs plainly but fails while recording") from exc
    forced = shifted(layers, list(native))
    for layer, a, b in zip(layers, native, forced):
        assert not torch.equal(a, b), layer.name
    with ExpertInputs(model) as received, replay_routing(model, forced), torch.no_grad():
        out = model_output(model, ids)
    received.assert_matches(forced)
    assert out.shape == reference.shape and out.dtype == reference.dtype
    assert bool(torch.isfinite(out).all()) == bool(torch.isfinite(reference).all())
    assert not torch.equal(out, reference), "other experts must give other outputs"


@pytest.mark.parametrize("model_type", FAMILIES)
def test_replay_forces_ids_that_differ_from_the_native_ones(model_type: str) -> None:
    """Issue 10, point 1: the experts receive the trace's ids, not the native ones, in every family."""
    model = tiny_or_skip(model_type)
    ids = torch.randint(1, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    _check_forced_ids_reach_the_experts(model, ids, model_type)


@pytest.mark.parametrize("family", family_params(kinds={"moe"}))
def test_replay_forces_ids_on_the_family_table(family: Family) -> None:
    """The same on tests/families.py's tiny configs (one expert group, top-2: the DeepSeek-V3 trap)."""
    model = family.model().eval()
    try:
        layers = moe_layers(model)
    except RoutingError as exc:
        pytest.skip(f"{family.model_type}: {exc}")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in layers:
            for tensor in [*layer.router.parameters(), *layer.router.buffers()]:
                if tensor.is_floating_point():
                    tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.5)
    ids = family.inputs(model.config, batch=BATCH, seq=SEQ)["input_ids"]
    _check_forced_ids_reach_the_experts(model, ids, family.model_type)
