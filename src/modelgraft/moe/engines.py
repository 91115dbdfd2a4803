"""Turn inference-engine routing output into a :class:`RoutingTrace` for the trainer's batch.

Engine conventions (see ``docs/moe.md``; the payload formats are decoded in ``_payloads.py``):

* vLLM (``enable_return_routed_experts=True``): per request ``(num_tokens - 1, num_hidden_layers,
  top_k)`` ids: the last sampled token never went through the model, so its row is missing. The
  layer axis counts *every* decoder layer; dense layers hold rows of zeros and are dropped here.
  Current releases split the rows into ``RequestOutput.prompt_routed_experts`` and the completion's
  own ``CompletionOutput.routed_experts``; :func:`from_vllm` takes the request outputs (or the
  server's JSON) and joins them. Rows vLLM did not compute (prefix-cache hits) are ``-1``.
* SGLang (``return_routed_experts``): the same rows, base64 of a flat buffer in
  ``meta_info["routed_experts"]`` (``int32``, or ``meta_info["routed_experts_dtype"]``), from
  ``meta_info["routed_experts_start_len"]`` on.
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

import numbers
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from modelgraft.errors import RoutingError
from modelgraft.moe._gaps import check_zero_rows_policy, handle_zero_rows
from modelgraft.moe._ids import MISSING_POLICIES, compact_dtype, spread_fill
from modelgraft.moe._layers import moe_layers
from modelgraft.moe._payloads import Request, as_ids, sglang_requests, vllm_requests
from modelgraft.moe.trace import RoutingTrace

__all__ = ["from_sglang", "from_vllm", "join_routes", "layout_requests"]

_fill = spread_fill


def _check_policy(missing: str) -> None:
    if missing not in MISSING_POLICIES:
        raise RoutingError(f"`missing` must be 'refuse' or 'live'; got `{missing!r}`.")


def layout_requests(
    requests: Sequence[Any],
    attention_mask: torch.Tensor,
    num_experts: int,
    *,
    layer_ids: Sequence[int] | None = None,
    model_type: str | None = None,
    missing: str = "refuse",
) -> RoutingTrace:
    """Lay per-request routes ``(num_real_tokens, num_moe_layers, top_k)`` out as a padded batch.

    Args:
        requests: one integer array per batch row, rows in token order.
        attention_mask: ``(batch, seq)`` with 1 on real tokens (left or right padding, or any layout).
        num_experts: experts per layer, for the padding filler.
        layer_ids: decoder-layer index of each MoE layer (kept in the trace).
        model_type: kept in the trace.
        missing: ``"live"`` keeps rows of ``-1`` (routed live by ``replay_routing``); ``"refuse"``
            treats them as out-of-range ids.

    Returns:
        A trace with ``batch * seq`` rows per layer, row-major over the batch, ``batch_size`` set,
        ids in :func:`~modelgraft.moe.compact_dtype` and ``routed`` False on the padding rows (filler).

    Example:
        >>> import torch
        >>> req = torch.tensor([[[2, 3]], [[1, 0]]])  # 2 tokens, 1 MoE layer, top-2
        >>> layout_requests([req], torch.tensor([[0, 1, 1]]), num_experts=4)[0].tolist()
        [[0, 1], [2, 3], [1, 0]]
    """
    _check_policy(missing)
    mask = torch.as_tensor(attention_mask).bool()
    if mask.dim() != 2 or mask.shape[0] != len(requests):
        raise RoutingError(
            f"`attention_mask` must be (batch, seq) with one row per request; got shape {tuple(mask.shape)} "
            f"for {len(requests)} requests."
        )
    tensors = [as_ids(req, f"request {i}") for i, req in enumerate(requests)]
    if not tensors:
        raise RoutingError("No requests given; pass one routed-experts array per batch row.")
    if tensors[0].dim() != 3:
        raise RoutingError(
            f"Request 0 has routes of shape {tuple(tensors[0].shape)}; expected (tokens, layers, top_k)."
        )
    num_layers, top_k = tensors[0].shape[1], tensors[0].shape[2]
    batch, seq = mask.shape
    live = missing == "live"
    out = torch.empty(batch * seq, num_layers, top_k, dtype=compact_dtype(num_experts, signed=live))
    pad_rows = (~mask).reshape(-1).nonzero().squeeze(1)
    out[pad_rows] = _fill(0, len(pad_rows), top_k, num_experts).unsqueeze(1).to(out.dtype)
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
        _check_range(req, num_experts, live, f"request {i}", layer_ids)
        out[i * seq + real] = req.to(out.dtype)
    ids = list(layer_ids) if layer_ids is not None else list(range(num_layers))
    return RoutingTrace(
        [out[:, j].clone() for j in range(num_layers)],
        ids,
        top_k=top_k,
        num_experts=num_experts,
        model_type=model_type,
        batch_size=batch,
        missing=missing,
        routed=mask.reshape(-1).cpu(),  # padding rows hold filler ids, no router chose them
    )


def _check_range(
    rows: torch.Tensor, num_experts: int, live: bool, where: str, layer_ids: Sequence[int] | None
) -> None:
    """Ids within ``0 .. num_experts - 1`` (whole ``-1`` rows allowed when ``live``); names the place."""
    if not rows.numel():
        return
    bad = (rows < 0) | (rows >= num_experts)
    if live:  # whole rows of -1 only: -2 or any other negative id is no expert
        bad &= ~(rows == -1).all(-1, keepdim=True)
    if bool(bad.any()):
        token, layer, slot = (int(i) for i in bad.nonzero()[0])
        lid = layer_ids[layer] if layer_ids is not None else layer
        low, high = int(rows.min()), int(rows.max())
        hint = " Rows of -1 mark tokens without a route: choose the `missing` policy." if low == -1 else ""
        raise RoutingError(
            f"Routed expert ids must lie in 0..{num_experts - 1}; found {low if low < 0 else high} "
            f"({where}, token {token}, decoder layer `{lid}`: {int(rows[token, layer, slot])}).{hint}"
        )


def _model_info(
    model: nn.Module | None,
) -> tuple[list[int] | None, int | None, int | None, str | None, int | None]:
    if model is None:
        return None, None, None, None, None
    layers = moe_layers(model)
    config: Any = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return (
        [layer.layer_id for layer in layers],
        layers[0].num_experts,
        getattr(text, "num_hidden_layers", None),
        getattr(config, "model_type", None),
        layers[0].top_k,
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
    missing: str = "refuse",
    expert_map: Any = None,
    zero_rows: str = "refuse",
) -> RoutingTrace:
    """Build the trace for the trainer's padded batch from vLLM's routed experts.

    Args:
        routed_experts: one item per request, any of:

            * a ``RequestOutput`` (``LLM.generate``): its ``prompt_routed_experts`` and each
              completion's ``routed_experts`` are joined; each completion is one batch row, in order;
            * a server response dict (``/v1/completions``, ``/v1/chat/completions`` with
              ``return_token_ids``): base64 ``.npy`` strings in ``prompt_routed_experts`` and
              ``choices[i].routed_experts``; each choice is one batch row;
            * an array ``(rows, num_hidden_layers, top_k)`` covering the tokens from 0 (older vLLM:
              ``num_tokens - 1`` rows, or ``num_tokens``), or a base64 ``.npy`` string of one;
            * ``(prompt_rows, completion_rows)``: the two arrays, joined;
            * ``(start, rows)``: rows from token ``start`` on.

        model: the trainer's model; gives the MoE layer ids, ``num_experts`` and ``num_hidden_layers``
            from its actual modules. Without it pass ``moe_layer_ids``, ``num_experts`` and
            ``num_hidden_layers``.
        attention_mask: ``(batch, seq)`` mask of the training batch. Or ``input_lengths``; or neither
            when every item says its token counts (request outputs, server dicts).
        input_lengths: tokens per request (prompt + completion); the batch is padded on ``padding_side``.
        padding_side: ``"right"`` or ``"left"``, used without ``attention_mask``.
        moe_layer_ids, num_experts, num_hidden_layers: override what ``model`` says.
        allow_all_zero: accept an MoE layer whose every routed id is 0 in every request (an engine
            reports that for a layer it did not capture, e.g. another pipeline stage's); refused by default.
        missing: rows of ``-1`` (tokens vLLM did not compute: prefix-cache hits; rows before
            ``routed_experts_prompt_start``) are refused (``"refuse"``, the default, naming the
            request, tokens and layer), or kept for the trainer's router to choose (``"live"``:
            ``replay_routing`` forces every other row).
        expert_map: physical-to-logical expert ids for engines that report physical ids
            (expert-parallel load balancing): ``(num_physical,)`` for every layer, or
            ``(layers, num_physical)`` with one row per decoder layer or per MoE layer. Capture gaps
            (``zero_rows``) and uncaptured layers (``allow_all_zero``) are looked for on the engine's
            own ids, before the map: a gap is a row of physical zeros, whatever ``map[0]`` is.
        zero_rows: a row of zeros in an otherwise captured MoE layer is a token the engine did not
            capture (its buffer was not written): with top-k > 1 it names expert 0 k times, which
            no router does; with top-1 it cannot be told from expert 0. ``"refuse"`` (default): an
            error naming the request, token and layer; ``"live"``: the trainer's router chooses
            those tokens (they become ``-1`` rows of a ``missing="live"`` trace; see
            :meth:`RoutingTrace.summary`); ``"accept"``: they are real choices of expert 0 (top-1
            only).

    Returns:
        A :class:`RoutingTrace` with ``batch * seq`` rows per MoE layer, ``batch_size`` set and ids
        in :func:`~modelgraft.moe.compact_dtype`, ready for ``replay_routing``. Its ``routed`` is
        False on the rows the engine did not route (padding, each request's last token): filler
        that ``compare_routing`` skips.

    Raises:
        RoutingError: a row count that is neither ``num_tokens`` nor ``num_tokens - 1``, a token
            count that differs from the mask, a layer axis that fits neither all layers nor MoE
            layers only, ids out of range (after ``expert_map``), a non-integer dtype, a payload
            that cannot be decoded, an MoE layer whose routed ids are all 0 (unless
            ``allow_all_zero``), ``-1`` rows (unless ``missing="live"``), all-zero rows (a capture
            gap; unless ``zero_rows`` says otherwise).
    """
    requests = vllm_requests(routed_experts)
    return _assemble(
        requests,
        model,
        attention_mask=attention_mask,
        input_lengths=input_lengths,
        padding_side=padding_side,
        moe_layer_ids=moe_layer_ids,
        num_experts=num_experts,
        num_hidden_layers=num_hidden_layers,
        allow_all_zero=allow_all_zero,
        missing=missing,
        expert_map=expert_map,
        zero_rows=zero_rows,
    )


def from_sglang(
    routed_experts: Sequence[Any],
    model: nn.Module | None = None,
    *,
    top_k: int | None = None,
    dtype: str | None = None,
    **kwargs: Any,
) -> RoutingTrace:
    """Like :func:`from_vllm` for SGLang output.

    Each item is a ``/generate`` response, its ``meta_info`` dict, the base64 string of
    ``meta_info["routed_experts"]``, an array already decoded, or ``(start, payload)``. The flat
    payload is decoded as ``meta_info["routed_experts_dtype"]`` (else ``dtype``, else ``int32``)
    and reshaped to ``(rows, num_hidden_layers, top_k)``; its rows start at
    ``meta_info["routed_experts_start_len"]`` (rows before it are missing: see ``missing``). With
    ``meta_info["prompt_tokens"]`` and ``["completion_tokens"]`` no mask is needed. ``top_k``
    defaults to the model's. Other keyword arguments are those of :func:`from_vllm`.

    Example:
        >>> import base64, numpy as np
        >>> payload = base64.b64encode(np.array([[[3, 1]], [[0, 2]]], dtype=np.int32).tobytes()).decode()
        >>> from_sglang([payload], top_k=2, moe_layer_ids=[0], num_experts=4, num_hidden_layers=1,
        ...             input_lengths=[3])[0].tolist()
        [[3, 1], [0, 2], [2, 3]]
    """
    layers = kwargs.get("num_hidden_layers")
    if model is not None:
        _, _, hidden, _, model_top_k = _model_info(model)
        top_k = top_k or model_top_k
        layers = layers or hidden
    requests = sglang_requests(routed_experts, layers, top_k, dtype)
    return _assemble(requests, model, **kwargs)


def _assemble(
    requests: list[Request],
    model: nn.Module | None,
    *,
    attention_mask: torch.Tensor | None = None,
    input_lengths: Sequence[int] | None = None,
    padding_side: str = "right",
    moe_layer_ids: Sequence[int] | None = None,
    num_experts: int | None = None,
    num_hidden_layers: int | None = None,
    allow_all_zero: bool = False,
    missing: str = "refuse",
    expert_map: Any = None,
    zero_rows: str = "refuse",
) -> RoutingTrace:
    _check_policy(missing)
    check_zero_rows_policy(zero_rows)
    ids, experts, hidden_layers, model_type, _ = _model_info(model)
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
    if not requests:
        raise RoutingError("No requests given; pass one engine output per batch row.")
    if attention_mask is None and input_lengths is None and all(r.tokens is not None for r in requests):
        input_lengths = [int(r.tokens) for r in requests]  # type: ignore[arg-type]
    mask = _mask(attention_mask, input_lengths, padding_side, len(requests))
    mapping = _ExpertMap(expert_map, ids, hidden_layers) if expert_map is not None else None
    # The engine's own ids: a capture gap (or an uncaptured layer) is a row of zeros in the engine's
    # buffer, before any `expert_map`; mapped, it would read as expert `map[0]` and hide.
    selected = [_select_layers(_place(request), ids, hidden_layers, request.name) for request in requests]
    if mapping is not None:
        for request, rows in zip(requests, selected):
            mapping.check(rows, request.name)  # map errors (out of range, -1 entries) come first, as before
    _refuse_uncaptured_layers(selected, ids)
    if not allow_all_zero:
        _refuse_all_zero_layers(selected, ids)
    exempt = _all_zero_layers(selected) if allow_all_zero else None
    laid_out = []
    filled = []  # requests whose last token got the filler (the engine never forwarded it)
    gaps = False
    for i, (request, arr) in enumerate(zip(requests, selected)):
        tokens, sent = int(mask[i].sum()), arr.shape[0]
        if request.tokens is not None and request.tokens != tokens:
            raise RoutingError(
                f"{request.name.capitalize()} has {request.tokens} tokens in the engine output (prompt + "
                f"completion) but its attention_mask row has {tokens} real tokens; pass the mask of the batch "
                "built from these outputs."
            )
        if sent not in (tokens - 1, tokens):
            raise RoutingError(
                f"Routed experts of {request.name} have {sent} rows but the request has {tokens} tokens; "
                f"expected {tokens - 1} (vLLM/SGLang: the last token has no route) or {tokens}."
            )
        if mapping is None:
            _check_range(arr, experts, True, request.name, ids)
        if missing == "refuse":
            _refuse_missing(arr, request.name, ids)
        routed = handle_zero_rows(arr, request.name, ids, zero_rows, exempt)
        if routed is not arr:
            gaps = True  # capture gaps, now -1 rows: the trace routes them live
        if mapping is not None:
            routed = mapping.apply(routed, request.name)  # -1 rows (gaps made live) stay -1
            _check_range(routed, experts, True, request.name, ids)
        if sent == tokens - 1:
            # The last sampled token never ran through the MoE: give it a valid route, using negative
            # filler ordinals so it does not repeat the pad rows' experts.
            fill = _fill(-1 - i, 1, arr.shape[2], experts).unsqueeze(1).expand(1, arr.shape[1], -1)
            routed = torch.cat([routed, fill.to(routed.dtype)])
            filled.append(i)
        laid_out.append(routed)
    policy = "live" if gaps else missing
    trace = layout_requests(laid_out, mask, experts, layer_ids=ids, model_type=model_type, missing=policy)
    if not filled:
        return trace
    flags = mask.clone().cpu()
    for i in filled:
        flags[i, int(flags[i].nonzero()[-1])] = False  # the request's last real position
    return trace._copy(trace.layers, trace.batch_size, routed=flags.reshape(-1))


def _place(request: Request) -> torch.Tensor:
    """The request's rows from token 0, ``-1`` where no part covers a token; parts sent twice agree."""
    parts = request.parts
    shape = parts[0].rows.shape[1:]
    for part in parts[1:]:
        if part.rows.shape[1:] != shape:
            raise RoutingError(
                f"The parts of {request.name} have shapes {tuple(parts[0].rows.shape)} and "
                f"{tuple(part.rows.shape)}; the prompt and completion routes must have the same layers and top_k."
            )
    end = max(part.start + part.rows.shape[0] for part in parts)
    out = torch.full((end, *shape), -1, dtype=torch.long)
    seen = torch.zeros(end, dtype=torch.bool)
    for part in parts:
        span = slice(part.start, part.start + part.rows.shape[0])
        overlap = seen[span]
        if bool(overlap.any()):
            differ = (out[span][overlap] != part.rows[overlap]).flatten(1).any(1)
            if bool(differ.any()):
                token = part.start + int(overlap.nonzero()[int(differ.nonzero()[0])])
                raise RoutingError(
                    f"Token {token} of {request.name} is routed differently in two parts of its routes."
                )
        out[span] = part.rows
        seen[span] = True
    return out


def _ranges(rows: torch.Tensor) -> str:
    """``[0, 1, 2, 5]`` as ``"0..2, 5"`` (first three runs)."""
    values = rows.tolist()
    runs: list[list[int]] = []
    for value in values:
        if runs and value == runs[-1][1] + 1:
            runs[-1][1] = value
        else:
            runs.append([value, value])
    shown = [f"{a}..{b}" if a != b else f"{a}" for a, b in runs[:3]]
    return ", ".join(shown) + (", ..." if len(runs) > 3 else "")


def _refuse_missing(arr: torch.Tensor, name: str, ids: list[int]) -> None:
    rows = (arr < 0).all(-1)  # (tokens, layers)
    if not bool(rows.any()):
        return
    layer = int(rows.any(0).nonzero()[0, 0])
    tokens = rows[:, layer].nonzero().squeeze(1)
    raise RoutingError(
        f"{name.capitalize()} has no route for tokens {_ranges(tokens)} of decoder layer `{ids[layer]}` (rows of -1: "
        "the engine did not compute them, e.g. prefix-cache hits, or rows before `routed_experts_prompt_start` / "
        "`routed_experts_start_len`). Pass `missing='live'` to let the trainer's router choose those tokens "
        "(every other row is replayed), or send complete routes."
    )


class _ExpertMap:
    """Physical-to-logical expert ids, per MoE layer."""

    def __init__(self, table: Any, ids: list[int], hidden_layers: int | None) -> None:
        table = as_ids(table, "`expert_map`")
        if table.dim() == 1:
            self.rows = [table] * len(ids)
        elif table.dim() == 2 and hidden_layers is not None and table.shape[0] == hidden_layers:
            self.rows = [table[lid] for lid in ids]
        elif table.dim() == 2 and table.shape[0] == len(ids):
            self.rows = list(table)
        else:
            raise RoutingError(
                f"`expert_map` has shape {tuple(table.shape)}; expected (num_physical,) for every layer or "
                f"(layers, num_physical) with num_hidden_layers={hidden_layers} or {len(ids)} MoE-layer rows."
            )
        self.ids = ids

    def check(self, rows: torch.Tensor, name: str) -> None:
        """Raise where ``rows`` name a physical expert the map does not have or maps to no expert."""
        self.apply(rows, name)

    def apply(self, rows: torch.Tensor, name: str) -> torch.Tensor:
        """``rows`` with every physical id replaced by its logical one; whole ``-1`` rows kept."""
        out = rows.clone()
        for j, table in enumerate(self.rows):
            column = rows[:, j]
            routed = ~(column < 0).all(-1)
            values = column[routed]
            if values.numel() and (int(values.min()) < 0 or int(values.max()) >= table.shape[0]):
                bad = (values < 0) | (values >= table.shape[0])
                token = int(routed.nonzero().squeeze(1)[int(bad.any(-1).nonzero()[0, 0])])
                physical = int(values[bad][0])
                raise RoutingError(
                    f"{name.capitalize()} routes token {token} of decoder layer `{self.ids[j]}` to physical expert "
                    f"{physical}, but the physical-to-logical map of that layer has {table.shape[0]} entries."
                )
            mapped = table[values]
            if bool((mapped < 0).any()):
                bad = (mapped < 0).any(-1)
                token = int(routed.nonzero().squeeze(1)[int(bad.nonzero()[0, 0])])
                physical = int(values[bad][0][(mapped[bad][0] < 0).nonzero()[0, 0]])
                raise RoutingError(
                    f"{name.capitalize()} routes token {token} of decoder layer `{self.ids[j]}` to physical expert "
                    f"{physical}, which `expert_map` maps to {int(table[physical])} (no logical expert): a missing "
                    "route, not an expert. Fix the map, or send the route as a -1 row with `missing='live'`."
                )
            out[routed, j] = mapped
        return out


def _all_zero_layers(requests: list[torch.Tensor]) -> torch.Tensor:
    """Per MoE layer, whether no request routes any token of it to an expert other than 0."""
    rows = [arr for arr in requests if arr.shape[0]]
    if not rows:
        return torch.zeros(0, dtype=torch.bool)
    return ~torch.stack([(arr > 0).any(-1).any(0) for arr in rows]).any(0)


def _refuse_uncaptured_layers(requests: list[torch.Tensor], ids: list[int]) -> None:
    """An MoE layer with no route in any request (every row -1), whatever the ``missing`` policy."""
    rows = [arr for arr in requests if arr.shape[0]]
    if not rows:
        return
    routed = torch.stack([(arr >= 0).any(-1).any(0) for arr in rows]).any(0)  # per layer
    if not bool(routed.all()):
        layer = ids[int((~routed).nonzero()[0, 0])]
        raise RoutingError(
            f"MoE layer `{layer}` has no route in any request (every row is -1, or maps to -1 through "
            "`expert_map`): the engine did not capture that layer (e.g. another pipeline stage's). Capture it; "
            "`missing='live'` lets the router choose some tokens, not a whole layer."
        )


def _refuse_all_zero_layers(requests: list[torch.Tensor], ids: list[int]) -> None:
    """An MoE layer routed to expert 0 only, in every request, is a layer the engine did not capture."""
    rows = [arr for arr in requests if arr.shape[0]]
    if not rows:
        return
    nonzero = torch.stack([(arr > 0).any(-1).any(0) for arr in rows]).any(0)  # per layer; -1 rows say nothing
    if not bool(nonzero.all()):
        layer = ids[int((~nonzero).nonzero()[0, 0])]
        raise RoutingError(
            f"Every routed expert id of MoE layer `{layer}` is 0 in every request: that is what an engine "
            "reports for a layer it did not capture (e.g. another pipeline stage's), and replaying it would "
            "send every token to expert 0. Capture that layer, or pass `allow_all_zero=True` if these routes "
            "are real."
        )


def join_routes(parts: Sequence[tuple[int, Any]], *, overlap: str = "check") -> torch.Tensor:
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
        ((int(start), as_ids(rows, f"the part starting at token {start}")) for start, rows in parts),
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
    arr: torch.Tensor, ids: list[int], hidden_layers: int | None, request: str
) -> torch.Tensor:
    if hidden_layers is not None and arr.shape[1] == hidden_layers:
        return arr[:, ids]
    if arr.shape[1] == len(ids):
        return arr
    if hidden_layers is None and arr.shape[1] > max(ids):
        return arr[:, ids]
    raise RoutingError(
        f"Routed experts of {request} have {arr.shape[1]} layers; expected num_hidden_layers="
        f"{hidden_layers} (vLLM/SGLang) or {len(ids)} MoE layers (MoE-only engines)."
    )


def _mask(
    attention_mask: torch.Tensor | None, input_lengths: Sequence[int] | None, padding_side: str, batch: int
) -> torch.Tensor:
    if input_lengths is not None:
        input_lengths = list(input_lengths)
        bad = [
            n for n in input_lengths if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0
        ]
        if bad:
            raise RoutingError(
                f"`input_lengths` must hold non-negative token counts, one per request; got {bad[0]!r} in "
                f"{input_lengths[:8]}."
            )
    if attention_mask is not None:
        mask = torch.as_tensor(attention_mask).bool()
        if mask.dim() != 2 or mask.shape[0] != batch:
            raise RoutingError(
                f"`attention_mask` must be (batch, seq) with one row per request ({batch}, completions of a "
                f"request counted one by one); got shape {tuple(mask.shape)}."
            )
        if input_lengths is not None:
            counts = mask.sum(-1).tolist()
            if len(input_lengths) != batch or counts != [int(n) for n in input_lengths]:
                row = next((i for i, (a, b) in enumerate(zip(counts, input_lengths)) if a != b), 0)
                raise RoutingError(
                    f"`attention_mask` and `input_lengths` disagree: mask row {row} has "
                    f"{counts[row] if row < len(counts) else '?'} real tokens, `input_lengths` says "
                    f"{input_lengths[row] if row < len(input_lengths) else 'nothing'}. Pass one of them (the mask of "
                    "the training batch)."
                )
        return mask
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
