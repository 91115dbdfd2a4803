"""Expert-id tensors: the dtype that holds them, the filler for positions without a route, rows of ``-1``.

A leaf of ``modelgraft.moe`` (imports nothing of it), shared by the trace, its storage, the engine
adapters and packing.

Example:
    >>> compact_dtype(8), spread_fill(0, 2, 2, 4).tolist()
    (torch.uint8, [[0, 1], [2, 3]])
"""

from __future__ import annotations

import torch

from modelgraft.errors import RoutingError

__all__ = [
    "MISSING_POLICIES",
    "compact_dtype",
    "is_id_dtype",
    "missing_rows",
    "spread_fill",
    "to_compact",
    "widen",
]

MISSING_POLICIES = ("refuse", "live")
_INT32_MAX = 2**31 - 1


def is_id_dtype(dtype: torch.dtype) -> bool:
    """Whether tensors of ``dtype`` can hold expert ids: integers (signed or not), not bool.

    Example:
        >>> is_id_dtype(torch.int32), is_id_dtype(torch.uint8), is_id_dtype(torch.bool), is_id_dtype(torch.float16)
        (True, True, False, False)
    """
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


def compact_dtype(num_experts: int, *, signed: bool = False) -> torch.dtype:
    """The smallest integer dtype that holds expert ids ``0 .. num_experts - 1`` (and ``-1`` if ``signed``).

    ``uint8`` up to 256 experts (``int16`` when ``-1`` must fit), ``int16`` up to 32768, else ``int32``.
    A ``uint8`` tensor used as an index is a boolean mask in torch: call ``.long()`` first.

    Example:
        >>> compact_dtype(128), compact_dtype(128, signed=True), compact_dtype(512), compact_dtype(40000)
        (torch.uint8, torch.int16, torch.int16, torch.int32)
    """
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise RoutingError(f"`num_experts` must be a positive integer; got `{num_experts!r}`.")
    if not signed and num_experts <= 256:
        return torch.uint8
    if num_experts <= 32768:
        return torch.int16
    return torch.int32


def spread_fill(start: int, count: int, top_k: int, num_experts: int) -> torch.Tensor:
    """Rows ``start .. start+count-1`` of the filler for positions without a route.

    Ordinal ``p`` uses experts ``(p * top_k + j) % num_experts``: valid, distinct within a row when
    ``top_k <= num_experts``, and spread over the experts (a constant fill would overload one).

    Example:
        >>> spread_fill(0, 3, 2, 4).tolist()
        [[0, 1], [2, 3], [0, 1]]
    """
    ordinal = torch.arange(start, start + count).unsqueeze(1) * top_k + torch.arange(top_k)
    return ordinal % num_experts


def widen(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as ``int64`` when its dtype lacks the ops the checks use (``uint16``, ``uint32``)."""
    return tensor.long() if tensor.dtype in (torch.uint16, torch.uint32) else tensor


def missing_rows(tensor: torch.Tensor, where: str) -> torch.Tensor | None:
    """Rows of ``tensor`` that are all ``-1`` (no route), or ``None`` when there are none.

    Raises:
        RoutingError: a row mixes ``-1`` with expert ids (no engine writes that), or holds a negative
            id other than ``-1``, naming ``where``.

    Example:
        >>> missing_rows(torch.tensor([[1, 2], [-1, -1]]), "layer `0`").tolist()
        [False, True]
    """
    if not tensor.numel() or not tensor.dtype.is_signed:
        return None
    other = (tensor < -1).any(-1)
    if bool(other.any()):
        row = int(other.nonzero()[0, 0])
        raise RoutingError(
            f"Routing for {where} has row {row} = {tensor[row].tolist()}: only -1 marks a token without a route; "
            "other negative ids are no expert. Fix the routing data."
        )
    negative = tensor < 0
    rows = negative.all(-1)
    partial = negative.any(-1) & ~rows
    if bool(partial.any()):
        row = int(partial.nonzero()[0, 0])
        raise RoutingError(
            f"Routing for {where} has row {row} = {tensor[row].tolist()}: a row is either all -1 (no route) "
            "or all expert ids; fix the routing data."
        )
    return rows if bool(rows.any()) else None


def to_compact(
    tensor: torch.Tensor, num_experts: int, where: str, *, allow_missing: bool = False
) -> torch.Tensor:
    """``tensor`` in :func:`compact_dtype`, after checking every id fits (never truncates).

    Raises:
        RoutingError: an id outside ``0 .. num_experts - 1`` (``-1`` rows allowed with ``allow_missing``).
    """
    tensor = widen(tensor)
    missing = missing_rows(tensor, where) if allow_missing else None
    real = tensor[~missing] if missing is not None else tensor
    if real.numel():
        low, high = int(real.min()), int(real.max())
        if low < 0 or high >= num_experts:
            bad = low if low < 0 else high
            hint = " (-1 marks a token without a route: choose the `missing` policy)" if bad == -1 else ""
            raise RoutingError(
                f"Routing for {where} holds expert id {bad}, outside 0..{num_experts - 1}{hint}."
            )
        if high > _INT32_MAX:
            raise RoutingError(
                f"Routing for {where} holds expert id {high}, which int32 cannot store; no engine or router "
                "produces such ids."
            )
    dtype = compact_dtype(num_experts, signed=missing is not None)
    return tensor if tensor.dtype == dtype else tensor.to(dtype)
