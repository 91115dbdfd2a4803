"""The interface the conversion engine offers the version layer (dependency inversion).

:mod:`modelgraft._compat` sits below the rest of modelgraft and imports nothing above it, yet its
wiring of transformers' load and save steps must call the conversion engine. The engine
(:mod:`modelgraft.conversion`) therefore implements :class:`ConversionEngine` and hands itself to
:func:`modelgraft._compat.loading.install`; the wiring only ever sees this interface.

Example:
    >>> Reversed({}, ["lm_head.weight"], [""]).scope_paths
    ['']
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple, Protocol

import torch

__all__ = ["ConversionEngine", "Offload", "Place", "Reversed"]

#: ``offload(key, tensor)``: write a converted weight to the loader's offload folder.
Offload = Callable[[str, torch.Tensor], None]
#: ``place(key, tensor) -> bool``: put a converted weight into the model itself (a quantizer does).
Place = Callable[[str, torch.Tensor], bool]


class Reversed(NamedTuple):
    """A state dict with modelgraft's conversions reversed (see :meth:`ConversionEngine.reverse`)."""

    converted: dict[str, torch.Tensor]  # original keys -> tensors, in the state dict's order
    untouched: list[str]  # keys of the state dict that no conversion covers
    scope_paths: list[str]  # module paths of the (sub)models with a conversion entry ("" = root)
    # True when the model was loaded through modelgraft's conversions: ``converted`` is then in the
    # checkpoint's layout; else in the plain model's own layout (built with ``from_config`` and
    # grafted), which transformers' built-in reverse still turns into the checkpoint's.
    from_checkpoint: bool = True
    # Keys of ``converted`` that carry the exact names a load read them under: transformers' own
    # reverse must not rename them again (its renamings need not be invertible).
    exact: frozenset[str] = frozenset()


class ConversionEngine(Protocol):
    """What the wiring calls; :mod:`modelgraft.conversion` provides it (``conversion._engine``)."""

    def active(self) -> bool:
        """Whether any conversion entry is visible to this load (the wiring stays out otherwise)."""
        ...

    def scope_paths(self, model: torch.nn.Module) -> list[str]:
        """Module paths of ``model`` and its sub-models that have a conversion entry."""
        ...

    def remember(self, model: torch.nn.Module) -> None:
        """Attach the entries visible now to a model just built, for a later save."""
        ...

    def load(
        self,
        model: torch.nn.Module,
        checkpoint_files: Sequence[str] | None,
        missing_keys: set[str],
        unexpected_keys: set[str],
        *,
        device_map: Mapping[str, object] | None,
        rename: Callable[[str], str] | None,
        offload: Offload | None,
        place: Place | None,
        state_dict: Mapping[str, torch.Tensor] | None,
    ) -> None:
        """Fill the missing converted parameters; update both key sets in place."""
        ...

    def reverse(self, model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> Reversed | None:
        """``state_dict`` with the model's conversions reversed, or ``None`` when none applies."""
        ...

    def report_problem(self, model: torch.nn.Module, message: str) -> None:
        """Add ``message`` to the model's graft report (strict mode raises on it)."""
        ...
