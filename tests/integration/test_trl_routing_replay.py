"""Routing replay inside TRL's GRPO trainer, end to end on tiny MoE models (issue 20, point 1).

Each test trains a few steps offline and reads, per token, which experts every training forward of
the policy and of the reference model sent it to (forward pre-hooks on the experts), against the
experts the rollout used: the trainer's own ``generate`` (read from the forwards it ran), or the
routed experts the (stand-in) vLLM engine returned. The engine routes differently from the policy
(its routers were moved), so a forward that routed live would be seen. Off, the trainer is TRL's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

trl = pytest.importorskip("trl")

import torch  # noqa: E402
import trl_helpers as th  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from modelgraft.errors import RoutingError  # noqa: E402
from modelgraft.integrations.trl import (  # noqa: E402
    RoutingReplayGRPOTrainer,
    RoutingReplayRLOOTrainer,
    enable_routing_replay,
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("trl-policies")
    return {family: th.checkpoint(root / family, family) for family in ("qwen3_moe", "deepseek_v3")}


def _args(tmp_path: Path, **overrides: Any) -> GRPOConfig:
    """2 optimizer steps over one generation batch of 2 prompts x 4 completions: 2 accumulation
    micro-batches of 4, reused for a second iteration (old-policy log-probs), a reference model (beta)."""
    settings: dict[str, Any] = {
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 4,
        "num_generations": 4,
        "max_completion_length": 5,
        "max_steps": 2,
        "gradient_accumulation_steps": 2,
        "num_iterations": 2,
        "beta": 0.04,
        "learning_rate": 5e-2,
        "logging_steps": 1,
        "report_to": "none",
        "use_cpu": True,
        "save_strategy": "no",
        "seed": 0,
        "dataloader_num_workers": 0,
    }
    settings.update(overrides)
    return GRPOConfig(**settings)


#: TRL's colocate mode writes these for vLLM; left set, the next trainer of the process would start
#: torch.distributed (transformers 4.57 then wraps the model in DistributedDataParallel)
_VLLM_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _trainer(cls: type, path: str, tmp_path: Path, **kwargs: Any) -> Any:
    args = kwargs.pop("args", None) or _args(tmp_path)
    before = {key: os.environ.get(key) for key in _VLLM_ENV}
    try:
        return cls(
            model=path,
            reward_funcs=th.reward,
            args=args,
            train_dataset=th.dataset(),
            processing_class=th.tokenizer(),
            **kwargs,
        )
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _spies(trainer: Any) -> tuple[th.RolloutSpy, th.RolloutSpy]:
    return th.RolloutSpy(trainer.model), th.RolloutSpy(trainer.ref_model)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_hf_generate_routes_are_replayed_in_every_training_forward(
    checkpoints: dict[str, str], tmp_path: Path, family: str
) -> None:
    trainer = _trainer(RoutingReplayGRPOTrainer, checkpoints[family], tmp_path)
    policy, ref = _spies(trainer)
    trainer.train()
    rollouts = policy.generate_rollouts()
    assert len(rollouts) == 8
    checked, _ = th.check_training_forwards(policy, rollouts)  # old policy + 2 x 2 policy micro-batches
    checked_ref, _ = th.check_training_forwards(ref, rollouts)
    train_forwards = [f for f in policy.forwards if f["phase"] == "train"]
    assert len(train_forwards) == 2 + 4  # old-policy log-probs in 2 chunks of 4, then 4 policy forwards
    assert checked > 0 and checked_ref > 0
    # TRL checkpoints by default: each policy forward's layers re-ran in backward, with the same experts
    assert th.recomputes(policy) == 4 * len(policy.names)
    logged = [h for h in trainer.state.log_history if "routing/mismatch_rate" in h]
    assert logged and 0.0 <= logged[0]["routing/mismatch_rate"] <= 1.0
    assert logged[0]["routing/replayed_tokens"] > 0
    policy.close()
    ref.close()


def test_peft_policy_with_trls_generate_replays_exactly(checkpoints: dict[str, str], tmp_path: Path) -> None:
    """``peft_config=...`` (issue 28, point 5): TRL generates through the ``PeftModel`` (its
    ``unwrap_model_for_generation``), the inner model runs; the rollout's routes are laid out per
    sequence and every training forward (LoRA weights moving) replays them."""
    from peft import LoraConfig

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    trainer = _trainer(RoutingReplayGRPOTrainer, checkpoints["qwen3_moe"], tmp_path, peft_config=config)
    assert type(trainer.model).__name__.startswith("PeftModel")
    policy = th.RolloutSpy(trainer.model.get_base_model())
    trainer.train()
    rollouts = policy.generate_rollouts()
    assert len(rollouts) == 8
    checked, _ = th.check_training_forwards(policy, rollouts)
    assert checked > 0
    # old-policy and reference log-probs (the same model, adapters off) in 2 chunks of 4 each, then 4
    # policy forwards: every one of them got the rollout's experts
    assert len([f for f in policy.forwards if f["phase"] == "train"]) == 2 + 2 + 4
    policy.close()


def test_without_replay_the_same_check_sees_live_routing(checkpoints: dict[str, str], tmp_path: Path) -> None:
    """The check can fail: off, the second iteration's forwards (weights moved) route some tokens otherwise."""
    trainer = _trainer(RoutingReplayGRPOTrainer, checkpoints["qwen3_moe"], tmp_path, routing_replay=False)
    policy = th.RolloutSpy(trainer.model)
    trainer.train()
    checked, differing = th.check_training_forwards(policy, policy.generate_rollouts(), expect_forced=False)
    assert checked > 0 and differing > 0
    policy.close()


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_switch_off_is_plain_trl_bit_for_bit(checkpoints: dict[str, str], tmp_path: Path) -> None:
    plain = _trainer(GRPOTrainer, checkpoints["qwen3_moe"], tmp_path / "plain")
    plain.train()
    off = _trainer(RoutingReplayGRPOTrainer, checkpoints["qwen3_moe"], tmp_path / "off", routing_replay=False)
    off.train()
    losses = [[h.get("loss") for h in t.state.log_history] for t in (plain, off)]
    assert losses[0] == losses[1] and any(loss is not None for loss in losses[0])
    a, b = _params(plain.model), _params(off.model)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not any(k.startswith("routing/") for h in off.state.log_history for k in h)


@pytest.mark.parametrize(("mode", "family"), [("colocate", "qwen3_moe"), ("server", "deepseek_v3")])
def test_vllm_routes_are_carried_and_replayed(
    checkpoints: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, family: str
) -> None:
    path = checkpoints[family]
    th.use_fake_vllm(monkeypatch, path)
    args = _args(tmp_path, use_vllm=True, vllm_mode=mode)
    trainer = _trainer(RoutingReplayGRPOTrainer, path, tmp_path, args=args)
    policy, ref = _spies(trainer)
    trainer.train()
    engine = th.FakeLLM.last.engine if mode == "colocate" else trainer.vllm_generation.vllm_client.engine
    rollouts = th.engine_rollouts(engine.outputs, trainer.model)
    assert len(rollouts) == 8
    checked, _ = th.check_training_forwards(policy, rollouts)
    checked_ref, _ = th.check_training_forwards(ref, rollouts)
    assert checked > 0 and checked_ref > 0
    # the engine routes otherwise than the trainer: the logged mismatch says how often
    comparison = trainer.last_routing_comparison
    assert comparison.mismatch_rate > 0
    logged = [h for h in trainer.state.log_history if "routing/mismatch_rate" in h]
    assert logged[0]["routing/mismatch_rate"] == pytest.approx(comparison.mismatch_rate)
    assert 0 < logged[0]["routing/token_mismatch_rate"] <= 1
    policy.close()
    ref.close()


def test_gradient_checkpointing_recomputes_with_the_rollouts_experts(
    checkpoints: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same engine rollouts, with and without checkpointing: the same parameters after 2 steps, bit for bit
    (a recompute that routed live would give other gradients: the engine disagrees with the policy)."""
    path = checkpoints["qwen3_moe"]
    th.use_fake_vllm(monkeypatch, path)
    results = []
    for checkpointing in (False, True):
        args = _args(
            tmp_path / str(checkpointing),
            use_vllm=True,
            vllm_mode="colocate",
            gradient_checkpointing=checkpointing,
        )
        trainer = _trainer(RoutingReplayGRPOTrainer, path, tmp_path, args=args)
        trainer.train()
        results.append(_params(trainer.model))
    assert all(torch.equal(results[0][n], results[1][n]) for n in results[0])


def test_enable_routing_replay_on_a_built_trainer_and_rloo(
    checkpoints: dict[str, str], tmp_path: Path
) -> None:
    trainer = enable_routing_replay(_trainer(GRPOTrainer, checkpoints["qwen3_moe"], tmp_path / "grpo"))
    assert isinstance(trainer, GRPOTrainer) and trainer.routing_replay
    policy = th.RolloutSpy(trainer.model)
    trainer.train()
    th.check_training_forwards(policy, policy.generate_rollouts())
    policy.close()

    from trl import RLOOConfig

    args = RLOOConfig(**{k: v for k, v in _args(tmp_path / "rloo").to_dict().items() if k in _RLOO_KEYS})
    rloo = RoutingReplayRLOOTrainer(
        model=checkpoints["qwen3_moe"],
        reward_funcs=th.reward,
        args=args,
        train_dataset=th.dataset(),
        processing_class=th.tokenizer(),
    )
    policy = th.RolloutSpy(rloo.model)
    rloo.train()
    checked, _ = th.check_training_forwards(policy, policy.generate_rollouts())
    assert checked > 0
    policy.close()


_RLOO_KEYS = {
    "output_dir",
    "per_device_train_batch_size",
    "num_generations",
    "max_completion_length",
    "max_steps",
    "gradient_accumulation_steps",
    "num_iterations",
    "learning_rate",
    "logging_steps",
    "report_to",
    "use_cpu",
    "save_strategy",
    "seed",
}


def test_unsupported_setups_are_refused(checkpoints: dict[str, str], tmp_path: Path) -> None:
    def rollout(prompts: list, trainer: Any) -> dict:
        raise AssertionError("never called")

    with pytest.raises(
        RoutingError, match=r"`rollout_func` is set, and a custom `rollout_func` returns no routes"
    ):
        _trainer(RoutingReplayGRPOTrainer, checkpoints["qwen3_moe"], tmp_path, rollout_func=rollout)
    with pytest.raises(RoutingError, match=r"takes a TRL GRPOTrainer or RLOOTrainer"):
        enable_routing_replay(object())


def test_server_replies_give_one_trace_row_per_choice_in_trls_order() -> None:
    """The prompt rows of a reply sit on each choice (several prompts) or on the reply (one prompt)."""
    from engine_payloads import engine_routes, qwen3_moe, vllm_output, vllm_server_response
    from modelgraft.integrations.trl import _engine_items
    from modelgraft.moe import from_vllm, moe_layers

    model = qwen3_moe(num_hidden_layers=2, dense=())
    prompt, completions = [5, 6, 7], [[9, 10], [11, 12, 13]]
    reply = vllm_server_response(vllm_output(model, prompt, completions))
    for choice in reply["choices"]:  # TRL asks for token ids: each choice names its prompt's
        choice["prompt_token_ids"] = prompt
    trace = from_vllm(_engine_items([reply], 2), model)
    assert trace.batch_size == 2
    for b, completion in enumerate(completions):
        tokens = prompt + completion
        want = engine_routes(model, tokens)
        for layer, rows in zip(moe_layers(model), trace):
            got = rows.reshape(2, -1, 2)[b, : len(tokens) - 1]
            assert torch.equal(got, torch.from_numpy(want[:, layer.layer_id]).long())
    with pytest.raises(RoutingError, match=r"vLLM returned 2 completions with routes but TRL kept 3"):
        _engine_items([reply], 3)
