"""Locks that a forked child gets back free.

``os.fork()`` copies a lock that another thread holds as held, but not that thread: the child would
wait for it forever. Every lock modelgraft keeps at module level is a :class:`ForkSafeLock`; after a
fork each one is replaced in the child by a new lock, unless the thread that forked holds it itself
(it carries on in the child and releases it there).

Example:
    >>> lock = ForkSafeLock()
    >>> with lock:
    ...     lock.held_here()
    True
    >>> lock.held_here()
    False
"""

from __future__ import annotations

import os
import threading
import weakref

__all__ = ["ForkSafeLock"]

_all_locks: weakref.WeakSet[ForkSafeLock] = weakref.WeakSet()


class ForkSafeLock:
    """A re-entrant lock, renewed in a forked child unless the forking thread holds it."""

    __slots__ = ("__weakref__", "_lock")

    def __init__(self) -> None:
        self._lock = threading.RLock()
        _all_locks.add(self)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def held_here(self) -> bool:
        """Whether the current thread holds the lock."""
        return bool(self._lock._is_owned())  # type: ignore[attr-defined]

    def _renew_in_child(self) -> None:
        if not self.held_here():
            self._lock = threading.RLock()


def _after_fork_in_child() -> None:
    for lock in list(_all_locks):
        lock._renew_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
