"""Patterns with the matching semantics of transformers 5's conversion mapping.

modelgraft's own patterns are dotted runs of whole key segments (``q_proj``,
``mlp.experts.*.gate_proj.weight``). The patterns of ``transformers.conversion_mapping`` are
regular expressions searched anywhere in a key: ``.block_sparse_moe.gate``, ``^w``,
``r"^vit\\.layers\\.(\\d+)\\.input_layernorm\\."``, ``experts.*.w1.weight``. A converter whose
patterns are not all plain segment runs (or that has a ``scope_prefix``) uses these semantics,
which this module implements:

- A source pattern is a regular expression searched in the key. ``*.`` stands for "any
  characters, then a dot" (``experts.*.w1.weight`` matches ``experts.3.w1.weight``); a pattern
  that ends in a letter or digit does not end inside a name (``weight`` does not match
  ``weight_scale_inv``).
- Among the source patterns of one converter, the match that starts first wins, and at equal
  start the longest pattern (then the first listed).
- The matched text is replaced by the *first* target pattern, which is a replacement string: a
  leading ``^`` and lookaround groups are dropped, ``\\.`` is a dot, and a capturing group ``(...)``
  stands for what the source's first group captured (``\\1``). Other target patterns are the
  other outputs of the operations, placed around the same prefix and suffix.
- A key is first renamed by every :class:`~modelgraft.WeightRenaming` of the entry in order
  (they chain), then by at most one :class:`~modelgraft.WeightConverter`.
- ``scope_prefix`` (with ``base_model_prefix``) restricts a transform to keys under a sub-model:
  the prefix is stripped before matching and put back afterwards.

Example:
    >>> from modelgraft.conversion._hf_patterns import TransformMatcher
    >>> m = TransformMatcher([".block_sparse_moe.gate"], [".mlp.gate"])
    >>> m.rename("model.layers.0.block_sparse_moe.gate.weight").key
    'model.layers.0.mlp.gate.weight'
    >>> TransformMatcher(["^vit\\\\.layers\\\\.(\\\\d+)\\\\.ln1\\\\."], ["vit.layers.\\\\1.norm1."]).rename(
    ...     "vit.layers.7.ln1.weight").key
    'vit.layers.7.norm1.weight'
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from modelgraft.errors import ConversionError

if TYPE_CHECKING:  # imported where used at run time, as before
    from modelgraft.conversion.keys import PatternMatch

__all__ = ["HFPattern", "HFTargetPattern", "Renamed", "TransformMatcher", "is_plain_pattern", "target_text"]

# What modelgraft's own segment patterns allow: identifier segments, `*` as a whole segment.
_PLAIN = re.compile(r"[A-Za-z0-9_]+|\*")
_REGEX_CHARS = re.compile(r"[\\^$()\[\]{}+?|]")
_STAR = "_mg_star"


def is_plain_pattern(text: str) -> bool:
    """Whether ``text`` is a modelgraft segment pattern (``q_proj``, ``mlp.experts.*.w1.weight``).

    Example:
        >>> is_plain_pattern("mlp.experts.*.w1.weight"), is_plain_pattern(".block_sparse_moe.gate")
        (True, False)
        >>> is_plain_pattern("model.language_model.*")
        False
    """
    segments = text.split(".")
    return (
        bool(text)
        and not _REGEX_CHARS.search(text)
        and all(_PLAIN.fullmatch(s) for s in segments)
        and segments.count("*") <= 1
        and segments[-1] != "*"  # a final `*` is a regex quantifier to transformers
    )


def target_text(pattern: str) -> tuple[str, str | None]:
    """A target pattern as the replacement string it stands for, and its capturing group if any.

    Example:
        >>> target_text(r"^vit\\.layers\\.(\\d+)\\.norm1\\.")
        ('vit.layers.\\\\1.norm1.', '(\\\\d+)')
    """
    text = pattern.removeprefix("^")
    text = re.sub(r"\(\?.+?\)?\)", "", text)  # lookarounds only restrict matching
    group = re.search(r"\(.+?\)", text)
    captured = None
    if group is not None:
        captured = group.group(0)
        text = text.replace(captured, r"\1", 1)
    return text.replace(r"\.", "."), captured


@dataclass(frozen=True)
class Match:
    """One source pattern found in a key: where, the ``*`` index, and the first captured group."""

    start: int
    end: int
    text: str
    index: int | None
    captured: str | None


class HFPattern:
    """One source pattern, compiled with transformers' semantics.

    Offers ``match``/``build``/``text`` like modelgraft's segment patterns, so that diagnostics
    can name keys; ``has_star`` is ``False`` because a regex's ``*`` need not be an index.
    """

    __slots__ = ("_user_group", "regex", "star", "text")
    has_star = False

    def __init__(self, text: str, capture: str | None = None) -> None:
        if not isinstance(text, str) or not text:
            raise ConversionError(f"A pattern must be a non-empty string; received {text!r}.")
        body = text
        if r"\1" in body:
            if capture is None:
                raise ConversionError(
                    f"Source pattern `{text}` refers to `\\1`, but no target pattern has a capturing group "
                    "`(...)` for it to stand for. Add the group to a target pattern or drop the `\\1`."
                )
            body = body.replace(r"\1", capture, 1)
        parts = body.split("*.")
        body = "".join(
            p + (rf"(?P<{_STAR}{i}>.*)\." if i < len(parts) - 1 else "") for i, p in enumerate(parts)
        )
        if re.search(r"[a-zA-Z0-9]$", body):
            body += r"(?!\w)"
        try:
            self.regex = re.compile(body)
        except re.error as e:
            raise ConversionError(
                f"Pattern `{text}` is not a valid regular expression ({e}). Escape literal characters "
                "(`\\.`, `\\(`) or write a plain dotted pattern such as `mlp.experts.*.w1.weight`."
            ) from None
        stars = {i for name, i in self.regex.groupindex.items() if name.startswith(_STAR)}
        self._user_group = next((i for i in range(1, self.regex.groups + 1) if i not in stars), None)
        self.star = bool(stars)
        self.text = text

    def search(self, key: str) -> Match | None:
        m = self.regex.search(key)
        if m is None:
            return None
        index = None
        if self.star:
            star = next(v for k, v in m.groupdict().items() if k.startswith(_STAR))
            index = int(star) if star is not None and star.isdigit() else None
        captured = m.group(self._user_group) if self._user_group is not None else None
        return Match(m.start(), m.end(), m.group(0), index, captured)

    def match(self, key: str) -> PatternMatch | None:
        from modelgraft.conversion.keys import PatternMatch

        m = self.search(key)
        return None if m is None else PatternMatch(key[: m.start], key[m.end :], m.index)

    def build(self, prefix: str, suffix: str, index: int | None = None) -> str:
        """The key this pattern would match around ``prefix``/``suffix`` (for messages only)."""
        body = target_text(self.text)[0].replace("\\", "")
        if index is not None:
            body = body.replace("*", str(index), 1)
        return prefix + body + suffix


class HFTargetPattern:
    """One target pattern: a replacement string (see :func:`target_text`)."""

    __slots__ = ("captured", "regex", "replacement", "text")
    has_star = False

    def __init__(self, text: str) -> None:
        if not isinstance(text, str):
            raise ConversionError(f"A target pattern must be a string; received {text!r}.")
        self.text = text
        self.replacement, self.captured = target_text(text)
        body = re.escape(self.replacement).replace(re.escape(r"\1"), r".+?").replace(r"\*", r"\d+")
        self.regex = re.compile(body)

    def fill(self, captured: str | None, index: int | None = None) -> str:
        out = self.replacement
        if r"\1" in out:
            out = out.replace(r"\1", captured or "")
        if index is not None:
            out = out.replace("*", str(index))
        return out

    def match(self, key: str) -> bool:
        """Whether a key may have been produced by this target (cheap pre-check for saving)."""
        return self.regex.search(key) is not None

    def expand(self, captured: str | None, keys: Sequence[str], prefix: str, suffix: str) -> list[str]:
        """The keys among ``keys`` this target names around ``prefix``/``suffix``; ``*`` expands in order."""
        text = self.fill(captured)
        if "*" not in text:
            return [prefix + text + suffix]
        regex = re.compile(re.escape(prefix + text + suffix).replace(r"\*", r"(\d+)", 1) + "$")
        found = [(int(m.group(1)), k) for k in keys if (m := regex.match(k))]
        return [k for _, k in sorted(found)]


@dataclass(frozen=True)
class Renamed:
    """The result of renaming one key: the new key, which source pattern matched, and where."""

    key: str
    source: int
    index: int | None
    prefix: str
    suffix: str
    captured: str | None


class TransformMatcher:
    """The source and target patterns of one transform, with transformers' renaming semantics.

    Example:
        >>> m = TransformMatcher(["experts.*.w1.weight", "experts.*.w3.weight"], ["experts.gate_up_proj"])
        >>> r = m.rename("model.layers.0.experts.3.w3.weight")
        >>> r.key, r.source, r.index
        ('model.layers.0.experts.gate_up_proj', 1, 3)
    """

    __slots__ = ("_order", "base_model_prefix", "scope_prefix", "sources", "targets")

    def __init__(
        self,
        sources: Sequence[str],
        targets: Sequence[str],
        scope_prefix: str | None = None,
        base_model_prefix: str | None = None,
    ) -> None:
        self.targets = tuple(HFTargetPattern(t) for t in targets)
        groups = {t.captured for t in self.targets if t.captured is not None}
        if len(groups) > 1:
            raise ConversionError(
                f"Target patterns {list(targets)} hold different capturing groups {sorted(groups)}; "
                "all target patterns of one transform must use the same group."
            )
        capture = groups.pop() if groups else None
        self.sources = tuple(HFPattern(s, capture) for s in sources)
        # transformers tries longer patterns first at the same position (`weight.absmax` before `weight`).
        self._order = sorted(range(len(self.sources)), key=lambda i: -len(self.sources[i].text))
        self.scope_prefix = scope_prefix
        self.base_model_prefix = base_model_prefix

    def _scope(self, key: str) -> tuple[str, str] | None:
        """``(consumed prefix, rest)`` under ``scope_prefix``, or ``None`` when out of scope."""
        if self.scope_prefix is None:
            return "", key
        scope = f"{self.scope_prefix}." if self.scope_prefix else ""
        base = f"{self.base_model_prefix}." if self.base_model_prefix else ""
        for prefix in (base + scope, scope):
            if key.startswith(prefix):
                return prefix, key[len(prefix) :]
        return None

    def find(self, key: str) -> tuple[int, Match] | None:
        """The source pattern that matches ``key`` first (leftmost, then longest), and its match."""
        best: tuple[int, int, Match] | None = None
        for rank, i in enumerate(self._order):
            m = self.sources[i].search(key)
            if m is not None and (best is None or m.start < best[2].start):
                best = (rank, i, m)
        return None if best is None else (best[1], best[2])

    def rename(self, key: str, target: int = 0) -> Renamed | None:
        """Rename ``key`` with target pattern ``target`` (the first by default), or ``None``."""
        scoped = self._scope(key)
        if scoped is None:
            return None
        consumed, rest = scoped
        found = self.find(rest)
        if found is None:
            return None
        i, m = found
        replacement = self.targets[target].fill(m.captured)
        # transformers replaces the first occurrence of the matched text.
        at = rest.find(m.text)
        prefix, suffix = consumed + rest[:at], rest[at + len(m.text) :]
        return Renamed(prefix + replacement + suffix, i, m.index, prefix, suffix, m.captured)
