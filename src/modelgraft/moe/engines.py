"""Turn inference-engine routing output into a :class:`RoutingTrace` for the trainer's padded batch.

Engine conventions (see ``docs/moe.md``):

* vLLM (``enable_return_routed_experts=True``): ``CompletionOutput.routed_experts`` is an array of
  shape ``(num_tokens - 1, num_hidden_layers, top_k)``, ``int32`` (``uint8``/``int16`` downstream).
  The last sampled token never went through the model, so its row is missing. The layer axis counts
  *every* decoder layer; dense layers hold rows of zeros and are dropped here.
* SGLang (``return_routed_experts``): the same array, sent as base64 of little-endian ``int32``
  in ``meta_info["routed_experts"]``.
* Engines that report MoE layers only (TensorRT-LLM) are accepted too: a layer axis equal to the
  number of MoE layers is taken as is.

The missing last row and every padding position get valid expert ids spread over the experts
(pad ordinal ``p`` uses experts ``(p * top_k + j) % num_experts``), never a constant fill: a single
hot expert breaks ``split_with_sizes`` and overloads one expert-parallel rank.

Example:
    >>> import numpy as np, torch
    >>> req = np.array([[[0, 0], [1, 2]], [[0, 0], [3, 1]]], dtype=np.int32)  # 3 tokens, 2 layers
    >>> trace = from_vllm([req], moe_layer_ids=[1], num_experts=4, num_hidden_layers=2,
    ...                   attention_mask=torch.tensor([[1, 1, 1, 0]]))
    >>> trace[0].tolist()  # rows: 2 routed tokens, the filled last token, one pad
    [[1, 2], [3, 1], [2, 3], [0, 1]]
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

from modelgraft.errors import RoutingError
from modelgraft.moe.routing import moe_layers
from modelgraft.moe.trace import RoutingTrace, spread_fill

__all__ = ["from_sglang", "from_vllm", "join_routes", "layout_requests"]

_INT_DTYPES = {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32}


_fill = spread_fill


def _as_long(array: Any, where: str) -> torch.Tensor:
    tensor = torch.as_tensor(array)
    if tensor.dtype not in _INT_DTYPES:
        raise RoutingError(
            f"Routed experts of {where} must be an integer array (int32, int16, uint8, ...); got `{tensor.dtype}`."
        )
    return tensor.long()


def layout_requests(
    requests: Sequence[Any],
    attention_mask: torch.Tensor,
    num_experts: int,
    *,
    layer_ids: Sequence[int] | None = None,
    model_type: str | None = None,
) -> RoutingTrace:
    """Lay per-request routes ``(num_real_tokens, num_moe_layers, top_k)`` out as a padded batch.

    Args:
        requests: one integer array per batch row, rows in token order.
        attention_mask: ``(batch, seq)`` with 1 on real tokens (left or right padding, or any layout).
        num_experts: experts per layer, for the padding filler.
        layer_ids: decoder-layer index of each MoE layer (kept in the trace).
        model_type: kept in the trace.

    Returns:
        A trace with ``batch * seq`` rows per layer, row-major over the batch.

    Example:
        >>> import torch
        >>> req = torch.tensor([[[2, 3]], [[1, 0]]])  # 2 tokens, 1 MoE layer, top-2
        >>> layout_requests([req], torch.tensor([[0, 1, 1]]), num_experts=4)[0].tolist()
        [[0, 1], [2, 3], [1, 0]]
    """
    mask = torch.as_tensor(attention_mask).bool()
    if mask.dim() != 2 or mask.shape[0] != len(requests):
        raise RoutingError(
            f"`attention_mask` must be (batch, seq) with one row per request; got shape {tuple(mask.shape)} "
            f"for {len(requests)} requests."
        )
    tensors = [_as_long(req, f"request {i}") for i, req in enumerate(requests)]
    if not tensors:
        raise RoutingError("No requests given; pass one routed-experts array per batch row.")
    num_layers, top_k = tensors[0].shape[1], tensors[0].shape[2]
    batch, seq = mask.shape
    out = torch.empty(batch * seq, num_layers, top_k, dtype=torch.long)
    pad_rows = (~mask).reshape(-1).nonzero().squeeze(1)
    out[pad_rows] = _fill(0, len(pad_rows), top_k, num_experts).unsqueeze(1)
    for i, req in enumerate(tensors):
        real = mask[i].nonzero().squeeze(1)
        if req.dim() != 3 or req.shape[1:] != (num_layers, top_k):
            raise RoutingError(
                f"Request {i} has routes of shape {tuple(req.shape)}; expected (tokens, {num_layers}, {top_k}) "
                "like request 0."
            )
        if req.shape[0] != len(real):
            raise RoutingError(
                f"Request {i} has {req.shape[0]} routed tokens but its attention_mask row has {len(real)} "
                "real tokens; pass the mask of the batch the trainer will run."
            )
        out[i * seq + real] = req
    if out.numel() and (int(out.min()) < 0 or int(out.max()) >= num_experts):
        raise RoutingError(
            f"Routed expert ids must lie in 0..{num_experts - 1}; found {int(out.min())}..{int(out.max())}. "
            "Replace missing-route sentinels (-1) before laying out."
        )
    ids = list(layer_ids) if layer_ids is not None else list(range(num_layers))
    return RoutingTrace([out[:, j].clone() for j in range(num_layers)], ids, top_k, num_experts, model_type)


def _model_info(model: nn.Module | None) -> tuple[list[int] | None, int | None, int | None, str | None]:
    if model is None:
        return None, None, None, None
    layers = moe_layers(model)
    config: Any = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return (
        [layer.layer_id for layer in layers],
        layers[0].num_experts,
        getattr(text, "num_hidden_layers", None),
        getattr(config, "model_type", None),
    )


def from_vllm(
    routed_experts: Sequence[Any],
    model: nn.Module | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
    input_lengths: Sequence[int] | None = None,
    padding_side: str = "right",
    moe_layer_ids: Sequence[int] | None = None,
    num_experts: int | None = None,
    num_hidden_layers: int | None = None,
    allow_all_zero: bool = False,
) -> RoutingTrace:
    """Build the trace for the trainer's padded batch from vLLM's per-request ``routed_experts``.

    Args:
        routed_experts: per request an array ``(num_tokens - 1, num_hidden_layers, top_k)`` (or with
            ``num_tokens`` rows) of int32/int16/uint8 expert ids, ``num_tokens`` = prompt + completion.
        model: the trainer's model; gives the MoE layer ids, ``num_experts`` and ``num_hidden_layers``
            from its actual modules. Without it pass ``moe_layer_ids``, ``num_experts`` and
            ``num_hidden_layers``.
        attention_mask: ``(batch, seq)`` mask of the training batch. Either this or ``input_lengths``.
        input_lengths: tokens per request (prompt + completion); the batch is padded on ``padding_side``.
        padding_side: ``"right"`` or ``"left"``, used with ``input_lengths``.
        moe_layer_ids, num_experts, num_hidden_layers: override what ``model`` says.
        allow_all_zero: accept an MoE layer whose every routed id is 0 in every request (an engine
            reports that for a layer it did not capture, e.g. another pipeline stage's); refused by default.

    Returns:
        A :class:`RoutingTrace` with ``batch * seq`` rows per MoE layer, ready for ``replay_routing``.

    Raises:
        RoutingError: a row count that is neither ``num_tokens`` nor ``num_tokens - 1``, a layer axis
            that fits neither all layers nor MoE layers only, ids out of range, a non-integer dtype,
            an MoE layer whose routed ids are all 0 (unless ``allow_all_zero``).
    """
    ids, experts, hidden_layers, model_type = _model_info(model)
    ids = list(moe_layer_ids) if moe_layer_ids is not None else ids
    experts = num_experts if num_experts is not None else experts
    hidden_layers = num_hidden_layers if num_hidden_layers is not None else hidden_layers
    if ids is None or experts is None:
        raise RoutingError(
            "Pass `model`, or `moe_layer_ids` and `num_experts`, to know which layers are MoE."
        )
    if len(set(ids)) != len(ids):
        raise RoutingError(
            f"The model has several routing sites per decoder layer (layer ids {ids}); engine arrays indexed "
            "by decoder layer cannot say which is which. Build the trace with `layout_requests` instead."
        )
    mask = _mask(attention_mask, input_lengths, padding_side, len(routed_experts))
    selected = []
    for i, raw in enumerate(routed_experts):
        arr = _as_long(raw, f"request {i}")
        if arr.dim() != 3:
            raise RoutingError(
                f"Routed experts of request {i} must be (tokens, layers, top_k); got shape {tuple(arr.shape)}."
            )
        selected.append(_select_layers(arr, ids, hidden_layers, i))
    if not allow_all_zero:
        _refuse_all_zero_layers(selected, ids)
    requests = []
    for i, arr in enumerate(selected):
        tokens = int(mask[i].sum())
        if arr.shape[0] == tokens - 1:
            # The last sampled token never ran through the MoE: give it a valid route, using negative
            # filler ordinals so it does not repeat the pad rows' experts.
            arr = torch.cat(
                [arr, _fill(-1 - i, 1, arr.shape[2], experts).unsqueeze(1).expand(1, arr.shape[1], -1)]
            )
        elif arr.shape[0] != tokens:
            raise RoutingError(
                f"Routed experts of request {i} have {arr.shape[0]} rows but the request has {tokens} tokens; "
                f"expected {tokens - 1} (vLLM/SGLang: the last token has no route) or {tokens}."
            )
        requests.append(arr)
    return layout_requests(requests, mask, experts, layer_ids=ids, model_type=model_type)


def _refuse_all_zero_layers(requests: list[torch.Tensor], ids: list[int]) -> None:
    """An MoE layer routed to expert 0 only, in every request, is a layer the engine did not capture."""
    rows = [arr for arr in requests if arr.shape[0]]
    if not rows:
        return
    nonzero = torch.stack([(arr != 0).any(-1).any(0) for arr in rows]).any(0)  # per layer
    if not bool(nonzero.all()):
        layer = ids[int((~nonzero).nonzero()[0, 0])]
        raise RoutingError(
            f"Every routed expert id of MoE layer `{layer}` is 0 in every request: that is what an engine "
            "reports for a layer it did not capture (e.g. another pipeline stage's), and replaying it would "
            "send every token to expert 0. Capture that layer, or pass `allow_all_zero=True` if these routes "
            "are real."
        )


def join_routes(parts: Sequence[tuple[int, Any]], overlap: str = "check") -> torch.Tensor:
    """Join one request's routed experts received in parts: multi-turn incremental transfer.

    With vLLM's ``SamplingParams.routed_experts_prompt_start`` (SGLang: ``routed_experts_start_len``)
    an engine returns only the rows from a token index on, so each turn of a conversation sends its
    new rows once. Give each part as ``(start, rows)``, ``start`` being the token index of its first
    row; together the parts must cover the rows from token 0 without a gap. The result goes to
    :func:`from_vllm` like a whole array.

    Args:
        parts: ``(start, array of shape (rows, layers, top_k))`` in any order.
        overlap: rows sent in two parts must be equal (``"check"``, the default: a mismatch means
            the engine routed the same token differently, which replay cannot honour twice), or the
            later part wins (``"last"``).

    Raises:
        RoutingError: a gap (names the missing token indices), a mismatch in an overlap (names the
            first token), parts whose layer or top-k axes differ, a negative start.

    Example:
        >>> import numpy as np
        >>> turn1 = np.array([[[1, 2]], [[0, 3]]], dtype=np.int32)  # tokens 0-1
        >>> turn2 = np.array([[[3, 1]], [[2, 0]]], dtype=np.int32)  # tokens 2-3 (prompt_start=2)
        >>> join_routes([(0, turn1), (2, turn2)])[:, 0].tolist()
        [[1, 2], [0, 3], [3, 1], [2, 0]]
    """
    if overlap not in ("check", "last"):
        raise RoutingError(f"`overlap` must be 'check' or 'last'; got `{overlap}`.")
    if not parts:
        raise RoutingError("`join_routes` needs at least one `(start, rows)` part.")
    ordered = sorted(
        ((int(start), _as_long(rows, f"the part starting at token {start}")) for start, rows in parts),
        key=lambda part: part[0],
    )
    if ordered[0][0] < 0:
        raise RoutingError(f"A part starts at token {ordered[0][0]}; starts are token indices (>= 0).")
    if ordered[0][1].dim() != 3:
        raise RoutingError(
            f"The part starting at token {ordered[0][0]} has shape {tuple(ordered[0][1].shape)}; parts must be "
            "(rows, layers, top_k)."
        )
    shape = ordered[0][1].shape[1:]
    joined = ordered[0][1]
    if ordered[0][0] != 0:
        raise RoutingError(
            f"The parts start at token {ordered[0][0]}; rows for tokens [0, {ordered[0][0]}) are missing. "
            "Pass the part that starts at 0 (the first turn's routes)."
        )
    for start, rows in ordered[1:]:
        if rows.dim() != 3 or rows.shape[1:] != shape:
            raise RoutingError(
                f"The part starting at token {start} has shape {tuple(rows.shape)}; every part must be "
                f"(rows, {shape[0]}, {shape[1]}) like the first."
            )
        end = joined.shape[0]
        if start > end:
            raise RoutingError(
                f"Rows for tokens [{end}, {start}) are missing between the parts; the part starting at "
                f"token {start} does not continue the rows so far (they end at token {end})."
            )
        common = min(end - start, rows.shape[0])
        if overlap == "check" and common > 0:
            differ = (joined[start : start + common] != rows[:common]).flatten(1).any(1).nonzero()
            if differ.numel():
                token = start + int(differ[0])
                raise RoutingError(
                    f"Token {token} was routed differently in two parts (rows sent twice must agree); pass "
                    "`overlap='last'` to keep the later part's routes."
                )
        joined = torch.cat([joined[:start], rows, joined[start + rows.shape[0] :]])
    return joined


def _select_layers(
    arr: torch.Tensor, ids: list[int], hidden_layers: int | None, request: int
) -> torch.Tensor:
    if hidden_layers is not None and arr.shape[1] == hidden_layers:
        return arr[:, ids]
    if arr.shape[1] == len(ids):
        return arr
    if hidden_layers is None and arr.shape[1] > max(ids):
        return arr[:, ids]
    raise RoutingError(
        f"Routed experts of request {request} have {arr.shape[1]} layers; expected num_hidden_layers="
        f"{hidden_layers} (vLLM/SGLang) or {len(ids)} MoE layers (MoE-only engines)."
    )


def _mask(
    attention_mask: torch.Tensor | None, input_lengths: Sequence[int] | None, padding_side: str, batch: int
) -> torch.Tensor:
    if attention_mask is not None:
        return torch.as_tensor(attention_mask).bool()
    if input_lengths is None:
        raise RoutingError(
            "Pass `attention_mask` (the training batch's) or `input_lengths` with `padding_side`."
        )
    if padding_side not in ("left", "right"):
        raise RoutingError(f"`padding_side` must be 'left' or 'right'; got `{padding_side}`.")
    if len(input_lengths) != batch:
        raise RoutingError(
            f"Got {len(input_lengths)} `input_lengths` for {batch} requests; pass one per request."
        )
    seq = max(input_lengths)
    positions = torch.arange(seq)
    lengths = torch.tensor(list(input_lengths)).unsqueeze(1)
    return positions >= seq - lengths if padding_side == "left" else positions < lengths


def from_sglang(
    routed_experts: Sequence[Any],
    model: nn.Module | None = None,
    *,
    top_k: int | None = None,
    **kwargs: Any,
) -> RoutingTrace:
    """Like :func:`from_vllm` for SGLang output: each item a base64 string of ``int32`` (or its
    ``meta_info`` dict holding ``routed_experts``, or an array already decoded).

    The flat payload is reshaped to ``(rows, num_hidden_layers, top_k)``; ``top_k`` defaults to the
    model's.

    Example:
        >>> import base64, numpy as np
        >>> payload = base64.b64encode(np.array([[[3, 1]], [[0, 2]]], dtype=np.int32).tobytes()).decode()
        >>> from_sglang([payload], top_k=2, moe_layer_ids=[0], num_experts=4, num_hidden_layers=1,
        ...             input_lengths=[3])[0].tolist()
        [[3, 1], [0, 2], [2, 3]]
    """
    layers = kwargs.get("num_hidden_layers")
    if model is not None:
        top_k = top_k or moe_layers(model)[0].top_k
        config = cast(Any, model).config.get_text_config() if hasattr(model, "config") else None
        layers = layers or getattr(config, "num_hidden_layers", None)
    decoded = []
    for i, item in enumerate(routed_experts):
        if isinstance(item, dict):
            if "routed_experts" not in item:
                raise RoutingError(
                    f"Request {i}'s `meta_info` has no `routed_experts`; start SGLang with "
                    "`return_routed_experts` and pass each request's `meta_info` (or its `routed_experts`)."
                )
            item = item["routed_experts"]
        if isinstance(item, (str, bytes)):
            if top_k is None or layers is None:
                raise RoutingError(
                    "Decoding SGLang base64 needs `top_k` and `num_hidden_layers` (or `model`)."
                )
            item = _decode_sglang(item, i, layers, top_k)
        elif not hasattr(item, "__array__") and not isinstance(item, (torch.Tensor, list, tuple)):
            raise RoutingError(
                f"SGLang routes of request {i} must be a base64 string of int32 (or an array); got "
                f"`{type(item).__name__}`."
            )
        decoded.append(item)
    return from_vllm(decoded, model, **kwargs)


def _decode_sglang(payload: str | bytes, request: int, layers: int, top_k: int) -> torch.Tensor:
    """Base64 of little-endian int32 to ``(rows, layers, top_k)``; malformed input is a RoutingError."""
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RoutingError(
            f"SGLang payload of request {request} is not valid base64 ({exc}); pass "
            "`meta_info['routed_experts']` as SGLang returned it."
        ) from None
    if not raw:
        raise RoutingError(f"SGLang payload of request {request} is empty; it holds no routed experts.")
    if len(raw) % 4:
        raise RoutingError(
            f"SGLang payload of request {request} decodes to {len(raw)} bytes, not a whole number of int32 ids."
        )
    flat = torch.frombuffer(bytearray(raw), dtype=torch.int32)
    if flat.numel() % (layers * top_k):
        raise RoutingError(
            f"SGLang payload of request {request} holds {flat.numel()} ids, not a multiple of "
            f"num_hidden_layers * top_k = {layers * top_k}."
        )
    return flat.reshape(-1, layers, top_k)
