"""Compare two routings of the same tokens: how often, and where, the expert sets differ.

This measures what routing replay removes: the engine routed a token to one set of experts and
the trainer's own router, on the same token, picks another (numerics of a different kernel or
batch, weights that moved since the rollout). Per MoE layer, the share of tokens whose expert
*set* differs (the order within a row does not matter, a top-k's order is not part of the
selection), the tokens where it does, and the mean share of experts both kept (``overlap``).

Example:
    >>> import torch
    >>> engine = RoutingTrace([torch.tensor([[0, 1], [2, 3], [4, 5]])], num_experts=8, batch_size=1)
    >>> trainer = RoutingTrace([torch.tensor([[1, 0], [2, 6], [4, 5]])], num_experts=8, batch_size=1)
    >>> result = compare_routing(engine, trainer)
    >>> result.rates, result.positions[0].tolist()
    ([0.3333333333333333], [1])
    >>> print(result.summary().splitlines()[0])
    routing mismatch: 1 of 3 token routes differ (33.3%) over 1 MoE layer; 1 of 3 tokens differ in some layer (33.3%)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from modelgraft.errors import RoutingError
from modelgraft.moe._ids import widen
from modelgraft.moe.trace import RoutingTrace

__all__ = ["RoutingComparison", "compare_routing"]

#: Positions listed per layer by ``summary()`` and ``to_dict()`` (the tensors keep them all).
SHOWN_POSITIONS = 16


@dataclass
class RoutingComparison:
    """Per MoE layer, how many compared tokens have a different expert set in the two routings.

    Attributes:
        layer_ids: decoder-layer index of each MoE layer.
        layer_names: router module names (empty when the traces do not say).
        compared: tokens compared per layer (the mask's tokens with a route in both; rows of ``-1``,
            tokens without a route, are skipped).
        mismatched: tokens per layer whose expert sets differ.
        overlap: per layer, the mean share of a token's ``top_k`` experts both routings chose
            (1.0 when every set is equal).
        positions: per layer, the token indices (rows of the trace, ``batch * seq`` order) that differ.
        batch_size: sequences in the traces when known (positions are then also given per sequence).
    """

    layer_ids: list[int]
    layer_names: list[str]
    compared: list[int]
    mismatched: list[int]
    overlap: list[float]
    positions: list[torch.Tensor]
    batch_size: int | None = None
    tokens_compared: int = 0
    tokens_mismatched: int = 0
    _seq: int | None = field(default=None, repr=False)

    @property
    def rates(self) -> list[float]:
        """Share of compared tokens whose expert set differs, per layer (0.0 for a layer with none compared)."""
        return [m / c if c else 0.0 for m, c in zip(self.mismatched, self.compared)]

    @property
    def mismatch_rate(self) -> float:
        """Differing token routes over compared token routes, all layers together."""
        total = sum(self.compared)
        return sum(self.mismatched) / total if total else 0.0

    @property
    def max_rate(self) -> float:
        """The largest per-layer rate (0.0 without layers)."""
        return max(self.rates, default=0.0)

    @property
    def token_rate(self) -> float:
        """Share of compared tokens that differ in at least one layer."""
        return self.tokens_mismatched / self.tokens_compared if self.tokens_compared else 0.0

    @property
    def exact(self) -> bool:
        """True when no compared token differs in any layer."""
        return not any(self.mismatched)

    def where(self, layer: int) -> list[tuple[int, int]]:
        """``(sequence, position)`` of the differing tokens of layer ``layer`` (needs the batch layout).

        Raises:
            RoutingError: the traces have no known batch layout.
        """
        if self._seq is None:
            raise RoutingError(
                "The compared traces have no batch layout (`batch_size`), so positions are only token rows; "
                "use `positions` instead."
            )
        seq = self._seq
        return [(int(p) // seq, int(p) % seq) for p in self.positions[layer]]

    def to_dict(self, *, max_positions: int = SHOWN_POSITIONS) -> dict[str, Any]:
        """A JSON-ready summary: totals, then per layer its counts, rate, overlap and first positions."""
        layers = []
        for i, lid in enumerate(self.layer_ids):
            entry: dict[str, Any] = {
                "layer_id": lid,
                "name": self.layer_names[i] if self.layer_names else None,
                "compared": self.compared[i],
                "mismatched": self.mismatched[i],
                "rate": self.rates[i],
                "overlap": self.overlap[i],
                "positions": [int(p) for p in self.positions[i][:max_positions]],
            }
            if self._seq is not None:
                entry["where"] = [list(w) for w in self.where(i)[:max_positions]]
            layers.append(entry)
        return {
            "exact": self.exact,
            "mismatch_rate": self.mismatch_rate,
            "max_rate": self.max_rate,
            "token_rate": self.token_rate,
            "tokens_compared": self.tokens_compared,
            "tokens_mismatched": self.tokens_mismatched,
            "batch_size": self.batch_size,
            "layers": layers,
        }

    def summary(self, *, max_positions: int = 8) -> str:
        """A short text report: totals, then one line per MoE layer."""
        n = len(self.layer_ids)
        lines = [
            f"routing mismatch: {sum(self.mismatched)} of {sum(self.compared)} token routes differ "
            f"({100 * self.mismatch_rate:.1f}%) over {n} MoE layer{'s' if n != 1 else ''}; "
            f"{self.tokens_mismatched} of {self.tokens_compared} tokens differ in some layer "
            f"({100 * self.token_rate:.1f}%)"
        ]
        for i, lid in enumerate(self.layer_ids):
            name = f" `{self.layer_names[i]}`" if self.layer_names else ""
            shown: list[Any] = (
                self.where(i)[:max_positions]
                if self._seq is not None
                else [int(p) for p in self.positions[i][:max_positions]]
            )
            more = " ..." if len(self.positions[i]) > max_positions else ""
            at = f" at {', '.join(map(str, shown))}{more}" if shown else ""
            lines.append(
                f"  layer {lid}{name}: {self.mismatched[i]}/{self.compared[i]} differ "
                f"({100 * self.rates[i]:.1f}%), overlap {self.overlap[i]:.3f}{at}"
            )
        return "\n".join(lines)


def _layers(routing: RoutingTrace | Sequence[torch.Tensor], name: str) -> list[torch.Tensor]:
    tensors = list(routing.layers) if isinstance(routing, RoutingTrace) else list(routing)
    for i, t in enumerate(tensors):
        if (
            not isinstance(t, torch.Tensor)
            or t.dim() != 2
            or t.dtype.is_floating_point
            or t.dtype == torch.bool
        ):
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise RoutingError(
                f"Layer {i} of `{name}` must be a 2-D integer tensor (num_tokens, top_k); got {got}."
            )
    return [widen(t).long().cpu() for t in tensors]


def _token_mask(mask: Any, num_tokens: int, batch: int | None) -> torch.Tensor:
    """The tokens to compare, one flag per row; a mask that could mean other rows is refused.

    A ``(num_tokens,)`` mask is taken in row order; a 2-D one must be ``(batch, seq)`` of the
    traces' batch layout (a transposed ``(seq, batch)`` mask has the same size and other rows).
    Only bools and integers 0/1 are flags: a float mask (0.5) says nothing exact.
    """
    if mask is None:
        return torch.ones(num_tokens, dtype=torch.bool)
    try:
        given = torch.as_tensor(mask).cpu()
    except (TypeError, ValueError, RuntimeError) as exc:
        raise RoutingError(
            f"`mask` must be a bool or 0/1 integer tensor (the attention mask); got `{type(mask).__name__}` ({exc})."
        ) from None
    shape = tuple(given.shape)
    if given.numel() != num_tokens:
        raise RoutingError(
            f"`mask` has {given.numel()} entries ({shape}) but the traces have "
            f"{num_tokens} tokens per layer; pass one entry per token (e.g. the `(batch, seq)` attention mask)."
        )
    if given.dim() == 2:
        if batch is None:
            raise RoutingError(
                f"`mask` has shape {shape}, but the compared traces have no batch layout (`batch_size`), so "
                "its rows cannot be checked against theirs; pass a flat `(num_tokens,)` mask in the traces' row "
                "order, or traces with `batch_size`."
            )
        if shape != (batch, num_tokens // batch):
            raise RoutingError(
                f"`mask` has shape {shape} but the traces hold {batch} sequences of {num_tokens // batch} "
                f"positions; pass the `({batch}, {num_tokens // batch})` attention mask of the batch (not transposed)."
            )
    elif given.dim() != 1:
        raise RoutingError(
            f"`mask` has shape {shape}; pass `(num_tokens,)` or the `(batch, seq)` attention mask."
        )
    if given.dtype.is_floating_point or given.dtype.is_complex:
        raise RoutingError(
            f"`mask` holds {str(given.dtype).removeprefix('torch.')}; a mask says per token compare or not: "
            "pass a bool tensor or integers 0 and 1 (e.g. the attention mask, or `mask > 0` of your own)."
        )
    if given.dtype != torch.bool:
        odd = given[(given != 0) & (given != 1)]
        if odd.numel():
            raise RoutingError(
                f"`mask` must hold only 0 and 1; found {int(odd[0])}. Pass the attention mask, or a bool tensor."
            )
    return given.reshape(-1).bool()


def compare_routing(
    a: RoutingTrace | Sequence[torch.Tensor],
    b: RoutingTrace | Sequence[torch.Tensor],
    *,
    mask: torch.Tensor | None = None,
) -> RoutingComparison:
    """Compare two routings of the same tokens (e.g. the engine's and the trainer's live routing), per layer.

    Args:
        a, b: :class:`RoutingTrace` objects (or lists of ``(num_tokens, top_k)`` tensors) over the
            same tokens in the same order: same MoE layers, token count and ``top_k``.
        mask: tokens to compare, one bool (or 0/1 integer) per token: ``(num_tokens,)`` in row
            order, or the ``(batch, seq)`` attention mask of the traces' batch layout; default all.
            Rows no router chose are skipped by construction: rows of ``-1`` (no route) and rows
            that a trace marks as filler (:attr:`RoutingTrace.routed`: padding and the last token
            of each engine request, which the engine never forwarded).

    Returns:
        A :class:`RoutingComparison` (``rates``, ``mismatch_rate``, ``positions``, ``summary()``).

    Raises:
        RoutingError: the routings cover other layers, token counts, batch layouts or ``top_k``,
            hold non-integer tensors; the mask has another shape (a 2-D mask must be the traces'
            ``(batch, seq)``) or is not bools or 0/1 integers; a layer has no token to compare
            (an all-zero mask, every row unrouted), which would read as exact.
    """
    la, lb = _layers(a, "a"), _layers(b, "b")
    ids_a = a.layer_ids if isinstance(a, RoutingTrace) else list(range(len(la)))
    ids_b = b.layer_ids if isinstance(b, RoutingTrace) else ids_a
    if len(la) != len(lb) or list(ids_a) != list(ids_b):
        raise RoutingError(
            f"The routings cover different MoE layers: {list(ids_a)} in `a`, {list(ids_b)} in `b`; compare traces "
            "of the same model (`trace.select_layers(...)` keeps a subset)."
        )
    num_tokens = int(la[0].shape[0]) if la else 0
    for lid, ta, tb in zip(ids_a, la, lb):
        if ta.shape != tb.shape or ta.shape[0] != num_tokens:
            raise RoutingError(
                f"Layer `{lid}`: `a` has {tuple(ta.shape)} (tokens, top_k) but `b` has {tuple(tb.shape)}; both "
                "must route the same tokens with the same top_k."
            )
    names = a.layer_names if isinstance(a, RoutingTrace) else []
    batch_a = a.batch_size if isinstance(a, RoutingTrace) else None
    batch_b = b.batch_size if isinstance(b, RoutingTrace) else None
    if batch_a is not None and batch_b is not None and batch_a != batch_b:
        raise RoutingError(
            f"`a` holds {batch_a} sequences but `b` {batch_b} ({num_tokens} rows each): the routings lay out "
            "other tokens; compare traces of the same batch."
        )
    batch = batch_a if batch_a is not None else batch_b
    seq = num_tokens // batch if batch and num_tokens % batch == 0 else None
    keep = _token_mask(mask, num_tokens, batch if seq is not None else None)
    for trace in (a, b):
        if isinstance(trace, RoutingTrace) and trace.routed is not None:
            keep = keep & trace.routed  # filler rows: no router chose them
    compared, mismatched, overlap, positions = [], [], [], []
    any_diff = torch.zeros(num_tokens, dtype=torch.bool)
    any_compared = torch.zeros(num_tokens, dtype=torch.bool)
    for ta, tb in zip(la, lb):
        routed = keep & (ta >= 0).all(-1) & (tb >= 0).all(-1)
        differs = routed & (ta.sort(-1).values != tb.sort(-1).values).any(-1)
        shared = (ta[:, :, None] == tb[:, None, :]).any(-1).float().mean(-1)
        count = int(routed.sum())
        compared.append(count)
        mismatched.append(int(differs.sum()))
        overlap.append(float(shared[routed].mean()) if count else 1.0)
        positions.append(differs.nonzero().reshape(-1))
        any_diff |= differs
        any_compared |= routed
    if not la:
        raise RoutingError("The routings hold no MoE layer: there is nothing to compare.")
    empty = [lid for lid, count in zip(ids_a, compared) if not count]
    if empty:
        raise RoutingError(
            f"compare_routing compared no token of decoder layer `{empty[0]}` ({num_tokens} rows; "
            f"{int(keep.sum())} in the mask and routed by both): an all-zero mask, rows of -1 or filler rows "
            "only. An empty comparison would read as exact; pass the mask of the tokens both routings chose."
        )
    return RoutingComparison(
        layer_ids=list(ids_a),
        layer_names=list(names),
        compared=compared,
        mismatched=mismatched,
        overlap=overlap,
        positions=positions,
        batch_size=batch,
        tokens_compared=int(any_compared.sum()),
        tokens_mismatched=int(any_diff.sum()),
        _seq=seq,
    )
