"""RoutingTrace: the experts each token was sent to, per MoE layer.

Ids are kept in the smallest integer dtype that holds ``num_experts`` (:func:`compact_dtype`:
``uint8`` up to 256 experts, ``int16`` up to 32768, else ``int32``), in memory, on disk and in
:meth:`RoutingTrace.to_bytes`. A row of ``-1`` is a token without a route (an engine's prefix-cache
hit); it is kept only in a trace whose ``missing`` policy is ``"live"``, and ``replay_routing``
lets the router choose for it.

Example:
    >>> import torch, tempfile, os
    >>> trace = RoutingTrace([torch.tensor([[0, 3], [2, 1]])], layer_ids=[1], top_k=2, num_experts=4,
    ...                      model_type="qwen3_moe").compact()
    >>> trace.layers[0].dtype, trace[0].dtype  # stored compact; indexing gives int64
    (torch.uint8, torch.int64)
    >>> path = os.path.join(tempfile.mkdtemp(), "routing.safetensors")
    >>> trace.save(path)
    >>> loaded = RoutingTrace.load(path)
    >>> loaded.layer_ids, loaded.num_tokens, bool(torch.equal(loaded[0], trace[0]))
    ([1], 2, True)
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Iterator, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from modelgraft.errors import RoutingError
from modelgraft.moe._ids import (
    MISSING_POLICIES,
    compact_dtype,
    is_id_dtype,
    missing_rows,
    spread_fill,
    to_compact,
)

if TYPE_CHECKING:
    from torch import nn

__all__ = ["MISSING_POLICIES", "RoutingTrace", "compact_dtype", "is_id_dtype", "missing_rows", "spread_fill"]


def _is_int(value: Any) -> bool:
    """A Python or numpy integer (``numpy.int64`` sample ids come from numpy index arrays), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _id_list(values: Any, name: str) -> list[int]:
    """``values`` as Python ints: a list, tuple, range, 1-D integer tensor or numpy array (numpy ints too)."""
    if hasattr(values, "tolist") and hasattr(values, "dtype"):  # a tensor or numpy array
        dtype = values.dtype
        integer = (
            not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool
            if isinstance(dtype, torch.dtype)
            else getattr(dtype, "kind", "") in ("i", "u")
        )
        if not integer or len(getattr(values, "shape", ())) != 1:
            raise RoutingError(
                f"`{name}` must be a 1-D sequence of integers; got a {type(values).__name__} of dtype {dtype} "
                f"and shape {tuple(values.shape)}."
            )
        values = values.tolist()
    if isinstance(values, (str, bytes)) or (
        not isinstance(values, Sequence) and not hasattr(values, "__iter__")
    ):
        raise RoutingError(f"`{name}` must be a sequence of integers; got `{type(values).__name__}`.")
    out = list(values)
    if not all(_is_int(v) for v in out):
        raise RoutingError(f"`{name}` must hold integers; got {out[:8]}.")
    return [int(v) for v in out]


@dataclass
class RoutingTrace:
    """Selected expert ids per MoE layer.

    Attributes:
        layers: one ``(num_tokens, top_k)`` integer tensor per MoE layer, in model order. Tokens are
            the flattened ``batch * seq`` positions as the router sees them (row-major over the batch).
            Traces made by modelgraft store them in :func:`compact_dtype`; ``trace[i]`` and iterating
            give ``int64`` copies (a ``uint8`` tensor used as an index would be a boolean mask).
        layer_ids: the decoder-layer index of each MoE layer (absolute, dense layers counted).
        top_k: experts per token.
        num_experts: experts per layer.
        model_type: ``config.model_type`` of the model it belongs to (informative).
        layer_names: qualified router module names (informative; empty when unknown).
        batch_size: when the rows are known to be ``batch_size`` sequences of equal length, laid out
            per sequence then per position (a recording of one forward, of ``generate``, an engine
            batch); else ``None``.
        missing: what ``replay_routing`` does with rows of ``-1`` (tokens without a route):
            ``"refuse"`` (the default: they are an error) or ``"live"`` (the router chooses them).
        routed: per row, whether a router chose its ids (``True``) or modelgraft filled them in
            (``False``: padding, the last token of an engine request, which the engine never
            forwarded, positions added by :meth:`append_positions` or by packing); ``None`` when
            every row was routed (a recording). A bool ``(num_tokens,)`` tensor on the CPU.
            ``compare_routing`` compares routed rows only; ``replay_routing`` forces every row alike.
    """

    layers: list[torch.Tensor]
    layer_ids: list[int] = field(default_factory=list)
    _: KW_ONLY  # the layers and their ids are the data; everything else is named
    top_k: int | None = None
    num_experts: int | None = None
    model_type: str | None = None
    layer_names: list[str] = field(default_factory=list)
    batch_size: int | None = None
    missing: str = "refuse"
    routed: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.layers = list(self.layers)
        if not self.layer_ids:
            self.layer_ids = list(range(len(self.layers)))
        if len(self.layer_ids) != len(self.layers):
            raise RoutingError(
                f"RoutingTrace got {len(self.layers)} layer tensors but {len(self.layer_ids)} `layer_ids`; "
                "pass one id per tensor."
            )
        if self.missing not in MISSING_POLICIES:
            raise RoutingError(f"`missing` must be 'refuse' or 'live'; got `{self.missing!r}`.")
        for lid, tensor in zip(self.layer_ids, self.layers):
            if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2 or not is_id_dtype(tensor.dtype):
                got = (
                    f"{tuple(tensor.shape)} {tensor.dtype}"
                    if isinstance(tensor, torch.Tensor)
                    else type(tensor).__name__
                )
                raise RoutingError(
                    f"Routing for layer `{lid}` must be a 2-D integer tensor (num_tokens, top_k); got {got}."
                )
        self.routed = self._check_routed(self.routed)

    def _check_routed(self, routed: Any) -> torch.Tensor | None:
        """``routed`` as a CPU bool vector of one entry per row, or ``None`` when every row is routed."""
        if routed is None:
            return None
        rows = self.num_tokens
        if (
            not isinstance(routed, torch.Tensor)
            or routed.dtype != torch.bool
            or routed.dim() != 1
            or routed.shape[0] != rows
        ):
            got = (
                f"{routed.dtype} of shape {tuple(routed.shape)}"
                if isinstance(routed, torch.Tensor)
                else f"`{type(routed).__name__}`"
            )
            raise RoutingError(
                f"`routed` must be a 1-D bool tensor of {rows} entries (one per row: True where a router chose the "
                f"ids); got {got}."
            )
        return None if bool(routed.all()) else routed.detach().cpu()

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, index: int) -> torch.Tensor:
        """Layer ``index``'s ids as ``int64`` (safe to index with; ``.layers`` holds the compact tensors)."""
        return self.layers[index].long()

    def __iter__(self) -> Iterator[torch.Tensor]:
        """The layers' ids as ``int64``, like ``trace[i]``."""
        return (tensor.long() for tensor in self.layers)

    @property
    def num_tokens(self) -> int:
        """Rows per layer (0 for an empty trace)."""
        return int(self.layers[0].shape[0]) if self.layers else 0

    @property
    def nbytes(self) -> int:
        """Bytes the ids take in memory (what :meth:`to_bytes` sends, less its small header).

        Example:
            >>> RoutingTrace([torch.zeros(32, 8, dtype=torch.long)], num_experts=128).compact().nbytes
            256
        """
        return sum(t.numel() * t.element_size() for t in self.layers)

    @classmethod
    def from_tensors(cls, tensors: Sequence[torch.Tensor]) -> RoutingTrace:
        """Wrap a per-layer list of ``(num_tokens, top_k)`` tensors (the seed's format).

        Example:
            >>> RoutingTrace.from_tensors([torch.zeros(3, 2, dtype=torch.long)]).num_tokens
            3
        """
        return cls(list(tensors))

    def _copy(self, layers: list[torch.Tensor], batch_size: int | None, **changes: Any) -> RoutingTrace:
        fields: dict[str, Any] = {
            "layer_ids": list(self.layer_ids),
            "top_k": self.top_k,
            "num_experts": self.num_experts,
            "model_type": self.model_type,
            "layer_names": list(self.layer_names),
            "batch_size": batch_size,
            "missing": self.missing,
            # Callers that change the rows pass the rows' `routed` (the check refuses a stale one).
            "routed": self.routed,
        }
        fields.update(changes)
        return RoutingTrace(layers, **fields)

    def to(self, device: torch.device | str) -> RoutingTrace:
        """A copy with every tensor moved to ``device``."""
        return self._copy([t.to(device) for t in self.layers], self.batch_size)

    def compact(self) -> RoutingTrace:
        """A copy whose ids use :func:`compact_dtype` (``num_experts`` from the trace, else the largest id + 1).

        Raises:
            RoutingError: an id outside ``0 .. num_experts - 1``; a ``-1`` row in a trace whose
                ``missing`` policy is ``"refuse"``.
        """
        experts = self.num_experts
        if experts is None:
            experts = 1 + max((int(t.max()) for t in self.layers if t.numel()), default=0)
        live = self.missing == "live"
        layers = [
            to_compact(t, experts, f"layer `{lid}`", allow_missing=live)
            for lid, t in zip(self.layer_ids, self.layers)
        ]
        return self._copy(layers, self.batch_size)

    # ---- batch layout -------------------------------------------------------------------------
    def _layout(self, action: str) -> tuple[int, int]:
        batch = self.batch_size
        if not batch or self.num_tokens % batch:
            raise RoutingError(
                f"To {action}, the trace needs a known batch layout (`batch_size`), but it has "
                f"batch_size={batch} for {self.num_tokens} rows; engine adapters, `layout_requests` and a "
                "recording of one forward or of `generate` set it (or pass `batch_size` to `RoutingTrace`)."
            )
        return batch, self.num_tokens // batch

    @property
    def seq_len(self) -> int | None:
        """Positions per sequence when the batch layout is known, else ``None``."""
        batch = self.batch_size
        return self.num_tokens // batch if batch and self.num_tokens % batch == 0 else None

    def select(self, sample_ids: Sequence[int]) -> RoutingTrace:
        """The rows of the sequences ``sample_ids`` (in that order): one micro-batch of a rollout batch.

        Raises:
            RoutingError: the trace has no batch layout, or a sample id outside ``0 .. batch_size - 1``.

        Example:
            >>> trace = RoutingTrace([torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])], batch_size=2)
            >>> trace.select([1])[0].tolist()  # sequence 1: its 2 positions
            [[4, 5], [6, 7]]
        """
        batch, seq = self._layout("select sequences")
        ids = _id_list(sample_ids, "sample_ids")
        bad = [i for i in ids if not 0 <= i < batch]
        if bad or not ids:
            raise RoutingError(
                f"Sample ids must be a non-empty list within 0..{batch - 1} (the trace holds {batch} "
                f"sequences); got {ids[:8]}."
            )
        index = torch.tensor(ids, device=self.layers[0].device if self.layers else None)
        layers = [t.reshape(batch, seq, t.shape[1])[index].reshape(-1, t.shape[1]) for t in self.layers]
        routed = (
            None if self.routed is None else self.routed.reshape(batch, seq)[torch.tensor(ids)].reshape(-1)
        )
        return self._copy(layers, len(ids), routed=routed)

    def append_positions(self, count: int = 1) -> RoutingTrace:
        """A copy with ``count`` more positions at the end of every sequence, routed to filler experts.

        A trace recorded around ``generate`` covers the tokens generate forwarded: ``sequences[:, :-1]``
        (the last generated token is sampled, never forwarded). A trainer that forwards all of
        ``sequences`` needs one more position per sequence; its route is the spread filler (valid,
        distinct ids), used by that position only, whose logits have no next token to predict.

        Raises:
            RoutingError: the trace has no known batch layout (``batch_size`` is ``None``) or no
                ``num_experts``, or ``count`` is negative.

        Example:
            >>> trace = RoutingTrace([torch.tensor([[1, 2], [3, 0]])], top_k=2, num_experts=4, batch_size=2)
            >>> trace.append_positions(1)[0].tolist()  # sequence 0: [1, 2] + filler, sequence 1: [3, 0] + filler
            [[1, 2], [0, 1], [3, 0], [2, 3]]
        """
        if not _is_int(count) or count < 0:
            raise RoutingError(f"`count` must be a non-negative integer; got `{count!r}`.")
        batch = self.batch_size
        if batch is None or (self.num_tokens % batch if batch else True):
            raise RoutingError(
                "This trace has no known batch layout (`batch_size` is None): only a trace recorded around one "
                "forward or `generate` (or built with `batch_size`) can be extended per sequence."
            )
        if self.num_experts is None:
            raise RoutingError(
                "This trace does not say `num_experts`; set it to fill the appended positions."
            )
        layers = []
        for tensor in self.layers:
            k = tensor.shape[1]
            per_sequence = tensor.reshape(batch, -1, k)
            fill = spread_fill(0, batch * count, k, self.num_experts).reshape(batch, count, k)
            layers.append(torch.cat([per_sequence, fill.to(tensor)], dim=1).reshape(-1, k))
        # The appended positions are filler, no router chose them.
        before = self.routed if self.routed is not None else torch.ones(self.num_tokens, dtype=torch.bool)
        routed = torch.cat([before.reshape(batch, -1), torch.zeros(batch, count, dtype=torch.bool)], dim=1)
        return self._copy(layers, batch, routed=routed.reshape(-1))

    def pack(
        self,
        attention_mask: torch.Tensor,
        packs: Sequence[Sequence[int]] | None = None,
        *,
        row_length: int | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> RoutingTrace:
        """The trace of a packed (padding-free) batch: see :func:`modelgraft.moe.pack_routes`."""
        from modelgraft.moe.packing import pack_routes

        return pack_routes(self, attention_mask, packs, row_length=row_length, position_ids=position_ids)

    # ---- layers (pipeline stages) -------------------------------------------------------------
    def select_layers(self, layer_ids: Sequence[int]) -> RoutingTrace:
        """The trace of the MoE layers ``layer_ids`` (decoder-layer indices), in that order.

        Raises:
            RoutingError: a layer id the trace does not hold (names it and the ids it holds), a layer
                id given twice, or a trace whose layer ids repeat (several routing sites per decoder layer).

        Example:
            >>> trace = RoutingTrace([torch.tensor([[0, 1]]), torch.tensor([[2, 3]])], layer_ids=[1, 3])
            >>> trace.select_layers([3]).layer_ids, trace.select_layers([3])[0].tolist()
            ([3], [[2, 3]])
        """
        wanted = _id_list(layer_ids, "layer_ids")
        repeated = sorted({lid for lid in wanted if wanted.count(lid) > 1})
        if repeated:
            raise RoutingError(
                f"`layer_ids` names decoder layer `{repeated[0]}` twice ({wanted}); a trace holds each layer once."
            )
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise RoutingError(
                f"This trace has several routing sites per decoder layer (layer ids {self.layer_ids}); "
                "select its layers by position (`trace.layers[i]`) instead."
            )
        position = {lid: i for i, lid in enumerate(self.layer_ids)}
        absent = [lid for lid in wanted if lid not in position]
        if absent:
            raise RoutingError(
                f"The trace has no routing for decoder layer `{absent[0]}`; it holds layers {self.layer_ids}."
            )
        picks = [position[lid] for lid in wanted]
        names = [self.layer_names[i] for i in picks] if self.layer_names else []
        return self._copy(
            [self.layers[i] for i in picks], self.batch_size, layer_ids=wanted, layer_names=names
        )

    def summary(self) -> str:
        """The trace in a few lines: layers, rows, layout, and per layer the rows routed live.

        Rows routed live are the ``-1`` rows of a ``missing="live"`` trace: tokens an engine did
        not compute (prefix-cache hits) or did not capture (``zero_rows="live"``); every other row
        is forced by ``replay_routing``.

        Example:
            >>> print(RoutingTrace([torch.tensor([[1, 2], [0, 3]])], layer_ids=[1], top_k=2).summary())
            RoutingTrace: 1 MoE layer (decoder layer 1), 2 rows each, top-2, missing='refuse'
              decoder layer `1`: all 2 rows forced
        """
        from modelgraft.moe._summary import summarize  # the summary imports this module's class for types

        return summarize(self)

    def check_captured(self, *, allow_all_zero: bool = False) -> RoutingTrace:
        """Check that every layer of the trace holds captured routes; returns the trace.

        A layer with no rows, with only ``-1`` rows, or whose every id is 0 is what an engine or a
        pipeline stage reports for a layer it did not capture; replaying it would send every token
        to expert 0 (or route it live unnoticed).

        Raises:
            RoutingError: naming the first such layer (all-zero layers pass with ``allow_all_zero``).

        Example:
            >>> RoutingTrace([torch.tensor([[0, 0]])], layer_ids=[5]).check_captured()
            Traceback (most recent call last):
            ...
            modelgraft.errors.RoutingError: Every expert id of decoder layer `5` is 0 ...
        """
        for lid, tensor in zip(self.layer_ids, self.layers):
            missing = missing_rows(tensor, f"layer `{lid}`")
            real = tensor[~missing] if missing is not None else tensor
            if not real.numel():
                raise RoutingError(
                    f"Decoder layer `{lid}` has no captured rows in the trace ({tensor.shape[0]} rows, none "
                    "routed); record or capture that layer (the pipeline stage that owns it)."
                )
            if not allow_all_zero and not bool(real.any()):
                raise RoutingError(
                    f"Every expert id of decoder layer `{lid}` is 0 ({real.shape[0]} rows): that is what an "
                    "engine or pipeline stage reports for a layer it did not capture. Capture that layer, or "
                    "pass `allow_all_zero=True` if these routes are real."
                )
        return self

    def for_model(
        self, model: nn.Module, *, layer_offset: int = 0, allow_all_zero: bool = False
    ) -> RoutingTrace:
        """The layers that ``model`` (e.g. one pipeline stage) holds, checked to be captured.

        Args:
            model: a model or stage whose MoE layers are found with ``moe_layers``.
            layer_offset: added to the stage's own layer ids to find them in the trace, for a stage
                whose decoder layers are numbered from 0 (a stage holding global layers 8.. with local
                names ``layers.0..``: ``layer_offset=8``). The result carries the stage's own ids.
            allow_all_zero: see :meth:`check_captured`.

        Raises:
            RoutingError: a layer of the stage absent from the trace, or not captured.
        """
        from modelgraft.moe._layers import moe_layers

        layers = moe_layers(model)
        local = [layer.layer_id for layer in layers]
        picked = self.select_layers([lid + layer_offset for lid in local])
        picked.layer_ids = local
        picked.layer_names = [layer.name for layer in layers]
        return picked.check_captured(allow_all_zero=allow_all_zero)

    @classmethod
    def join_layers(cls, traces: Sequence[RoutingTrace]) -> RoutingTrace:
        """One trace from the traces of several pipeline stages (disjoint layers, the same tokens).

        Raises:
            RoutingError: traces with different rows, top-k, experts or batch layout, or a layer twice.

        Example:
            >>> a = RoutingTrace([torch.tensor([[0, 1]])], layer_ids=[0], top_k=2, num_experts=4)
            >>> b = RoutingTrace([torch.tensor([[2, 3]])], layer_ids=[1], top_k=2, num_experts=4)
            >>> RoutingTrace.join_layers([b, a]).layer_ids
            [0, 1]
        """
        traces = list(traces)
        if not traces:
            raise RoutingError("`join_layers` needs at least one trace.")
        first = traces[0]
        for other in traces[1:]:
            same = (other.num_tokens, other.top_k, other.num_experts, other.batch_size, other.missing)
            want = (first.num_tokens, first.top_k, first.num_experts, first.batch_size, first.missing)
            if same != want:
                raise RoutingError(
                    "Traces of pipeline stages must cover the same tokens: (rows, top_k, num_experts, "
                    f"batch_size, missing) = {want} and {same} differ."
                )
        entries = sorted(
            (lid, t, (tr.layer_names[i] if tr.layer_names else ""))
            for tr in traces
            for i, (lid, t) in enumerate(zip(tr.layer_ids, tr.layers))
        )
        ids = [lid for lid, _, _ in entries]
        repeated = sorted({lid for lid in ids if ids.count(lid) > 1})
        if repeated:
            raise RoutingError(f"Decoder layer `{repeated[0]}` is in more than one of the traces to join.")
        names = [name for _, _, name in entries]
        # A row is routed when every stage says so (stages of one engine agree).
        given = [tr.routed for tr in traces if tr.routed is not None]
        routed = torch.stack(given).all(0) if given else None
        return first._copy(
            [t for _, t, _ in entries],
            first.batch_size,
            layer_ids=ids,
            layer_names=names if all(names) else [],
            routed=routed,
        )

    # ---- storage ------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the trace to a safetensors file: tensors ``layer.<i>`` in :func:`compact_dtype`,
        metadata as JSON strings.

        Raises:
            RoutingError: an id outside ``0 .. num_experts - 1`` (it would be truncated), or ``-1``
                in a trace whose ``missing`` policy is ``"refuse"``.
        """
        from modelgraft.moe._storage import save_trace

        save_trace(self, path)

    def to_bytes(self) -> bytes:
        """The safetensors bytes :meth:`save` writes: the compact form to send over the wire.

        Example:
            >>> trace = RoutingTrace([torch.tensor([[0, 3]])], top_k=2, num_experts=4)
            >>> RoutingTrace.from_bytes(trace.to_bytes())[0].tolist()
            [[0, 3]]
        """
        from modelgraft.moe._storage import trace_bytes

        return trace_bytes(self)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RoutingTrace:
        """Read a trace written by :meth:`save`; ids come back in :func:`compact_dtype`.

        Every part of the file is checked: metadata (valid JSON of the right types), tensor names
        (exactly ``layer.0`` .. ``layer.<n-1>`` for ``n`` layer ids), integer dtypes, 2-D shapes,
        ``top_k`` columns and ids within ``0 .. num_experts - 1`` (``-1`` rows only when the
        trace's ``missing`` policy is ``"live"``).

        Raises:
            RoutingFileError: ``path`` does not exist or is a folder (a ``RoutingError`` and a
                ``FileNotFoundError``).
            RoutingError: the file is not a routing trace or any of the above does not hold.
        """
        from modelgraft.moe._storage import load_trace

        return cls(**load_trace(path))

    @classmethod
    def from_bytes(cls, data: bytes) -> RoutingTrace:
        """Read the bytes of :meth:`to_bytes`, with the checks of :meth:`load`."""
        from modelgraft.moe._storage import trace_from_bytes

        return cls(**trace_from_bytes(data))
