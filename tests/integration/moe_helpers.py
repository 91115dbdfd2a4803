"""What the experts of each MoE layer actually receive, for the record/replay integration tests.

Checking the logits alone cannot tell "the forced experts ran" from "the native experts ran and
happened to give similar numbers", so the tests look at the experts' inputs through forward
pre-hooks. Families hand experts their tokens in three ways, and each is read as it comes:

* ``ids``: the experts module is called with the ``(tokens, top_k)`` expert ids (transformers 5.x
  fused experts, GPT-OSS on 4.57). Compared to the trace exactly, order included.
* ``rows``: each expert gets the hidden-state rows of its tokens (4.57 ``ModuleList`` experts, or a
  ``ParallelExperts`` module given rows sorted by expert and their counts). Compared as the multiset
  of rows each expert got against the rows of the tokens the trace sends to it.
* ``dense``: Llama 4 gives every expert every token scaled by its routing score, zero when the
  expert is not selected; the non-zero rows are the selection.

Example::

    with ExpertInputs(model) as received, replay_routing(model, trace):
        model(input_ids=ids)
    received.assert_matches(trace)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from modelgraft.moe import moe_layers


@dataclass
class _Call:
    """What one layer's experts got during one call of its routing scope."""

    hidden: torch.Tensor  # (tokens, hidden): the rows experts take their inputs from
    ids: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    rows: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    dense: torch.Tensor | None = None  # (tokens, experts) bool


def _values(args: tuple, kwargs: dict) -> list[Any]:
    return [*args, *kwargs.values()]


class ExpertInputs:
    """Forward pre-hooks on the experts of every MoE layer; a context manager that removes them."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = moe_layers(model)
        self.calls: dict[str, list[_Call]] = {layer.name: [] for layer in self.layers}
        self.expert_count: dict[str, int] = {}
        self.unseen: list[str] = []
        self._handles: list[Any] = []
        self._model = model

    def __enter__(self) -> ExpertInputs:
        for layer in self.layers:
            holder = self._holder(layer)
            children = list(holder.named_children())
            experts = [m for n, m in children if n == "experts"] or [
                m for n, m in children if "Expert" in type(m).__name__ and "shared" not in n.lower()
            ]
            if not experts:
                self.unseen.append(layer.name)
                continue
            self._hook(layer, experts[0])
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def clear(self) -> None:
        """Forget what was seen."""
        for calls in self.calls.values():
            calls.clear()

    def _holder(self, layer: Any) -> nn.Module:
        if layer.scope is not layer.router:
            return layer.scope
        parent = layer.name.rpartition(".")[0]
        return self._model.get_submodule(parent) if parent else self._model

    def _hook(self, layer: Any, experts: nn.Module) -> None:
        name, k, num_experts = layer.name, layer.top_k, layer.num_experts
        count = getattr(experts, "num_experts", None)
        self.expert_count[name] = count if isinstance(count, int) else num_experts
        calls = self.calls[name]

        # The routing scope sees the tokens the experts take their rows from (the router's input, or
        # the MoE block's where the block selects); a block may call its experts outside `forward`.
        def scope_pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
            hidden = next(t for t in _values(args, kwargs) if isinstance(t, torch.Tensor))
            calls.append(_Call(hidden.detach().reshape(-1, hidden.shape[-1]).clone()))

        self._handles.append(layer.scope.register_forward_pre_hook(scope_pre, with_kwargs=True))

        if isinstance(experts, nn.ModuleList):
            for index, expert in enumerate(experts):

                def expert_pre(module: nn.Module, args: tuple, kwargs: dict, index: int = index) -> None:
                    rows = next(t for t in _values(args, kwargs) if isinstance(t, torch.Tensor))
                    calls[-1].rows.setdefault(index, []).append(
                        rows.detach().reshape(-1, rows.shape[-1]).clone()
                    )

                self._handles.append(expert.register_forward_pre_hook(expert_pre, with_kwargs=True))
            return

        def experts_pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
            values = _values(args, kwargs)
            tensors = [t for t in values if isinstance(t, torch.Tensor)]
            call = calls[-1]
            ids = [t for t in tensors if not t.is_floating_point() and t.dim() >= 2 and t.shape[-1] == k]
            if ids:
                weights = [t for t in tensors if t.is_floating_point() and t.shape == ids[0].shape]
                call.ids = ids[0].detach().reshape(-1, k).long().clone()
                call.weights = weights[0].detach().reshape(-1, k).clone() if weights else None
                return
            sizes = [v for v in values if isinstance(v, (list, tuple)) and len(v) == num_experts]
            inputs = tensors[0].detach()
            if sizes:  # ParallelExperts: rows sorted by expert, with the count per expert
                for index, chunk in enumerate(inputs.reshape(-1, inputs.shape[-1]).split(list(sizes[0]))):
                    call.rows.setdefault(index, []).append(chunk.clone())
                return
            per_expert = inputs.reshape(num_experts, -1, inputs.shape[-1])
            call.dense = (per_expert.abs().sum(-1) != 0).T.clone()

        self._handles.append(experts.register_forward_pre_hook(experts_pre, with_kwargs=True))

    def membership(self, name: str, call: _Call) -> torch.Tensor:
        """``(tokens, experts)`` bool: which experts each token went to in ``call`` (any mode)."""
        experts = self.expert_count[name]
        tokens = call.hidden.shape[0]
        if call.ids is not None:
            routed = torch.zeros(tokens, experts + 1, dtype=torch.bool)
            return routed.scatter_(1, call.ids.clamp(max=experts), True)[:, :experts]
        if call.dense is not None:
            return call.dense
        routed = torch.zeros(tokens, experts, dtype=torch.bool)
        for expert, chunks in call.rows.items():
            for row in torch.cat(chunks):
                match = (call.hidden == row).all(-1)
                assert match.any(), f"{name}: expert {expert} got a row no token has"
                routed[:, expert] |= match
        return routed

    def assert_matches(self, routing: Any) -> None:
        """The experts of every layer got exactly ``routing`` (a trace or a list of tensors) in the
        one forward run inside the block (or since :meth:`clear`)."""
        assert not self.unseen, f"no experts module found next to {self.unseen}"
        for layer, expected in zip(self.layers, routing, strict=True):
            expected = expected.long()
            calls = self.calls[layer.name]
            assert len(calls) == 1, f"{layer.name}: one forward expected, saw {len(calls)}"
            call = calls[0]
            assert call.hidden.shape[0] == expected.shape[0], (layer.name, call.hidden.shape, expected.shape)
            if call.ids is not None:
                got = call.ids
                assert got.shape == expected.shape, (layer.name, got.shape, expected.shape)
                # A router that can pick a "skip" class beyond the real experts (ZAYA) hands it to the
                # experts as some id with weight zero; every other slot must be the forced id.
                skip = expected >= self.expert_count[layer.name]
                assert torch.equal(got[~skip], expected[~skip]), (
                    f"{layer.name}: experts got other ids than forced"
                )
                if skip.any():
                    assert call.weights is not None and bool((call.weights[skip] == 0).all()), layer.name
                continue
            routed_to = torch.zeros(expected.shape[0], layer.num_experts, dtype=torch.bool)
            routed_to.scatter_(1, expected, True)
            if call.dense is not None:
                assert torch.equal(call.dense, routed_to), f"{layer.name}: experts got other tokens"
                continue
            assert call.rows, f"{layer.name}: its experts never ran"
            for expert in range(layer.num_experts):
                chunks = call.rows.get(expert, [])
                got = _multiset(torch.cat(chunks) if chunks else call.hidden[:0])
                want = _multiset(call.hidden[routed_to[:, expert]])
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (
                    f"{layer.name}: expert {expert} got other tokens than forced"
                )


def _multiset(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if rows.shape[0] == 0:
        return rows.reshape(0, rows.shape[-1]), torch.zeros(0, dtype=torch.long)
    unique, counts = torch.unique(rows, dim=0, return_counts=True)
    return unique, counts
