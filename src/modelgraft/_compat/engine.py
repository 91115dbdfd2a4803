"""The seam between transformers' load and save steps and modelgraft's conversion engine.

The version layer knows *where* transformers loads and saves (the ``conversion`` sites of
:mod:`modelgraft._compat.wraps`); the engine (:mod:`modelgraft.conversion`) knows *what* to do
there. :mod:`modelgraft._compat` sits below the rest of modelgraft and imports nothing above it,
so the dependency is inverted: the engine implements :class:`ConversionEngine` and, when it
installs itself, hands itself to ``TRANSFORMERS.conversion_wrappers(engine)`` (the wiring of the
installed line, :mod:`._conversion_v5` or :mod:`._conversion_v4`), whose wrappers go into
``wraps.CONVERSION``. The wiring only ever sees this interface; each load reaches the engine as
one :class:`LoadRequest`.

Example:
    >>> Reversed({}, ["lm_head.weight"], [""]).scope_paths
    ['']
    >>> import torch
    >>> request = LoadRequest(model=torch.nn.Linear(1, 1), checkpoint_files=None, missing_keys=set(),
    ...                       unexpected_keys=set())
    >>> request.device_map, request.state_dict
    (None, None)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

__all__ = ["ConversionEngine", "LoadRequest", "Offload", "Place", "Reversed", "wrap_post_init"]

#: ``offload(key, tensor)``: write a converted weight to the loader's offload folder.
Offload = Callable[[str, torch.Tensor], None]
#: ``place(key, tensor) -> bool``: put a converted weight into the model itself (a quantizer does).
Place = Callable[[str, torch.Tensor], bool]


@dataclass(frozen=True, kw_only=True, eq=False)
class LoadRequest:
    """One load as transformers' loader hands it to the engine (see :meth:`ConversionEngine.load`).

    The wiring of each transformers line gathers these from its loader's arguments. Frozen: the
    engine cannot rebind a field, but it updates the two key sets in place (that is its answer).
    """

    model: torch.nn.Module
    #: The checkpoint's safetensors files, or ``None`` when the load reads from ``state_dict``.
    checkpoint_files: Sequence[str] | None
    #: Keys of ``model`` that transformers found no tensor for; filled ones are removed.
    missing_keys: set[str]
    #: Checkpoint keys that fit no parameter; those a conversion consumes are removed.
    unexpected_keys: set[str]
    #: The loader's ``device_map`` (module prefix -> device, ``"disk"`` or ``"cpu"``).
    device_map: Mapping[str, object] | None = None
    #: The loader's own key renamings (legacy layouts), applied to checkpoint keys first.
    rename: Callable[[str], str] | None = None
    #: Where a converted weight whose device is ``"disk"`` goes.
    offload: Offload | None = None
    #: A quantizing loader's hook for converted weights.
    place: Place | None = None
    #: The tensors of ``from_pretrained(..., state_dict=)``, converted like files.
    state_dict: Mapping[str, torch.Tensor] | None = None


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

    def load(self, request: LoadRequest) -> None:
        """Fill the request's missing converted parameters; update both key sets in place."""
        ...

    def reverse(self, model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> Reversed | None:
        """``state_dict`` with the model's conversions reversed, or ``None`` when none applies."""
        ...

    def report_problem(self, model: torch.nn.Module, message: str) -> None:
        """Add ``message`` to the model's graft report (strict mode raises on it)."""
        ...


def wrap_post_init(engine: ConversionEngine) -> Any:
    """The ``post_init`` wrapper of both transformers lines: a model built while a load is being
    converted is remembered by the engine (the same step on 4.57 and 5.x)."""

    def wrap(original: Any) -> Any:
        def post_init(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            if engine.active():
                engine.remember(self)
            return result

        return post_init

    return wrap
