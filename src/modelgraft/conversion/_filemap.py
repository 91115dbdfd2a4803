"""Concatenate byte ranges of files into one tensor without copying them: private file mappings.

A plain ``from_pretrained`` leaves each weight a copy-on-write view of the memory-mapped
checkpoint, so loading reads nothing until a weight is first used. A fused target (``qkv_proj``
built from ``q_proj``, ``k_proj`` and ``v_proj``) is not one range of the file, so it cannot be a
view of safetensors' own mapping. Here each source range is mapped, copy-on-write, into its place
in one reserved address range, so the fused tensor is as lazy as the plain weights: the pages
come from the page cache on first touch, writes stay private to the process, and the file can
be replaced or deleted afterwards (the mapping keeps its inode), as with a plain load.

The kernel maps whole pages, so a range can be mapped only when its file offset and its place in
the tensor agree modulo the page size; the partial pages at its ends, and any range that does
not agree, are read with ``pread`` instead. Nothing here is required: where mapping is not
possible (another OS, a file system without ``mmap``, too many mappings) the caller copies.

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "blob")
    >>> data = bytes(range(256)) * 64  # four pages of 4 KiB
    >>> with open(path, "wb") as fh:
    ...     _ = fh.write(data)
    >>> t = map_ranges([(path, 8192, 8192), (path, 0, 4096)], torch.uint8, (12288,))
    >>> t is None or bytes(t.numpy()) == data[8192:] + data[:4096]  # None where mapping is unavailable
    True
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import sys
import weakref
from collections.abc import Sequence

import torch

from modelgraft._forksafe import ForkSafeLock
from modelgraft.conversion._safetensors import read_range

__all__ = ["map_ranges", "mapping_enabled"]

_MAP_FIXED = 0x10  # the same value on Linux and macOS; the mmap module does not export it
_PAGE = mmap.PAGESIZE
# Each mapped range adds up to three kernel mappings (VMAs); Linux allows 65530 per process by
# default and other libraries need some, so stay well below it and copy beyond this budget.
_MAX_LIVE_MAPPINGS = 24_000
_live = 0
_live_lock = ForkSafeLock()


def _libc_mmap() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith(("linux", "darwin")) or ctypes.sizeof(ctypes.c_void_p) != 8:
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).mmap
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64]
    return fn


_mmap_call = _libc_mmap()


def mapping_enabled() -> bool:
    """Whether fused targets may be file-backed here (POSIX 64-bit; ``MODELGRAFT_FILE_MAPPING=0`` disables it)."""
    return (
        _mmap_call is not None
        and hasattr(os, "preadv")
        and os.environ.get("MODELGRAFT_FILE_MAPPING", "1") not in ("0", "false", "no")
    )


def _release(count: int) -> None:
    global _live
    with _live_lock:
        _live -= count


def _reserve(count: int) -> bool:
    global _live
    with _live_lock:
        if _live + count > _MAX_LIVE_MAPPINGS:
            return False
        _live += count
        return True


def map_ranges(
    ranges: Sequence[tuple[str, int, int]], dtype: torch.dtype, shape: Sequence[int]
) -> torch.Tensor | None:
    """A CPU tensor of ``dtype`` and ``shape`` whose bytes are the ``(path, offset, nbytes)``
    ranges one after another, backed by private file mappings where the alignment allows.

    Returns ``None`` (and maps nothing) when mapping is unavailable or not worth it: then the
    caller reads the ranges itself. The tensor owns its mappings; they go when it goes.
    """
    nbytes = sum(n for _, _, n in ranges)
    itemsize = dtype.itemsize
    if not ranges or not mapping_enabled() or nbytes < _PAGE or nbytes != itemsize * math.prod(shape):
        return None
    lead = ranges[0][1] % _PAGE  # where the tensor starts inside its first page
    if lead % itemsize:
        return None
    plan: list[tuple[str, int, int, int]] = []  # (path, file offset, region offset, nbytes)
    at = lead
    for path, offset, n in ranges:
        plan.append((path, offset, at, n))
        at += n
    mappable = [p for p in plan if (p[1] - p[2]) % _PAGE == 0 and _whole_pages(p[2], p[3])[1] > 0]
    if not mappable or not _reserve(1 + 2 * len(mappable)):
        return None
    try:
        region = mmap.mmap(
            -1,
            -(-at // _PAGE) * _PAGE,
            flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
        )
    except OSError:
        _release(1 + 2 * len(mappable))
        return None
    weakref.finalize(region, _release, 1 + 2 * len(mappable))
    anchor = ctypes.c_char.from_buffer(region)
    base = ctypes.addressof(anchor)
    del anchor  # an exported buffer would keep the region from ever closing
    view = memoryview(region)
    fds: dict[str, int] = {}
    try:
        for path, offset, at_, n in plan:
            fd = fds.get(path)
            if fd is None:
                fd = fds[path] = os.open(path, os.O_RDONLY)
            size = os.fstat(fd).st_size
            if offset + n > size:  # a page mapped past the end would fault (SIGBUS) on first touch
                raise OSError(
                    f"`{path}` ends at byte {size}, before the range [{offset}, {offset + n}): truncated file"
                )
            start, length = _whole_pages(at_, n) if (offset - at_) % _PAGE == 0 else (at_, 0)
            if length and not _map_fixed(base + start, length, fd, offset + (start - at_)):
                # A failed fixed mapping may leave a hole in the region: give all of it up.
                view.release()
                region.close()
                return None
            # The partial pages around the mapped run (or the whole range) are read instead.
            if start > at_ or not length:
                head_end = start if length else at_ + n
                read_range(fd, view[at_:head_end], offset, path, "a converted tensor")
            if length and start + length < at_ + n:
                read_range(
                    fd,
                    view[start + length : at_ + n],
                    offset + (start + length - at_),
                    path,
                    "a converted tensor",
                )
    finally:
        for fd in fds.values():
            os.close(fd)
        view.release()
    storage = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=lead).untyped_storage()
    # contiguous strides; torch's stubs lack the overload without a stride
    mapped: torch.Tensor = torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape))  # type: ignore[call-overload]
    return mapped


def _whole_pages(start: int, n: int) -> tuple[int, int]:
    """The page-aligned run ``(start, length)`` lying inside ``[start, start + n)``."""
    first = -(-start // _PAGE) * _PAGE
    last = (start + n) // _PAGE * _PAGE
    return first, max(0, last - first)


def _map_fixed(address: int, length: int, fd: int, offset: int) -> bool:
    assert _mmap_call is not None
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    got = _mmap_call(address, length, prot, mmap.MAP_PRIVATE | _MAP_FIXED, fd, offset)
    return bool(got == address)
