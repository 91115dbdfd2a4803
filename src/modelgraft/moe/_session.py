"""Micro-batches of one replayed rollout batch: which rows each forward (and its recompute) uses.

A trainer splits the rollout batch into micro-batches and accumulates gradients. Inside one
``replay_routing`` block, ``session.micro_batch(sample_ids)`` makes the forwards run in it use the
rows of those sequences (laid out padded, or packed into one row). A forward that gradient
checkpointing recomputes during backward must get the rows of *its* micro-batch, also when the
backward runs later (interleaved schedules: forward of micro-batch 2 before backward of 1):

* transformers' gradient checkpointing (``model.gradient_checkpointing_enable()``) calls each
  layer's ``_gradient_checkpointing_func``; for the block, that function is wrapped so the function
  it checkpoints runs with the micro-batch that was active when the forward ran, in the forward and
  again in the recompute. Any schedule is then exact.
* another checkpoint function (FSDP's ``apply_activation_checkpointing``, a hand-written one) is not
  seen: its recompute uses the micro-batch active at backward time, so run each micro-batch's
  backward inside its block; a recompute outside every block is refused.

Example:
    >>> session = ReplaySession.__new__(ReplaySession)
    >>> isinstance(session, ReplaySession)
    True
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from modelgraft.errors import RoutingError
from modelgraft.moe._ids import missing_rows
from modelgraft.moe._intercept import _Site, activated, active_sites, in_backward
from modelgraft.moe.trace import RoutingTrace, _id_list

__all__ = ["ReplaySession"]


@dataclass
class _Rows:
    """What every site forces while one micro-batch (or the whole trace) is active."""

    forced: list[torch.Tensor]
    live: list[torch.Tensor | None]
    batch_size: int | None
    samples: tuple[int, ...] = ()
    trace: RoutingTrace | None = None


def rows_of(tensors: Sequence[torch.Tensor], batch_size: int | None, live_ok: bool) -> _Rows:
    """Per-site forced ids and the rows the router chooses (``-1`` rows, when allowed)."""
    live = [missing_rows(t, "the routing data") if live_ok else None for t in tensors]
    return _Rows(list(tensors), live, batch_size)


def _micro_batch_mask(
    mask: torch.Tensor, ids: tuple[int, ...], trace: RoutingTrace, mask_of: str
) -> torch.Tensor:
    """The mask of the micro-batch's sequences, row ``j`` for ``ids[j]``, from either kind of mask."""
    if mask_of not in ("auto", "rollout", "micro_batch"):
        raise RoutingError(f"`mask_of` must be 'auto', 'rollout' or 'micro_batch'; got `{mask_of!r}`.")
    batch = trace.batch_size
    if mask.dim() != 2:
        raise RoutingError(f"`attention_mask` must be (batch, seq); got shape {tuple(mask.shape)}.")
    rows = mask.shape[0]
    if mask_of == "auto":
        if rows == batch and rows != len(ids):
            mask_of = "rollout"
        elif rows == len(ids) and rows != batch:
            mask_of = "micro_batch"
        elif rows == batch and torch.equal(mask[list(ids)], mask):
            mask_of = "micro_batch"  # both readings give the same mask
        elif rows == batch:
            raise RoutingError(
                f"`attention_mask` has {rows} rows: it can be the rollout batch's mask (row i for sequence i) or "
                f"this micro-batch's (row j for sample_ids[j] of {list(ids)[:8]}), and the two readings give "
                "other masks. Pass `mask_of='rollout'` or `mask_of='micro_batch'`."
            )
    expected = batch if mask_of == "rollout" else len(ids)
    if rows != expected:
        raise RoutingError(
            f"`attention_mask` has {rows} rows but "
            + (
                f"the rollout batch holds {batch} sequences"
                if mask_of == "rollout"
                else f"the micro-batch holds {len(ids)} sequences"
            )
            + f" (mask_of={mask_of!r}); pass the rollout batch's mask ({batch} rows) or the micro-batch's "
            f"({len(ids)} rows)."
        )
    return mask[list(ids)] if mask_of == "rollout" else mask


class ReplaySession:
    """What ``replay_routing`` yields: the replayed trace, and micro-batches of it.

    Attributes:
        trace: the routing given to ``replay_routing`` (a :class:`RoutingTrace`, or ``None`` for a
            plain list of tensors).
    """

    def __init__(self, model: nn.Module, sites: list[_Site], routing: Any, whole: _Rows) -> None:
        self.model = model
        self.trace = routing if isinstance(routing, RoutingTrace) else None
        self._sites = sites
        self._whole = whole
        self._active: _Rows | None = None
        self._in_block = False
        self._closed = False
        self._used_micro_batches = False
        self._used_samples: set[int] = set()
        self._wrapped: list[tuple[nn.Module, Any]] = []
        self._set(whole)
        for site in sites:
            site.guard = self._guard
        self._bind_checkpointing()

    # ---- what the sites force -----------------------------------------------------------------
    def _set(self, rows: _Rows) -> None:
        for site, forced, live in zip(self._sites, rows.forced, rows.live):
            site.forced, site.live, site.batch_size = forced, live, rows.batch_size

    @contextmanager
    def _use(self, rows: _Rows | None) -> Iterator[None]:
        previous = self._active
        self._active = rows
        self._set(rows or self._whole)
        try:
            yield
        finally:
            self._active = previous
            self._set(previous or self._whole)

    def _guard(self, site: _Site) -> None:
        if self._used_micro_batches and self._active is None and in_backward():
            raise RoutingError(
                f"MoE layer `{site.layer.name}` is recomputed during backward (gradient checkpointing) outside "
                "every micro-batch, and the checkpoint function is not transformers' (which modelgraft binds to "
                "the micro-batch of the forward): run each micro-batch's backward inside its `micro_batch` "
                "block, or enable checkpointing with `model.gradient_checkpointing_enable()`."
            )

    # ---- transformers' gradient checkpointing -------------------------------------------------
    def _bind_checkpointing(self) -> None:
        if self._wrapped:
            return
        for module in self.model.modules():
            original = module.__dict__.get("_gradient_checkpointing_func")
            if original is None or getattr(original, "_modelgraft_session", None) is not None:
                continue
            module._gradient_checkpointing_func = self._bound(original)
            self._wrapped.append((module, original))

    def _bound(self, checkpoint: Any) -> Any:
        # The function checkpointed runs, in the forward and again in the recompute, with the sites
        # and rows of the forward: the recompute also keeps the forced routes after the block ended, in
        # autograd's worker threads, and stays plain for a forward that ran outside the block.
        def bound(function: Any, *args: Any, **kwargs: Any) -> Any:
            sites = active_sites()
            mine = any(sites.get(id(site.layer.scope)) is site for site in self._sites)
            rows = self._active

            def run(*inner: Any, **named: Any) -> Any:
                with activated(sites):
                    if not mine:
                        return function(*inner, **named)
                    with self._use(rows):
                        return function(*inner, **named)

            return checkpoint(run, *args, **kwargs)

        bound._modelgraft_session = self  # type: ignore[attr-defined]
        return bound

    def close(self) -> None:
        """Put the checkpoint functions back and forget the sites (the block has ended)."""
        for module, original in self._wrapped:
            if (
                getattr(module.__dict__.get("_gradient_checkpointing_func"), "_modelgraft_session", None)
                is self
            ):
                module._gradient_checkpointing_func = original
        self._wrapped.clear()
        self._closed = True
        for site in self._sites:
            site.guard = None

    def unused_samples(self) -> list[int]:
        """Sequences of the trace that no micro-batch ran (empty when micro-batches were not used)."""
        if not self._used_micro_batches or self.trace is None or not self.trace.batch_size:
            return []
        return [i for i in range(self.trace.batch_size) if i not in self._used_samples]

    # ---- the public part ----------------------------------------------------------------------
    @contextmanager
    def micro_batch(
        self,
        sample_ids: Sequence[int],
        *,
        attention_mask: torch.Tensor | None = None,
        mask_of: str = "auto",
    ) -> Iterator[RoutingTrace]:
        """Make the forwards inside the block use the rows of the sequences ``sample_ids``.

        Args:
            sample_ids: sequences of the replayed trace (its batch rows), in the order the
                micro-batch holds them.
            attention_mask: for a *packed* micro-batch (one row, the sequences' real tokens one after
                the other, as TRL's padding-free collator and verl's remove-padding lay them out): the
                mask of the rollout batch (``(batch, seq)``, row ``i`` for sequence ``i``) or of these
                sequences (``(len(sample_ids), seq)``, row ``j`` for ``sample_ids[j]``). Without it the
                micro-batch keeps the padded layout of the trace.
            mask_of: which of the two ``attention_mask`` is: ``"rollout"``, ``"micro_batch"``, or
                ``"auto"`` (by its row count; when both counts are equal and the two readings give other
                masks, the call is refused and asks for ``mask_of``).

        Yields:
            The micro-batch's trace (what its forwards replay).

        Raises:
            RoutingError: the trace has no batch layout, a sample id out of range, a mask of another
                shape or one that could be either mask, a micro-batch block inside another, or the
                ``replay_routing`` block has ended.
        """
        if self._closed:
            raise RoutingError(
                "This `micro_batch` belongs to a `replay_routing` block that has ended, so its forwards would run "
                "with the live router; call `micro_batch` inside the `with replay_routing(...) as session:` block."
            )
        if self.trace is None:
            raise RoutingError(
                "Micro-batches need a RoutingTrace with a batch layout; `replay_routing` was given a list of tensors."
            )
        if self._in_block:
            raise RoutingError("A `micro_batch` block is already active; micro-batch blocks do not nest.")
        ids = tuple(_id_list(sample_ids, "sample_ids"))
        part = self.trace.select(ids)
        if attention_mask is not None:
            part = part.pack(_micro_batch_mask(torch.as_tensor(attention_mask), ids, self.trace, mask_of))
        rows = rows_of(part.layers, part.batch_size, self.trace.missing == "live")
        rows.samples, rows.trace = ids, part
        self._bind_checkpointing()
        self._used_micro_batches = True
        for site in self._sites:
            site.consumed_in_block = False
        self._in_block = True
        try:
            with self._use(rows):
                yield part
        finally:
            self._in_block = False
        if any(getattr(site, "consumed_in_block", False) for site in self._sites):
            self._used_samples.update(ids)
