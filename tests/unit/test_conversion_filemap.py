"""Fused targets built from private file mappings: same bytes as a copy, lazy, private, released.

Unit tests of ``modelgraft.conversion._filemap`` (their own file): they import it directly, the one exception to
tests using public names only (issue 14); everything else comes from the public namespaces.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _file_backing import backing_files, mapped_anywhere, needs_proc_maps
from modelgraft.conversion import _filemap
from modelgraft.conversion._filemap import map_ranges

PAGE = _filemap._PAGE
pytestmark = pytest.mark.skipif(
    not _filemap.mapping_enabled(),
    reason=f"private file mappings need Linux or macOS (this is {sys.platform})",
)


def _blob(path: Path, nbytes: int, seed: int = 0) -> bytes:
    data = torch.randint(0, 256, (nbytes,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    raw = bytes(data.numpy())
    path.write_bytes(raw)
    return raw


@needs_proc_maps
def test_aligned_ranges_are_file_backed_and_hold_the_concatenated_bytes(tmp_path):
    data = _blob(tmp_path / "w.bin", 16 * PAGE)
    ranges = [(str(tmp_path / "w.bin"), 8 * PAGE + 24, 4 * PAGE), (str(tmp_path / "w.bin"), 24, 2 * PAGE)]
    t = map_ranges(ranges, torch.float32, (6 * PAGE // 4,))
    assert t is not None and t._base is None
    assert (
        bytes(t.view(torch.uint8).numpy()) == data[8 * PAGE + 24 : 12 * PAGE + 24] + data[24 : 2 * PAGE + 24]
    )
    assert str(tmp_path / "w.bin") in backing_files(t)


def test_ranges_whose_offsets_disagree_are_read_instead_and_still_exact(tmp_path):
    data = _blob(tmp_path / "w.bin", 16 * PAGE, seed=1)
    # The second range starts 8 bytes later in its page than where it lands in the tensor.
    ranges = [(str(tmp_path / "w.bin"), 0, 3 * PAGE), (str(tmp_path / "w.bin"), 5 * PAGE + 8, 2 * PAGE)]
    t = map_ranges(ranges, torch.uint8, (5 * PAGE,))
    assert t is not None
    assert bytes(t.numpy()) == data[: 3 * PAGE] + data[5 * PAGE + 8 : 7 * PAGE + 8]


@settings(max_examples=40, deadline=None)
@given(
    spans=st.lists(st.tuples(st.integers(0, 12 * PAGE), st.integers(1, 3 * PAGE)), min_size=1, max_size=4),
    itemsize=st.sampled_from([1, 2, 4]),
)
def test_any_layout_of_ranges_gives_exactly_the_concatenated_bytes(tmp_path_factory, spans, itemsize):
    path = tmp_path_factory.mktemp("blob") / "w.bin"
    data = _blob(path, 16 * PAGE, seed=len(spans))
    ranges = [(str(path), off - off % itemsize, n - n % itemsize or itemsize) for off, n in spans]
    total = sum(n for _, _, n in ranges)
    dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[itemsize]
    t = map_ranges(ranges, dtype, (total // itemsize,))
    if t is None:  # nothing worth mapping (the caller then copies): no range holds a whole page
        # at a place in the tensor that agrees with its place in the file.
        at = ranges[0][1] % PAGE
        for _, offset, n in ranges:
            first_page = -(-at // PAGE) * PAGE
            assert (offset - at) % PAGE or first_page + PAGE > at + n or at % itemsize
            at += n
        return
    assert bytes(t.view(torch.uint8).numpy()) == b"".join(data[o : o + n] for _, o, n in ranges)


def test_writes_stay_private_and_the_file_can_be_replaced(tmp_path):
    path = tmp_path / "w.bin"
    data = _blob(path, 8 * PAGE, seed=2)
    t = map_ranges([(str(path), 0, 4 * PAGE), (str(path), 6 * PAGE, 2 * PAGE)], torch.uint8, (6 * PAGE,))
    assert t is not None
    t[: PAGE * 2].fill_(7)
    assert path.read_bytes() == data  # copy-on-write: the checkpoint is never modified
    # save_pretrained replaces files (a new inode); the mapping keeps the old one alive.
    path.unlink()
    _blob(path, 8 * PAGE, seed=3)
    assert bytes(t[PAGE * 2 :].numpy()) == data[2 * PAGE : 4 * PAGE] + data[6 * PAGE :]
    assert bytes(t[: PAGE * 2].numpy()) == b"\x07" * (2 * PAGE)


@needs_proc_maps
def test_the_mappings_go_with_the_tensor(tmp_path):
    path = tmp_path / "w.bin"
    _blob(path, 8 * PAGE)
    gc.collect()
    before = _filemap._live
    t = map_ranges([(str(path), 0, 4 * PAGE), (str(path), 4 * PAGE, 4 * PAGE)], torch.float32, (2 * PAGE,))
    assert t is not None and _filemap._live > before
    p = torch.nn.Parameter(t)
    del t
    gc.collect()
    assert str(path) in backing_files(p)
    del p
    gc.collect()
    assert _filemap._live == before
    assert not mapped_anywhere(path)


def test_disabled_by_environment_variable(tmp_path, monkeypatch):
    path = tmp_path / "w.bin"
    _blob(path, 4 * PAGE)
    monkeypatch.setenv("MODELGRAFT_FILE_MAPPING", "0")
    assert not _filemap.mapping_enabled()
    assert map_ranges([(str(path), 0, 4 * PAGE)], torch.uint8, (4 * PAGE,)) is None


def test_no_mapping_beyond_the_budget(tmp_path, monkeypatch):
    path = tmp_path / "w.bin"
    _blob(path, 4 * PAGE)
    gc.collect()
    monkeypatch.setattr(_filemap, "_MAX_LIVE_MAPPINGS", _filemap._live + 2)
    assert map_ranges([(str(path), 0, 4 * PAGE)], torch.uint8, (4 * PAGE,)) is None


def test_a_failed_fixed_mapping_gives_up_the_whole_region(tmp_path, monkeypatch):
    path = tmp_path / "w.bin"
    _blob(path, 4 * PAGE)
    gc.collect()
    before = _filemap._live
    monkeypatch.setattr(_filemap, "_map_fixed", lambda *args: False)
    assert map_ranges([(str(path), 0, 4 * PAGE)], torch.uint8, (4 * PAGE,)) is None
    gc.collect()
    assert _filemap._live == before


def test_shape_or_size_mismatch_is_refused(tmp_path):
    path = tmp_path / "w.bin"
    _blob(path, 4 * PAGE)
    assert map_ranges([(str(path), 0, 4 * PAGE)], torch.float32, (PAGE,)) is not None
    assert map_ranges([(str(path), 0, 4 * PAGE)], torch.float32, (PAGE + 1,)) is None
    assert map_ranges([], torch.float32, (0,)) is None


def test_an_unreadable_range_raises_and_leaks_no_descriptor(tmp_path):
    path = tmp_path / "w.bin"
    _blob(path, 2 * PAGE)
    fds = len(os.listdir("/proc/self/fd")) if Path("/proc/self/fd").exists() else None
    with pytest.raises(OSError, match="truncated file"):
        map_ranges([(str(path), PAGE + 8, 2 * PAGE)], torch.uint8, (2 * PAGE,))
    if fds is not None:
        assert len(os.listdir("/proc/self/fd")) == fds
