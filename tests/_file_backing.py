"""Which files back a tensor's memory, read from ``/proc/self/maps`` (Linux only).

Tests of file-backed weights (``modelgraft.conversion._filemap``) import this module as
``from _file_backing import backing_files, needs_proc_maps``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

_MAPS = Path("/proc/self/maps")

#: Skip marker for tests that read the process's memory map.
needs_proc_maps = pytest.mark.skipif(not _MAPS.exists(), reason="needs /proc/self/maps (Linux)")


def backing_files(tensor: torch.Tensor) -> set[str]:
    """The files mapped anywhere in ``tensor``'s storage (a deleted file keeps its path)."""
    start = tensor.data_ptr()
    end = start + tensor.untyped_storage().nbytes()
    files = set()
    for line in _MAPS.read_text().splitlines():
        fields = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo < end and hi > start and len(fields) == 6:
            files.add(fields[5].removesuffix(" (deleted)"))
    return files


def mapped_anywhere(path: str | Path) -> bool:
    """Whether ``path`` is mapped anywhere in this process."""
    return str(path) in _MAPS.read_text()
