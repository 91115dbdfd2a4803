"""Rollout routing replay (R3) end to end: vLLM-style routed experts -> the trainer's padded batch.

No vLLM here: a tiny DeepSeek-V3 (first layer dense, two MoE layers) plays the engine. Its routes
are turned into exactly what vLLM returns with ``enable_return_routed_experts=True``: per request
an ``int32`` array ``(num_tokens - 1, num_hidden_layers, top_k)`` whose dense-layer rows are zeros
and whose last token has no row. The trainer then

1. pads the requests into one batch (left padding here, as many RL trainers do),
2. turns the engine arrays into a ``RoutingTrace`` for that batch with ``from_vllm``,
3. runs a policy-gradient-style step under ``replay_routing`` with weights that moved since the
   rollout, so every token uses the experts it used during generation while the routing weights
   (and their gradients) come from the live router.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from modelgraft.moe import from_vllm, moe_layers, record_routing, replay_routing
from modelgraft.testing import tiny_config

torch.manual_seed(0)
# 8 experts in 4 groups, of which the router keeps 2: DeepSeek-V3's group-limited routing.
config = tiny_config(
    "deepseek_v3", num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, n_group=4, topk_group=2
)
policy = AutoModelForCausalLM.from_config(config).eval()
layers = moe_layers(policy)
print(f"MoE layers: {[layer.layer_id for layer in layers]} of {config.num_hidden_layers} (layer 0 is dense)")


# ---- the "engine": generate, and report routes the way vLLM does --------------------------------
def engine_generate(prompt: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, np.ndarray]:
    tokens = prompt
    for _ in range(new_tokens):
        with torch.no_grad():
            next_token = policy(input_ids=tokens[None], use_cache=False).logits[0, -1].argmax()
        tokens = torch.cat([tokens, next_token[None]])
    # vLLM routes every token that went through the model: all but the last sampled one.
    with torch.no_grad(), record_routing(policy) as trace:
        policy(input_ids=tokens[None, :-1], use_cache=False)
    routed = np.zeros((len(tokens) - 1, config.num_hidden_layers, layers[0].top_k), dtype=np.int32)
    for layer, routes in zip(layers, trace):
        routed[:, layer.layer_id] = routes.numpy()
    return tokens, routed


prompts = [torch.randint(1, 128, (n,)) for n in (4, 6, 3)]
rollouts = [engine_generate(p, new_tokens=3) for p in prompts]
for tokens, routed in rollouts:
    print(f"engine: {len(tokens)} tokens, routed_experts {routed.shape} {routed.dtype}")

# ---- the trainer: pad, convert, replay ---------------------------------------------------------
seq = max(len(t) for t, _ in rollouts)
input_ids = torch.zeros(len(rollouts), seq, dtype=torch.long)
attention_mask = torch.zeros_like(input_ids)
for i, (tokens, _) in enumerate(rollouts):
    input_ids[i, seq - len(tokens) :] = tokens
    attention_mask[i, seq - len(tokens) :] = 1
position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)

routing = from_vllm([routed for _, routed in rollouts], policy, attention_mask=attention_mask)
print(
    f"trace: layers {routing.layer_ids}, {routing.num_tokens} rows each (batch {len(rollouts)} x seq {seq})"
)

# The policy moved since the rollout (an optimizer step happened in between).
with torch.no_grad():
    for layer in layers:
        layer.router.weight.add_(0.5 * torch.randn_like(layer.router.weight))

policy.train()
with replay_routing(policy, routing):
    logits = policy(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logprobs = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, input_ids[:, 1:, None])[..., 0]
    advantages = torch.tensor([1.0, -0.5, 0.25])[:, None]
    loss = -(logprobs * advantages * attention_mask[:, 1:]).sum() / attention_mask[:, 1:].sum()
    loss.backward()

# Real tokens got exactly the engine's experts; padding got valid ids spread over the experts.
flat_mask = attention_mask.reshape(-1).bool()
engine_rows = [torch.from_numpy(r[:, layers[0].layer_id]).long() for _, r in rollouts]
real = routing[0][flat_mask].reshape(-1, layers[0].top_k)
starts = np.cumsum([0] + [len(t) for t, _ in rollouts])
same = all(torch.equal(real[s : s + len(e)], e) for s, e in zip(starts, engine_rows))
print(f"real tokens replay the engine's experts: {same}")
print(f"padding rows use {routing[0][~flat_mask].unique().numel()} distinct experts")
grad = torch.stack([layer.router.weight.grad.norm() for layer in layers])
print(f"router weights received gradients: {bool((grad > 0).all())}")
