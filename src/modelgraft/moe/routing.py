"""Record the experts a model routes each token to, and replay them in a later forward.

Replay fixes the expert *indices*; the routing *weights* are recomputed by the family's own router
code from the live router weights (softmax, top-k renormalisation, sigmoid with correction bias,
group limits), so gradients reach the router and, with unchanged weights, the replayed forward is
bit-identical to the recorded one.

Example:
    >>> import torch
    >>> from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    >>> cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
    ...     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    ...     num_experts=4, num_experts_per_tok=2)
    >>> model = Qwen3MoeForCausalLM(cfg).eval()
    >>> ids = torch.tensor([[1, 5, 9]])
    >>> with record_routing(model) as trace:
    ...     ref = model(ids).logits
    >>> len(trace), tuple(trace[0].shape)
    (2, (3, 2))
    >>> with replay_routing(model, trace):
    ...     out = model(ids).logits
    >>> bool(torch.equal(out, ref))
    True
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from modelgraft.errors import RoutingError
from modelgraft.moe._discovery import MoELayer
from modelgraft.moe._ids import compact_dtype, is_id_dtype, missing_rows, widen
from modelgraft.moe._intercept import _Site, active_sites, hook_scope, in_backward, unhook_scope
from modelgraft.moe._layers import moe_layers, wrapper_chain
from modelgraft.moe._layout import ForwardLog, input_shape, past_length
from modelgraft.moe._packed import guard_packed_forwards
from modelgraft.moe._session import ReplaySession, rows_of
from modelgraft.moe.trace import RoutingTrace

__all__ = ["ReplaySession", "moe_layers", "record_routing", "replay_routing"]


@contextmanager
def _hooked(sites: list[_Site]) -> Iterator[None]:
    try:
        for site in sites:
            hook_scope(site)
        yield
    finally:
        for site in sites:
            unhook_scope(site)


def _model_type(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None)


@contextmanager
def record_routing(model: nn.Module) -> Iterator[RoutingTrace]:
    """Record the selected experts of every MoE layer during the forwards run inside the block.

    The yielded :class:`RoutingTrace` is filled when the block exits: per MoE layer a
    ``(num_tokens, top_k)`` integer tensor (in :func:`~modelgraft.moe.compact_dtype`: ``uint8`` up to
    256 experts; call ``.long()`` before indexing with it) laid out like one forward of the tokens
    that were forwarded:

    * independent forwards (each starting a fresh KV cache, or none) are concatenated along the
      token axis in call order, each row-major over its batch;
    * forwards that continue a KV cache (``model.generate(...)``, or a manual decoding loop) are laid
      out per sequence, then per position, as one forward over ``sequences[:, :-1]`` would route them:
      ``generate`` never forwards the last token it samples (see
      :meth:`RoutingTrace.append_positions` for a forward over all of ``sequences``). Padding
      positions keep the routes the router gave them. ``trace.batch_size`` is then the batch size.

    Forwards recomputed by gradient checkpointing during backward are not recorded twice.

    Through a wrapper (PEFT's ``PeftModel``, ``torch.compile``, DDP, FSDP, accelerate's prepared
    model, TRL's ``unwrap_model_for_generation``) the model owning the MoE layers is found and
    hooked, so ``wrapper.generate(...)`` (or ``ddp.module.generate(...)``) is laid out per sequence
    too, and layer names are the inner model's: the trace replays on the plain model and on any
    wrapper of it.

    Args:
        model: a transformers MoE model (any family of the installed version), or a wrapper of one.

    Yields:
        The trace, complete after the block.

    Raises:
        RoutingError: the model has no replayable MoE layer; a layer selects with several top-k calls
            that cannot be told apart; a forward continues a KV cache that the block's previous forward
            did not end; ``generate`` with beam search, assisted decoding or ``use_cache=False``.
    """
    chain = wrapper_chain(model)
    owner = chain[-1]
    layers = moe_layers(owner)
    sites = [_Site(layer) for layer in layers]
    for site in sites:
        site.recorded = []
    trace = RoutingTrace(
        [],
        [],
        top_k=layers[0].top_k,
        num_experts=layers[0].num_experts,
        model_type=_model_type(owner),
    )
    log = ForwardLog(chain, sites)
    with _hooked(sites), log:
        yield trace
    recorded, trace.batch_size = log.layout()
    # The ids are stored compact (uint8 up to 256 experts): the recording is what travels to the trainer.
    trace.layers = [t.to(compact_dtype(site.layer.num_experts)) for t, site in zip(recorded, sites)]
    trace.layer_ids = [site.layer.layer_id for site in sites]
    trace.layer_names = [site.layer.name for site in sites]


def _as_tensors(
    routing: RoutingTrace | Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor], list[int] | None]:
    if isinstance(routing, RoutingTrace):
        return list(routing.layers), list(routing.layer_ids)
    if isinstance(routing, torch.Tensor) or not isinstance(routing, Sequence):
        raise RoutingError(
            f"`routing` must be a RoutingTrace or a list of (num_tokens, top_k) tensors, one per MoE layer; "
            f"got `{type(routing).__name__}`."
        )
    return list(routing), None


def _validate(
    layers: list[MoELayer],
    tensors: list[torch.Tensor],
    layer_ids: list[int] | None,
    allow_all_zero: bool,
    live_ok: bool,
) -> None:
    if len(tensors) != len(layers):
        names = ", ".join(f"`{layer.name}`" for layer in layers[:4])
        more = ", ..." if len(layers) > 4 else ""
        raise RoutingError(
            f"The model has {len(layers)} MoE layers ({names}{more}) but the routing data has "
            f"{len(tensors)}; pass one (num_tokens, top_k) tensor per MoE layer (use `from_vllm` to drop "
            "dense layers from engine output)."
        )
    if layer_ids is not None:
        expected = [layer.layer_id for layer in layers]
        if layer_ids != expected:
            bad = next(i for i, (a, b) in enumerate(zip(layer_ids, expected)) if a != b)
            raise RoutingError(
                f"Routing entry {bad} is for layer `{layer_ids[bad]}` but MoE layer `{layers[bad].name}` is "
                f"decoder layer `{expected[bad]}`; the trace was made for a model with MoE layers "
                f"{layer_ids}, this model has {expected}."
            )
    for layer, tensor in zip(layers, tensors):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2 or not is_id_dtype(tensor.dtype):
            got = (
                f"{tuple(tensor.shape)} {tensor.dtype}"
                if isinstance(tensor, torch.Tensor)
                else type(tensor).__name__
            )
            raise RoutingError(
                f"Routing for MoE layer `{layer.name}` must be a 2-D integer tensor (num_tokens, top_k); got {got}."
            )
        if tensor.shape[1] != layer.top_k:
            raise RoutingError(
                f"Routing for MoE layer `{layer.name}` has top_k={tensor.shape[1]} columns but the layer "
                f"selects top_k={layer.top_k}; record with the same model configuration."
            )
        tensor = widen(tensor)
        live = missing_rows(tensor, f"MoE layer `{layer.name}`") if live_ok else None
        real = tensor[~live] if live is not None else tensor
        if tensor.numel() and not real.numel():
            raise RoutingError(
                f"Every row of the routing for MoE layer `{layer.name}` is -1 (no route): that layer was not "
                "captured. Capture it; `missing='live'` lets the router choose some tokens, not a whole layer."
            )
        if real.numel():
            low, high = int(real.min()), int(real.max())
            if low < 0 or high >= layer.num_experts:
                hint = (
                    " Rows of -1 (tokens without a route) are replayed live only with `missing='live'`."
                    if low == -1
                    else ""
                )
                raise RoutingError(
                    f"Routing for MoE layer `{layer.name}` holds expert id {low if low < 0 else high}, out of "
                    f"range for its {layer.num_experts} experts (valid: 0..{layer.num_experts - 1}); fill "
                    f"missing routes (e.g. -1 sentinels) before replaying.{hint}"
                )
        _refuse_unreal_routes(layer, real, allow_all_zero)


def _refuse_unreal_routes(layer: MoELayer, tensor: torch.Tensor, allow_all_zero: bool) -> None:
    """Routes no router produces: an all-zero layer (an uncaptured stage) and a repeated expert."""
    if not tensor.numel():
        return
    if not allow_all_zero and not bool(tensor.any()):
        raise RoutingError(
            f"In the routing data, every expert id is 0 in MoE layer `{layer.name}` ({tensor.shape[0]} tokens): that "
            "is what an uncaptured layer looks like (e.g. a pipeline stage that did not record), and replaying it "
            "would send every token to expert 0. Capture that layer, or pass `allow_all_zero=True` to "
            "`replay_routing` if these routes are real."
        )
    ordered = tensor.sort(dim=-1).values
    repeated = ordered[:, 1:] == ordered[:, :-1]
    if bool(repeated.any()):
        token, slot = (int(i) for i in repeated.nonzero()[0])
        raise RoutingError(
            f"Routing for MoE layer `{layer.name}` sends token {token} to expert {int(ordered[token, slot])} twice "
            f"(row {tensor[token].tolist()}); a top-k selection holds {layer.top_k} distinct experts. Fix the "
            "routing data (a constant fill, or ids from another layer?)."
        )


def _batch_guard(session: ReplaySession, site: _Site) -> Any:
    """A pre-hook refusing a fresh forward whose batch is not the trace's (``(3, 4)`` tokens against a
    trace of 2 sequences of 6 have the same 12 rows, in another layout)."""

    def pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if (
            torch.compiler.is_compiling()
            or active_sites().get(id(site.layer.scope)) is not site
            or in_backward()
        ):
            return  # traced by torch.compile (checked outside the graph), another thread's forward, a recompute
        rows = session._active or session._whole
        batch, seq = input_shape(args, kwargs)
        if batch is None or past_length(kwargs):
            return
        total = int(rows.forced[0].shape[0]) if rows.forced else 0
        if rows.batch_size is None:
            # Rows of several forwards in call order (or a trace built without a layout) that happen to
            # number batch x seq would be taken for this batch's row-major layout, silently. A trace
            # whose rows are not batch x seq (a family routing only some tokens) is checked per layer.
            if batch > 1 and seq is not None and total == batch * seq and session.trace is not None:
                raise RoutingError(
                    f"The replayed trace has no batch layout (`batch_size=None`: its {total} rows per layer are "
                    "in call order, e.g. several forwards recorded in one block), but this forward of "
                    f"`{type(module).__name__}` has {batch} sequences of {seq} positions: the rows could belong to "
                    "other tokens. Record the batch in one forward (or one `generate`) per `record_routing` block; "
                    f"if the rows are this batch's, row-major, give the trace `batch_size={batch}`."
                )
            return
        if batch == rows.batch_size:
            return
        raise RoutingError(
            f"The replayed routing lays out {rows.batch_size} sequences of {total // rows.batch_size} positions, but "
            f"this forward of `{type(module).__name__}` has {batch} sequences of {seq}: the rows would go to other "
            "tokens. Forward the batch the routing was recorded on (or `session.micro_batch(ids)` of it)."
        )

    return pre


@contextmanager
def replay_routing(
    model: nn.Module,
    routing: RoutingTrace | Sequence[torch.Tensor],
    *,
    allow_all_zero: bool = False,
    missing: str | None = None,
) -> Iterator[ReplaySession]:
    """Force every MoE layer to use the given experts during the forwards run inside the block.

    Each MoE layer uses its whole routing tensor on each forward call, so a forward recomputed by
    gradient checkpointing gets the same experts. Every layer must consume its routing at least once
    before the block ends. Exactly the given ids reach the experts, in every family; what a family
    cannot select exactly is refused.

    The block yields a :class:`ReplaySession`: ``session.micro_batch(sample_ids)`` makes the forwards
    inside it use the rows of those sequences only (gradient accumulation), padded or packed, and
    the forwards gradient checkpointing recomputes get the rows of their own micro-batch. A packed
    forward (``position_ids`` restarting inside a row) runs without a cache (``use_cache=False`` is
    set when not given), since with one transformers lets packed sequences attend to each other;
    ``use_cache=True``, a cache, or a 2-D attention mask joining packed sequences is refused.

    Args:
        model: the model the routing was recorded on (or one with the same architecture), or a
            wrapper of it (``PeftModel``, ``torch.compile``, DDP, ...).
        routing: a :class:`RoutingTrace` or a list with one ``(num_tokens, top_k)`` integer tensor per
            MoE layer, in model order.
        allow_all_zero: accept an MoE layer whose every id is 0. Refused by default: that is what a
            layer nobody captured looks like (a pipeline stage that did not record).
        missing: what rows of ``-1`` (tokens without a route) mean: ``"refuse"`` (an error) or
            ``"live"`` (the router chooses those tokens itself; every other row is forced). Default:
            the trace's ``missing`` (``"refuse"`` for a list of tensors).

    Raises:
        RoutingError: wrong number of layers, top-k, an expert id out of range, a non-integer tensor,
            the same expert twice in one token's row, an all-zero layer (unless ``allow_all_zero``), a
            token count that does not match the batch (at forward time), a trace without batch layout
            (``batch_size=None``) given to a forward of several sequences (at forward time), experts in more groups than a
            group-limited router keeps (at forward time), a packed forward with a cache or with an
            attention mask joining its sequences (at forward time), or routing left unconsumed when
            the block ends (a layer no forward ran through, or sequences no micro-batch ran).
    """
    chain = wrapper_chain(model)
    layers = moe_layers(chain[-1])
    tensors, layer_ids = _as_tensors(routing)
    if missing is None:
        missing = routing.missing if isinstance(routing, RoutingTrace) else "refuse"
    if missing not in ("refuse", "live"):
        raise RoutingError(f"`missing` must be 'refuse' or 'live'; got `{missing!r}`.")
    _validate(layers, tensors, layer_ids, allow_all_zero, missing == "live")
    batch_size = routing.batch_size if isinstance(routing, RoutingTrace) else None
    sites = [_Site(layer) for layer in layers]
    whole = rows_of(tensors, batch_size, missing == "live")
    session = ReplaySession(model, sites, routing, whole)
    if isinstance(routing, RoutingTrace) and missing != routing.missing:
        session.trace = routing._copy(list(routing.layers), routing.batch_size, missing=missing)
    # The checks run on every module of the wrapper chain: a wrapper's forward runs the inner model,
    # but the inner model may also be called alone (``ddp.module(...)``, inside ``generate``).
    packed_guard = guard_packed_forwards(chain[-1])
    guards = [m.register_forward_pre_hook(_batch_guard(session, sites[0]), with_kwargs=True) for m in chain]
    try:
        with _hooked(sites):
            yield session
    finally:
        for guard in guards:
            guard.remove()
        packed_guard.remove()
        session.close()
    unused = [site.layer.name for site in sites if not site.consumed]
    if unused:
        shown = ", ".join(f"`{name}`" for name in unused[:4])
        raise RoutingError(
            f"Routing for MoE layers {shown}{', ...' if len(unused) > 4 else ''} was never used: no forward "
            "ran through them inside the `replay_routing` block. Run the model inside the block."
        )
    samples = session.unused_samples()
    if samples:
        raise RoutingError(
            f"Routing of sequences {samples[:8]}{' ...' if len(samples) > 8 else ''} was never used: no "
            "`micro_batch` block ran them. Give every sequence of the trace to a micro-batch, or replay "
            "`trace.select(...)` of the ones you train on."
        )
