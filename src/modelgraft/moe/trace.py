"""RoutingTrace: the experts each token was sent to, per MoE layer, and its safetensors form.

Example:
    >>> import torch, tempfile, os
    >>> trace = RoutingTrace([torch.tensor([[0, 3], [2, 1]])], layer_ids=[1], top_k=2, num_experts=4,
    ...                      model_type="qwen3_moe")
    >>> path = os.path.join(tempfile.mkdtemp(), "routing.safetensors")
    >>> trace.save(path)
    >>> loaded = RoutingTrace.load(path)
    >>> loaded.layer_ids, loaded.num_tokens, bool(torch.equal(loaded[0], trace[0]))
    ([1], 2, True)
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from modelgraft.errors import RoutingError

__all__ = ["RoutingTrace"]

_FORMAT = "modelgraft.routing/1"
_INT32_MAX = 2**31 - 1


def is_id_dtype(dtype: torch.dtype) -> bool:
    """Whether tensors of ``dtype`` can hold expert ids: integers (signed or not), not bool.

    Example:
        >>> is_id_dtype(torch.int32), is_id_dtype(torch.uint8), is_id_dtype(torch.bool), is_id_dtype(torch.float16)
        (True, True, False, False)
    """
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class RoutingTrace:
    """Selected expert ids per MoE layer.

    Attributes:
        layers: one ``(num_tokens, top_k)`` integer tensor per MoE layer, in model order. Tokens are
            the flattened ``batch * seq`` positions as the router sees them (row-major over the batch).
        layer_ids: the decoder-layer index of each MoE layer (absolute, dense layers counted).
        top_k: experts per token.
        num_experts: experts per layer.
        model_type: ``config.model_type`` of the model it belongs to (informative).
        layer_names: qualified router module names (informative; empty when unknown).
        batch_size: when the rows are known to be ``batch_size`` sequences of equal length, laid out
            per sequence then per position (a recording of one forward, or of ``generate``); else ``None``.
    """

    layers: list[torch.Tensor]
    layer_ids: list[int] = field(default_factory=list)
    top_k: int | None = None
    num_experts: int | None = None
    model_type: str | None = None
    layer_names: list[str] = field(default_factory=list)
    batch_size: int | None = None

    def __post_init__(self) -> None:
        self.layers = list(self.layers)
        if not self.layer_ids:
            self.layer_ids = list(range(len(self.layers)))
        if len(self.layer_ids) != len(self.layers):
            raise RoutingError(
                f"RoutingTrace got {len(self.layers)} layer tensors but {len(self.layer_ids)} `layer_ids`; "
                "pass one id per tensor."
            )
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

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.layers[index]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self.layers)

    @property
    def num_tokens(self) -> int:
        """Rows per layer (0 for an empty trace)."""
        return int(self.layers[0].shape[0]) if self.layers else 0

    @classmethod
    def from_tensors(cls, tensors: Sequence[torch.Tensor]) -> RoutingTrace:
        """Wrap a per-layer list of ``(num_tokens, top_k)`` tensors (the seed's format).

        Example:
            >>> RoutingTrace.from_tensors([torch.zeros(3, 2, dtype=torch.long)]).num_tokens
            3
        """
        return cls(list(tensors))

    def _copy(self, layers: list[torch.Tensor], batch_size: int | None) -> RoutingTrace:
        return RoutingTrace(
            layers,
            list(self.layer_ids),
            self.top_k,
            self.num_experts,
            self.model_type,
            list(self.layer_names),
            batch_size,
        )

    def to(self, device: torch.device | str) -> RoutingTrace:
        """A copy with every tensor moved to ``device``."""
        return self._copy([t.to(device) for t in self.layers], self.batch_size)

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
        return self._copy(layers, batch)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the trace to a safetensors file (tensors ``layer.<i>`` as int32, metadata as JSON strings).

        Raises:
            RoutingError: an id int32 cannot store (it would be truncated).
        """
        for lid, tensor in zip(self.layer_ids, self.layers):
            if tensor.numel():
                low, high = int(tensor.min()), int(tensor.max())
                if low < -_INT32_MAX - 1 or high > _INT32_MAX:
                    bad = high if high > _INT32_MAX else low
                    raise RoutingError(
                        f"Routing for layer `{lid}` holds expert id {bad}, which int32 cannot store; the file "
                        "keeps ids as int32."
                    )
        tensors = {
            f"layer.{i}": t.detach().to("cpu", torch.int32).contiguous() for i, t in enumerate(self.layers)
        }
        meta = {
            "format": _FORMAT,
            "layer_ids": json.dumps(self.layer_ids),
            "layer_names": json.dumps(self.layer_names),
            "top_k": json.dumps(self.top_k),
            "num_experts": json.dumps(self.num_experts),
            "model_type": json.dumps(self.model_type),
            "batch_size": json.dumps(self.batch_size),
        }
        save_file(tensors, os.fspath(path), metadata=meta)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RoutingTrace:
        """Read a trace written by :meth:`save`; tensors come back as ``torch.long``.

        Every part of the file is checked: metadata (valid JSON of the right types), tensor names
        (exactly ``layer.0`` .. ``layer.<n-1>`` for ``n`` layer ids), integer dtypes, 2-D shapes,
        ``top_k`` columns and ids within ``0 .. num_experts - 1``.

        Raises:
            RoutingError: the file is not a routing trace or any of the above does not hold.
        """
        try:
            with safe_open(os.fspath(path), framework="pt") as handle:
                meta = handle.metadata() or {}
                names = list(handle.keys())
                if meta.get("format") != _FORMAT:
                    raise RoutingError(
                        f"`{path}` is not a modelgraft routing trace (metadata format `{meta.get('format')}`, "
                        f"expected `{_FORMAT}`); write it with `RoutingTrace.save`."
                    )
                fields = _read_metadata(path, meta)
                expected = [f"layer.{i}" for i in range(len(fields["layer_ids"]))]
                _check_names(path, names, expected)
                layers = [_read_layer(path, name, handle.get_tensor(name), fields) for name in expected]
        except RoutingError:
            raise
        except (SafetensorError, OSError, ValueError, RuntimeError, TypeError) as exc:
            if isinstance(exc, FileNotFoundError):
                raise
            raise RoutingError(
                f"`{path}` cannot be read as safetensors ({type(exc).__name__}: {exc}); write it with "
                "`RoutingTrace.save`."
            ) from exc
        return cls(
            layers,
            fields["layer_ids"],
            fields["top_k"],
            fields["num_experts"],
            fields["model_type"],
            fields["layer_names"],
            fields["batch_size"],
        )


def _json_field(path: Any, meta: dict[str, str], key: str, default: str | None = None) -> Any:
    raw = meta.get(key, default)
    if raw is None:
        raise RoutingError(
            f"`{path}`: the routing trace's metadata has no `{key}`; write it with `RoutingTrace.save`."
        )
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise RoutingError(
            f"`{path}`: the routing trace's metadata `{key}` is not valid JSON ({type(exc).__name__}); the file "
            "was changed after `RoutingTrace.save` wrote it."
        ) from None


def _read_metadata(path: Any, meta: dict[str, str]) -> dict[str, Any]:
    fields = {
        "layer_ids": _json_field(path, meta, "layer_ids"),
        "top_k": _json_field(path, meta, "top_k"),
        "num_experts": _json_field(path, meta, "num_experts"),
        "model_type": _json_field(path, meta, "model_type"),
        "layer_names": _json_field(path, meta, "layer_names", "[]"),
        "batch_size": _json_field(path, meta, "batch_size", "null"),
    }
    ids = fields["layer_ids"]
    if not isinstance(ids, list) or not all(_is_int(i) and i >= 0 for i in ids):
        raise RoutingError(
            f"`{path}`: metadata `layer_ids` must be a list of non-negative integers; got {json.dumps(ids)[:80]}."
        )
    for key in ("top_k", "num_experts", "batch_size"):
        value = fields[key]
        if value is not None and not (_is_int(value) and value > 0):
            raise RoutingError(
                f"`{path}`: metadata `{key}` must be a positive integer or null; got {json.dumps(value)[:80]}."
            )
    if fields["model_type"] is not None and not isinstance(fields["model_type"], str):
        raise RoutingError(
            f"`{path}`: metadata `model_type` must be a string or null; got {json.dumps(fields['model_type'])[:80]}."
        )
    names = fields["layer_names"]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise RoutingError(
            f"`{path}`: metadata `layer_names` must be a list of strings; got {json.dumps(names)[:80]}."
        )
    if names and len(names) != len(ids):
        raise RoutingError(f"`{path}`: metadata `layer_names` has {len(names)} names for {len(ids)} layers.")
    return fields


def _check_names(path: Any, names: list[str], expected: list[str]) -> None:
    extra = sorted(set(names) - set(expected))
    if extra:
        raise RoutingError(
            f"`{path}` holds unexpected tensor `{extra[0]}`; a routing trace holds `layer.0` .. "
            f"`layer.{len(expected) - 1}`, one per entry of `layer_ids`."
        )
    if len(names) != len(expected):
        shown = ", ".join(f"`{n}`" for n in sorted(names))
        raise RoutingError(
            f"`{path}` holds tensors [{shown}] but its metadata names {len(expected)} layers (`layer_ids`); the "
            "file is incomplete."
        )


def _read_layer(path: Any, name: str, tensor: torch.Tensor, fields: dict[str, Any]) -> torch.Tensor:
    if not is_id_dtype(tensor.dtype):
        raise RoutingError(
            f"`{path}`: tensor `{name}` holds `{tensor.dtype}` ids; expected integers (int32)."
        )
    if tensor.dim() != 2:
        raise RoutingError(
            f"`{path}`: tensor `{name}` has shape {tuple(tensor.shape)}; expected (num_tokens, top_k)."
        )
    top_k, num_experts = fields["top_k"], fields["num_experts"]
    if top_k is not None and tensor.shape[1] != top_k:
        raise RoutingError(f"`{path}`: tensor `{name}` has {tensor.shape[1]} columns but top_k={top_k}.")
    tensor = tensor.long()
    if tensor.numel():
        low, high = int(tensor.min()), int(tensor.max())
        limit = num_experts if num_experts is not None else None
        if low < 0 or (limit is not None and high >= limit):
            bad = low if low < 0 else high
            valid = f"0..{limit - 1}" if limit is not None else "0 or more"
            raise RoutingError(f"`{path}`: tensor `{name}` holds expert id {bad}, outside {valid}.")
    return tensor
