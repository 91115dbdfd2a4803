"""How many experts a router selects among, where its family names the count in unusual places.

Shapes of transformers 5.x families that the routing tests found miscounted: DBRX names its expert
count only on the experts module (and a nested config), LongCat-Flash's router names both its experts
and its experts plus "zero" experts, and selects over the latter.
"""

from __future__ import annotations

import torch
from torch import nn

from modelgraft.moe import record_routing, replay_routing
from modelgraft.moe._discovery import find_moe_layers


class DbrxLikeRouter(nn.Module):
    """A router that only scores: a wrapped linear layer, no count attribute (as ``DbrxRouter``)."""

    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__()
        self.layer = nn.Linear(hidden, experts, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


class DbrxLikeExperts(nn.Module):
    """Holds the expert count; returns the indices it is given as floats, so outputs show the routing."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.num_experts = experts

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return index.float() + 0 * weights


class DbrxLikeBlock(nn.Module):
    """Selects in the block with ``top_k``, as ``DbrxFFN`` does."""

    def __init__(self, hidden: int = 4, experts: int = 6) -> None:
        super().__init__()
        self.router, self.experts = DbrxLikeRouter(hidden, experts), DbrxLikeExperts(experts)
        self.top_k = 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, index = torch.topk(self.router(x).softmax(-1), self.top_k, dim=-1)
        return self.experts(x, index, weights)


class LongcatLikeRouter(nn.Module):
    """``num_experts`` real experts, ``n_routed_experts`` = those plus zero experts, the top-k over all."""

    def __init__(self, hidden: int = 4, experts: int = 4, zero: int = 2) -> None:
        super().__init__()
        self.top_k, self.num_experts, self.n_routed_experts = 2, experts, experts + zero
        self.classifier = nn.Linear(hidden, experts + zero, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.topk(self.classifier(x), k=self.top_k, dim=-1)[1]


class LongcatLikeExperts(nn.Module):
    pass


class LongcatLikeBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router, self.experts = LongcatLikeRouter(), LongcatLikeExperts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.router(x)


def _inputs(n: int = 16) -> torch.Tensor:
    return torch.randn(n, 4, generator=torch.Generator().manual_seed(0))


def test_count_named_only_by_the_experts_module_is_found() -> None:
    torch.manual_seed(0)
    block = DbrxLikeBlock(experts=6)
    [layer] = find_moe_layers(block)
    assert (layer.name, layer.top_k, layer.num_experts, layer.scope) == ("router", 2, 6, block)
    x = _inputs()
    with record_routing(block) as trace, torch.no_grad():
        native = block(x)
    forced = (trace.layers[0].long() + 1) % 6
    with replay_routing(block, [forced]), torch.no_grad():
        out = block(x)
    assert torch.equal(native, trace.layers[0].float())
    assert torch.equal(out, forced.float())


def test_a_router_naming_two_counts_selects_over_the_larger() -> None:
    torch.manual_seed(0)
    block = LongcatLikeBlock()
    [layer] = find_moe_layers(block)
    assert (layer.top_k, layer.num_experts) == (2, 6)
    x = _inputs(64)
    with record_routing(block) as trace, torch.no_grad():
        native = block(x)
    assert torch.equal(trace.layers[0].long(), native)
    assert int(native.max()) >= 4  # zero experts (ids 4 and 5) are selected and recorded
    forced = (native + 3) % 6
    with replay_routing(block, [forced]), torch.no_grad():
        assert torch.equal(block(x), forced)
