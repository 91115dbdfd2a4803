"""RoutingTrace: the experts each token was sent to, per MoE layer, and its safetensors form.

Example:
    >>> import torch, tempfile, os
    >>> trace = RoutingTrace([torch.tensor([[0, 3], [2, 1]])], layer_ids=[1], top_k=2, num_experts=4,
    ...                      model_type="qwen3_moe")
    >>> path = os.path.join(tempfile.mkdtemp(), "routing.safetensors")
    >>> trace.save(path)
    >>> loaded = RoutingTrace.load(path)
    >>> loaded.layer_ids, loaded.num_tokens, bool(torch.equal(loaded[0], trace[0]))
    ([1], 2, True)
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from safetensors.torch import load_file, save_file

from modelgraft.errors import RoutingError

__all__ = ["RoutingTrace"]

_FORMAT = "modelgraft.routing/1"


@dataclass
class RoutingTrace:
    """Selected expert ids per MoE layer.

    Attributes:
        layers: one ``(num_tokens, top_k)`` integer tensor per MoE layer, in model order. Tokens are
            the flattened ``batch * seq`` positions as the router sees them (row-major over the batch).
        layer_ids: the decoder-layer index of each MoE layer (absolute, dense layers counted).
        top_k: experts per token.
        num_experts: experts per layer.
        model_type: ``config.model_type`` of the model it belongs to (informative).
        layer_names: qualified router module names (informative; empty when unknown).
    """

    layers: list[torch.Tensor]
    layer_ids: list[int] = field(default_factory=list)
    top_k: int | None = None
    num_experts: int | None = None
    model_type: str | None = None
    layer_names: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.layers = list(self.layers)
        if not self.layer_ids:
            self.layer_ids = list(range(len(self.layers)))
        if len(self.layer_ids) != len(self.layers):
            raise RoutingError(
                f"RoutingTrace got {len(self.layers)} layer tensors but {len(self.layer_ids)} `layer_ids`; "
                "pass one id per tensor."
            )
        for lid, tensor in zip(self.layer_ids, self.layers):
            if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2 or tensor.is_floating_point():
                got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise RoutingError(
                    f"Routing for layer `{lid}` must be a 2-D integer tensor (num_tokens, top_k); got {got}."
                )

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.layers[index]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self.layers)

    @property
    def num_tokens(self) -> int:
        """Rows per layer (0 for an empty trace)."""
        return int(self.layers[0].shape[0]) if self.layers else 0

    @classmethod
    def from_tensors(cls, tensors: Sequence[torch.Tensor]) -> RoutingTrace:
        """Wrap a per-layer list of ``(num_tokens, top_k)`` tensors (the seed's format).

        Example:
            >>> RoutingTrace.from_tensors([torch.zeros(3, 2, dtype=torch.long)]).num_tokens
            3
        """
        return cls(list(tensors))

    def to(self, device: torch.device | str) -> RoutingTrace:
        """A copy with every tensor moved to ``device``."""
        return RoutingTrace(
            [t.to(device) for t in self.layers],
            list(self.layer_ids),
            self.top_k,
            self.num_experts,
            self.model_type,
            list(self.layer_names),
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the trace to a safetensors file (tensors ``layer.<id>``, metadata as JSON strings)."""
        tensors = {
            f"layer.{i}": t.detach().to("cpu", torch.int32).contiguous() for i, t in enumerate(self.layers)
        }
        meta = {
            "format": _FORMAT,
            "layer_ids": json.dumps(self.layer_ids),
            "layer_names": json.dumps(self.layer_names),
            "top_k": json.dumps(self.top_k),
            "num_experts": json.dumps(self.num_experts),
            "model_type": json.dumps(self.model_type),
        }
        save_file(tensors, os.fspath(path), metadata=meta)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RoutingTrace:
        """Read a trace written by :meth:`save`; tensors come back as ``torch.long``."""
        from safetensors import safe_open

        with safe_open(os.fspath(path), framework="pt") as handle:
            meta = handle.metadata() or {}
        if meta.get("format") != _FORMAT:
            raise RoutingError(
                f"`{path}` is not a modelgraft routing trace (metadata format `{meta.get('format')}`, "
                f"expected `{_FORMAT}`); write it with `RoutingTrace.save`."
            )
        tensors = load_file(os.fspath(path))
        layers = [tensors[f"layer.{i}"].long() for i in range(len(tensors))]
        return cls(
            layers,
            json.loads(meta["layer_ids"]),
            json.loads(meta["top_k"]),
            json.loads(meta["num_experts"]),
            json.loads(meta["model_type"]),
            json.loads(meta.get("layer_names", "[]")),
        )
