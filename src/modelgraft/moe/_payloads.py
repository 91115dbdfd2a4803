"""Decode what the engines send into per-request route parts: ``(start, rows)`` with rows
``(n, layers, top_k)``, and the request's token count when the payload says it.

Formats, as the engines' own code writes them:

* vLLM offline (``vllm/outputs.py``): ``RequestOutput.prompt_routed_experts`` (prompt rows) and
  ``CompletionOutput.routed_experts`` (rows of the generated tokens but the last); older releases
  put every row (prompt and completion, ``num_tokens - 1``) in ``CompletionOutput.routed_experts``.
  Rows are aligned by their end: the prompt rows end at the last prompt token, the completion rows
  at the last token but one. This is exact for both layouts and for ``routed_experts_prompt_start``
  (leading rows trimmed).
* vLLM server (OpenAI responses with ``return_token_ids``): the same arrays as base64 of a ``.npy``
  file (``np.save``), in ``prompt_routed_experts`` and ``choices[i].routed_experts``.
* SGLang (``python/sglang/srt/layers/moe/routed_experts_capturer.py``): ``meta_info["routed_experts"]``
  is base64 of the flat row-major ids, ``int32`` by default, ``uint16``/``uint8`` when
  ``meta_info["routed_experts_dtype"]`` says so; rows cover ``[routed_experts_start_len, seqlen - 1)``.

Example:
    >>> import base64, io, numpy as np
    >>> buffer = io.BytesIO(); np.save(buffer, np.arange(8, dtype=np.int16).reshape(2, 2, 2))
    >>> decode_npy(base64.b64encode(buffer.getvalue()).decode(), "request 0").tolist()
    [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
"""

from __future__ import annotations

import ast
import base64
import binascii
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from modelgraft.errors import RoutingError

_NPY_MAGIC = b"\x93NUMPY"
# `.npy` type strings of integer ids (numpy writes native little-endian on every platform we run).
_NPY_DTYPES = {
    "|u1": torch.uint8,
    "|i1": torch.int8,
    "<u2": torch.uint16,
    "<i2": torch.int16,
    "<u4": torch.uint32,
    "<i4": torch.int32,
    "<i8": torch.int64,
}
_SGLANG_DTYPES = {"int32": torch.int32, "uint16": torch.uint16, "uint8": torch.uint8}


@dataclass
class Part:
    """Rows of one request from token ``start`` on."""

    start: int
    rows: torch.Tensor  # (n, layers, top_k) int64


@dataclass
class Request:
    """The route parts of one training sequence and, when the payload says it, its token count."""

    name: str
    parts: list[Part] = field(default_factory=list)
    tokens: int | None = None


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def as_ids(array: Any, where: str) -> torch.Tensor:
    """An integer array (numpy, torch, nested lists) as ``int64``; anything else is a RoutingError."""
    try:
        tensor = torch.as_tensor(array)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise RoutingError(
            f"Routed experts of {where} must be an integer array (int32, int16, uint8, ...); got "
            f"`{type(array).__name__}` ({exc})."
        ) from None
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise RoutingError(
            f"Routed experts of {where} must be an integer array (int32, int16, uint8, ...); got `{tensor.dtype}`."
        )
    return tensor.long()


def _b64(payload: str | bytes, where: str, what: str) -> bytes:
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RoutingError(
            f"{what} of {where} is not valid base64 ({exc}); pass it as the engine returned it."
        ) from None
    if not raw:
        raise RoutingError(f"{what} of {where} is empty; it holds no routed experts.")
    return raw


def decode_npy(payload: str | bytes, where: str) -> torch.Tensor:
    """Base64 of a ``.npy`` file (vLLM's server) to an ``int64`` tensor; no pickle is ever loaded.

    Raises:
        RoutingError: not base64, not a ``.npy`` file, a header that cannot be read, a dtype that
            is not an integer, a byte count that does not fit the shape, or not 3-D.
    """
    raw = _b64(payload, where, "The `.npy` routes")
    if not raw.startswith(_NPY_MAGIC) or len(raw) < 10:
        raise RoutingError(
            f"The routes of {where} are base64 but not of a `.npy` file (vLLM's server sends `np.save` output); "
            "for SGLang's flat buffers use `from_sglang`."
        )
    major = raw[6]
    width = 2 if major == 1 else 4
    size = int.from_bytes(raw[8 : 8 + width], "little")
    start = 8 + width
    try:
        header = ast.literal_eval(raw[start : start + size].decode("latin1"))
        descr, fortran, shape = header["descr"], header["fortran_order"], tuple(header["shape"])
    except (ValueError, SyntaxError, KeyError, TypeError, UnicodeDecodeError, MemoryError, RecursionError):
        raise RoutingError(f"The `.npy` routes of {where} have a header that cannot be read.") from None
    if not isinstance(fortran, bool):
        raise RoutingError(
            f"The `.npy` routes of {where} have `fortran_order` {fortran!r} in their header; expected True or False."
        )
    dtype = _NPY_DTYPES.get(descr) if isinstance(descr, str) else None
    if dtype is None:
        raise RoutingError(
            f"The `.npy` routes of {where} hold `{descr}`; expected little-endian integer ids "
            f"({', '.join(_NPY_DTYPES)})."
        )
    if len(shape) != 3 or not all(_is_int(n) and n >= 0 for n in shape):
        raise RoutingError(
            f"The `.npy` routes of {where} have shape {shape}; expected (tokens, num_hidden_layers, top_k)."
        )
    body = raw[start + size :]
    count = shape[0] * shape[1] * shape[2]
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if len(body) != count * itemsize:
        raise RoutingError(
            f"The `.npy` routes of {where} hold {len(body)} bytes of data for shape {shape} ({count * itemsize} "
            "expected); the payload is truncated or altered."
        )
    flat = torch.frombuffer(bytearray(body), dtype=dtype) if count else torch.empty(0, dtype=dtype)
    if fortran:
        return flat.long().reshape(shape[::-1]).permute(2, 1, 0).contiguous()
    return flat.long().reshape(shape)


def decode_sglang(
    payload: str | bytes, where: str, dtype: str, layers: int | None, top_k: int | None
) -> torch.Tensor:
    """SGLang's base64 flat buffer to ``(rows, layers, top_k)`` ``int64``.

    Raises:
        RoutingError: not base64, an unknown dtype, a byte count that is not whole ids, an id count
            that is not a multiple of ``layers * top_k``, or ``layers``/``top_k`` unknown.
    """
    if dtype not in _SGLANG_DTYPES:
        raise RoutingError(
            f"SGLang routes of {where} are marked `{dtype}`; SGLang sends int32, uint16 or uint8."
        )
    if top_k is None or layers is None:
        raise RoutingError("Decoding SGLang base64 needs `top_k` and `num_hidden_layers` (or `model`).")
    raw = _b64(payload, where, "SGLang payload")
    itemsize = torch.empty(0, dtype=_SGLANG_DTYPES[dtype]).element_size()
    if len(raw) % itemsize:
        raise RoutingError(
            f"SGLang payload of {where} decodes to {len(raw)} bytes, not a whole number of {dtype} ids."
        )
    flat = torch.frombuffer(bytearray(raw), dtype=_SGLANG_DTYPES[dtype]).long()
    if flat.numel() % (layers * top_k):
        raise RoutingError(
            f"SGLang payload of {where} holds {flat.numel()} ids, not a multiple of "
            f"num_hidden_layers * top_k = {layers * top_k}."
        )
    return flat.reshape(-1, layers, top_k)


# ---- vLLM ------------------------------------------------------------------------------------------
def _array_or_npy(value: Any, where: str) -> torch.Tensor:
    if isinstance(value, (str, bytes)):
        return decode_npy(value, where)
    return as_ids(value, where)


def _get(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)


def _token_count(value: Any, where: str, what: str) -> int:
    if value is None:
        raise RoutingError(
            f"{where} has no `{what}`; vLLM returns token ids with `return_token_ids=True` (server), and "
            "always on `RequestOutput`/`CompletionOutput`. They place the routed rows."
        )
    try:
        return len(value)
    except TypeError:
        raise RoutingError(f"`{what}` of {where} must be a sequence of token ids.") from None


def _end_aligned(rows: torch.Tensor, end: int, where: str) -> Part:
    if rows.dim() != 3:
        raise RoutingError(
            f"Routed experts of {where} must be (tokens, layers, top_k); got shape {tuple(rows.shape)}."
        )
    start = end - rows.shape[0]
    if start < 0:
        raise RoutingError(
            f"Routed experts of {where} have {rows.shape[0]} rows but only {end} tokens can have a route there."
        )
    return Part(start, rows)


def vllm_request(item: Any, index: int) -> list[Request]:
    """One request per completion of a vLLM ``RequestOutput`` or server response dict."""
    is_json = isinstance(item, dict)
    outputs = item.get("choices") if is_json else getattr(item, "outputs", None)
    label = f"request {index}"
    if not isinstance(outputs, (list, tuple)) or not outputs:
        raise RoutingError(
            f"{label} has no completions (`outputs` / `choices`); pass vLLM's output as returned."
        )
    prompt_rows = _get(item, "prompt_routed_experts")
    requests = []
    for position, completion in enumerate(outputs):
        where = f"request {index}" if len(outputs) == 1 else f"request {index} completion {position}"
        prompt_ids = _get(completion, "prompt_token_ids") if is_json else None
        prompt_ids = prompt_ids if prompt_ids is not None else _get(item, "prompt_token_ids")
        prompt_len = _token_count(prompt_ids, where, "prompt_token_ids")
        completion_len = _token_count(_get(completion, "token_ids"), where, "token_ids")
        parts = []
        if prompt_rows is not None:
            parts.append(_end_aligned(_array_or_npy(prompt_rows, where), prompt_len, f"{where} (prompt)"))
        generated = _get(completion, "routed_experts")
        if generated is not None:
            end = prompt_len + max(completion_len - 1, 0)
            parts.append(_end_aligned(_array_or_npy(generated, where), end, where))
        if not parts:
            raise RoutingError(
                f"{where} carries no routed experts; start vLLM with `enable_return_routed_experts=True` "
                "(server: `--enable-return-routed-experts`)."
            )
        requests.append(Request(where, parts, prompt_len + completion_len))
    return requests


def vllm_requests(items: Sequence[Any]) -> list[Request]:
    """The requests of ``from_vllm``'s input, in batch order (completions of a request in order)."""
    requests: list[Request] = []
    for index, item in enumerate(items):
        where = f"request {index}"
        if isinstance(item, dict) or hasattr(item, "outputs"):
            requests.extend(vllm_request(item, index))
        elif isinstance(item, tuple) and len(item) == 2 and _is_int(item[0]):
            requests.append(Request(where, [Part(int(item[0]), _array_or_npy(item[1], where))]))
        elif isinstance(item, tuple) and len(item) == 2:
            prompt = _array_or_npy(item[0], f"{where} (prompt)")
            generated = _array_or_npy(item[1], where)
            requests.append(Request(where, [Part(0, prompt), Part(prompt.shape[0], generated)]))
        elif hasattr(item, "routed_experts") and hasattr(item, "token_ids"):  # a CompletionOutput alone
            requests.append(Request(where, [Part(0, _array_or_npy(item.routed_experts, where))]))
        else:
            requests.append(Request(where, [Part(0, _array_or_npy(item, where))]))
    for request in requests:
        for part in request.parts:
            if part.rows.dim() != 3:
                raise RoutingError(
                    f"Routed experts of {request.name} must be (tokens, layers, top_k); got shape "
                    f"{tuple(part.rows.shape)}."
                )
            if part.start < 0:
                raise RoutingError(
                    f"{request.name} has a part starting at token {part.start}; starts are >= 0."
                )
    return requests


# ---- SGLang ----------------------------------------------------------------------------------------
def sglang_requests(
    items: Sequence[Any], layers: int | None, top_k: int | None, dtype: str | None
) -> list[Request]:
    """The requests of ``from_sglang``'s input: payload strings, ``meta_info`` dicts or whole responses."""
    requests = []
    for index, item in enumerate(items):
        where = f"request {index}"
        start, tokens, wire = 0, None, dtype or "int32"
        if isinstance(item, dict) and isinstance(item.get("meta_info"), dict):
            item = item["meta_info"]
        if isinstance(item, dict):
            if "routed_experts" not in item:
                raise RoutingError(
                    f"Request {index}'s `meta_info` has no `routed_experts`; start SGLang with "
                    "`--enable-return-routed-experts`, send `return_routed_experts: true`, and pass each "
                    "request's `meta_info` (or its `routed_experts`)."
                )
            start = item.get("routed_experts_start_len", 0) or 0
            if not _is_int(start) or start < 0:
                raise RoutingError(
                    f"`routed_experts_start_len` of {where} must be a non-negative integer; got {start!r}."
                )
            wire = item.get("routed_experts_dtype") or wire
            # JSON numbers of the server's response: any integral type (_is_int checks them).
            prompt: Any = item.get("prompt_tokens")
            completion: Any = item.get("completion_tokens")
            if _is_int(prompt) and _is_int(completion):
                tokens = prompt + completion
            item = item["routed_experts"]
        elif isinstance(item, tuple) and len(item) == 2 and _is_int(item[0]):
            start, item = item
        if isinstance(item, (str, bytes)):
            rows = decode_sglang(item, where, str(wire).strip().lower(), layers, top_k)
        elif hasattr(item, "__array__") or isinstance(item, (torch.Tensor, list)):
            rows = as_ids(item, where)
        else:
            raise RoutingError(
                f"SGLang routes of {where} must be a base64 string of int32 (or an array); got "
                f"`{type(item).__name__}`."
            )
        requests.append(Request(where, [Part(int(start), rows)], tokens))
    return requests
