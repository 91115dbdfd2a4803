"""Offline pieces for the TRL routing-replay tests: tokenizer, data, tiny MoE checkpoints, vLLM stand-ins
and a spy that reads, per token, which experts every forward of the policy sent it to.

The vLLM stand-ins return what vLLM returns, built by ``engine_payloads`` (``RequestOutput`` with
``prompt_routed_experts`` and int16 ``routed_experts``; the server's base64 ``.npy`` fields), with the
sampled tokens' log-probs in vLLM's shapes (offline: one ``{token_id: Logprob}`` dict per token;
server: ``tokens`` / ``token_logprobs`` / ``top_logprobs`` with ``token_id:<id>`` keys, as TRL asks
with ``return_tokens_as_token_ids``). The engine is a copy of the policy whose routers were moved, so
it routes some tokens differently from the trainer: replay is then visible in the experts' inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from datasets import Dataset
from moe_helpers import ExpertInputs
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from engine_payloads import CompletionOutput, RequestOutput, engine_routes, npy_base64, qwen3_moe
from modelgraft.moe import moe_layers
from modelgraft.testing import tiny_config

VOCAB = 128
EOS = 1


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``w3 .. w127`` (0 pad, 1 eos, 2 unk), built without the hub."""
    words = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(3, VOCAB)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def dataset() -> Dataset:
    """Prompts of different lengths (left padding matters)."""
    return Dataset.from_dict({"prompt": ["w3 w4 w5", "w6 w7", "w8 w9 w10 w11 w12", "w13"]})


def reward(completions: list[str], **_: Any) -> list[float]:
    """More ``w5`` and longer completions score higher (any signal will do)."""
    return [float(c.count("w5")) + 0.1 * len(c.split()) for c in completions]


def _spread_routers(model: torch.nn.Module, seed: int, std: float = 0.5) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in moe_layers(model):
            for tensor in [*layer.router.parameters(), *layer.router.buffers()]:
                if tensor.is_floating_point():
                    tensor.copy_(torch.randn(tensor.shape, generator=gen) * std)


def checkpoint(folder: Path, family: str) -> str:
    """Save a tiny ``family`` MoE and the tokenizer to ``folder``: ``qwen3_moe`` (8 experts, top-2) or
    ``deepseek_v3`` (8 experts in 4 groups, 2 groups kept, top-2, one dense layer first)."""
    if family == "qwen3_moe":
        model = qwen3_moe(num_hidden_layers=2, dense=())
    else:
        config = tiny_config(
            "deepseek_v3",
            vocab_size=VOCAB,
            num_hidden_layers=3,
            n_routed_experts=8,
            n_group=4,
            topk_group=2,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            pad_token_id=0,
        )
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        _spread_routers(model, seed=1)
    model.config.eos_token_id = EOS
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = EOS
    model.save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return str(folder)


# ---- vLLM stand-ins -----------------------------------------------------------------------------------
@dataclass
class Logprob:
    """vLLM's ``Logprob`` (``vllm/logprobs.py``)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class SamplingParams:
    """vLLM's ``SamplingParams``: keeps whatever TRL passes."""

    def __init__(self, **kwargs: Any) -> None:
        self.n = kwargs.pop("n", 1)
        self.max_tokens = kwargs.pop("max_tokens", 16)
        self.kwargs = kwargs


class Engine:
    """The engine's model: the policy with its routers moved (seed 7), sampling with its own seed."""

    def __init__(self, path: str) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(path).eval()
        _spread_routers(self.model, seed=7, std=0.5)
        self.calls = 0
        self.outputs: list[RequestOutput] = []  # every RequestOutput returned, for the tests' reference

    def sample(self, prompt: list[int], max_tokens: int, seed: int) -> tuple[list[int], list[float]]:
        generator = torch.Generator().manual_seed(seed)
        tokens, logprobs = list(prompt), []
        with torch.no_grad():
            for _ in range(max_tokens):
                logits = self.model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0, -1]
                logits[0] = float("-inf")  # never the pad token
                probs = logits.log_softmax(-1)
                token = int(torch.multinomial(probs.exp(), 1, generator=generator))
                tokens.append(token)
                logprobs.append(float(probs[token]))
                if token == EOS:
                    break
        return tokens[len(prompt) :], logprobs

    def request(self, prompt: list[int], n: int, max_tokens: int) -> RequestOutput:
        """One request as vLLM returns it: prompt rows + each completion's rows (int16), log-probs."""
        self.calls += 1
        outputs, prompt_rows = [], None
        for j in range(n):
            completion, lps = self.sample(prompt, max_tokens, seed=1000 * self.calls + j)
            routes = engine_routes(self.model, prompt + completion)  # (tokens - 1, layers, top_k)
            prompt_rows = routes[: len(prompt)].astype(np.int16)
            out = CompletionOutput(
                j, "", completion, sum(lps), None, routed_experts=routes[len(prompt) :].astype(np.int16)
            )
            out.logprobs = [{t: Logprob(lp, 1)} for t, lp in zip(completion, lps)]
            outputs.append(out)
        result = RequestOutput(
            f"req-{self.calls}", None, list(prompt), None, outputs, True, prompt_routed_experts=prompt_rows
        )
        self.outputs.append(result)
        return result


class FakeLLM:
    """``vllm.LLM`` in TRL's colocate mode; refuses to run unless routed experts were asked for."""

    last: FakeLLM | None = None

    def __init__(self, model: str, enable_return_routed_experts: bool = False, **_: Any) -> None:
        assert enable_return_routed_experts, "TRL's LLM was built without enable_return_routed_experts=True"
        self.engine = Engine(model)
        FakeLLM.last = self

    def generate(
        self, prompts: list[dict[str, Any]], sampling_params: SamplingParams, use_tqdm: bool = False
    ) -> list:
        return [
            self.engine.request(list(p["prompt_token_ids"]), sampling_params.n, sampling_params.max_tokens)
            for p in prompts
        ]


def server_client_class(path: str) -> type:
    """TRL's ``VLLMClient`` talking to a stand-in ``/v1/completions`` (TRL's own ``generate`` code runs)."""
    from trl.generation.vllm_client import VLLMClient

    class FakeClient(VLLMClient):
        last: Any = None

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.engine = Engine(path)
            self.model = "tiny"
            self.base_url = "http://stand-in:8000"
            FakeClient.last = self

        def init_communicator(self, *args: Any, **kwargs: Any) -> None:
            pass

        def get_server_info(self) -> dict[str, Any]:
            return {"model_config": {"logprobs_mode": "processed_logprobs"}}

        def _post(self, url: str, **kwargs: Any) -> Any:
            body = kwargs["json"]
            assert url.endswith("/v1/completions") and body["return_token_ids"], (url, body)
            choices = []
            for prompt in body["prompt"]:
                out = self.engine.request(list(prompt), body["n"], body["max_tokens"])
                for c in out.outputs:
                    choices.append(
                        {
                            "index": len(choices),
                            "text": "",
                            "prompt_token_ids": out.prompt_token_ids,
                            "prompt_routed_experts": npy_base64(out.prompt_routed_experts),
                            "token_ids": c.token_ids,
                            "routed_experts": npy_base64(c.routed_experts),
                            "logprobs": {
                                "tokens": [f"token_id:{t}" for t in c.token_ids],
                                "token_logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
                                "top_logprobs": [
                                    {f"token_id:{t}": lp[t].logprob} for t, lp in zip(c.token_ids, c.logprobs)
                                ],
                            },
                            "finish_reason": "stop" if c.token_ids[-1] == EOS else "length",
                        }
                    )
            return {"id": "cmpl-1", "object": "text_completion", "model": "tiny", "choices": choices}

    return FakeClient


def use_fake_vllm(monkeypatch: Any, path: str) -> None:
    """Make TRL's vLLM generation run on the stand-ins (both modes), with weight sync a no-op."""
    from trl.generation import vllm_generation

    monkeypatch.setattr(vllm_generation, "is_vllm_available", lambda: True)
    monkeypatch.setattr(vllm_generation, "LLM", FakeLLM, raising=False)
    monkeypatch.setattr(vllm_generation, "SamplingParams", SamplingParams, raising=False)
    monkeypatch.setattr(vllm_generation, "VLLMClient", server_client_class(path))
    monkeypatch.setattr(vllm_generation.VLLMGeneration, "sync_weights", lambda self: None)


# ---- what the experts received, per token -----------------------------------------------------------------
class RolloutSpy:
    """Per forward of ``model``: its input ids and mask, and which experts each token went to, per MoE layer.

    Forwards run inside ``model.generate`` are the rollout's; the others are training forwards.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.experts = ExpertInputs(model).__enter__()
        self.names = [layer.name for layer in self.experts.layers]
        self.forwards: list[dict[str, Any]] = []
        self.generations: list[dict[str, Any]] = []
        self._phase = "train"
        self._depth = 0
        self._handles = [
            model.register_forward_pre_hook(self._pre, with_kwargs=True),
            model.register_forward_hook(self._post),
            # a forward of the decoder alone (the integration's mismatch measurement) is a forward too
            model.get_decoder().register_forward_pre_hook(self._decoder_pre),
        ]
        original = model.generate

        def generate(*args: Any, **kwargs: Any) -> Any:
            self._phase, start = "generate", len(self.forwards)
            try:
                out = original(*args, **kwargs)
            finally:
                self._phase = "train"
            self.generations.append({"forwards": self.forwards[start:], "kwargs": kwargs, "out": out})
            return out

        model.generate = generate

    def _post(self, module: Any, args: tuple, output: Any) -> None:
        self._depth -= 1

    def _decoder_pre(self, module: Any, args: tuple) -> None:
        if self._depth == 0:
            names = self.names
            self.forwards.append(
                {
                    "phase": "other",
                    "input_ids": None,
                    "attention_mask": None,
                    "call": {n: len(self.experts.calls[n]) for n in names},
                }
            )

    def _pre(self, module: Any, args: tuple, kwargs: dict) -> None:
        self._depth += 1
        ids = kwargs.get("input_ids", args[0] if args else None)
        # TRL's log-prob forwards pass `fused_lm_head`; a forward without it (the mismatch measurement
        # of the integration, routed live on purpose) is not a training forward.
        phase = self._phase if self._phase == "generate" or kwargs.get("fused_lm_head") else "other"
        self.forwards.append(
            {
                "phase": phase,
                "input_ids": ids.detach().clone(),
                "attention_mask": kwargs.get("attention_mask"),
                "call": {name: len(self.experts.calls[name]) for name in self.names},
            }
        )

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self.experts.__exit__()
        del self.model.generate

    def membership(self, forward: dict[str, Any], name: str) -> torch.Tensor:
        """``(batch, seq, experts)`` bool: the experts each token of ``forward`` went to in layer ``name``."""
        call = self.experts.calls[name][forward["call"][name]]
        return self.experts.membership(name, call).reshape(*forward["input_ids"].shape, -1)

    # The rollouts: per completion, its real tokens and the experts of those the model routed.
    def generate_rollouts(self) -> list[tuple[tuple[int, ...], dict[str, torch.Tensor]]]:
        """From the forwards ``generate`` ran: the left-padded prompt forward, then one token per step."""
        rollouts = []
        for gen in self.generations:
            forwards = gen["forwards"]
            prompt_mask = gen["kwargs"]["attention_mask"]
            sequences = gen["out"]
            width = prompt_mask.shape[1]
            routed = {
                name: torch.cat([self.membership(f, name) for f in forwards], dim=1) for name in self.names
            }
            for b in range(sequences.shape[0]):
                row = sequences[b].tolist()
                real = [j for j in range(width) if prompt_mask[b, j]]
                for j in range(width, len(row)):
                    real.append(j)
                    if row[j] == EOS:
                        break
                tokens = tuple(row[j] for j in real)
                seen = [j for j in real if j < routed[self.names[0]].shape[1]]
                rollouts.append((tokens, {name: routed[name][b, seen] for name in self.names}))
        return rollouts


def engine_rollouts(
    outputs: list[RequestOutput], model: torch.nn.Module
) -> list[tuple[tuple[int, ...], dict[str, torch.Tensor]]]:
    """Per completion of the engine: its tokens and, for all but the last, the experts vLLM reported."""
    layers = moe_layers(model)
    rollouts = []
    for out in outputs:
        for c in out.outputs:
            rows = np.concatenate([out.prompt_routed_experts, c.routed_experts]).astype(np.int64)
            member = {}
            for layer in layers:
                ids = torch.from_numpy(rows[:, layer.layer_id])
                member[layer.name] = torch.zeros(ids.shape[0], layer.num_experts, dtype=torch.bool).scatter_(
                    1, ids, True
                )
            rollouts.append((tuple(out.prompt_token_ids) + tuple(c.token_ids), member))
    return rollouts


def recomputes(spy: RolloutSpy) -> int:
    """Layer calls gradient checkpointing re-ran during backward; each must route as its forward did."""
    count = 0
    for i, forward in enumerate(spy.forwards):
        for name in spy.names:
            calls = spy.experts.calls[name]
            end = spy.forwards[i + 1]["call"][name] if i + 1 < len(spy.forwards) else len(calls)
            first = spy.experts.membership(name, calls[forward["call"][name]])
            for again in calls[forward["call"][name] + 1 : end]:
                assert torch.equal(spy.experts.membership(name, again), first), (
                    f"{name}: a recompute routed otherwise"
                )
                count += 1
    return count


def check_training_forwards(
    spy: RolloutSpy, rollouts: list, *, expect_forced: bool = True
) -> tuple[int, int]:
    """For every training forward, every real token with a rollout route: did its experts equal the rollout's?

    Returns ``(checked tokens x layers, differing)``; with ``expect_forced`` any difference fails.
    """
    by_tokens: dict[tuple[int, ...], list[dict[str, torch.Tensor]]] = {}
    for tokens, member in rollouts:
        by_tokens.setdefault(tokens, []).append(member)
    checked = differing = 0
    forwards = [f for f in spy.forwards if f["phase"] == "train"]
    assert forwards, "no training forward ran"
    for forward in forwards:
        ids, mask = forward["input_ids"], forward["attention_mask"]
        got = {name: spy.membership(forward, name) for name in spy.names}
        for row in range(ids.shape[0]):
            real = mask[row].nonzero().reshape(-1)
            tokens = tuple(ids[row, real].tolist())
            candidates = by_tokens.get(tokens)
            assert candidates, f"training row {tokens} is no rollout's completion"
            best = None
            for member in candidates:
                n = member[spy.names[0]].shape[0]
                diff = sum(
                    int((got[name][row, real[:n]] != member[name]).any(-1).sum()) for name in spy.names
                )
                best = diff if best is None else min(best, diff)
                count = n * len(spy.names)
            checked += count
            differing += best
    if expect_forced:
        assert differing == 0, f"{differing} of {checked} token routes differ from the rollout's"
    return checked, differing
