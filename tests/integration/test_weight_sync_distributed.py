"""Routing record/replay and the weight-sync iterator under FSDP2 and under a transformers
tensor-parallel load, each with two CPU ranks over gloo (issue 11, point 10).

FSDP2 (``fully_shard`` of every decoder layer and the root, on a Qwen3-MoE grafted with fused QKV):
each rank records its own batch (the trace equals the one a single process records), replays a
trace recorded before the routers moved (the gradients, gathered, equal one process computing both
batches), and ``original_state_dict`` gathers the sharded DTensors one at a time into the plain
checkpoint, bit for bit.

Tensor parallel (``from_pretrained(..., tp_plan="auto")``): the plain Qwen3-MoE records and replays
as in one process, and the iterator gives the checkpoint bit for bit; a fused-QKV graft loads and
streams its checkpoint bit for bit too, but cannot run its forward under TP: its ``qkv_proj`` has
no entry in the model's TP plan (see docs/conversion.md, "Distributed"), which the last test
checks and reports as a skip with the error.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM
from weight_sync_helpers import assert_matches_plain

from families import family
from modelgraft import graft_model, original_state_dict
from modelgraft.grafts import fused_qkv
from modelgraft.moe import moe_layers, record_routing, replay_routing

WORLD = 2
MODEL = "qwen3_moe"
SIZES = {"num_attention_heads": 4, "num_key_value_heads": 2}  # heads split over two TP ranks


def _model(perturbed: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = family(MODEL).causal_lm(**SIZES).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in moe_layers(model):
            layer.router.weight.copy_(torch.randn(layer.router.weight.shape, generator=gen))
        if perturbed:  # the policy moved since the rollout
            for layer in moe_layers(model):
                layer.router.weight.add_(torch.randn(layer.router.weight.shape, generator=gen))
    return model


def _batch(rank: int) -> torch.Tensor:
    return torch.randint(1, 100, (2, 5), generator=torch.Generator().manual_seed(100 + rank))


def _trace(model: torch.nn.Module, ids: torch.Tensor):
    with torch.no_grad(), record_routing(model) as trace:
        model(input_ids=ids, use_cache=False)
    return trace


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits.float().pow(2).mean()


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _router_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {f"{layer.name}.weight": _full(layer.router.weight.grad) for layer in moe_layers(model)}


def _init(rank: int, store: str) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD)
    )
    # A FileStore has no server process (see test_moe_distributed.py); a lost peer errors in 300 s.
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=300)
    )


def _fsdp_worker(rank: int, store: str, out_dir: str, traces: list) -> None:
    _init(rank, store)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD,))

        def sharded(perturbed: bool) -> torch.nn.Module:
            model = _model(perturbed)
            graft_model(model, fused_qkv(MODEL))
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            return fully_shard(model, mesh=mesh)

        ids = _batch(rank)
        recorded = _trace(sharded(False), ids)  # the rollout, recorded under FSDP2
        model = sharded(True)
        model.train()
        with replay_routing(model, traces[rank]):
            _loss(model, ids).backward()  # FSDP2 averages gradients over the ranks
        result = {
            "recorded": [layer.clone() for layer in recorded.layers],
            "grads": _router_grads(model),
            "param_type": type(next(model.parameters())).__name__,
            "stream": [(name, tensor.clone()) for name, tensor in original_state_dict(model)],
        }
        torch.save(result, os.path.join(out_dir, f"fsdp{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _tp_worker(rank: int, store: str, out_dir: str, path: str, trace: Any) -> None:
    _init(rank, store)
    try:
        ids = _batch(0)  # tensor parallel: every rank runs the same batch
        model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")
        sharded = [n for n, p in model.named_parameters() if getattr(p, "placements", None) is not None]
        recorded = _trace(model, ids)
        model.train()
        with replay_routing(model, trace):
            loss = _loss(model, ids)
            loss.backward()
        result = {
            "sharded": sharded,
            "local_q": tuple(model.model.layers[0].self_attn.q_proj.weight.to_local().shape),
            "recorded": [layer.clone() for layer in recorded.layers],
            "loss": loss.detach(),
            "grads": _router_grads(model),
            "stream": [(name, tensor.clone()) for name, tensor in original_state_dict(model)],
        }
        try:  # in place after the TP load: refused, the model left as it was
            graft_model(model, fused_qkv(MODEL))
        except Exception as error:
            result["in_place_error"] = (type(error).__name__, str(error))
        result["after_refusal"] = [n for n, _ in model.named_parameters()]
        with fused_qkv(MODEL).applied(strict=True):
            grafted = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")
        result["grafted_stream"] = [(name, tensor.clone()) for name, tensor in original_state_dict(grafted)]
        try:
            result["grafted_loss"] = _loss(grafted, ids).detach()
        except RuntimeError as error:  # why it cannot run here, reported by the test
            result["grafted_error"] = f"{type(error).__name__}: {error}"
        torch.save(result, os.path.join(out_dir, f"tp{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("fsdp")
    rollout = _model(False)
    traces = [_trace(rollout, _batch(rank)) for rank in range(WORLD)]
    mp.spawn(_fsdp_worker, args=(str(out / "store"), str(out), traces), nprocs=WORLD, join=True)
    return {"out": out, "traces": traces, "ranks": [torch.load(out / f"fsdp{r}.pt") for r in range(WORLD)]}


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("tp")
    path = out / "checkpoint"
    _model(True).save_pretrained(path)
    trace = _trace(_model(False), _batch(0))
    mp.spawn(_tp_worker, args=(str(out / "store"), str(out), str(path), trace), nprocs=WORLD, join=True)
    return {"path": path, "trace": trace, "ranks": [torch.load(out / f"tp{r}.pt") for r in range(WORLD)]}


@pytest.mark.distributed
def test_fsdp2_records_as_one_process_and_replays_with_the_same_gradients(fsdp_run) -> None:
    grafted = _model(False)
    graft_model(grafted, fused_qkv(MODEL))
    model = _model(True)
    graft_model(model, fused_qkv(MODEL))
    model.train()
    for rank in range(WORLD):
        with replay_routing(model, fsdp_run["traces"][rank]):
            (_loss(model, _batch(rank)) / WORLD).backward()
    expected = _router_grads(model)
    for rank, got in enumerate(fsdp_run["ranks"]):
        assert got["param_type"] == "DTensor"  # the parameters really are sharded
        single = _trace(grafted, _batch(rank))
        assert len(got["recorded"]) == len(single.layers) > 0
        for lid, (ids, want) in enumerate(zip(got["recorded"], single.layers)):
            assert torch.equal(ids, want), f"layer {lid}"
        assert got["grads"].keys() == expected.keys()
        for name, grad in expected.items():
            assert bool(grad.abs().sum() > 0), name
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.distributed
def test_fsdp2_weight_sync_gathers_the_plain_checkpoint_bit_for_bit(fsdp_run, tmp_path: Path) -> None:
    plain = _model(True)
    plain.save_pretrained(tmp_path)
    for got in fsdp_run["ranks"]:
        # the weights after the replayed backward: no optimizer step ran, so still the plain ones
        assert_matches_plain(got["stream"], tmp_path, plain)


@pytest.mark.distributed
def test_tensor_parallel_load_records_replays_and_syncs_as_one_process(tp_run) -> None:
    plain = AutoModelForCausalLM.from_pretrained(tp_run["path"])
    ids = _batch(0)
    single = _trace(plain, ids)
    plain.train()
    with replay_routing(plain, tp_run["trace"]):
        loss = _loss(plain, ids)
        loss.backward()
    expected = _router_grads(plain)
    for got in tp_run["ranks"]:
        assert any("q_proj" in n for n in got["sharded"]), got["sharded"][:4]
        assert got["local_q"][0] < plain.model.layers[0].self_attn.q_proj.weight.shape[0]  # really split
        assert len(got["recorded"]) == len(single.layers) > 0
        for lid, (routed, want) in enumerate(zip(got["recorded"], single.layers)):
            assert torch.equal(routed, want), f"layer {lid}"
        assert torch.isfinite(got["loss"]) and torch.isfinite(loss)
        torch.testing.assert_close(got["loss"], loss.detach(), rtol=1e-5, atol=1e-6)
        for name, grad in expected.items():
            assert bool(grad.abs().sum() > 0), name
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)
        assert_matches_plain(got["stream"], tp_run["path"], plain)


@pytest.mark.distributed
def test_tensor_parallel_grafted_load_syncs_the_plain_checkpoint(tp_run) -> None:
    plain = AutoModelForCausalLM.from_pretrained(tp_run["path"])
    for got in tp_run["ranks"]:
        assert_matches_plain(got["grafted_stream"], tp_run["path"], plain)


@pytest.mark.distributed
def test_tensor_parallel_model_refuses_an_in_place_graft(tp_run) -> None:
    plain = AutoModelForCausalLM.from_pretrained(tp_run["path"])
    for got in tp_run["ranks"]:
        kind, message = got.get("in_place_error", ("no error", ""))
        assert kind == "GraftStateError", (kind, message[:300])
        assert "Cannot graft `model.layers.0.self_attn`" in message and "left unchanged" in message, message
        assert got["after_refusal"] == [n for n, _ in plain.named_parameters()]


@pytest.mark.distributed
def test_tensor_parallel_grafted_forward(tp_run) -> None:
    plain = AutoModelForCausalLM.from_pretrained(tp_run["path"])
    expected = _loss(plain, _batch(0)).detach()
    for got in tp_run["ranks"]:
        if "grafted_error" in got:
            pytest.skip(
                "a fused-QKV graft cannot run its forward under transformers tensor parallelism on CPU/gloo: "
                f"its `qkv_proj` has no entry in the model's TP plan, so it gets no TP hooks ({got['grafted_error'][:160]})"
            )
        torch.testing.assert_close(got["grafted_loss"], expected, rtol=1e-5, atol=1e-6)
