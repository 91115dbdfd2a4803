"""Key matching: which checkpoint and model keys a conversion pattern names, and how they pair up.

This is the one place that knows the pattern syntax. A pattern is a dotted run of key segments;
``*`` stands for one index segment (an expert number). ``q_proj`` matches
``model.layers.0.self_attn.q_proj.weight`` (and ``.bias``): the part before the run is the
*prefix*, the part after it the *suffix*, and a converter writes ``prefix + target + suffix``.
Keys with the same prefix and suffix form one conversion group (:func:`bucket_keys`). Checkpoint
keys are first brought into the model's key space (:func:`translate_checkpoint_keys`: a base model
loaded from a checkpoint with a head, or the reverse).

Example:
    >>> m = Pattern("mlp.experts.*.up_proj").match("model.layers.1.mlp.experts.7.up_proj.weight")
    >>> m.prefix, m.suffix, m.index
    ('model.layers.1', 'weight', 7)
    >>> Pattern("v_proj").match("model.layers.0.self_attn.qkv_proj.weight") is None
    True
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeGuard

import torch

from modelgraft.errors import ConversionError

__all__ = ["Pattern", "PatternMatch", "as_patterns", "bucket_keys", "translate_checkpoint_keys"]

_REGEX_CHARS = re.compile(r"[\\^$()\[\]{}+?|]")


@dataclass(frozen=True)
class PatternMatch:
    """Where a pattern matched a key: ``prefix.<pattern>.suffix``, and the ``*`` index if any."""

    prefix: str
    suffix: str
    index: int | None


class Pattern:
    """One compiled source or target pattern."""

    __slots__ = ("has_star", "regex", "text")

    def __init__(self, text: str) -> None:
        segments = text.split(".")
        if not text or any(not s for s in segments):
            raise ConversionError(
                f"Pattern `{text}` is not a dotted run of key segments (for example `q_proj` or "
                "`mlp.experts.*.gate_proj.weight`)."
            )
        if _REGEX_CHARS.search(text) or any("*" in seg and seg != "*" for seg in segments):
            raise ConversionError(
                f"Pattern `{text}` looks like a regular expression. modelgraft patterns are dotted key segments, "
                "with `*` standing for one whole index segment: write `mlp.experts.*.w1.weight`, not "
                "`\\.experts.*.w1.weight`."
            )
        if segments.count("*") > 1:
            raise ConversionError(
                f"Pattern `{text}` has more than one `*`; one index per pattern is supported."
            )
        self.text = text
        self.has_star = "*" in segments
        body = r"\.".join(r"(?P<idx>\d+)" if s == "*" else re.escape(s) for s in segments)
        # Anchor on segment boundaries so that `v_proj` never matches inside `qkv_proj`.
        self.regex = re.compile(rf"(?:^|\.)(?P<body>{body})(?=\.|$)")

    def match(self, key: str) -> PatternMatch | None:
        m = self.regex.search(key)
        if m is None:
            return None
        start, end = m.span("body")
        idx = m.group("idx") if self.has_star else None
        return PatternMatch(key[: max(start - 1, 0)], key[end + 1 :], None if idx is None else int(idx))

    def build(self, prefix: str, suffix: str, index: int | None = None) -> str:
        body = self.text if index is None else self.text.replace("*", str(index))
        return ".".join(p for p in (prefix, body, suffix) if p)


def as_patterns(value: str | Sequence[str], what: str) -> tuple[str, ...]:
    items = (value,) if isinstance(value, str) else tuple(value)
    if not items or not all(isinstance(p, str) for p in items):
        raise ConversionError(f"`{what}` must be a non-empty string or list of strings; received {value!r}.")
    return items


def are_segment_patterns(patterns: Sequence[object]) -> TypeGuard[Sequence[Pattern]]:
    """Whether every one of ``patterns`` is a segment :class:`Pattern`.

    True of every converter without transformers' semantics (``_hf``); the plan's segment path
    asserts it so that the type checker knows which patterns it holds.
    """
    return all(isinstance(p, Pattern) for p in patterns)


def bucket_keys(
    patterns: Sequence[Pattern], keys: Iterable[str]
) -> dict[tuple[str, str], list[dict[int | None, str]]]:
    """``(prefix, suffix) -> [per pattern: {index: key}]`` for every key a pattern matches."""
    buckets: dict[tuple[str, str], list[dict[int | None, str]]] = {}
    for key in keys:
        for i, pattern in enumerate(patterns):
            m = pattern.match(key)
            if m is None:
                continue
            slots = buckets.setdefault((m.prefix, m.suffix), [{} for _ in patterns])
            slots[i][m.index] = key
            break  # a key belongs to the first pattern that matches it
    return buckets


def translate_checkpoint_keys(
    model: torch.nn.Module, model_keys: set[str], ckpt_keys: Iterable[str]
) -> dict[str, str]:
    """Map checkpoint keys into the model's key space (adding or removing ``base_model_prefix``)."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    ckpt_keys = list(ckpt_keys)
    if not prefix:
        return {k: k for k in ckpt_keys}
    dotted = prefix + "."
    model_has = any(k.startswith(dotted) for k in model_keys)
    ckpt_has = any(k.startswith(dotted) for k in ckpt_keys)
    if ckpt_has and not model_has:  # a base model loaded from a checkpoint with a head
        return {k: k[len(dotted) :] if k.startswith(dotted) else k for k in ckpt_keys}
    if model_has and not ckpt_has:  # a model with a head loaded from a base checkpoint
        roots = set(model._modules)
        return {k: k if k.split(".", 1)[0] in roots else dotted + k for k in ckpt_keys}
    return {k: k for k in ckpt_keys}
