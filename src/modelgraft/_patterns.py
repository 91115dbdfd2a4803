"""Registry keys that are regular expressions: refused when they can backtrack catastrophically,
compiled once, and matched against each class name once.

Python's ``re`` cannot be interrupted, so a pattern that backtracks exponentially would hang every
load that scans class names (while holding the construction lock). :func:`backtracking_problem`
inspects the parsed pattern instead, before it is ever run, and refuses three shapes:

* *nested quantifiers*: a quantifier that can repeat its group more than once (``*``, ``+``,
  ``{m,n}`` with ``n >= 2``) applied to a group that contains another such quantifier, when either
  of the two has no upper bound: ``(\\w+)+``, ``(a*)*``, ``(a{1,3})+``, ``(\\w+){2,30}``.
  Both bounded (``(\\d{1,3}\\.){3}``) is accepted.
* *quantified overlapping alternation*: an alternation inside a group that can repeat more than
  once, where two branches can start with the same character (a branch that can match nothing
  starts with what follows it), or both can match the empty string: ``(Attention|\\w)+``,
  ``(\\w|\\w\\w)+``, ``(a|a)*``. ``(Llama|Mistral)+`` is accepted. (``re`` itself turns
  single-character alternatives such as ``(\\w|\\d)`` into a character class, which is safe.)
* *three unbounded quantifiers in a row* over a common character with only optional items between
  them: ``\\w*\\w*\\w*``. Two (``.*.*``) cost at most quadratic time on a class name and are accepted.

The check is conservative: a few patterns that would in fact run fast are refused too (``(ab+)+``);
rewrite them without nesting (``(ab)+b*``) or use exact class names.

Example:
    >>> backtracking_problem("(\\\\w+)+!")
    'nested quantifiers: a group repeated by `+` contains another repeated item, and at least one of the two is unbounded'
    >>> backtracking_problem("^Qwen.*Experts$") is None, backtracking_problem("(Llama|Mistral)MLP") is None
    (True, True)
    >>> key = matcher(".*Attention$")
    >>> key.matches("LlamaAttention"), key.matches("LlamaMLP")
    (True, False)
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from modelgraft.errors import UnsafePatternError

if sys.version_info >= (3, 11):
    from re import _parser  # type: ignore[attr-defined]  # private, so absent from typeshed
else:  # pragma: no cover - Python 3.10
    import sre_parse as _parser

__all__ = ["Matcher", "UnsafePatternError", "backtracking_problem", "matcher"]

_MAXREPEAT = _parser.MAXREPEAT
_REPEATS = {"MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"}
# Characters the character-overlap tests probe: all of Latin-1 plus a few non-ASCII letters,
# digits and spaces (class names are identifiers; this is enough to tell classes apart).
_SAMPLE = (*(chr(c) for c in range(256)), "\u03b1", "\u0663", "\u2003", "\u4e00", "\u0416")
_ALL = frozenset(_SAMPLE)
_CATEGORIES = {
    name: frozenset(ch for ch in _SAMPLE if re.fullmatch(regex, ch))
    for name, regex in {
        "CATEGORY_DIGIT": r"\d",
        "CATEGORY_NOT_DIGIT": r"\D",
        "CATEGORY_SPACE": r"\s",
        "CATEGORY_NOT_SPACE": r"\S",
        "CATEGORY_WORD": r"\w",
        "CATEGORY_NOT_WORD": r"\W",
        "CATEGORY_LINEBREAK": r"\n",
        "CATEGORY_NOT_LINEBREAK": r"[^\n]",
    }.items()
}
_MATCHERS_MAX = 4096  # distinct pattern strings kept compiled (with their per-class-name results)


def _name(op: Any) -> str:
    return getattr(op, "name", str(op))


def _unbounded(hi: int) -> bool:
    return bool(hi == _MAXREPEAT)


class _Scan:
    """One walk over a parsed pattern (its flags decide what ``.`` and letters match)."""

    def __init__(self, flags: int) -> None:
        self.ignore_case = bool(flags & re.IGNORECASE)
        self.dotall = bool(flags & re.DOTALL)

    # ---- which characters can start an item ----------------------------------------------------
    def _literal(self, code: int) -> frozenset[str]:
        ch = chr(code)
        if self.ignore_case:
            return frozenset(c for c in _SAMPLE if c.lower() == ch.lower())
        return frozenset((ch,))

    def _charset(self, items: Sequence[tuple[Any, Any]]) -> frozenset[str]:
        chars: set[str] = set()
        negate = False
        for op, av in items:
            name = _name(op)
            if name == "NEGATE":
                negate = True
            elif name == "LITERAL":
                chars |= self._literal(av)
            elif name == "RANGE":
                lo, hi = av
                chars |= {
                    c
                    for c in _SAMPLE
                    if lo <= ord(c) <= hi or (self.ignore_case and lo <= ord(c.lower()) <= hi)
                }
            elif name == "CATEGORY":
                chars |= _CATEGORIES.get(_name(av), _ALL)
            else:  # an item we do not model: assume it can be anything
                chars |= _ALL
        return _ALL - chars if negate else frozenset(chars)

    def first(self, items: Iterable[tuple[Any, Any]]) -> tuple[frozenset[str], bool]:
        """The characters a sequence can start with, and whether it can match the empty string."""
        chars: frozenset[str] = frozenset()
        for op, av in items:
            more, nullable = self._first_item(_name(op), av)
            chars |= more
            if not nullable:
                return chars, False
        return chars, True

    def _first_item(self, name: str, av: Any) -> tuple[frozenset[str], bool]:
        if name == "LITERAL":
            return self._literal(av), False
        if name == "NOT_LITERAL":
            return _ALL - self._literal(av), False
        if name == "ANY":
            return (_ALL if self.dotall else _ALL - {"\n"}), False
        if name == "IN":
            return self._charset(av), False
        if name == "CATEGORY":
            return _CATEGORIES.get(_name(av), _ALL), False
        if name == "SUBPATTERN":
            return self.first(av[-1])
        if name == "ATOMIC_GROUP":
            return self.first(av)
        if name in _REPEATS:
            lo, _hi, body = av
            chars, nullable = self.first(body)
            return chars, nullable or lo == 0
        if name == "BRANCH":
            firsts = [self.first(branch) for branch in av[1]]
            return frozenset().union(*(c for c, _ in firsts)), any(n for _, n in firsts)
        if name in ("AT", "ASSERT", "ASSERT_NOT"):
            return frozenset(), True  # zero-width
        return _ALL, True  # group references and anything else: assume the worst

    # ---- the three refused shapes ---------------------------------------------------------------
    def problem(self, items: Sequence[tuple[Any, Any]]) -> str | None:
        found = self._in_a_row(items)
        if found is not None:
            return found
        for op, av in items:
            name = _name(op)
            if name in _REPEATS:
                lo, hi, body = av
                if hi > 1:
                    symbol = _quantifier(lo, hi)
                    for inner_hi in self._repeats_inside(body):
                        if _unbounded(hi) or _unbounded(inner_hi):
                            return (
                                f"nested quantifiers: a group repeated by `{symbol}` contains another repeated "
                                "item, and at least one of the two is unbounded"
                            )
                    if self._overlapping_branches(body, self.first(body)[0]):
                        return (
                            f"alternation repeated by `{symbol}` whose branches overlap (two of them can start "
                            "with the same character or both match nothing)"
                        )
                children: list[Sequence[tuple[Any, Any]]] = [body]
            elif name == "SUBPATTERN":
                children = [av[-1]]
            elif name == "ATOMIC_GROUP":
                children = [av]
            elif name == "BRANCH":
                children = list(av[1])
            elif name in ("ASSERT", "ASSERT_NOT"):
                children = [av[1]]
            elif name == "GROUPREF_EXISTS":
                children = [branch for branch in av[1:] if branch is not None]
            else:
                children = []
            for child in children:
                found = self.problem(child)
                if found is not None:
                    return found
        return None

    def _repeats_inside(self, items: Iterable[tuple[Any, Any]]) -> Iterable[int]:
        """The upper bounds of every quantifier (allowing more than one repetition) inside ``items``."""
        for op, av in items:
            name = _name(op)
            if name in _REPEATS:
                if av[1] > 1:
                    yield av[1]
                yield from self._repeats_inside(av[2])
            elif name == "SUBPATTERN":
                yield from self._repeats_inside(av[-1])
            elif name == "ATOMIC_GROUP":
                yield from self._repeats_inside(av)
            elif name == "BRANCH":
                for branch in av[1]:
                    yield from self._repeats_inside(branch)
            elif name == "GROUPREF_EXISTS":
                for branch in av[1:]:
                    if branch is not None:
                        yield from self._repeats_inside(branch)

    def _overlapping_branches(self, items: Sequence[tuple[Any, Any]], follow: frozenset[str]) -> bool:
        """Whether an alternation in ``items`` has two branches that can start the same way.

        A branch that can match nothing starts with whatever follows the alternation (``follow``
        for the end of ``items``: the next repetition of the enclosing group).
        """
        for i, (op, av) in enumerate(items):
            name = _name(op)
            rest, rest_nullable = self.first(items[i + 1 :])
            after = rest | follow if rest_nullable else rest
            if name == "BRANCH":
                starts = []
                for branch in av[1]:
                    chars, nullable = self.first(branch)
                    starts.append((chars | after if nullable else chars, nullable))
                for j, (chars_a, null_a) in enumerate(starts):
                    for chars_b, null_b in starts[j + 1 :]:
                        if (null_a and null_b) or chars_a & chars_b:
                            return True
                if any(self._overlapping_branches(branch, after) for branch in av[1]):
                    return True
            elif name in _REPEATS:
                body = av[2]
                if self._overlapping_branches(body, self.first(body)[0] | after):
                    return True
            elif name == "SUBPATTERN" and self._overlapping_branches(av[-1], after):
                return True
            elif name == "ATOMIC_GROUP" and self._overlapping_branches(av, after):
                return True
        return False

    def _in_a_row(self, items: Sequence[tuple[Any, Any]]) -> str | None:
        """Three unbounded quantifiers over a common character, with only optional items between."""
        if sum(_name(op) in _REPEATS and _unbounded(av[1]) for op, av in items) < 3:
            return None
        run: list[frozenset[str]] = []
        for op, av in items:
            name = _name(op)
            _chars, nullable = self._first_item(name, av)
            if name in _REPEATS and _unbounded(av[1]):
                run.append(self.first(av[2])[0])
                common = [c for c in _SAMPLE if sum(c in r for r in run) >= 3]
                if common:
                    return (
                        "three or more unbounded quantifiers in a row over the same characters (such as "
                        "`\\w*\\w*\\w*`)"
                    )
            elif not nullable:
                run = []
        return None


def _quantifier(lo: int, hi: int) -> str:
    if _unbounded(hi):
        return {0: "*", 1: "+"}.get(lo, f"{{{lo},}}")
    return f"{{{lo},{hi}}}" if lo != hi else f"{{{lo}}}"


def backtracking_problem(pattern: str) -> str | None:
    """Say why ``pattern`` could backtrack catastrophically, or return None when it cannot.

    ``pattern`` must compile (call :func:`re.compile` first for a clear syntax error).

    Example:
        >>> backtracking_problem("(Attention|\\\\w)+!").startswith("alternation repeated by `+`")
        True
    """
    quantifiers = sum(pattern.count(c) for c in "*+{")  # escaped ones too: over-counting is safe
    if quantifiers == 0 or (quantifiers == 1 and "|" not in pattern):
        # Every refused shape needs two quantifiers, or one and an alternation: skip the parse.
        return None
    parsed = _parser.parse(pattern)
    return _Scan(parsed.state.flags).problem(list(parsed))


class Matcher:
    """A compiled, vetted pattern and what it answered for each class name so far.

    Shared by every registration of the same pattern string, so a class name is matched against
    a pattern once, whatever the registry looks like around it.
    """

    __slots__ = ("_hits", "key", "regex")

    def __init__(self, key: str, regex: re.Pattern[str]) -> None:
        self.key = key
        self.regex = regex
        self._hits: dict[str, bool] = {}

    def matches(self, class_name: str) -> bool:
        """``re.search(key, class_name)``, computed once per class name."""
        hit = self._hits.get(class_name)
        if hit is None:
            hit = self._hits[class_name] = self.regex.search(class_name) is not None
        return hit


# pattern string -> Matcher. No lock: two threads vetting the same new key at once build two
# equal Matchers and one wins, which costs nothing but a duplicate compile.
_matchers: dict[str, Matcher] = {}


def matcher(key: str) -> Matcher:
    """Compile and vet ``key`` (once per pattern string) and return its :class:`Matcher`.

    Raises:
        re.error: ``key`` is not a valid regular expression.
        UnsafePatternError: ``key`` can backtrack catastrophically (see the module docstring).
    """
    found = _matchers.get(key)
    if found is not None:
        return found
    regex = re.compile(key)
    problem = backtracking_problem(key)
    if problem is not None:
        raise UnsafePatternError(problem)
    if len(_matchers) >= _MATCHERS_MAX:
        _matchers.clear()  # bounded; forgetting only costs a recompile and rematching
    found = _matchers[key] = Matcher(key, regex)
    return found
