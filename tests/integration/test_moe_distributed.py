"""Replay under DistributedDataParallel: two gloo CPU ranks, each replaying its own trace, give the
same gradients as one process computing both batches (issue 4, point 7)."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from modelgraft.moe import moe_layers, record_routing, replay_routing
from moe_families import build_tiny

WORLD = 2


def _model() -> torch.nn.Module:
    model = build_tiny("qwen3_moe", seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in moe_layers(model):
            layer.router.weight.copy_(torch.randn(layer.router.weight.shape, generator=gen))
    return model


def _batch(rank: int) -> torch.Tensor:
    return torch.randint(1, 128, (2, 4), generator=torch.Generator().manual_seed(100 + rank))


def _trace(model: torch.nn.Module, ids: torch.Tensor):
    with torch.no_grad(), record_routing(model) as trace:
        model(input_ids=ids, use_cache=False)
    return trace


def _perturb(model: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in moe_layers(model):
            layer.router.weight.add_(torch.randn(layer.router.weight.shape, generator=gen))


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits.float().pow(2).mean()


def _worker(rank: int, store: str, out_dir: str) -> None:
    # A FileStore has no server process: with a TCPStore hosted by rank 0, a rank 0 that exits first
    # can leave rank 1 waiting in destroy_process_group until the store timeout (seen once in CI).
    # The short timeout turns any lost peer into an error instead of a 30-minute wait.
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=300),
    )
    try:
        torch.manual_seed(0)
        model = _model()
        ids = _batch(rank)
        trace = _trace(model, ids)  # each rank records its own rollout
        _perturb(model)  # the policy moved since the rollout
        model.train()
        # Per-expert MLPs (transformers 4.57) that no token of this rank reaches take no part in
        # its backward; DDP must be told, as for any MoE model with per-expert parameters.
        ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        with replay_routing(model, trace):
            _loss(ddp, ids).backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        torch.save(grads, os.path.join(out_dir, f"grads{rank}.pt"))
        dist.barrier()  # both ranks are done before either tears the group down
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_ddp_replay_matches_single_process(tmp_path) -> None:
    mp.spawn(_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD, join=True)

    model = _model()
    batches = [_batch(rank) for rank in range(WORLD)]
    traces = [_trace(model, ids) for ids in batches]
    _perturb(model)
    model.train()
    for ids, trace in zip(batches, traces):
        with replay_routing(model, trace):
            (_loss(model, ids) / WORLD).backward()  # DDP averages gradients over ranks
    expected = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    router_names = {f"{layer.name}.weight" for layer in moe_layers(model)}
    assert router_names <= expected.keys()
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"grads{rank}.pt")
        assert got.keys() == expected.keys()
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)
        assert all(bool(got[name].abs().sum() > 0) for name in router_names)
