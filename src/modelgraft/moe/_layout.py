"""Lay the rows recorded by ``record_routing`` out like one forward of the tokens that were forwarded.

Every MoE layer records one ``(rows, top_k)`` tensor per call, in call order. That is the layout of a
training forward only when the forwards were independent. Incremental decoding (``generate``, or a
manual loop over a KV cache) forwards the padded prompts once and then one token per sequence per
step, so call order would interleave the sequences. This module logs every forward of the recorded
model (batch, tokens, and the KV-cache position it starts at) and rebuilds the layout:

* a forward that starts at cache position 0 starts a *session*; a forward that continues a KV cache
  must continue the last session exactly (same batch, starting where it ended), else the routes
  cannot be placed and a :class:`RoutingError` says so at that forward;
* a session of several forwards is laid out per sequence, then per position: the rows of a forward
  over ``sequences[:, :-1]`` (``generate`` never forwards its last token); padding positions keep
  the routes the router gave them, since the training forward routes them too;
* sessions follow each other in call order (independent forwards concatenate as before).

``generate`` is also wrapped for the block: beam search and assisted generation (which reorder or
discard forwarded tokens) and ``use_cache=False`` (which re-runs the prefix at every step) are refused.

Example:
    >>> import torch
    >>> prompt = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])  # 2 sequences x 2 positions, top-2
    >>> step = torch.tensor([[8, 9], [10, 11]])  # the next position of each sequence
    >>> _per_sequence([prompt, step], [(2, 2), (2, 1)]).tolist()
    [[0, 1], [2, 3], [8, 9], [4, 5], [6, 7], [10, 11]]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from modelgraft.errors import RoutingError
from modelgraft.moe._intercept import _Site, active_sites

__all__ = ["ForwardLog", "input_shape", "past_length"]


@dataclass
class _Forward:
    """One forward of the recorded model: its shape, where it starts in the KV cache, its rows."""

    index: int  # 1-based, for messages
    batch: int | None
    seq: int | None
    past: int
    starts: list[int]  # per site: recorded entries before this forward
    ends: list[int] | None = None


@dataclass
class _Session:
    """Forwards that continue one another through a KV cache (one prefill, its decode steps)."""

    batch: int | None
    forwards: list[_Forward] = field(default_factory=list)
    length: int = 0


def input_shape(args: tuple[Any, ...], kwargs: dict[Any, Any]) -> tuple[int | None, int | None]:
    tensor = kwargs.get("input_ids")
    if tensor is None:
        tensor = kwargs.get("inputs_embeds")
    if tensor is None and args and isinstance(args[0], torch.Tensor):
        tensor = args[0]
    if not isinstance(tensor, torch.Tensor) or tensor.dim() < 2:
        return None, None
    return int(tensor.shape[0]), int(tensor.shape[1])


def past_length(kwargs: dict[Any, Any]) -> int:
    """Cache position the forward starts at: tokens already in the KV cache it was given."""
    position = kwargs.get("cache_position")
    if isinstance(position, torch.Tensor) and position.numel():
        return int(position.reshape(-1)[0])
    cache = kwargs.get("cache")  # transformers 5.x name; 4.57 and older call it past_key_values
    if cache is None:
        cache = kwargs.get("past_key_values")
    if cache is None:
        return 0
    length = getattr(cache, "get_seq_length", None)
    if callable(length):
        return int(length())
    if isinstance(cache, (tuple, list)) and cache and isinstance(cache[0], (tuple, list)) and cache[0]:
        first = cache[0][0]
        if isinstance(first, torch.Tensor):
            return int(first.shape[-2])
    return 0


def _per_sequence(chunks: list[torch.Tensor], shapes: list[tuple[int, int]]) -> torch.Tensor:
    """Rows of forwards ``(batch, seq_i)`` that continue one another, laid out per sequence, then position."""
    k = chunks[0].shape[1]
    batch = shapes[0][0]
    parts = [chunk.reshape(batch, seq, k) for chunk, (_, seq) in zip(chunks, shapes)]
    return torch.cat(parts, dim=1).reshape(-1, k)


class ForwardLog:
    """Hooks that log the forwards of the recorded model and wrap its ``generate``; a context manager.

    ``chain`` is the model given to ``record_routing`` and the modules it wraps, down to the model
    owning the MoE layers (:func:`~modelgraft.moe._layers.wrapper_chain`). Every module of the chain
    is hooked, and a forward is logged once, by the outermost module it entered: a wrapper's forward
    runs the inner model's, while ``generate`` (a method of the inner model, reached through
    ``PeftModel.generate``, ``OptimizedModule.__getattr__`` or ``ddp.module``) runs the inner model
    alone. ``generate`` is wrapped on the inner model, where it runs whoever called it.
    """

    def __init__(self, chain: list[nn.Module], sites: list[_Site]) -> None:
        self.chain = chain
        self.model = chain[-1]
        self.sites = sites
        self.forwards: list[_Forward] = []
        self.sessions: list[_Session] = []
        self._handles: list[Any] = []
        self._generate_before: Any = None
        self._wrapped = False
        self._depth = 0  # owned forwards of chain modules entered and not yet left

    def __enter__(self) -> ForwardLog:
        for module in self.chain:
            self._handles.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post, with_kwargs=True, always_call=True))
        if callable(getattr(self.model, "generate", None)):
            self._wrap_generate()
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._wrapped:
            if self._generate_before is None:
                self.model.__dict__.pop("generate", None)
            else:
                self.model.generate = self._generate_before
            self._wrapped = False

    def _owned(self) -> bool:
        """Whether the caller runs in the block's thread or task (another's forwards are not logged)."""
        site = self.sites[0]
        return active_sites().get(id(site.layer.scope)) is site

    def _recorded(self) -> list[int]:
        return [len(site.recorded or ()) for site in self.sites]

    def _pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[Any, Any]) -> None:
        if torch.compiler.is_compiling() or not self._owned():
            return  # traced by torch.compile: the wrapper's hook, outside the graph, logged it
        self._depth += 1
        if self._depth > 1:
            return  # the inner model of a wrapper whose forward was logged
        batch, seq = input_shape(args, kwargs)
        forward = _Forward(len(self.forwards) + 1, batch, seq, past_length(kwargs), self._recorded())
        if forward.past == 0:
            self.sessions.append(_Session(batch))
        else:
            self._check_continues(forward)
        session = self.sessions[-1]
        session.forwards.append(forward)
        session.length += seq or 0
        self.forwards.append(forward)

    def _post(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[Any, Any], output: Any) -> None:
        if torch.compiler.is_compiling() or not self._owned():
            return
        self._depth -= 1
        if self._depth > 0:
            return
        if self.forwards and self.forwards[-1].ends is None:
            self.forwards[-1].ends = self._recorded()

    def _check_continues(self, forward: _Forward) -> None:
        where = (
            f"Forward {forward.index} inside `record_routing` continues a KV cache at position {forward.past}"
        )
        if not self.sessions:
            raise RoutingError(
                f"{where}, but no forward recorded in this block produced positions 0..{forward.past - 1}; record "
                "the prompt's forward (or the whole `generate` call) in the same block, so that the routes can be "
                "laid out per sequence."
            )
        session = self.sessions[-1]
        if forward.batch is None or forward.seq is None or session.batch is None:
            raise RoutingError(
                f"{where}, but its batch shape cannot be read (no 2-D `input_ids` or `inputs_embeds`); the "
                "routes cannot be laid out per sequence."
            )
        if forward.batch != session.batch or forward.past != session.length:
            raise RoutingError(
                f"{where} with batch {forward.batch}, but the forwards recorded before it end at position "
                f"{session.length} with batch {session.batch}; the routes cannot be laid out per sequence. Record "
                "each generation (its prompt forward, then its steps) in a block of its own."
            )

    def _wrap_generate(self) -> None:
        model = self.model
        self._generate_before = model.__dict__.get("generate")
        generating: Any = model  # `generate` is a PreTrainedModel method, untyped on nn.Module
        original = generating.generate

        def generate(*args: Any, **kwargs: Any) -> Any:
            if not self._owned():  # another thread's or task's generate: plain
                return original(*args, **kwargs)
            _refuse_generation_mode(model, kwargs)
            first = len(self.forwards)
            out = original(*args, **kwargs)
            self._check_generate(first, out)
            return out

        generating.generate = generate
        self._wrapped = True

    def _check_generate(self, first: int, out: Any) -> None:
        forwards = self.forwards[first:]
        fresh = sum(1 for f in forwards if f.past == 0)
        if fresh > 1:
            raise RoutingError(
                f"`generate` inside `record_routing` ran {len(forwards)} forwards without a KV cache "
                "(use_cache=False re-runs the whole prefix at every step, routing each position again), so no "
                "single route per position exists; generate with use_cache=True (the default)."
            )
        sequences = getattr(out, "sequences", out)
        config = getattr(self.model, "config", None)
        if (
            not forwards
            or not isinstance(sequences, torch.Tensor)
            or getattr(config, "is_encoder_decoder", False)
        ):
            return
        session = self.sessions[-1]
        if sequences.dim() != 2 or (session.batch, session.length) != (
            sequences.shape[0],
            sequences.shape[1] - 1,
        ):
            raise RoutingError(
                f"`generate` returned sequences of shape {tuple(sequences.shape)} but forwarded {session.batch} "
                f"sequences of {session.length} positions (expected all but the last token); the routes cannot be "
                "laid out per sequence."
            )

    def layout(self) -> tuple[list[torch.Tensor], int | None]:
        """Per site the recorded rows in forward layout, and the batch size when one layout covers them all."""
        sites = self.sites
        empty = [torch.empty(0, site.layer.top_k, dtype=torch.long) for site in sites]
        flat = [torch.cat(site.recorded) if site.recorded else e for site, e in zip(sites, empty)]
        if not any(len(s.forwards) > 1 for s in self.sessions):
            return flat, self._single_batch(flat)
        layers = []
        for i, site in enumerate(sites):
            recorded = site.recorded or []
            chunks, used = [], 0
            for session in self.sessions:
                parts, shapes = [], []
                for forward in session.forwards:
                    end = (forward.ends or self._recorded())[i]
                    used += end - forward.starts[i]
                    rows = recorded[forward.starts[i] : end]
                    part = torch.cat(rows) if rows else empty[i]
                    expected = (forward.batch or 0) * (forward.seq or 0)
                    if part.shape[0] != expected:
                        raise RoutingError(
                            f"MoE layer `{site.layer.name}` routed {part.shape[0]} tokens in forward {forward.index}, "
                            f"which had {forward.batch} x {forward.seq} tokens; the routes cannot be laid out per "
                            "sequence."
                        )
                    parts.append(part)
                    shapes.append((forward.batch or 0, forward.seq or 0))
                chunks.append(_per_sequence(parts, shapes) if len(parts) > 1 else parts[0])
            if used != len(recorded):
                raise RoutingError(
                    f"MoE layer `{site.layer.name}` ran outside the forwards of the model given to `record_routing` "
                    "while a KV cache was being continued; the routes cannot be laid out per sequence. Record the "
                    "model you call."
                )
            layers.append(torch.cat(chunks) if chunks else empty[i])
        return layers, self.sessions[0].batch if len(self.sessions) == 1 else None

    def _single_batch(self, flat: list[torch.Tensor]) -> int | None:
        """The batch size of a block that ran exactly one forward covering every recorded row."""
        if len(self.forwards) != 1:
            return None
        forward = self.forwards[0]
        if forward.batch is None or forward.seq is None:
            return None
        rows = forward.batch * forward.seq
        return forward.batch if all(t.shape[0] == rows for t in flat) else None


def _refuse_generation_mode(model: nn.Module, kwargs: dict[Any, Any]) -> None:
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    beams = kwargs.get("num_beams", getattr(config, "num_beams", 1))
    if isinstance(beams, int) and beams > 1:
        raise RoutingError(
            f"`generate` with beam search (num_beams={beams}) inside `record_routing` reorders the sequences "
            "between steps, so the routes recorded per step cannot be assigned to the returned sequences; "
            "record with greedy or sampled decoding (num_beams=1)."
        )
    lookup = kwargs.get("prompt_lookup_num_tokens", getattr(config, "prompt_lookup_num_tokens", None))
    if kwargs.get("assistant_model") is not None or lookup:
        raise RoutingError(
            "Assisted generation inside `record_routing` forwards candidate tokens that may be rejected, so "
            "forwarded positions are not the returned sequences; record without an assistant model or prompt lookup."
        )
