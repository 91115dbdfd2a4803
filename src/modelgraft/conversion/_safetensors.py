"""Read tensors from safetensors files with positional reads, straight into a given buffer.

The format is an 8-byte little-endian header length, a JSON header (``dtype``, ``shape`` and
``data_offsets`` per key, offsets relative to the end of the header) and the raw bytes. Reading
with unbuffered reads into the destination tensor copies each byte once and maps nothing, so a
converted group costs its own size and no page of the file stays resident in this process.

Example:
    >>> import os, tempfile, torch
    >>> from safetensors.torch import save_file
    >>> path = os.path.join(tempfile.mkdtemp(), "t.safetensors")
    >>> save_file({"a": torch.arange(6.0).reshape(2, 3)}, path)
    >>> f = SafetensorsFile(path)
    >>> f.shape("a"), f.read("a")[1].tolist()
    (torch.Size([2, 3]), [3.0, 4.0, 5.0])
"""

from __future__ import annotations

import io
import json
import os
import struct
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import cast

import torch
from safetensors import safe_open

from modelgraft._forksafe import ForkSafeLock

__all__ = ["SafetensorsFile", "read_into_many", "read_range", "read_ranges_into"]

# Reads of at least twice this size are split across threads (one slice per thread, page-aligned).
_CHUNK_MIN = 1 << 20
_MAX_THREADS = 4
_pool_state: tuple[int, ThreadPoolExecutor] | None = None
_pool_lock = ForkSafeLock()


def _threads() -> int:
    return max(1, min(_MAX_THREADS, os.cpu_count() or 1))


def _pool() -> ThreadPoolExecutor:
    """A reader pool for this process (a forked child makes its own: the parent's threads are gone)."""
    global _pool_state
    with _pool_lock:
        if _pool_state is None or _pool_state[0] != os.getpid():
            _pool_state = (os.getpid(), ThreadPoolExecutor(_threads(), thread_name_prefix="modelgraft-read"))
        return _pool_state[1]


def _chunks(nbytes: int) -> list[tuple[int, int]]:
    n = min(_threads(), nbytes // _CHUNK_MIN) if hasattr(os, "preadv") else 1
    if n <= 1:
        return [(0, nbytes)]
    step = (nbytes // n + 4095) & ~4095
    return [(a, min(a + step, nbytes)) for a in range(0, nbytes, step)]


def read_range(fd: int, buffer: memoryview, offset: int, path: str, key: str) -> None:
    """Read ``buffer.nbytes`` bytes at ``offset`` of ``fd`` straight into ``buffer`` (short reads retried)."""
    fh = None if hasattr(os, "preadv") else io.FileIO(fd, closefd=False)
    done = 0
    while done < buffer.nbytes:
        if fh is None:
            n = os.preadv(fd, [buffer[done:]], offset + done)
        else:  # no positional read here: seek, then one unbuffered read (never run in parallel)
            fh.seek(offset + done)
            n = fh.readinto(buffer[done:])
        if not n:
            raise OSError(f"unexpected end of `{path}` while reading `{key}`")
        done += n


_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class SafetensorsFile:
    """The header of one safetensors file, and positional reads of its tensors."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        with open(self.path, "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
        header.pop("__metadata__", None)
        self._entries = header
        self._data_start = 8 + length

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, key: str) -> torch.Size:
        return torch.Size(self._entries[key]["shape"])

    def dtype(self, key: str) -> torch.dtype | None:
        """The torch dtype of ``key``, or ``None`` for a dtype this reader does not know."""
        return _DTYPES.get(self._entries[key]["dtype"])

    def byte_range(self, key: str) -> tuple[int, int]:
        """``(offset in the file, number of bytes)`` of ``key``'s data."""
        start, end = self._entries[key]["data_offsets"]
        return self._data_start + start, end - start

    def read_into(self, key: str, out: torch.Tensor) -> None:
        """Fill the contiguous CPU tensor ``out`` (same dtype and number of elements) with ``key``."""
        read_into_many([(self, key, out)])

    def read(self, key: str) -> torch.Tensor:
        """A new CPU tensor holding ``key``."""
        dtype = self.dtype(key)
        if dtype is None:
            with safe_open(self.path, framework="pt") as f:
                return cast(torch.Tensor, f.get_tensor(key))
        out = torch.empty(self.shape(key), dtype=dtype)
        if out.numel():
            self.read_into(key, out)
        return out


def read_into_many(items: Sequence[tuple[SafetensorsFile, str, torch.Tensor]]) -> None:
    """Fill each contiguous CPU tensor ``out`` of ``(file, key, out)`` with ``key`` of ``file``
    (all reads at once, see :func:`read_ranges_into`)."""
    jobs: list[_Job] = []
    for f, key, out in items:
        jobs.extend(_jobs([(f.path, *f.byte_range(key))], out, key))
    _run(jobs)


def read_ranges_into(ranges: Sequence[tuple[str, int, int]], out: torch.Tensor, what: str = "tensor") -> None:
    """Fill the contiguous CPU tensor ``out`` with the ``(path, offset, nbytes)`` ranges, in order.

    The copies out of the page cache (and the first touch of each destination's fresh pages) run
    in the kernel with the GIL released, so large ranges are split into page-aligned slices and,
    with the small ones, read by a few threads at once.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "blob")
        >>> with open(path, "wb") as fh:
        ...     _ = fh.write(bytes(range(10)))
        >>> out = torch.empty(4, dtype=torch.uint8)
        >>> read_ranges_into([(path, 6, 2), (path, 1, 2)], out)
        >>> out.tolist()
        [6, 7, 1, 2]
    """
    _run(_jobs(ranges, out, what))


_Job = tuple[str, memoryview, int, str]  # (path, destination, file offset, what is read)


def _jobs(ranges: Sequence[tuple[str, int, int]], out: torch.Tensor, what: str) -> list[_Job]:
    buffer = out.view(-1).view(torch.uint8).numpy().data if out.numel() else memoryview(b"")
    total = sum(n for _, _, n in ranges)
    if buffer.nbytes != total:
        raise ValueError(f"`{what}` holds {total} bytes; the destination holds {buffer.nbytes}.")
    jobs: list[_Job] = []
    at = 0
    for path, offset, nbytes in ranges:
        part = buffer[at : at + nbytes]
        jobs.extend((path, part[a:b], offset + a, what) for a, b in _chunks(nbytes))
        at += nbytes
    return jobs


def _run(jobs: Sequence[_Job]) -> None:
    fds: dict[str, int] = {}
    try:
        for path, *_ in jobs:
            if path not in fds:
                fds[path] = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        if len(jobs) == 1 or not hasattr(os, "preadv") or _threads() == 1:
            for path, view, offset, key in jobs:
                read_range(fds[path], view, offset, path, key)
            return
        futures = [_pool().submit(read_range, fds[p], view, off, p, k) for p, view, off, k in jobs]
        wait(futures)  # every read ends before its file is closed, even when one fails
        for future in futures:
            future.result()
    finally:
        for fd in fds.values():
            os.close(fd)
