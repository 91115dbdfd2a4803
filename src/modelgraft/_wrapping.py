"""Replace attributes of transformers by wrappers, and put exactly the originals back.

modelgraft wraps a handful of transformers functions and methods (the loaders, the construction
site, the conversion hooks, the output-recorder lookup). Each wiring module keeps one
:class:`Wrappers` set, which installs all of its wrappers or none, remembers what each attribute
held (a plain function, a ``classmethod``/``staticmethod`` object, or nothing at all), and on
removal restores an attribute only where it still holds modelgraft's wrapper, so that a library
that wrapped the same attribute afterwards is never undone.

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
import threading
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["WRAPPED_MARK", "Wrappers", "is_wrapped"]

#: Set on every wrapper function; its value is the function it wraps.
WRAPPED_MARK = "__modelgraft_wrapped__"
_ABSENT = object()

Step = tuple[Any, str, Callable[[Callable[..., Any]], Callable[..., Any]]]


def is_wrapped(value: object) -> bool:
    """Whether ``value`` (a function, or a ``classmethod``/``staticmethod`` object) is a modelgraft wrapper."""
    return hasattr(getattr(value, "__func__", value), WRAPPED_MARK)


class Wrappers:
    """A set of attribute wrappers installed and removed together (thread-safe, idempotent)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        # (owner, attribute, what it held before, what was installed), in installation order
        self._applied: list[tuple[Any, str, object, object]] = []

    @property
    def installed(self) -> bool:
        return bool(self._applied)

    def install(self, steps: Iterable[Step]) -> None:
        """For each ``(owner, name, make)``: ``owner.name`` becomes ``make(original function)``,
        re-wrapped as ``classmethod``/``staticmethod`` when the original was one. Nothing happens
        when the set is already installed; a failing ``make`` leaves nothing installed."""
        with self._lock:
            if self._applied:
                return
            try:
                for owner, name, make in steps:
                    self._wrap(owner, name, make)
            except BaseException:
                self.uninstall()
                raise

    def _wrap(self, owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        held = vars(owner).get(name, _ABSENT)
        if held is _ABSENT:  # inherited, or looked up through the class of an instance
            kind, original = None, getattr(owner, name)
        elif isinstance(held, (classmethod, staticmethod)):
            kind, original = type(held), held.__func__
        else:
            kind, original = None, held
        wrapper = make(original)
        functools.update_wrapper(wrapper, original)
        setattr(wrapper, WRAPPED_MARK, original)
        installed = kind(wrapper) if kind is not None else wrapper
        setattr(owner, name, installed)
        self._applied.append((owner, name, held, installed))

    def uninstall(self) -> None:
        """Put back what :meth:`install` replaced, newest first (idempotent)."""
        with self._lock:
            for owner, name, held, installed in reversed(self._applied):
                if vars(owner).get(name, _ABSENT) is not installed:
                    continue  # wrapped again on top by someone else: unwrapping would undo theirs
                if held is _ABSENT:
                    delattr(owner, name)
                else:
                    setattr(owner, name, held)
            self._applied.clear()
