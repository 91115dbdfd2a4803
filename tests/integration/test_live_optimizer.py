"""graft_model on a model whose optimizer is already built (issue 19, point 7).

The graft puts new parameter objects in the model (``qkv_proj`` from ``q/k/v_proj``; per-expert
linears from fused 3-D experts). With ``optimizer=`` the groups and the state move exactly: the
state of a new weight is the state of its sources laid out by the weights' own conversion. Without
it, an optimizer still holding a replaced parameter refuses to step, naming it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from _versions import requires_fused_experts
from modelgraft import GraftStateError, graft_model
from modelgraft.grafts import fused_qkv, linear_experts
from modelgraft.testing import tiny_config


def _model(model_type: str) -> nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(model_type)).train()


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(seed))
    optimizer.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)  # a graft refuses weights with a pending `.grad`


def test_the_optimizer_moves_to_the_fused_weights_with_its_state() -> None:
    model = _model("llama")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for seed in range(2):
        _step(model, optimizer, seed)
    attn = model.model.layers[0].self_attn
    projections = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
    states = [optimizer.state[p] for p in projections]
    count = sum(len(g["params"]) for g in optimizer.param_groups)

    graft_model(model, fused_qkv("llama"), optimizer=optimizer)

    fused = model.model.layers[0].self_attn.qkv_proj.weight
    held = [p for g in optimizer.param_groups for p in g["params"]]
    assert any(p is fused for p in held) and not any(p is q for p in held for q in projections)
    assert {id(p) for p in held} == {id(p) for p in model.parameters()}
    assert len(held) == count - 2 * len(model.model.layers)  # three projections became one, per layer
    moved = optimizer.state[fused]
    for name in ("exp_avg", "exp_avg_sq"):
        expected = torch.cat([s[name] for s in states])
        assert moved[name].dtype == expected.dtype and torch.equal(moved[name], expected), name
    assert torch.equal(moved["step"], states[0]["step"])
    assert not any(p in optimizer.state for p in projections)
    before = fused.detach().clone()
    _step(model, optimizer, 3)  # the fused weight is the one that is trained now
    assert not torch.equal(fused, before) and bool(torch.isfinite(fused).all())


def test_an_optimizer_left_holding_replaced_parameters_refuses_to_step() -> None:
    model = _model("llama")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    graft_model(model, fused_qkv("llama"))
    with pytest.raises(
        GraftStateError, match=r"SGD.step\(\) would update `model.layers.0.self_attn.q_proj.weight`"
    ):
        _step(model, optimizer, 0)
    fresh = torch.optim.SGD(model.parameters(), lr=1e-2)  # built after the graft: fine
    _step(model, fresh, 0)


def test_sources_in_different_groups_are_refused_and_nothing_changes() -> None:
    model = _model("llama")
    attn = model.model.layers[0].self_attn
    q = [attn.q_proj.weight]
    rest = [p for p in model.parameters() if p is not attn.q_proj.weight]
    optimizer = torch.optim.SGD([{"params": q, "lr": 1.0}, {"params": rest}], lr=1e-2)
    with pytest.raises(
        GraftStateError, match=r"`model.layers.0.self_attn.qkv_proj.weight`.*different parameter groups"
    ):
        graft_model(model, fused_qkv("llama"), optimizer=optimizer)
    assert (
        model.model.layers[0].self_attn is attn
        and optimizer.param_groups[0]["params"][0] is attn.q_proj.weight
    )


def test_sources_with_different_state_are_refused() -> None:
    model = _model("llama")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    _step(model, optimizer, 0)
    attn = model.model.layers[0].self_attn
    del optimizer.state[attn.k_proj.weight]  # as if k_proj had been frozen for that step
    with pytest.raises(
        GraftStateError, match=r"`model.layers.0.self_attn.qkv_proj.weight`: its sources .* hold different"
    ):
        graft_model(model, fused_qkv("llama"), optimizer=optimizer)


@requires_fused_experts
def test_the_optimizer_moves_to_per_expert_linears() -> None:
    model = _model("qwen2_moe")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    _step(model, optimizer, 0)
    experts = model.model.layers[0].mlp.experts
    fused = experts.down_proj  # (experts, hidden, intermediate)
    state = {k: v.clone() for k, v in optimizer.state[fused].items()}
    graft_model(model, linear_experts("qwen2_moe"), optimizer=optimizer)
    new = model.model.layers[0].mlp.experts
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert held == {id(p) for p in model.parameters()}
    for e in range(fused.shape[0]):
        moved = optimizer.state[new[e].down_proj.weight]
        assert torch.equal(moved["exp_avg"], state["exp_avg"][e]) and torch.equal(
            moved["exp_avg_sq"], state["exp_avg_sq"][e]
        )
