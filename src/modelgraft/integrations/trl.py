"""Rollout routing replay for TRL's online trainers (GRPO, RLOO), as one switch.

Change the trainer class, nothing else::

    from modelgraft.integrations.trl import RoutingReplayGRPOTrainer

    trainer = RoutingReplayGRPOTrainer(model=policy, reward_funcs=reward, args=args, train_dataset=data)
    trainer.train()

or switch an existing trainer: ``enable_routing_replay(trainer)``.

What it does, per generation batch:

* **Routes of the rollout.** With the trainer's own ``generate`` the experts it used are recorded
  (``record_routing``); with vLLM (``use_vllm=True``) they are read from the engine's reply as vLLM
  sends it: ``RequestOutput.prompt_routed_experts`` + ``CompletionOutput.routed_experts`` in
  colocate mode, the base64 ``.npy`` fields of ``/v1/completions`` in server mode (``from_vllm``).
* **Carried with the batch.** The routes ride in the batch as ``routed_experts``, a
  ``(batch, prompt + completion, moe_layers, top_k)`` tensor laid out like TRL's
  ``prompt_completion_ids`` (left-padded prompt, right-padded completion), so TRL's shuffling,
  splitting per gradient-accumulation step and buffering for ``num_iterations`` move them with
  their sequences. Positions no model forward routed (padding, the last sampled token) are ``-1``:
  the router chooses them, and nothing reads their output.
* **Replayed in every training forward** of that batch: the old-policy and reference log-probs,
  every micro-batch chunk of them (``per_device_train_batch_size``), and the policy forward of each
  gradient-accumulation step, whose replay stays active through its backward (gradient
  checkpointing recomputes with the same experts).
* **Mismatch logged.** Each generation batch, the trainer's live routing of the same tokens is
  compared with the rollout's (``compare_routing``) and logged as ``routing/mismatch_rate`` (share
  of token routes whose expert set differs), ``routing/mismatch_rate_max_layer`` and
  ``routing/token_mismatch_rate`` (tokens differing in some layer); ``routing/replayed_tokens``
  counts the forced tokens. ``log_routing_mismatch=False`` skips that extra no-grad forward.

With ``routing_replay=False`` the trainer is TRL's, unchanged.

Not supported (refused with a ``RoutingError`` when the trainer is built): tool calling and
environments (tool output is spliced into the completion), ``rollout_func``, transformers'
continuous batching, vision-language inputs, vLLM colocate with tensor parallelism and vLLM
server mode with several processes.

Example:
    >>> from modelgraft.integrations.trl import RoutingReplayGRPOTrainer, enable_routing_replay
    >>> [c.__name__ for c in RoutingReplayGRPOTrainer.__mro__[2:4]]
    ['RoutingReplayMixin', 'GRPOTrainer']
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.rloo_trainer import RLOOTrainer

from modelgraft.errors import RoutingError
from modelgraft.moe import (
    RoutingTrace,
    compare_routing,
    from_vllm,
    moe_layers,
    record_routing,
    replay_routing,
)

__all__ = [
    "RoutingReplayGRPOTrainer",
    "RoutingReplayMixin",
    "RoutingReplayRLOOTrainer",
    "enable_routing_replay",
]

#: The batch key that carries the routes (``(batch, seq, moe_layers, top_k)``, ``-1`` = no route).
ROUTES_KEY = "routed_experts"

# A generation batch's routes before TRL pads them: per completion, the prompt rows and the
# completion rows, each ``(tokens, moe_layers, top_k)``.
_PerSample = list[tuple[torch.Tensor, torch.Tensor]]


class RoutingReplayMixin:
    """Routing replay for a TRL trainer with GRPO's generation path (``GRPOTrainer``, ``RLOOTrainer``).

    Mix it in before the trainer class, or call :func:`enable_routing_replay` on a built trainer.
    """

    # Set by `_init_routing_replay`; class-level defaults keep a half-built trainer harmless.
    routing_replay: bool = False
    log_routing_mismatch: bool = True
    _mg_stack: contextlib.ExitStack | None = None
    _mg_pending: _PerSample | None = None
    _mg_routes: torch.Tensor | None = None
    _mg_generating: bool = False

    # ---- setup ---------------------------------------------------------------------------------
    def _init_routing_replay(self, enabled: bool, log_mismatch: bool, allow_all_zero: bool) -> None:
        trainer: Any = self
        self.routing_replay = bool(enabled)
        self.log_routing_mismatch = bool(log_mismatch)
        self._mg_allow_all_zero = bool(allow_all_zero)
        if not self.routing_replay:
            return
        model = trainer.accelerator.unwrap_model(trainer.model)
        layers = moe_layers(model)  # an error naming the model when it has no MoE layer
        self._mg_layer_ids = [layer.layer_id for layer in layers]
        self._mg_layer_names = [layer.name for layer in layers]
        self._mg_top_k = layers[0].top_k
        self._mg_num_experts = max(layer.num_experts for layer in layers)
        if len({layer.top_k for layer in layers}) != 1:
            raise RoutingError(
                "Routing replay in TRL carries one `(moe_layers, top_k)` block per token; the MoE layers of "
                f"`{type(model).__name__}` select different top_k {sorted({la.top_k for la in layers})}."
            )
        name = type(self).__name__
        unsupported = {
            "tools": "tool calls splice tool output into the completion, which no model forward routed",
            "environment_factories": "environments splice their output into the completion",
            "rollout_func": "a custom `rollout_func` returns no routes",
            "use_transformers_continuous_batching": "transformers' continuous batching is not recorded per sequence",
            "_is_vlm": "vision-language inputs are not replayed",
        }
        for attribute, why in unsupported.items():
            if getattr(trainer, attribute, None):
                raise RoutingError(
                    f"`{name}` with routing replay: `{attribute.lstrip('_')}` is set, and {why}. Turn it off, or "
                    "build the trainer with `routing_replay=False`."
                )
        if getattr(trainer, "use_vllm", False):
            generation = trainer.vllm_generation
            if generation.mode == "colocate" and getattr(generation, "tensor_parallel_size", 1) > 1:
                raise RoutingError(
                    f"`{name}` with routing replay: vLLM colocate mode with tensor_parallel_size="
                    f"{generation.tensor_parallel_size} is not supported (each rank would need its slice of the "
                    "routes); use tensor_parallel_size=1 or server mode."
                )
            if generation.mode == "server" and trainer.accelerator.num_processes > 1:
                raise RoutingError(
                    f"`{name}` with routing replay: vLLM server mode with {trainer.accelerator.num_processes} "
                    "processes is not supported yet (the routes arrive on the main process only); use colocate mode."
                )

    # ---- where the routes come from -----------------------------------------------------------
    def _generate_single_turn(self, prompt_ids: Sequence[Sequence[int]], *args: Any, **kwargs: Any) -> Any:
        trainer: Any = self
        parent: Any = super()
        if not self.routing_replay:
            return parent._generate_single_turn(prompt_ids, *args, **kwargs)
        model = trainer.accelerator.unwrap_model(trainer.model)
        if trainer.use_vllm:
            with _captured_engine_reply(trainer.vllm_generation) as replies:
                result = parent._generate_single_turn(prompt_ids, *args, **kwargs)
            completion_ids = _completions(result)
            trace = from_vllm(
                _engine_items(replies, len(completion_ids)), model, allow_all_zero=self._mg_allow_all_zero
            )
            self._mg_pending = _split_engine_trace(trace, prompt_ids, completion_ids)
            return result
        with record_routing(model) as recorded:
            result = parent._generate_single_turn(prompt_ids, *args, **kwargs)
        self._mg_pending = _split_generate_trace(
            recorded, prompt_ids, _completions(result), trainer.pad_to_multiple_of
        )
        return result

    def _generate_and_score_completions(self, inputs: Any) -> Any:
        trainer: Any = self
        parent: Any = super()
        if not self.routing_replay:
            return parent._generate_and_score_completions(inputs)
        self._mg_pending, self._mg_generating = None, True
        try:
            output = parent._generate_and_score_completions(inputs)
        finally:
            self._mg_generating = False
        pending, self._mg_pending = self._mg_pending, None
        if pending is None:
            raise RoutingError(
                "Routing replay: the generation batch was scored but no routes were recorded for it (the trainer's "
                "`_generate_single_turn` did not run); a subclass that generates another way must set the routes."
            )
        routes = _layout(pending, output["prompt_ids"].size(1), output["completion_ids"].size(1))
        output[ROUTES_KEY] = routes.to(output["prompt_ids"].device)
        if self.log_routing_mismatch:
            self._mg_log_mismatch(output, routes)
        mode = "train" if trainer.model.training else "eval"
        trainer._metrics[mode]["routing/replayed_tokens"].append(float((routes[:, :, 0, 0] >= 0).sum()))
        return output

    # ---- where they are replayed --------------------------------------------------------------
    def _compute_loss(self, model: nn.Module, inputs: dict[str, Any]) -> Any:
        parent: Any = super()
        if not self.routing_replay:
            return parent._compute_loss(model, inputs)
        routes = inputs.get(ROUTES_KEY)
        if routes is None:
            raise RoutingError(
                f"Routing replay: the training batch has no `{ROUTES_KEY}`; it comes from this trainer's generation "
                "(`_generate_and_score_completions`). A batch built elsewhere must carry it."
            )
        self._mg_routes = routes
        try:
            return parent._compute_loss(model, inputs)
        finally:
            self._mg_routes = None

    def _get_per_token_logps_and_entropies(
        self,
        model: nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
        **kwargs: Any,
    ) -> Any:
        parent: Any = super()
        routes = self._mg_current(input_ids, logits_to_keep) if self.routing_replay else None
        if routes is None:
            return parent._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, **kwargs
            )
        extra = sorted(k for k, v in kwargs.items() if v is not None and not k.startswith("compute_"))
        if extra:
            raise RoutingError(f"Routing replay in TRL does not replay multimodal forwards; got {extra}.")
        if tuple(routes.shape[:2]) != tuple(input_ids.shape):
            raise RoutingError(
                f"Routing replay: the batch's routes cover {tuple(routes.shape[:2])} (sequences, positions) but the "
                f"forward gets input_ids {tuple(input_ids.shape)}; the routes must travel with their sequences."
            )
        total = input_ids.size(0)
        step = batch_size or total
        chunks = [(start, min(start + step, total)) for start in range(0, total, step)]
        results = []
        with self._mg_replay(model, routes, len(chunks) > 1) as micro_batch:
            for start, end in chunks:
                with micro_batch(start, end):
                    results.append(
                        parent._get_per_token_logps_and_entropies(
                            model,
                            input_ids[start:end],
                            attention_mask[start:end],
                            logits_to_keep,
                            end - start,
                            **kwargs,
                        )
                    )
        return _join_chunks(results)

    def training_step(self, model: nn.Module, inputs: Any, num_items_in_batch: Any = None) -> Any:
        parent: Any = super()
        if not self.routing_replay:
            return parent.training_step(model, inputs, num_items_in_batch)
        # The policy forward's replay stays open until its backward has run (checkpoint recompute).
        with contextlib.ExitStack() as stack:
            self._mg_stack = stack
            try:
                return parent.training_step(model, inputs, num_items_in_batch)
            finally:
                self._mg_stack = None

    # ---- helpers ------------------------------------------------------------------------------
    def _mg_current(self, input_ids: torch.Tensor, logits_to_keep: int) -> torch.Tensor | None:
        if self._mg_routes is not None:
            return self._mg_routes
        if self._mg_generating and self._mg_pending is not None:
            # old-policy / reference log-probs inside `_generate_and_score_completions`: the batch is
            # padded by then, its prompt width is the forward's width less the completion's.
            width = input_ids.size(1)
            return _layout(self._mg_pending, width - logits_to_keep, logits_to_keep).to(input_ids.device)
        return None

    def _mg_trace(self, routes: torch.Tensor) -> RoutingTrace:
        batch, seq, layers, k = routes.shape
        return RoutingTrace(
            [routes[:, :, i].reshape(batch * seq, k) for i in range(layers)],
            layer_ids=list(self._mg_layer_ids),
            top_k=self._mg_top_k,
            num_experts=self._mg_num_experts,
            layer_names=list(self._mg_layer_names),
            batch_size=batch,
            missing="live",
        )

    @contextlib.contextmanager
    def _mg_replay(
        self, model: nn.Module, routes: torch.Tensor, several: bool
    ) -> Iterator[Callable[[int, int], contextlib.AbstractContextManager[Any]]]:
        trace = self._mg_trace(routes)
        replay = replay_routing(model, trace, allow_all_zero=self._mg_allow_all_zero)
        keep_open = torch.is_grad_enabled() and self._mg_stack is not None
        with contextlib.ExitStack() as local:
            owner = self._mg_stack if keep_open and self._mg_stack is not None else local
            session = owner.enter_context(replay)
            if several:
                yield lambda start, end: session.micro_batch(list(range(start, end)))
            else:
                yield lambda start, end: contextlib.nullcontext()

    def _mg_log_mismatch(self, output: dict[str, Any], routes: torch.Tensor) -> None:
        trainer: Any = self
        mode = "train" if trainer.model.training else "eval"
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        # The decoder alone: the routers are all in it, and the LM head's (batch, seq, vocab) logits
        # would cost what TRL's fused head saves.
        model = _backbone(trainer.accelerator.unwrap_model(trainer.model))
        step = (
            trainer.args.per_device_train_batch_size
            if mode == "train"
            else trainer.args.per_device_eval_batch_size
        )
        live = []
        with torch.no_grad():
            for start in range(0, ids.size(0), step):
                with record_routing(model) as trace:
                    model(
                        input_ids=ids[start : start + step],
                        attention_mask=mask[start : start + step],
                        use_cache=False,
                    )
                live.append(trace)
        layers = [torch.cat([t.layers[i].long() for t in live]) for i in range(len(self._mg_layer_ids))]
        result = compare_routing(
            self._mg_trace(routes.cpu()), [t.cpu() for t in layers], mask=mask.bool().cpu()
        )
        trainer._metrics[mode]["routing/mismatch_rate"].append(result.mismatch_rate)
        trainer._metrics[mode]["routing/mismatch_rate_max_layer"].append(result.max_rate)
        trainer._metrics[mode]["routing/token_mismatch_rate"].append(result.token_rate)
        self.last_routing_comparison = result


def _backbone(model: nn.Module) -> nn.Module:
    """The model's decoder (``get_decoder()``) when it has one, else the model."""
    get = getattr(model, "get_decoder", None)
    try:
        decoder = get() if callable(get) else None
    except Exception:  # a model whose get_decoder cannot answer: the whole model will do
        decoder = None
    return decoder if isinstance(decoder, nn.Module) else model


# ---- the trainers ---------------------------------------------------------------------------------
@contextlib.contextmanager
def _vllm_returns_routes(enabled: bool) -> Iterator[None]:
    """While a trainer is built, make TRL's colocated ``vllm.LLM`` return the routed experts."""
    try:
        from trl.generation import vllm_generation
    except ImportError:  # pragma: no cover - every TRL 1.x has it
        yield
        return
    original = getattr(vllm_generation, "LLM", None)
    if not enabled or original is None:
        yield
        return

    def llm(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("enable_return_routed_experts", True)
        return original(*args, **kwargs)

    setattr(vllm_generation, "LLM", llm)  # noqa: B010 - absent without vLLM, so not a declared attribute
    try:
        yield
    finally:
        setattr(vllm_generation, "LLM", original)  # noqa: B010


class _ReplayOnInit(RoutingReplayMixin):
    """The constructor of both trainers: vLLM asked for routes while TRL builds the trainer, then
    replay switched on (the trainer class comes after this one in the bases)."""

    def __init__(
        self,
        *args: Any,
        routing_replay: bool = True,
        log_routing_mismatch: bool = True,
        allow_all_zero: bool = False,
        **kwargs: Any,
    ) -> None:
        with _vllm_returns_routes(routing_replay):
            super().__init__(*args, **kwargs)
        self._init_routing_replay(routing_replay, log_routing_mismatch, allow_all_zero)


class RoutingReplayGRPOTrainer(_ReplayOnInit, GRPOTrainer):
    """TRL's ``GRPOTrainer`` with rollout routing replay (see the module docstring).

    Args:
        routing_replay: the switch; ``False`` gives TRL's trainer unchanged.
        log_routing_mismatch: log the rollout-vs-trainer routing mismatch each generation batch.
        allow_all_zero: accept an MoE layer whose routed ids are all 0 (see ``replay_routing``).
        *args, **kwargs: ``GRPOTrainer``'s.
    """


class RoutingReplayRLOOTrainer(_ReplayOnInit, RLOOTrainer):
    """TRL's ``RLOOTrainer`` with rollout routing replay (same generation path as GRPO; the same
    arguments as :class:`RoutingReplayGRPOTrainer`)."""


def enable_routing_replay(
    trainer: Any, *, log_routing_mismatch: bool = True, allow_all_zero: bool = False
) -> Any:
    """Switch routing replay on for a built ``GRPOTrainer`` / ``RLOOTrainer`` (in place; returns it).

    vLLM in colocate mode must have been started with ``enable_return_routed_experts=True``
    (``RoutingReplayGRPOTrainer`` does that while building the trainer); a server must run with
    ``--enable-return-routed-experts``.

    Raises:
        RoutingError: not a GRPO/RLOO trainer, a model without MoE layers, or a setup replay does
            not support (tools, ``rollout_func``, ...).
    """
    if isinstance(trainer, RoutingReplayMixin):
        trainer._init_routing_replay(True, log_routing_mismatch, allow_all_zero)
        return trainer
    base = type(trainer)
    if not issubclass(base, (GRPOTrainer, RLOOTrainer)):
        raise RoutingError(
            f"`enable_routing_replay` takes a TRL GRPOTrainer or RLOOTrainer (or a subclass); got `{base.__name__}`."
        )
    trainer.__class__ = type(f"RoutingReplay{base.__name__}", (RoutingReplayMixin, base), {})
    trainer._init_routing_replay(True, log_routing_mismatch, allow_all_zero)
    return trainer


# ---- routes: capture, split per completion, lay out like TRL's batch ---------------------------------
@contextlib.contextmanager
def _captured_engine_reply(generation: Any) -> Iterator[list[Any]]:
    """Keep what vLLM returns to TRL during the block: request outputs (colocate) or replies (server)."""
    replies: list[Any] = []
    if generation.mode == "colocate":
        owner, attribute = generation.llm, "generate"
    else:
        owner, attribute = generation.vllm_client, "_post"
    original = getattr(owner, attribute)

    def capture(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        if attribute == "generate":
            replies.extend(out)
        elif str(args[0] if args else kwargs.get("url", "")).endswith("/completions"):
            replies.append(out)
        return out

    setattr(owner, attribute, capture)
    try:
        yield replies
    finally:
        if owner.__dict__.get(attribute) is capture:
            delattr(owner, attribute)


def _engine_items(replies: list[Any], completions: int) -> list[Any]:
    """One ``from_vllm`` item per completion, in TRL's order.

    Request outputs (colocate) already are; a server reply holds every prompt's choices: each
    becomes a one-choice reply with its prompt's ids and rows (``prompt_routed_experts`` on the
    choice, or on the reply when it has a single prompt).
    """
    items: list[Any] = []
    for reply in replies:
        if not isinstance(reply, dict):
            items.append(reply)
            continue
        choices = reply.get("choices") or []
        prompts = {tuple(c.get("prompt_token_ids") or ()) for c in choices}
        for choice in choices:
            prompt_rows = choice.get("prompt_routed_experts")
            if prompt_rows is None and len(prompts) <= 1:
                prompt_rows = reply.get("prompt_routed_experts")
            items.append(
                {
                    "prompt_token_ids": choice.get("prompt_token_ids", reply.get("prompt_token_ids")),
                    "prompt_routed_experts": prompt_rows,
                    "choices": [choice],
                }
            )
    count = sum(len(item.outputs) if hasattr(item, "outputs") else 1 for item in items)
    if count != completions:
        raise RoutingError(
            f"Routing replay: vLLM returned {count} completions with routes but TRL kept {completions}; start vLLM "
            "with `enable_return_routed_experts=True` (server: `--enable-return-routed-experts`)."
        )
    return items


def _completions(result: Any) -> Sequence[Sequence[int]]:
    """The completion ids of ``_generate_single_turn``: GRPO returns ``(ids, logprobs)``, RLOO the ids."""
    return result[0] if isinstance(result, tuple) else result  # type: ignore[no-any-return]


def _per_sequence(trace: RoutingTrace) -> torch.Tensor:
    """``(batch, seq, layers, top_k)`` int16 of a trace with a batch layout."""
    batch = trace.batch_size
    if not batch or trace.num_tokens % batch:
        raise RoutingError(
            f"Routing replay: a trace of {trace.num_tokens} rows has no batch layout (batch={batch})."
        )
    return torch.stack(
        [t.to(torch.int16).reshape(batch, trace.num_tokens // batch, -1) for t in trace.layers], dim=2
    )


def _split_generate_trace(
    trace: RoutingTrace,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    pad_to_multiple_of: int | None,
) -> _PerSample:
    """Per completion, the rows ``generate`` routed: left-padded prompt, then all but the last token."""
    routes = _per_sequence(trace)
    width = max(len(p) for p in prompt_ids)
    if pad_to_multiple_of:
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    if routes.shape[0] != len(prompt_ids) or routes.shape[1] < width:
        raise RoutingError(
            f"Routing replay: `generate` routed {routes.shape[0]} sequences of {routes.shape[1]} positions, but TRL "
            f"gave it {len(prompt_ids)} prompts padded to {width} tokens."
        )
    generated = routes.shape[1] - width
    return [
        (routes[b, width - len(p) : width], routes[b, width : width + min(len(c), generated)])
        for b, (p, c) in enumerate(zip(prompt_ids, completion_ids))
    ]


def _split_engine_trace(
    trace: RoutingTrace, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]]
) -> _PerSample:
    """Per completion, the engine's rows (``from_vllm``: right padding, prompt then completion)."""
    routes = _per_sequence(trace)
    if routes.shape[0] != len(completion_ids):
        raise RoutingError(
            f"Routing replay: vLLM's routes cover {routes.shape[0]} completions, TRL kept {len(completion_ids)}."
        )
    out = []
    for b, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        # the last sampled token never ran through the engine: its row is a filler, left to the router
        out.append((routes[b, : len(p)], routes[b, len(p) : len(p) + max(len(c) - 1, 0)]))
    return out


def _layout(pending: _PerSample, prompt_width: int, completion_width: int) -> torch.Tensor:
    """The routes laid out like TRL's ``prompt_completion_ids``: prompt right-aligned, completion after it."""
    if not pending:
        raise RoutingError("Routing replay: the generation batch has no routes.")
    layers, k = pending[0][0].shape[1:]
    out = torch.full((len(pending), prompt_width + completion_width, layers, k), -1, dtype=torch.int16)
    for b, (prompt, completion) in enumerate(pending):
        if prompt.shape[0] > prompt_width or completion.shape[0] > completion_width:
            raise RoutingError(
                f"Routing replay: completion {b} has routes for {prompt.shape[0]} prompt and {completion.shape[0]} "
                f"completion tokens, more than the batch's {prompt_width} and {completion_width} positions."
            )
        out[b, prompt_width - prompt.shape[0] : prompt_width] = prompt
        out[b, prompt_width : prompt_width + completion.shape[0]] = completion
    return out


def _join_chunks(results: list[Any]) -> Any:
    """Join the per-chunk results of ``_get_per_token_logps_and_entropies`` as TRL's own loop does."""
    if len(results) == 1:
        return results[0]
    joined: list[torch.Tensor | None] = []
    for parts in zip(*results):
        if parts[0] is None:
            joined.append(None)
        elif parts[0].dim() == 0:  # the MoE aux loss: TRL averages the chunks' values
            joined.append(torch.stack(list(parts)).mean())
        else:
            joined.append(torch.cat(list(parts), dim=0))
    return tuple(joined)
