"""Pack traces the way trainers pack tokens: padding-free rows of several sequences.

TRL's padding-free collator (``DataCollatorWithFlattening``) and verl's remove-padding path
(``unpad_input``) put the real tokens of several sequences one after the other in one row, with
``position_ids`` restarting at 0 for each sequence; the router then sees the tokens in that
order. :func:`pack_sequences` packs a padded batch's tokens so, and :func:`pack_routes` packs its
trace the same way, so the two always agree.

* ``packs`` says which sequences go in which row, in order (default: all of them in one row, the
  remove-padding layout). Real tokens are the mask's 1s, whatever the padding side.
* ``row_length`` pads every row to one length (default: the longest row). Padding tokens get the
  spread filler routes (valid, distinct, spread over the experts).

Example:
    >>> import torch
    >>> from modelgraft.moe.trace import RoutingTrace
    >>> ids = torch.tensor([[0, 5, 6], [7, 8, 9]]); mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    >>> packed = pack_sequences(ids, mask)
    >>> packed["position_ids"].tolist(), packed["use_cache"]  # a cache would join the sequences
    ([[0, 1, 0, 1, 2]], False)
    >>> trace = RoutingTrace([torch.arange(12).reshape(6, 2)], top_k=2, num_experts=16, batch_size=2)
    >>> pack_routes(trace, mask)[0].tolist()  # sequence 0's two real rows, then sequence 1's three
    [[2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from modelgraft.errors import RoutingError
from modelgraft.moe._ids import spread_fill

if TYPE_CHECKING:  # the trace imports this module for `RoutingTrace.pack`
    from modelgraft.moe.trace import RoutingTrace

__all__ = ["pack_routes", "pack_sequences"]


def _plan(
    mask: torch.Tensor, packs: Sequence[Sequence[int]] | None, row_length: int | None
) -> tuple[list[list[int]], list[torch.Tensor], int]:
    """Sequences per row, each sequence's real positions, and the row length."""
    if mask.dim() != 2:
        raise RoutingError(f"`attention_mask` must be (batch, seq); got shape {tuple(mask.shape)}.")
    batch = mask.shape[0]
    rows = [list(range(batch))] if packs is None else [list(p) for p in packs]
    flat = [i for row in rows for i in row]
    if not rows or any(not row for row in rows):
        raise RoutingError("`packs` must be a non-empty list of non-empty lists of sequence indices.")
    bad = [i for i in flat if not (isinstance(i, int) and not isinstance(i, bool) and 0 <= i < batch)]
    if bad:
        raise RoutingError(
            f"`packs` holds {bad[0]!r}; sequence indices are 0..{batch - 1} (rows of the mask)."
        )
    repeated = sorted({i for i in flat if flat.count(i) > 1})
    if repeated:
        raise RoutingError(f"Sequence {repeated[0]} is in `packs` twice; each sequence goes in one row once.")
    real = [mask[i].bool().nonzero().squeeze(1) for i in range(batch)]
    lengths = [sum(len(real[i]) for i in row) for row in rows]
    longest = max(lengths)
    if row_length is None:
        row_length = longest
    if not isinstance(row_length, int) or row_length < longest:
        raise RoutingError(
            f"`row_length` is {row_length} but packed row {lengths.index(longest)} holds {longest} tokens; pass at "
            "least that many (or None)."
        )
    return rows, real, row_length


def _check_positions(
    position_ids: torch.Tensor, rows: list[list[int]], real: list[torch.Tensor], row_length: int
) -> None:
    positions = torch.as_tensor(position_ids)
    if positions.dim() == 1:
        positions = positions.unsqueeze(0)
    if positions.shape != (len(rows), row_length):
        raise RoutingError(
            f"`position_ids` has shape {tuple(positions.shape)} but the packed batch is ({len(rows)}, {row_length})."
        )
    for r, row in enumerate(rows):
        start = 0
        for sample in row:
            n = len(real[sample])
            got = positions[r, start : start + n]
            if not torch.equal(got.cpu(), torch.arange(n)):
                raise RoutingError(
                    f"Packed row {r} does not hold sequence {sample} at tokens {start}..{start + n - 1} (its "
                    f"position_ids there are {got[:6].tolist()}...; expected 0..{n - 1}): the tokens were packed in "
                    "another order or with other lengths than `packs` and the mask say."
                )
            start += n


def pack_routes(
    trace: RoutingTrace,
    attention_mask: torch.Tensor,
    packs: Sequence[Sequence[int]] | None = None,
    *,
    row_length: int | None = None,
    position_ids: torch.Tensor | None = None,
) -> RoutingTrace:
    """The trace of a packed batch: each row the real tokens of ``packs[r]``'s sequences, in order.

    Args:
        trace: the trace of the padded batch (``batch_size`` rows of ``seq`` positions).
        attention_mask: ``(batch, seq)``, 1 on real tokens, of that padded batch.
        packs: the sequences of each packed row (default: all, in one row).
        row_length: tokens per packed row (default: the longest); the rest is padding.
        position_ids: the packed batch's ``position_ids``, if the trainer made them: checked to
            restart at 0 exactly where ``packs`` and the mask put each sequence.

    Returns:
        A trace with ``batch_size = len(packs)`` rows of ``row_length`` positions.

    Raises:
        RoutingError: no batch layout, a mask of another shape, bad ``packs``, a ``row_length`` that
            is too short, or ``position_ids`` that do not fit the packing.
    """
    batch, seq = trace._layout("pack sequences")
    mask = torch.as_tensor(attention_mask)
    if tuple(mask.shape) != (batch, seq):
        raise RoutingError(
            f"`attention_mask` has shape {tuple(mask.shape)} but the trace holds {batch} sequences of {seq} positions."
        )
    rows, real, length = _plan(mask, packs, row_length)
    if position_ids is not None:
        _check_positions(position_ids, rows, real, length)
    experts = trace.num_experts
    # Which packed rows a router chose: the real positions' own flags, then filler padding.
    flags = (trace.routed if trace.routed is not None else torch.ones(batch * seq, dtype=torch.bool)).reshape(
        batch, seq
    )
    routed = torch.cat(
        [
            torch.cat(
                [flags[i][real[i].cpu()] for i in row]
                + [torch.zeros(length - sum(len(real[i]) for i in row), dtype=torch.bool)]
            )
            for row in rows
        ]
    )
    layers = []
    for tensor in trace.layers:
        k = tensor.shape[1]
        grid = tensor.reshape(batch, seq, k)
        packed = []
        for r, row in enumerate(rows):
            parts = [grid[i][real[i].to(grid.device)] for i in row]
            used = sum(len(real[i]) for i in row)
            if used < length:
                if experts is None:
                    raise RoutingError(
                        "This trace does not say `num_experts`; set it to fill the padding of packed rows."
                    )
                fill = spread_fill(r * length + used, length - used, k, experts)
                parts.append(fill.to(device=tensor.device, dtype=tensor.dtype))
            packed.append(torch.cat(parts))
        layers.append(torch.cat(packed))
    return trace._copy(layers, len(rows), routed=routed)


def pack_sequences(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    packs: Sequence[Sequence[int]] | None = None,
    *,
    row_length: int | None = None,
    pad_token_id: int = 0,
) -> dict[str, Any]:
    """Pack a padded batch's tokens into padding-free rows, as :func:`pack_routes` packs its trace.

    Returns:
        ``input_ids`` and ``position_ids`` (``(rows, row_length)``; positions restart at 0 for each
        sequence, as transformers expects for packed sequences), ``seq_lengths`` (per row, the
        lengths of its sequences), ``packs``, and ``use_cache=False``: pass it to the forward with
        the packed tensors, since with a cache transformers does not separate packed sequences
        (each would attend to the ones packed before it; a replay block refuses that forward).

    Raises:
        RoutingError: a mask of another shape than ``input_ids``, bad ``packs`` or ``row_length``.
    """
    ids = torch.as_tensor(input_ids)
    mask = torch.as_tensor(attention_mask)
    if ids.shape != mask.shape:
        raise RoutingError(
            f"`input_ids` {tuple(ids.shape)} and `attention_mask` {tuple(mask.shape)} must have the same shape."
        )
    rows, real, length = _plan(mask, packs, row_length)
    out_ids = torch.full((len(rows), length), pad_token_id, dtype=ids.dtype, device=ids.device)
    out_pos = torch.zeros((len(rows), length), dtype=torch.long, device=ids.device)
    seq_lengths = []
    for r, row in enumerate(rows):
        start = 0
        lengths = []
        for i in row:
            n = len(real[i])
            out_ids[r, start : start + n] = ids[i][real[i].to(ids.device)]
            out_pos[r, start : start + n] = torch.arange(n, device=ids.device)
            start += n
            lengths.append(n)
        out_pos[r, start:] = torch.arange(length - start, device=ids.device)  # padding: a sequence of its own
        seq_lengths.append(lengths)
    return {
        "input_ids": out_ids,
        "position_ids": out_pos,
        "use_cache": False,
        "seq_lengths": seq_lengths,
        "packs": rows,
    }
