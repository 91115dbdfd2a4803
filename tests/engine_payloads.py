"""Tiny MoE models, and engine output built exactly as the engines' own code builds it (no engine is installed).

Sources read (field names, dtypes, row semantics):

* vLLM ``vllm/outputs.py`` (vllm-project/vllm 003d3ee2 for ``CompletionOutput``; the current
  ``RequestOutput`` signature with ``prompt_routed_experts: np.ndarray | None`` from the API page
  docs.vllm.ai/en/latest/api/vllm/outputs): ``CompletionOutput.routed_experts`` is
  ``np.ndarray | None  # [seq_len,layer_num,topk]``; current releases give the prompt rows in
  ``RequestOutput.prompt_routed_experts`` and the generated rows (all but the last token, which never
  ran through the model) in ``CompletionOutput.routed_experts``, ``int16``.
* vLLM ``vllm/model_executor/layers/fused_moe/routed_experts_capturer.py`` (42fa4c09): the capture
  buffer is ``torch.zeros((tokens, hf_text_config.num_hidden_layers, num_experts_per_tok), int32)``
  and only MoE layers ``capture(layer_id, topk_ids)``, so dense layers stay 0; ``num_tokens - 1`` rows.
* vLLM server: each choice's ``routed_experts`` and the response's ``prompt_routed_experts`` are
  base64 of ``np.save(buffer, array, allow_pickle=False)`` (vllm-project/router #184, verifiers #1363);
  token ids come with ``return_token_ids`` (``prompt_token_ids``, ``choices[i].token_ids``).
* SGLang ``python/sglang/srt/layers/moe/routed_experts_capturer.py`` (sgl-project/sglang d4d0fc58 and
  the wire-dtype version with ``SGLANG_ROUTED_EXPERTS_DTYPE``): ``get_routed_experts`` returns the host
  rows of ``req_to_token[: seqlen - 1]`` (int32), ``encode_routed_experts_for_wire`` sends
  ``base64(flat.astype(wire_dtype).tobytes())`` with ``meta_info["routed_experts_dtype"]`` in
  {int32, uint16, uint8}; ``GenerateReqInput.routed_experts_start_len`` (io_struct.py): "response covers
  ``[routed_experts_start_len, seqlen - 1)``".
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from modelgraft._families import ROUTING_SIZES
from modelgraft.moe import moe_layers, record_routing


def qwen3_moe(num_hidden_layers: int = 3, dense: tuple[int, ...] = (0,), seed: int = 0, **overrides: Any):
    """A tiny Qwen3-MoE (8 experts, top-2) whose layers ``dense`` are dense MLPs."""
    profile = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "moe_intermediate_size",
        "num_attention_heads",
    )
    profile += ("num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok", "pad_token_id")
    sizes = {name: ROUTING_SIZES[name] for name in profile}  # the family table's routing profile
    sizes |= {
        "num_hidden_layers": num_hidden_layers,
        "mlp_only_layers": list(dense),
        "max_position_embeddings": 128,
    }
    sizes.update(overrides)
    config = AutoConfig.for_model("qwen3_moe", **sizes)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # spread the router's scores so that routing depends on the tokens
        for layer in moe_layers(model):
            layer.router.weight.normal_(std=0.5)
    return model


def engine_routes(model: torch.nn.Module, tokens: list[int]) -> np.ndarray:
    """What the capturer holds for a request of ``tokens``: ``(len(tokens) - 1, num_hidden_layers, top_k)``
    int32, dense layers 0 (the engine forwards every token but the last sampled one)."""
    layers = moe_layers(model)
    with torch.no_grad(), record_routing(model) as trace:
        model(input_ids=torch.tensor([tokens[:-1]]), use_cache=False)
    routes = np.zeros((len(tokens) - 1, model.config.num_hidden_layers, layers[0].top_k), dtype=np.int32)
    for layer, rows in zip(layers, trace):
        routes[:, layer.layer_id] = rows.numpy()
    return routes


# ---- vLLM offline objects (vllm/outputs.py) ---------------------------------------------------------
@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: Any
    routed_experts: np.ndarray | None = None  # [seq_len,layer_num,topk]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: Any = None


class RequestOutput:
    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        prompt_logprobs: Any,
        outputs: list[CompletionOutput],
        finished: bool,
        metrics: Any = None,
        lora_request: Any = None,
        encoder_prompt: str | None = None,
        encoder_prompt_token_ids: list[int] | None = None,
        num_cached_tokens: int | None = None,
        *,
        kv_transfer_params: dict[str, Any] | None = None,
        prompt_routed_experts: np.ndarray | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.prompt_logprobs = prompt_logprobs
        self.outputs = outputs
        self.finished = finished
        self.metrics = metrics
        self.lora_request = lora_request
        self.encoder_prompt = encoder_prompt
        self.encoder_prompt_token_ids = encoder_prompt_token_ids
        self.num_cached_tokens = num_cached_tokens
        self.kv_transfer_params = kv_transfer_params
        self.prompt_routed_experts = prompt_routed_experts


def vllm_output(
    model: torch.nn.Module,
    prompt: list[int],
    completions: list[list[int]],
    *,
    split: bool = True,
    cached: int = 0,
    prompt_start: int = 0,
) -> RequestOutput:
    """A ``RequestOutput`` for ``prompt`` and its ``completions`` (n > 1 sampling when several).

    ``split``: current layout (``prompt_routed_experts`` + int16 generated rows) or the older one
    (every row, int32, on the completion). ``cached``: leading prompt tokens served from the prefix
    cache (rows of -1). ``prompt_start``: ``SamplingParams.routed_experts_prompt_start``.
    """
    outputs, prompt_rows = [], None
    for index, generated in enumerate(completions):
        routes = engine_routes(model, prompt + generated)
        routes[:cached] = -1
        if split:
            prompt_rows = routes[prompt_start : len(prompt)].astype(np.int16)
            rows = routes[len(prompt) :].astype(np.int16)
        else:
            rows = routes[prompt_start:]
        outputs.append(
            CompletionOutput(
                index, "", list(generated), None, None, routed_experts=rows, finish_reason="length"
            )
        )
    return RequestOutput(
        f"req-{prompt[0]}",
        None,
        list(prompt),
        None,
        outputs,
        True,
        num_cached_tokens=cached,
        prompt_routed_experts=prompt_rows,
    )


def npy_base64(array: np.ndarray) -> str:
    """How vLLM's server encodes routed experts: base64 of an ``np.save`` file."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode()


def vllm_server_response(output: RequestOutput) -> dict[str, Any]:
    """The JSON body of ``/v1/completions`` with ``return_token_ids`` for that request output."""
    return {
        "id": f"cmpl-{output.request_id}",
        "object": "text_completion",
        "model": "tiny",
        "prompt_token_ids": output.prompt_token_ids,
        "prompt_routed_experts": None
        if output.prompt_routed_experts is None
        else npy_base64(output.prompt_routed_experts),
        "choices": [
            {
                "index": c.index,
                "text": c.text,
                "token_ids": c.token_ids,
                "routed_experts": None if c.routed_experts is None else npy_base64(c.routed_experts),
                "finish_reason": c.finish_reason,
                "logprobs": None,
            }
            for c in output.outputs
        ],
        "usage": {"prompt_tokens": len(output.prompt_token_ids or [])},
    }


# ---- SGLang /generate ---------------------------------------------------------------------------------
def sglang_response(
    model: torch.nn.Module,
    prompt: list[int],
    completion: list[int],
    *,
    wire: str = "int32",
    start_len: int = 0,
) -> dict[str, Any]:
    """The JSON body of SGLang's ``/generate`` with ``return_routed_experts``."""
    routes = engine_routes(model, prompt + completion)[start_len:]
    meta: dict[str, Any] = {
        "id": f"gen-{prompt[0]}",
        "prompt_tokens": len(prompt),
        "completion_tokens": len(completion),
        "cached_tokens": 0,
        "finish_reason": {"type": "length", "length": len(completion)},
        "routed_experts": base64.b64encode(routes.reshape(-1).astype(wire).tobytes()).decode("utf-8"),
    }
    if wire != "int32":
        meta["routed_experts_dtype"] = wire
    if start_len:
        meta["routed_experts_start_len"] = start_len
    return {"text": "", "output_ids": list(completion), "meta_info": meta}


# ---- stand-ins for the engines, for the docs examples ---------------------------------------------
def _complete(model: torch.nn.Module, prompt: list[int], max_tokens: int, seed: int) -> list[int]:
    """``max_tokens`` tokens sampled from ``model`` after ``prompt`` (what the engine generates)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0, -1]
            logits[0] = float("-inf")  # never the pad token, so every completion has max_tokens tokens
            tokens.append(int(torch.multinomial(logits.softmax(-1), 1, generator=generator)))
    return tokens[len(prompt) :]


@dataclass
class SamplingParams:
    """vLLM's ``SamplingParams``, the fields the examples use."""

    max_tokens: int = 16
    n: int = 1
    temperature: float = 1.0
    routed_experts_prompt_start: int = 0


class FakeLLM:
    """vLLM's offline ``LLM`` serving ``model``: ``generate`` returns ``RequestOutput`` objects as vLLM builds them."""

    def __init__(self, policy: torch.nn.Module, enable_return_routed_experts: bool = False, **_: Any) -> None:
        self.model, self.routed = policy, enable_return_routed_experts

    def generate(
        self, prompts: list[dict[str, list[int]]], sampling_params: SamplingParams
    ) -> list[RequestOutput]:
        outputs = []
        for i, prompt in enumerate(prompts):
            ids = list(prompt["prompt_token_ids"])
            completions = [
                _complete(self.model, ids, sampling_params.max_tokens, seed=100 * i + j)
                for j in range(sampling_params.n)
            ]
            out = vllm_output(
                self.model, ids, completions, prompt_start=sampling_params.routed_experts_prompt_start
            )
            if not self.routed:
                out.prompt_routed_experts = None
                for completion in out.outputs:
                    completion.routed_experts = None
            outputs.append(out)
        return outputs


def fake_vllm_module(model: torch.nn.Module) -> Any:
    """A ``vllm`` module whose ``LLM(...)`` serves ``model`` (whatever model path it is given)."""
    import types

    module = types.ModuleType("vllm")
    module.LLM = lambda *args, **kwargs: FakeLLM(model, **kwargs)
    module.SamplingParams = SamplingParams
    return module


def fake_post_json(model: torch.nn.Module) -> Any:
    """``post_json(url, body)``: vLLM's ``/v1/completions`` and SGLang's ``/generate`` serving ``model``."""

    def post_json(url: str, body: dict[str, Any]) -> Any:
        if url.endswith("/v1/completions"):
            prompt = list(body["prompt"])
            completions = [
                _complete(model, prompt, body.get("max_tokens", 16), seed=j + prompt[0])
                for j in range(body.get("n", 1))
            ]
            reply = vllm_server_response(vllm_output(model, prompt, completions))
            if not body.get("return_token_ids"):
                del reply["prompt_token_ids"]
                for choice in reply["choices"]:
                    del choice["token_ids"]
            return reply
        if url.endswith("/generate"):
            batch = body["input_ids"]
            single = bool(batch) and isinstance(batch[0], int)
            replies = []
            for i, prompt in enumerate([batch] if single else batch):
                completion = _complete(model, list(prompt), body["sampling_params"]["max_new_tokens"], seed=i)
                reply = sglang_response(model, list(prompt), completion)
                if not body.get("return_routed_experts"):
                    del reply["meta_info"]["routed_experts"]
                replies.append(reply)
            return replies[0] if single else replies
        raise ValueError(f"no such endpoint in the stand-in server: {url}")

    return post_json
