"""The safetensors form of a :class:`~modelgraft.moe.RoutingTrace`, on disk and as bytes.

One tensor ``layer.<i>`` per MoE layer in :func:`~modelgraft.moe.compact_dtype` and the fields as
JSON strings in the metadata. Reading checks every part and raises :class:`RoutingError` (never a
``KeyError``, JSON or safetensors error) for anything a writer of ours would not have produced.

Example:
    >>> import torch
    >>> from modelgraft.moe.trace import RoutingTrace
    >>> data = trace_bytes(RoutingTrace([torch.tensor([[1, 0]])], top_k=2, num_experts=300))
    >>> trace_from_bytes(data)["layers"][0].dtype  # 300 experts do not fit uint8
    torch.int16
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from modelgraft.errors import RoutingError, RoutingFileError
from modelgraft.moe._ids import MISSING_POLICIES, is_id_dtype, missing_rows, to_compact, widen

if TYPE_CHECKING:  # the trace imports this module to save and load itself
    from modelgraft.moe.trace import RoutingTrace

_FORMAT = "modelgraft.routing/1"
# The optional per-row flags of `RoutingTrace.routed` (absent: every row routed; older files lack it).
_ROUTED = "routed"


def _payload(trace: RoutingTrace) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    live = trace.missing == "live"
    experts = trace.num_experts
    tensors = {}
    for i, (lid, tensor) in enumerate(zip(trace.layer_ids, trace.layers)):
        layer_experts = experts
        if layer_experts is None:  # unknown: keep the ids as they are, only narrowed to what holds them
            layer_experts = 1 + (int(tensor.max()) if tensor.numel() else 0)
        compact = to_compact(tensor.detach().cpu(), layer_experts, f"layer `{lid}`", allow_missing=live)
        tensors[f"layer.{i}"] = compact.contiguous()
    if trace.routed is not None:  # rows modelgraft filled in (padding, an engine's last token)
        tensors[_ROUTED] = trace.routed.contiguous()
    meta = {
        "format": _FORMAT,
        "layer_ids": json.dumps(trace.layer_ids),
        "layer_names": json.dumps(trace.layer_names),
        "top_k": json.dumps(trace.top_k),
        "num_experts": json.dumps(trace.num_experts),
        "model_type": json.dumps(trace.model_type),
        "batch_size": json.dumps(trace.batch_size),
        # Positions per sequence: with `batch_size` it fixes the row count, so a `batch_size` edited
        # into another divisor of the rows is caught at load.
        "seq_len": json.dumps(trace.seq_len),
        "missing": json.dumps(trace.missing),
    }
    return tensors, meta


def save_trace(trace: RoutingTrace, path: str | os.PathLike[str]) -> None:
    """Write ``trace`` to ``path`` (see :meth:`RoutingTrace.save`)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    tensors, meta = _payload(trace)
    try:
        save_file(tensors, os.fspath(path), metadata=meta)
    except (
        SafetensorError,
        OSError,
        RuntimeError,
        ValueError,
        TypeError,
    ) as exc:  # safetensors reports I/O as its own error
        raise RoutingError(
            f"Cannot write the routing trace to `{path}` ({type(exc).__name__}: {exc}); pass a path in an existing, "
            "writable directory."
        ) from exc


def trace_bytes(trace: RoutingTrace) -> bytes:
    """``trace`` as safetensors bytes (see :meth:`RoutingTrace.to_bytes`)."""
    from safetensors.torch import save

    tensors, meta = _payload(trace)
    return save(tensors, metadata=meta)


def load_trace(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a trace file: the fields of its :class:`RoutingTrace` (see :meth:`RoutingTrace.load`)."""
    from safetensors import SafetensorError, safe_open

    try:
        where = os.fspath(path)
    except TypeError:
        raise RoutingError(
            f"A routing trace is loaded from a path (`str` or `os.PathLike`); got `{type(path).__name__}`."
        ) from None
    # Before safetensors opens it: a folder is "No such device (os error 19)" there, and a missing
    # file its own FileNotFoundError; both are paths that hold no trace.
    if os.path.isdir(where):
        raise RoutingFileError(
            f"`{path}` is a folder, not a routing trace file; pass the `.safetensors` file `RoutingTrace.save` wrote."
        )
    if not os.path.exists(where):
        raise RoutingFileError(
            f"`{path}` does not exist; pass the path of a routing trace written by `RoutingTrace.save`."
        )
    try:
        with safe_open(where, framework="pt") as handle:
            return _read(path, handle.metadata() or {}, list(handle.keys()), handle.get_tensor)
    except RoutingError:
        raise
    except (SafetensorError, OSError, ValueError, RuntimeError, TypeError) as exc:
        raise RoutingError(
            f"`{path}` cannot be read as safetensors ({type(exc).__name__}: {exc}); write it with "
            "`RoutingTrace.save`."
        ) from exc


def trace_from_bytes(data: bytes) -> dict[str, Any]:
    """Read the bytes of :func:`trace_bytes`: the fields of the trace (see :meth:`RoutingTrace.from_bytes`)."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    where = "the routing bytes"
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise RoutingError(
            f"{where} must be `bytes` (from `RoutingTrace.to_bytes`); got `{type(data).__name__}`."
        )
    data = bytes(data)
    try:
        size = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + size]) if len(data) >= 8 + size else None
        if not isinstance(header, dict):
            raise ValueError("no safetensors header")
        meta = header.get("__metadata__") or {}
        names = [name for name in header if name != "__metadata__"]
        tensors = load(data)
    except (SafetensorError, ValueError, RecursionError, OverflowError, UnicodeDecodeError) as exc:
        raise RoutingError(
            f"{where} cannot be read as safetensors ({type(exc).__name__}); send `RoutingTrace.to_bytes()`."
        ) from None
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise RoutingError(f"{where}: the safetensors metadata must map names to strings.")
    return _read(where, meta, names, tensors.__getitem__)


def _read(
    path: Any, meta: dict[str, str], names: list[str], get: Callable[[str], torch.Tensor]
) -> dict[str, Any]:
    if meta.get("format") != _FORMAT:
        raise RoutingError(
            f"`{path}` is not a modelgraft routing trace (metadata format `{meta.get('format')}`, "
            f"expected `{_FORMAT}`); write it with `RoutingTrace.save`."
        )
    fields = _read_metadata(path, meta)
    expected = [f"layer.{i}" for i in range(len(fields["layer_ids"]))]
    _check_names(path, [n for n in names if n != _ROUTED], expected)
    layers = [_read_layer(path, name, get(name), fields) for name in expected]
    routed = _read_routed(path, get(_ROUTED), layers) if _ROUTED in names else None
    seq_len = fields.pop("seq_len")
    batch = fields["batch_size"]
    if seq_len is not None or batch is not None:
        if seq_len is None and "seq_len" in meta:
            raise RoutingError(
                f"`{path}`: metadata `batch_size` is {batch} but `seq_len` is null; the file was changed after "
                "`RoutingTrace.save` wrote it."
            )
        for name, tensor in zip(expected, layers):
            if seq_len is not None and (batch is None or tensor.shape[0] != batch * seq_len):
                raise RoutingError(
                    f"`{path}`: metadata `batch_size` {batch} and `seq_len` {seq_len} describe "
                    f"{(batch or 0) * seq_len} rows but tensor `{name}` has {tensor.shape[0]}; the file was changed "
                    "after `RoutingTrace.save` wrote it."
                )
    return {"layers": layers, **fields, "routed": routed}


def _read_routed(path: Any, tensor: torch.Tensor, layers: list[torch.Tensor]) -> torch.Tensor:
    rows = int(layers[0].shape[0]) if layers else 0
    if tensor.dtype != torch.bool or tensor.dim() != 1 or tensor.shape[0] != rows:
        raise RoutingError(
            f"`{path}`: tensor `{_ROUTED}` is {tensor.dtype} of shape {tuple(tensor.shape)}; expected bool of "
            f"shape ({rows},), one flag per row. The file was changed after `RoutingTrace.save` wrote it."
        )
    return tensor


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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _read_metadata(path: Any, meta: dict[str, str]) -> dict[str, Any]:
    fields = {
        "layer_ids": _json_field(path, meta, "layer_ids"),
        "top_k": _json_field(path, meta, "top_k"),
        "num_experts": _json_field(path, meta, "num_experts"),
        "model_type": _json_field(path, meta, "model_type"),
        "layer_names": _json_field(path, meta, "layer_names", "[]"),
        "batch_size": _json_field(path, meta, "batch_size", "null"),
        "seq_len": _json_field(path, meta, "seq_len", "null"),
        "missing": _json_field(path, meta, "missing", '"refuse"'),
    }
    ids = fields["layer_ids"]
    if not isinstance(ids, list) or not all(_is_int(i) and i >= 0 for i in ids):
        raise RoutingError(
            f"`{path}`: metadata `layer_ids` must be a list of non-negative integers; got {json.dumps(ids)[:80]}."
        )
    for key in ("top_k", "num_experts", "batch_size", "seq_len"):
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
    if fields["missing"] not in MISSING_POLICIES:
        raise RoutingError(
            f'`{path}`: metadata `missing` must be "refuse" or "live"; got {json.dumps(fields["missing"])[:80]}.'
        )
    return fields


def _check_names(path: Any, names: list[str], expected: list[str]) -> None:
    extra = sorted(set(names) - set(expected))
    if extra:
        raise RoutingError(
            f"`{path}` holds unexpected tensor `{extra[0]}`; a routing trace holds `layer.0` .. "
            f"`layer.{len(expected) - 1}`, one per entry of `layer_ids`, and optionally `{_ROUTED}`."
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
            f"`{path}`: tensor `{name}` holds `{tensor.dtype}` ids; expected integers (uint8, int16, int32)."
        )
    if tensor.dim() != 2:
        raise RoutingError(
            f"`{path}`: tensor `{name}` has shape {tuple(tensor.shape)}; expected (num_tokens, top_k)."
        )
    top_k, num_experts = fields["top_k"], fields["num_experts"]
    if top_k is not None and tensor.shape[1] != top_k:
        raise RoutingError(f"`{path}`: tensor `{name}` has {tensor.shape[1]} columns but top_k={top_k}.")
    tensor = widen(tensor)
    live = fields["missing"] == "live"
    missing = missing_rows(tensor, f"`{path}` tensor `{name}`") if live else None
    real = tensor[~missing] if missing is not None else tensor
    if real.numel():
        low, high = int(real.min()), int(real.max())
        if low < 0 or (num_experts is not None and high >= num_experts):
            bad = low if low < 0 else high
            valid = f"0..{num_experts - 1}" if num_experts is not None else "0 or more"
            raise RoutingError(f"`{path}`: tensor `{name}` holds expert id {bad}, outside {valid}.")
    experts = num_experts if num_experts is not None else 1 + (int(real.max()) if real.numel() else 0)
    return to_compact(tensor, experts, f"`{path}` tensor `{name}`", allow_missing=live)
