"""Every module-level lock of modelgraft is free again in a forked child (issue 10, point 9).

Unit tests of ``modelgraft._forksafe`` (their own file): they import it directly, the one exception to
tests using public names only (issue 14); everything else comes from the public namespaces.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

import modelgraft
import modelgraft.grafts
import modelgraft.moe  # noqa: F401
from modelgraft import _forksafe

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (POSIX)")

_HANG_GUARD_S = 60  # a broken child would wait forever; this bounds the wait, it is not a speed limit


def _fork_and_wait(child) -> int:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            code = child()
        finally:
            os._exit(code)
    deadline = time.monotonic() + _HANG_GUARD_S
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung on a lock another thread held at fork time")


def test_module_locks_are_all_fork_safe() -> None:
    locks = list(_forksafe._all_locks)
    assert len(locks) >= 10  # swap, registry, conversion, grafts and compat locks


def test_locks_held_by_another_thread_are_free_in_the_child() -> None:
    locks = list(_forksafe._all_locks)
    held, release = threading.Event(), threading.Event()

    def hold_all() -> None:
        for lock in locks:
            lock.acquire()
        held.set()
        release.wait()
        for lock in reversed(locks):
            lock.release()

    holder = threading.Thread(target=hold_all)
    holder.start()
    held.wait()
    try:

        def child() -> int:
            ok = all(lock.acquire(timeout=5) for lock in locks)
            return 0 if ok else 3

        assert _fork_and_wait(child) == 0
    finally:
        release.set()
        holder.join()


def test_a_lock_held_by_the_forking_thread_stays_held_for_it() -> None:
    lock = _forksafe.ForkSafeLock()
    with lock:

        def child() -> int:
            # Still ours: releasing it (by leaving the block in the child) must work.
            return 0 if lock.held_here() else 4

        assert _fork_and_wait(child) == 0
