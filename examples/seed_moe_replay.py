"""The documentation's "record and replay MoE expert routing" recipe, run on a tiny Qwen3-MoE.

Adapted only where necessary:

* import lines: ``transformers.monkey_patching`` -> ``modelgraft``;
* ``Qwen3MoeConfig(...)`` gets tiny sizes, and ``input_ids`` (left undefined in the docs) is a
  small random batch;
* ``_CAN_RECORD_REGISTRY`` is keyed by the *model* on transformers 5.23: ``.get(model)`` takes one
  argument (the docs' ``.get(str(cls), {})`` raises ``TypeError``) and ``registry[model] = ...``
  stores under ``str(model.__class__)`` itself (the docs' ``registry[str(cls)]`` would store under
  ``"<class 'str'>"``). The two lines below pass the model.

``modelgraft.moe.record_routing`` / ``replay_routing`` do all of this for every MoE family
without a router subclass; the last lines check that both give the same experts.
"""

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY, OutputRecorder

from modelgraft import apply_patches, clear_patch_mapping, register_patch_mapping
from modelgraft.moe import record_routing, replay_routing


class ReplayableQwen3MoeTopKRouter(Qwen3MoeTopKRouter):
    _forced_indices: torch.Tensor | None = None

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states, self.weight)
        router_logits = F.softmax(router_logits, dtype=torch.float, dim=-1)

        if self._forced_indices is not None:
            router_indices = self._forced_indices.to(router_logits.device).long()
            # Megatron-style replay: preserve expert path, recompute current scores
            router_top_value = router_logits.gather(-1, router_indices)
        else:
            router_top_value, router_indices = torch.topk(router_logits, self.top_k, dim=-1)

        if self.norm_topk_prob:
            router_top_value = router_top_value / router_top_value.sum(dim=-1, keepdim=True)
        return router_logits, router_top_value.to(router_logits.dtype), router_indices


@contextmanager
def replay_moe_routing(model, selected_experts_per_layer):
    routers = [m for m in model.modules() if isinstance(m, ReplayableQwen3MoeTopKRouter)]
    if len(routers) != len(selected_experts_per_layer):
        raise ValueError(f"Got {len(routers)} routers but {len(selected_experts_per_layer)} tensors")
    for r, t in zip(routers, selected_experts_per_layer):
        r._forced_indices = t
    try:
        yield
    finally:
        for r in routers:
            r._forced_indices = None


# Swap the router class and construct the model
register_patch_mapping({"Qwen3MoeTopKRouter": ReplayableQwen3MoeTopKRouter})
with apply_patches():
    model = Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=32,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
        )
    ).eval()
torch.manual_seed(0)
with torch.no_grad():
    for router in model.modules():
        if isinstance(router, ReplayableQwen3MoeTopKRouter):
            router.weight.normal_()
input_ids = torch.randint(1, 128, (2, 6))

# Expose `output_selected_experts=True` on the base model by adding an OutputRecorder
# at runtime. Index 2 of the router's tuple output is the expert indices.
inner = model.model
existing = _CAN_RECORD_REGISTRY.get(inner) or {}  # adapted: keyed by the model on transformers 5.23
_CAN_RECORD_REGISTRY[inner] = {  # adapted: stores under str(inner.__class__)
    **existing,
    "selected_experts": OutputRecorder(ReplayableQwen3MoeTopKRouter, index=2),
}

# Record
captured = inner(input_ids=input_ids, output_selected_experts=True)
selected_experts = captured.selected_experts  # tuple of (num_tokens, top_k) LongTensors

# Replay — same expert path regardless of current router weights
with replay_moe_routing(inner, list(selected_experts)):
    outputs = inner(input_ids=input_ids)

# --- not in the documentation: what it printed, and the same with modelgraft.moe -------------------
print(f"recorded {len(selected_experts)} layers of {tuple(selected_experts[0].shape)} expert ids")
print(
    f"replayed output equals recorded: {torch.equal(outputs.last_hidden_state, captured.last_hidden_state)}"
)
with record_routing(inner) as trace:
    ours = inner(input_ids=input_ids)
print(f"modelgraft.moe records the same experts: {all(map(torch.equal, trace, selected_experts))}")
with replay_routing(inner, list(selected_experts)):
    replayed = inner(input_ids=input_ids)
print(
    f"modelgraft.moe replays the recipe's routing bit-identically: {torch.equal(replayed.last_hidden_state, ours.last_hidden_state)}"
)
clear_patch_mapping()
