"""Registry keys that are regular expressions: matched by RE2, in time linear in the class name.

Python's ``re`` backtracks and cannot be interrupted, so a pattern such as ``(\\w\\w?)+!`` takes
seconds on a 40-character class name and grows exponentially; a load scans class names while it
holds the construction lock, so one such key would hang every load. No static check of ``re``
patterns catches every such shape. Keys are therefore matched with RE2 (``google-re2``), whose
automata match in time linear in the input whatever the pattern: no key can hang a load, by
construction.

What RE2 cannot express (backreferences ``\\1``, lookaround ``(?=...)``/``(?<!...)``, possessive
and atomic groups, conditionals, ``(?x)``) is refused at registration with
:class:`UnsafePatternError`. A key must also be a valid Python regular expression (checked first,
for a familiar syntax error). ``\\w``, ``\\d``, ``\\s`` and ``\\b`` are ASCII in RE2 (class names are
ASCII identifiers in practice); ``(?i)``, ``(?s)``, ``^``/``$`` and ``re.search`` semantics
(unanchored) are as in ``re``.

Example:
    >>> key = matcher(".*Attention$")
    >>> key.matches("LlamaAttention"), key.matches("LlamaMLP")
    (True, False)
    >>> matcher("(\\\\w\\\\w?)+!").matches("A" * 40 + "Attention")  # linear time: answers at once
    False
    >>> try:
    ...     matcher("(Llama)\\\\1")
    ... except UnsafePatternError as error:
    ...     print(str(error)[:72])
    RE2, the linear-time engine that matches pattern keys, cannot express it
"""

from __future__ import annotations

import re
from typing import Any

import re2  # type: ignore[import-untyped]  # google-re2 ships no type hints

from modelgraft.errors import UnsafePatternError

__all__ = ["Matcher", "UnsafePatternError", "matcher"]

_MATCHERS_MAX = 4096  # distinct pattern strings kept compiled (with their per-class-name results)
_OPTIONS = re2.Options()
_OPTIONS.log_errors = False  # refusals are reported by the exception, not on stderr


def _compile(key: str) -> Any:
    """``key`` compiled by RE2 (a seam for tests that count matches)."""
    return re2.compile(_without_comments(key), _OPTIONS)


def _without_comments(key: str) -> str:
    """``key`` without its ``(?#...)`` comment groups, which match nothing in ``re`` and which RE2 lacks.

    Example:
        >>> _without_comments(r"^Llama(?#the family)MLP[(?#]$")
        '^LlamaMLP[(?#]$'
    """
    out, i, in_class = [], 0, False
    while i < len(key):
        char = key[i]
        if char == "\\":
            out.append(key[i : i + 2])
            i += 2
            continue
        if in_class:
            in_class = char != "]" or out[-1] == "["  # `[]...]`: a leading `]` is a member
        elif char == "[":
            in_class = True
        elif key.startswith("(?#", i):
            end = key.find(")", i)
            i = len(key) if end < 0 else end + 1
            continue
        out.append(char)
        i += 1
    return "".join(out)


class Matcher:
    """A compiled pattern and what it answered for each class name so far.

    Shared by every registration of the same pattern string, so a class name is matched against
    a pattern once, whatever the registry looks like around it.
    """

    __slots__ = ("_hits", "key", "regex")

    def __init__(self, key: str, regex: Any) -> None:
        self.key = key
        self.regex = regex
        self._hits: dict[str, bool] = {}

    def matches(self, class_name: str) -> bool:
        """Whether ``key`` matches anywhere in ``class_name`` (``re.search``), computed once per class name."""
        hit = self._hits.get(class_name)
        if hit is None:
            hit = self._hits[class_name] = self.regex.search(class_name) is not None
        return hit


# pattern string -> Matcher. No lock: two threads compiling the same new key at once build two
# equal Matchers and one wins, which costs nothing but a duplicate compile.
_matchers: dict[str, Matcher] = {}


def matcher(key: str) -> Matcher:
    """Compile ``key`` (once per pattern string) with RE2 and return its :class:`Matcher`.

    Raises:
        re.error: ``key`` is not a valid regular expression.
        UnsafePatternError: RE2 cannot express ``key`` (a backreference, lookaround, ...).
    """
    found = _matchers.get(key)
    if found is not None:
        return found
    re.compile(key)  # a Python syntax error reads as usual
    try:
        regex = _compile(key)
    except re2.error as exc:
        reason = exc.args[0].decode() if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise UnsafePatternError(
            f"RE2, the linear-time engine that matches pattern keys, cannot express it ({reason}); "
            "backreferences, lookaround, possessive or atomic groups and conditionals need backtracking, "
            "which could hang a load"
        ) from None
    if len(_matchers) >= _MATCHERS_MAX:
        _matchers.clear()  # bounded; forgetting only costs a recompile and rematching
    found = _matchers[key] = Matcher(key, regex)
    return found
