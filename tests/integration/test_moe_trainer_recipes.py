"""The verl (FSDP actor) and OpenRLHF recipes of docs/moe.md, on the tensors those actors build (issue 20, point 2).

No verl or OpenRLHF is imported; their layouts are rebuilt here from their source (verl 0.9.1
``experimental/agent_loop/agent_loop.py``, ``workers/engine/fsdp/transformer_impl.py``,
``workers/engine/utils.py``; OpenRLHF 0.11.2 ``models/actor.py``, ``models/ring_attn_utils.py``):

* verl's rollout batch: prompts left-padded to the prompt width, responses right-padded,
  ``attention_mask`` over both, ``position_ids = clip(cumsum(mask) - 1, 0)``, and
  ``routed_experts`` ``(bsz, prompt + response, num_hidden_layers, top_k)`` int16, the engine's rows
  (every token but the last) placed from the first real prompt token, zeros elsewhere.
* ``use_remove_padding`` (verl) / ``packing_samples`` (OpenRLHF): each micro-batch's real tokens in
  row-major order as one row ``(1, total_nnz)`` (``unpad_input``), ``position_ids`` restarting per
  sequence, ``cu_seqlens``, ``attention_mask=None``; ulysses / ring attention off.
* micro-batches: consecutive chunks of ``micro_batch_size_per_gpu``, or verl's dynamic batch size,
  which regroups sequences by token budget (``batch_idx_list``).
* OpenRLHF without packing: the padded batch, ``position_ids = cumsum(mask) - 1`` with padding set to 1.

Every forward's experts are read at the experts' input and compared, per real token, to the engine's.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from moe_helpers import ExpertInputs

from engine_payloads import engine_routes, qwen3_moe
from modelgraft.moe import from_vllm, moe_layers, replay_routing

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14], [15, 16, 17, 18]]
TOP_K = 2


@pytest.fixture(scope="module")
def rollout() -> dict[str, Any]:
    """A verl-style rollout batch from an engine whose routers differ from the policy's."""
    policy = qwen3_moe(num_hidden_layers=3, dense=(0,), seed=0)
    engine = qwen3_moe(num_hidden_layers=3, dense=(0,), seed=0)
    with torch.no_grad():
        for layer in moe_layers(engine):
            layer.router.weight.add_(
                torch.randn(layer.router.weight.shape, generator=torch.Generator().manual_seed(3))
            )
    gen = torch.Generator().manual_seed(0)
    responses = [torch.randint(3, 100, (n,), generator=gen).tolist() for n in (4, 2, 5, 3)]
    width_p, width_r = max(map(len, PROMPTS)), max(map(len, responses))
    layers = engine.config.num_hidden_layers
    batch = len(PROMPTS)
    input_ids = torch.zeros(batch, width_p + width_r, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    routed = torch.zeros(batch, width_p + width_r, layers, TOP_K, dtype=torch.int16)
    rows_per_sample = []
    for b, (p, r) in enumerate(zip(PROMPTS, responses)):
        start = width_p - len(p)
        input_ids[b, start:width_p] = torch.tensor(p)
        input_ids[b, width_p : width_p + len(r)] = torch.tensor(r)
        mask[b, start : width_p + len(r)] = 1
        rows = engine_routes(engine, p + r)  # (tokens - 1, num_hidden_layers, top_k), dense layer 0 zeros
        routed[b, start : start + rows.shape[0]] = torch.from_numpy(rows.astype(np.int16))
        rows_per_sample.append(rows)
    position_ids = torch.clip(torch.cumsum(mask, dim=-1) - 1, min=0)
    return {
        "policy": policy,
        "input_ids": input_ids,
        "attention_mask": mask,
        "position_ids": position_ids,
        "routed_experts": routed,
        "engine_rows": rows_per_sample,
    }


def _trace_from_verl_batch(batch: dict[str, Any], model: torch.nn.Module) -> Any:
    """The docs' recipe: verl's padded `routed_experts` -> a trace of the rollout batch."""
    mask = batch["attention_mask"].bool()
    routes = [
        r[m][:-1].numpy() for r, m in zip(batch["routed_experts"], mask)
    ]  # all real tokens but the last
    return from_vllm(routes, model, attention_mask=batch["attention_mask"])


def _unpad(ids: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """``unpad_input`` + ``index_first_axis``: the real tokens, row-major, as one row."""
    keep = mask.bool()
    lengths = keep.sum(-1)
    return {
        "input_ids": ids[keep].unsqueeze(0),
        "position_ids": position_ids[keep].unsqueeze(0),
        "cu_seqlens": torch.nn.functional.pad(lengths.cumsum(0), (1, 0)),
    }


def _check_forward(
    seen: ExpertInputs, rollout: dict[str, Any], sample_ids: list[int], packed: bool, call: int = -1
) -> tuple[int, int]:
    """Per real token but each sequence's last: did the experts get the engine's ids? (checked, differing)."""
    layers = moe_layers(rollout["policy"])
    mask = rollout["attention_mask"][sample_ids]
    checked = differing = 0
    for layer in layers:
        calls = seen.calls[layer.name]
        member = seen.membership(layer.name, calls[call])
        if not packed:
            member = member.reshape(len(sample_ids), mask.shape[1], -1)[mask.bool()]
        offset = 0
        for b, sample in enumerate(sample_ids):
            n = int(mask[b].sum())
            rows = torch.from_numpy(rollout["engine_rows"][sample][:, layer.layer_id].astype(np.int64))
            want = torch.zeros(n - 1, layer.num_experts, dtype=torch.bool).scatter_(1, rows, True)
            same = (member[offset : offset + n - 1] == want).all(-1)
            checked += same.numel()
            differing += int((~same).sum())
            offset += n
    return checked, differing


@pytest.mark.parametrize(
    "micro_batches",
    [[[0, 1], [2, 3]], [[2, 0, 3], [1]]],
    ids=["micro_batch_size_per_gpu", "dynamic_bsz_regrouped"],
)
@pytest.mark.parametrize("replay", [True, False])
def test_verl_remove_padding_actor(
    rollout: dict[str, Any], micro_batches: list[list[int]], replay: bool
) -> None:
    policy = rollout["policy"]
    trace = _trace_from_verl_batch(rollout, policy)
    totals = [0, 0]
    with ExpertInputs(policy) as seen:
        block = replay_routing(policy, trace) if replay else None
        session = block.__enter__() if block is not None else None
        for ids in micro_batches:
            inputs = _unpad(
                rollout["input_ids"][ids], rollout["attention_mask"][ids], rollout["position_ids"][ids]
            )
            assert inputs["input_ids"].shape == (1, int(rollout["attention_mask"][ids].sum()))
            seen.clear()
            step = session.micro_batch(ids, attention_mask=rollout["attention_mask"]) if session else None
            if step is not None:
                step.__enter__()
            out = policy(
                input_ids=inputs["input_ids"],
                attention_mask=None,
                position_ids=inputs["position_ids"],
                use_cache=False,
            )
            out.logits.float().logsumexp(-1).mean().backward()  # the micro-batch's backward inside its block
            if step is not None:
                step.__exit__(None, None, None)
            checked, differing = _check_forward(seen, rollout, ids, packed=True)
            totals[0] += checked
            totals[1] += differing
        if block is not None:
            block.__exit__(None, None, None)
    policy.zero_grad()
    assert totals[0] == sum(int(m.sum()) - 1 for m in rollout["attention_mask"]) * len(moe_layers(policy))
    if replay:
        assert totals[1] == 0, f"{totals[1]} of {totals[0]} token routes are not the engine's"
    else:
        assert totals[1] > 0  # the engine routes otherwise: without replay the check fails


@pytest.mark.parametrize("packing_samples", [True, False])
def test_openrlhf_actor_forward(rollout: dict[str, Any], packing_samples: bool) -> None:
    """OpenRLHF's ``Actor.forward``: packed like verl, or the padded batch with its position ids."""
    policy = rollout["policy"]
    trace = _trace_from_verl_batch(rollout, policy)
    ids, mask = rollout["input_ids"], rollout["attention_mask"]
    with ExpertInputs(policy) as seen, replay_routing(policy, trace) as replay:
        for micro in ([0, 1], [2, 3]):
            seen.clear()
            if packing_samples:
                inputs = _unpad(ids[micro], mask[micro], torch.clip(torch.cumsum(mask[micro], -1) - 1, min=0))
                with replay.micro_batch(micro, attention_mask=mask):
                    policy(
                        input_ids=inputs["input_ids"], position_ids=inputs["position_ids"], use_cache=False
                    )
            else:
                position_ids = mask[micro].long().cumsum(-1) - 1
                position_ids.masked_fill_(mask[micro] == 0, 1)
                with replay.micro_batch(micro):
                    policy(ids[micro], attention_mask=mask[micro], position_ids=position_ids, use_cache=False)
            checked, differing = _check_forward(seen, rollout, micro, packed=packing_samples)
            assert checked > 0 and differing == 0


# ---- the blocks of docs/moe.md, run as written ---------------------------------------------------------
DOC = Path(__file__).resolve().parents[2] / "docs" / "moe.md"
_RECIPE = re.compile(r"<!-- recipe: ([\w-]+) -->\n```python\n(.*?)\n```", re.S)


def _recipes() -> dict[str, str]:
    return dict(_RECIPE.findall(DOC.read_text()))


def test_the_docs_have_both_recipes() -> None:
    # Each recipe block of the page runs in a test: the two trainer recipes here, compare-routing
    # in test_moe_compare_docs.py.
    assert sorted(_recipes()) == ["compare-routing", "openrlhf", "verl"]


@pytest.mark.parametrize("name", ["verl", "openrlhf"])
def test_docs_recipe_replays_the_engines_experts_in_every_micro_batch(
    rollout: dict[str, Any], name: str
) -> None:
    policy = rollout["policy"]
    micro_batches = [[2, 0, 3], [1]]
    namespace: dict[str, Any] = {"batch": dict(rollout), "micro_batches": micro_batches}
    if name == "verl":
        namespace["actor_module"] = policy
    else:
        namespace["actor"] = SimpleNamespace(model=policy)
        namespace["trace"] = _trace_from_verl_batch(rollout, policy)
    with ExpertInputs(policy) as seen:
        exec(compile(_recipes()[name], f"docs/moe.md [{name}]", "exec"), namespace)
    policy.zero_grad()
    total = 0
    for index, ids in enumerate(micro_batches):
        checked, differing = _check_forward(seen, rollout, ids, packed=True, call=index)
        assert differing == 0, (
            f"micro-batch {ids}: {differing} of {checked} token routes are not the engine's"
        )
        total += checked
    assert total == sum(int(m.sum()) - 1 for m in rollout["attention_mask"]) * len(moe_layers(policy))
