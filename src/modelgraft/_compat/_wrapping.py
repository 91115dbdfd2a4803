"""Replace attributes of transformers by wrappers, and put exactly the originals back.

modelgraft wraps a handful of transformers functions and methods (the loaders, the construction
site, the conversion hooks, the output-recorder lookup; the full list is the table in
:mod:`modelgraft._compat.wraps`). Each group of them is one :class:`Wrappers` set, which installs
all of its wrappers or none, remembers what each attribute held (a plain function, a
``classmethod``/``staticmethod`` object, a value, or nothing at all), and on removal restores an
attribute only where it still holds modelgraft's wrapper, so that a library that wrapped the same
attribute afterwards is never undone.

Example:
    >>> class Greeter:
    ...     @classmethod
    ...     def hello(cls, name):
    ...         return f"hello {name}"
    >>> wrappers = Wrappers()
    >>> wrappers.install([(Greeter, "hello", lambda f: lambda cls, name: f(cls, name).upper())])
    >>> Greeter.hello("ada"), is_wrapped(Greeter.__dict__["hello"])
    ('HELLO ADA', True)
    >>> wrappers.uninstall()
    >>> Greeter.hello("ada"), is_wrapped(Greeter.__dict__["hello"])
    ('hello ada', False)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

from modelgraft._forksafe import ForkSafeLock

__all__ = ["WRAPPED_MARK", "Wrappers", "is_wrapped"]

#: Set on every wrapper function; its value is the function it wraps.
WRAPPED_MARK = "__modelgraft_wrapped__"
_ABSENT = object()

Make = Callable[[Any], Any]
Restore = Callable[[Any], Any]
#: ``(owner, attribute, make)`` or ``(owner, attribute, make, restore)``; see :meth:`Wrappers.install`.
Step = tuple[Any, str, Make] | tuple[Any, str, Make, Restore]


def is_wrapped(value: object) -> bool:
    """Whether ``value`` (a function, a ``classmethod``/``staticmethod`` object, or a replaced value)
    is one that modelgraft installed."""
    return hasattr(getattr(value, "__func__", value), WRAPPED_MARK)


class Wrappers:
    """A set of attribute wrappers installed and removed together (thread-safe, idempotent)."""

    def __init__(self) -> None:
        self._lock = ForkSafeLock()
        # (owner, attribute, what it held before, what was installed, restore), in installation order
        self._applied: list[tuple[Any, str, object, object, Restore | None]] = []

    @property
    def installed(self) -> bool:
        return bool(self._applied)

    def install(self, steps: Iterable[Step]) -> None:
        """For each ``(owner, name, make)``: ``owner.name`` becomes ``make(original)``, re-wrapped as
        ``classmethod``/``staticmethod`` when the original was one. A step may add ``restore``:
        on removal ``owner.name`` then becomes ``restore(installed value)`` instead of the original
        (for a value replaced by a copy that others may have added to meanwhile). Nothing happens
        when the set is already installed; a failing ``make`` leaves nothing installed."""
        with self._lock:
            if self._applied:
                return
            try:
                for step in steps:
                    self._wrap(*step)
            except BaseException:
                self.uninstall()
                raise

    def _wrap(self, owner: Any, name: str, make: Make, restore: Restore | None = None) -> None:
        held = vars(owner).get(name, _ABSENT)
        if held is _ABSENT:  # inherited, or looked up through the class of an instance
            kind, original = None, getattr(owner, name)
        elif isinstance(held, (classmethod, staticmethod)):
            kind, original = type(held), held.__func__
        else:
            kind, original = None, held
        wrapper = make(original)
        if callable(original):  # a replaced value (a registry dict) keeps its own identity
            functools.update_wrapper(wrapper, original)
        setattr(wrapper, WRAPPED_MARK, original)
        installed = kind(wrapper) if kind is not None else wrapper
        setattr(owner, name, installed)
        self._applied.append((owner, name, held, installed, restore))

    def uninstall(self) -> None:
        """Put back what :meth:`install` replaced, newest first (idempotent)."""
        with self._lock:
            for owner, name, held, installed, restore in reversed(self._applied):
                if vars(owner).get(name, _ABSENT) is not installed:
                    continue  # wrapped again on top by someone else: unwrapping would undo theirs
                if restore is not None:
                    setattr(owner, name, restore(installed))
                elif held is _ABSENT:
                    delattr(owner, name)
                else:
                    setattr(owner, name, held)
            self._applied.clear()
