"""A trace in a few lines: its layout, and per layer which rows replay forces and which run live.

Rows of ``-1`` (no route) are routed by the trainer's router in a ``missing="live"`` trace: an
engine's prefix-cache hits, and capture gaps that ``from_vllm(..., zero_rows="live")`` turned
into such rows. The summary names them, so a trace that is partly live is never mistaken for a
fully forced one.

Example:
    >>> import torch
    >>> from modelgraft.moe.trace import RoutingTrace
    >>> trace = RoutingTrace([torch.tensor([[1, 2], [-1, -1], [0, 3]])], layer_ids=[4], top_k=2,
    ...                      num_experts=4, batch_size=1, missing="live")
    >>> print(summarize(trace))
    RoutingTrace: 1 MoE layer (decoder layer 4), 3 rows each (1 sequence x 3 positions), top-2 of 4 experts, missing='live'
      decoder layer `4`: 1 of 3 rows routed live (sequence 0 position 1)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from modelgraft.moe._ids import missing_rows, widen

if TYPE_CHECKING:
    from modelgraft.moe.trace import RoutingTrace

__all__ = ["summarize"]

_SHOWN = 4  # places named per layer; the rest is counted


def _runs(values: list[int]) -> list[str]:
    runs: list[list[int]] = []
    for value in values:
        if runs and value == runs[-1][1] + 1:
            runs[-1][1] = value
        else:
            runs.append([value, value])
    return [f"{a}..{b}" if a != b else f"{a}" for a, b in runs]


def _places(rows: torch.Tensor, seq: int | None) -> str:
    """Where the rows are: per sequence and position with a batch layout, else flat row numbers."""
    flat = rows.nonzero().squeeze(1).tolist()
    if seq is None:
        runs = _runs(flat)
        return "rows " + ", ".join(runs[:_SHOWN]) + (", ..." if len(runs) > _SHOWN else "")
    parts = []
    for sequence in sorted({row // seq for row in flat}):
        runs = _runs([row % seq for row in flat if row // seq == sequence])
        word = "positions" if len(runs) > 1 or ".." in runs[0] else "position"
        parts.append(f"sequence {sequence} {word} {', '.join(runs)}")
    return "; ".join(parts[:_SHOWN]) + ("; ..." if len(parts) > _SHOWN else "")


def summarize(trace: RoutingTrace) -> str:
    """The text of :meth:`RoutingTrace.summary`."""
    count = len(trace.layers)
    ids = ", ".join(str(i) for i in trace.layer_ids)
    tokens = trace.num_tokens
    seq = tokens // trace.batch_size if trace.batch_size else None
    layout = ""
    if trace.batch_size and seq is not None:
        plural = "s" if trace.batch_size != 1 else ""
        layout = f" ({trace.batch_size} sequence{plural} x {seq} positions)"
    routing = f", top-{trace.top_k}" if trace.top_k is not None else ""
    if trace.num_experts is not None:
        routing += f" of {trace.num_experts} experts" if routing else f", {trace.num_experts} experts"
    lines = [
        f"RoutingTrace: {count} MoE layer{'s' if count != 1 else ''} (decoder layer{'s' if count != 1 else ''} "
        f"{ids}), {tokens} rows each{layout}{routing}, missing={trace.missing!r}"
    ]
    for lid, tensor in zip(trace.layer_ids, trace.layers):
        live = missing_rows(widen(tensor), f"layer `{lid}`")
        rows = tensor.shape[0]
        if live is None:
            lines.append(f"  decoder layer `{lid}`: all {rows} rows forced")
        else:
            lines.append(
                f"  decoder layer `{lid}`: {int(live.sum())} of {rows} rows routed live ({_places(live.cpu(), seq)})"
            )
    return "\n".join(lines)
