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

import json
import os
import struct

import torch

__all__ = ["SafetensorsFile"]

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

    def __init__(self, path: str | os.PathLike) -> None:
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

    def read_into(self, key: str, out: torch.Tensor) -> None:
        """Fill the contiguous CPU tensor ``out`` (same dtype and number of elements) with ``key``."""
        start, end = self._entries[key]["data_offsets"]
        buffer = memoryview(out.view(-1).view(torch.uint8).numpy())
        if buffer.nbytes != end - start:
            raise ValueError(f"`{key}` holds {end - start} bytes; the destination holds {buffer.nbytes}.")
        # Unbuffered readinto copies from the OS straight into `out`; it may return short counts.
        with open(self.path, "rb", buffering=0) as fh:
            done = 0
            while done < buffer.nbytes:
                fh.seek(self._data_start + start + done)
                n = fh.readinto(buffer[done:])
                if not n:
                    raise OSError(f"unexpected end of `{self.path}` while reading `{key}`")
                done += n

    def read(self, key: str) -> torch.Tensor:
        """A new CPU tensor holding ``key``."""
        dtype = self.dtype(key)
        if dtype is None:
            from safetensors import safe_open

            with safe_open(self.path, framework="pt") as f:
                return f.get_tensor(key)
        out = torch.empty(self.shape(key), dtype=dtype)
        if out.numel():
            self.read_into(key, out)
        return out
