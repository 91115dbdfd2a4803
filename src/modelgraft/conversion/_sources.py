"""Where a load's checkpoint tensors come from: safetensors files, or a state dict in memory.

Both give the engine the same view, keyed by checkpoint key: each tensor's shape and dtype (from
the file headers, or the tensors), the tensor itself, and, for files, where its bytes lie (so the
fast path can map or read a fused target straight from the file, see ``_layout``). A load with
``from_pretrained(..., state_dict=sd)`` therefore converts exactly like a load from files.

Example:
    >>> import torch
    >>> source = StateDictSource({"w": torch.ones(2, 3, dtype=torch.float16)})
    >>> list(source.keys()), tuple(source.shape("w")), source.dtype("w"), source.layout("w")
    (['w'], (2, 3), torch.float16, None)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from modelgraft.conversion._layout import ByteLayout
from modelgraft.conversion._safetensors import SafetensorsFile

__all__ = ["FileSource", "StateDictSource", "TensorSource"]


class TensorSource:
    """The checkpoint tensors of one load, by checkpoint key."""

    def keys(self) -> Iterable[str]:
        raise NotImplementedError

    def shape(self, key: str) -> torch.Size:
        raise NotImplementedError

    def dtype(self, key: str) -> torch.dtype | None:
        """The tensor's dtype (``None`` for a safetensors dtype torch does not have)."""
        raise NotImplementedError

    def read(self, key: str) -> torch.Tensor:
        raise NotImplementedError

    def layout(self, key: str) -> ByteLayout | None:
        """Where the tensor's bytes lie in a file, or ``None`` when it is not in one."""
        return None


class FileSource(TensorSource):
    """The tensors of a checkpoint's safetensors files (other files are left out: see ``skipped``)."""

    def __init__(self, files: Iterable[str]) -> None:
        self.files = [str(f) for f in files]
        self.skipped = [f for f in self.files if not f.endswith(".safetensors")]
        self._index: dict[str, SafetensorsFile] = {}
        for path in self.files:
            if path.endswith(".safetensors"):
                f = SafetensorsFile(path)
                for key in f.keys():
                    self._index[key] = f

    def keys(self) -> Iterable[str]:
        return self._index.keys()

    def shape(self, key: str) -> torch.Size:
        return self._index[key].shape(key)

    def dtype(self, key: str) -> torch.dtype | None:
        return self._index[key].dtype(key)

    def read(self, key: str) -> torch.Tensor:
        return self._index[key].read(key)

    def layout(self, key: str) -> ByteLayout | None:
        f = self._index[key]
        dtype = f.dtype(key)
        if dtype is None:
            return None
        return ByteLayout(tuple(f.shape(key)), dtype.itemsize, ((f.path, *f.byte_range(key)),))


class StateDictSource(TensorSource):
    """The tensors of a state dict given to ``from_pretrained(..., state_dict=...)``."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        self._tensors = {k: v for k, v in state_dict.items() if isinstance(v, torch.Tensor)}

    def keys(self) -> Iterable[str]:
        return self._tensors.keys()

    def shape(self, key: str) -> torch.Size:
        return self._tensors[key].shape

    def dtype(self, key: str) -> torch.dtype | None:
        return self._tensors[key].dtype

    def read(self, key: str) -> torch.Tensor:
        return self._tensors[key].detach()
