"""Record/replay contract on every MoE family of the installed transformers (issue 4, points 1-2).

Families are found at run time (``moe_model_types``); each is built tiny. A family that cannot be
built tiny, or whose router does not select with a top-k, is skipped with the reason (``-ra``).
"""

from __future__ import annotations

from functools import cache

import pytest
import torch
from moe_helpers import ExpertInputs

from _versions import MIN_MOE_FAMILIES, MIN_MOE_FAMILIES_RUNNING
from families import Family, family_params
from modelgraft import RoutingError
from modelgraft.moe import _intercept, moe_layers, record_routing, replay_routing
from moe_families import build_tiny, forward_inputs, moe_model_types, routed_tokens

FAMILIES = moe_model_types()
BATCH, SEQ = 2, 4


@cache
def _built(model_type: str) -> tuple[torch.nn.Module | None, str]:
    """The tiny model with randomised routers, or None and why it cannot be used."""
    try:
        model = build_tiny(model_type)
    except Exception as exc:  # any failure to build tiny is a skip reason, reported verbatim
        return None, f"cannot be built tiny: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    try:
        layers = moe_layers(model)
    except RoutingError as exc:
        return None, str(exc)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in layers:
            # Initialisers often zero the router; random routers make the selection non-trivial.
            for tensor in [*layer.router.parameters(), *layer.router.buffers()]:
                if tensor.is_floating_point():
                    tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.5)
    return model, ""


def _model_or_skip(model_type: str) -> torch.nn.Module:
    model, reason = _built(model_type)
    if model is None:
        pytest.skip(f"{model_type}: {reason}")
    return model


def _out(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(**forward_inputs(model.config.model_type, ids), use_cache=False)
    logits = getattr(out, "logits", None)
    return logits if logits is not None else out.last_hidden_state


def _expert_inputs(model: torch.nn.Module) -> tuple[list[tuple[str, torch.Tensor, torch.Tensor]], list]:
    """Hook each experts module to see the (indices, weights) it is given, where its call shows them."""
    seen: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    handles = []
    for layer in moe_layers(model):
        parent = layer.scope if layer.scope is not layer.router else None
        holder = parent if parent is not None else _parent_of(model, layer.name)
        experts = [
            m for n, m in holder.named_children() if "Expert" in type(m).__name__ and "Shared" not in n
        ]
        if not experts:
            continue

        def hook(module, args, kwargs, k=layer.top_k, name=layer.name):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            idx = [t for t in tensors if not t.is_floating_point() and t.shape[-1:] == (k,)]
            wts = [t for t in tensors if t.is_floating_point() and idx and t.shape == idx[0].shape]
            if idx and wts:
                seen.append(
                    (name, idx[0].detach().reshape(-1, k).clone(), wts[0].detach().reshape(-1, k).clone())
                )

        handles.append(experts[0].register_forward_pre_hook(hook, with_kwargs=True))
    return seen, handles


@cache
def _plain_failure(model_type: str) -> str:
    """Why the family's own forward fails at tiny size (without modelgraft), or ''."""
    model, _ = _built(model_type)
    try:
        with torch.no_grad():
            _out(model, torch.ones(BATCH, SEQ, dtype=torch.long))
    except Exception as exc:
        return f"plain forward fails when tiny: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return ""


def _skip_if_plain_forward_fails(model_type: str) -> None:
    reason = _plain_failure(model_type)
    if reason:
        pytest.skip(f"{model_type}: {reason}")


def _parent_of(model: torch.nn.Module, name: str) -> torch.nn.Module:
    return model.get_submodule(name.rpartition(".")[0]) if "." in name else model


@pytest.fixture
def selections(monkeypatch: pytest.MonkeyPatch) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, (indices, scores) of its expert selection (the last selection-shaped top-k of the
    layer's forward), as the family's code received them."""
    captured: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    original = _intercept._SelectionMode._topk

    def spy(self, func, args, kwargs):
        before = self.site.candidates
        out = original(self, func, args, kwargs)
        if self.site.candidates > before:
            k = self.site.layer.top_k
            captured[self.site.layer.name] = (
                out.indices.detach().reshape(-1, k),
                out.values.detach().reshape(-1, k),
            )
        return out

    monkeypatch.setattr(_intercept._SelectionMode, "_topk", spy)
    return captured


def test_family_discovery_finds_the_installed_families() -> None:
    assert len(FAMILIES) >= MIN_MOE_FAMILIES  # 36 on transformers 5.23, 25 on 4.57
    assert {"qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"} <= set(FAMILIES)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_replay_contract(model_type: str, selections: dict) -> None:
    model = _model_or_skip(model_type)
    layers = moe_layers(model)
    ids = torch.randint(1, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))

    try:
        with record_routing(model) as trace, torch.no_grad():
            reference = _out(model, ids)
    except RoutingError:
        raise
    except Exception as exc:
        _skip_if_plain_forward_fails(model_type)
        raise AssertionError(f"{model_type} runs plainly but fails while recording") from exc
    assert len(trace) == len(layers)
    for layer, routes in zip(layers, trace):
        assert layer.top_k < layer.num_experts, f"{layer.name}: a choice among experts is needed to test"
        assert routes.shape == (routed_tokens(model_type, layer.name, ids), layer.top_k), layer.name
        assert 0 <= int(routes.min()) and int(routes.max()) < layer.num_experts

    # Unchanged weights: bit-identical.
    seen, handles = _expert_inputs(model)
    selections.clear()
    with replay_routing(model, trace), torch.no_grad():
        replayed = _out(model, ids)
    assert torch.equal(replayed, reference)
    before = list(seen)
    seen.clear()
    selected_before = dict(selections)
    selections.clear()

    # Perturbed router: same experts, different routing weights, and the router gets a gradient.
    routers = [layer.router for layer in layers]
    saved = [{k: v.clone() for k, v in r.state_dict().items()} for r in routers]
    try:
        with torch.no_grad():
            gen = torch.Generator().manual_seed(2)
            for router in routers:
                for p in router.parameters():
                    if p.is_floating_point():
                        p.add_(torch.randn(p.shape, generator=gen))
        model.zero_grad(set_to_none=True)
        with replay_routing(model, trace):
            out = _out(model, ids)
            out.float().pow(2).mean().backward()
    finally:
        for handle in handles:
            handle.remove()
        for router, state in zip(routers, saved):
            router.load_state_dict(state)
    after = list(seen)
    assert not torch.equal(out.detach(), reference)
    # What the family's own code got back from its selection: the recorded experts, live scores.
    # (Keyed by layer: execution order may differ from module order, e.g. JetMoE's attention experts.)
    by_name_before, by_name_after = selected_before, selections
    assert len(selected_before) == len(selections) == len(layers)
    for layer, routes in zip(layers, trace):
        (idx_b, score_b), (idx_a, score_a) = by_name_before[layer.name], by_name_after[layer.name]
        assert torch.equal(idx_b, routes) and torch.equal(idx_a, routes), layer.name
        assert not torch.equal(score_a, score_b), layer.name
    if before:  # the family's experts module shows the indices and weights it receives
        routes_of = {layer.name: routes for layer, routes in zip(layers, trace)}
        weights_before = {name: w for name, _, w in before}
        assert len(after) == len(before)
        for (name, idx_b, _), (name_a, idx_a, w_a) in zip(before, after):
            assert name == name_a
            assert torch.equal(idx_b.long(), routes_of[name]) and torch.equal(idx_a.long(), routes_of[name])
            assert not torch.equal(w_a, weights_before[name]), name
    grads = [p.grad for r in routers for p in r.parameters() if p.requires_grad]
    assert any(g is not None and bool(g.abs().sum() > 0) for g in grads), "router weight got no gradient"


def test_at_least_30_families_run() -> None:
    # Families whose plain forward fails at tiny size are skipped in test_replay_contract too.
    skipped = {t: _built(t)[1] or _plain_failure(t) for t in FAMILIES}
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
            reference = _out(model, ids)
    except RoutingError:
        raise
    except Exception as exc:
        with torch.no_grad():
            try:
                _out(model, ids)
            except Exception as plain:
                pytest.skip(f"{name}: plain forward fails when tiny: {type(plain).__name__}: {plain}"[:300])
        raise AssertionError(f"{name} runs plainly but fails while recording") from exc
    forced = shifted(layers, list(native))
    for layer, a, b in zip(layers, native, forced):
        assert not torch.equal(a, b), layer.name
    with ExpertInputs(model) as received, replay_routing(model, forced), torch.no_grad():
        out = _out(model, ids)
    received.assert_matches(forced)
    assert out.shape == reference.shape and out.dtype == reference.dtype
    assert bool(torch.isfinite(out).all()) == bool(torch.isfinite(reference).all())
    assert not torch.equal(out, reference), "other experts must give other outputs"


@pytest.mark.parametrize("model_type", FAMILIES)
def test_replay_forces_ids_that_differ_from_the_native_ones(model_type: str) -> None:
    """Issue 10, point 1: the experts receive the trace's ids, not the native ones, in every family."""
    model = _model_or_skip(model_type)
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
