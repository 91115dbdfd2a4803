"""The conversion engine as the version layer sees it (:class:`~modelgraft._compat.engine.ConversionEngine`).

:func:`modelgraft.conversion.install` hands :data:`ENGINE` to
:meth:`modelgraft._compat.TransformersLine.conversion_wrappers`, whose wrappers call it from transformers' load and
save steps. The dependency points down: ``_compat`` never imports the engine.

Example:
    >>> import torch
    >>> ENGINE.scope_paths(torch.nn.Linear(1, 1)), ENGINE.reverse(torch.nn.Linear(1, 1), {})
    ([], None)
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from modelgraft import registry
from modelgraft._compat.engine import LoadRequest, Reversed
from modelgraft.conversion.load import apply_load_conversions, device_for_map
from modelgraft.conversion.save import reverse_state_dict
from modelgraft.conversion.scopes import remember_conversions, resolve_scopes
from modelgraft.report import report_for

__all__ = ["ENGINE"]


class _Engine:
    """Routes each call of the wiring to the engine's load, save and scope steps."""

    def active(self) -> bool:
        return bool(registry.current().conversions)

    def scope_paths(self, model: torch.nn.Module) -> list[str]:
        return [path for scope in resolve_scopes(model) for path in (scope.path, *scope.absorbed)]

    def remember(self, model: torch.nn.Module) -> None:
        remember_conversions(model)

    def load(self, request: LoadRequest) -> None:
        apply_load_conversions(
            request.model,
            request.checkpoint_files,
            request.missing_keys,
            request.unexpected_keys,
            device_for_map(request.device_map),
            request.rename,
            request.offload,
            request.place,
            state_dict=request.state_dict,
        )

    def reverse(self, model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> Reversed | None:
        found = reverse_state_dict(model, state_dict)
        if found is None:
            return None
        return Reversed(
            found.converted,
            found.untouched,
            [scope.path for scope in found.scopes],
            found.from_checkpoint,
            found.exact,
        )

    def report_problem(self, model: torch.nn.Module, message: str) -> None:
        report_for(model).problems.append(message)


#: The one engine; stateless, so installing it twice is harmless.
ENGINE = _Engine()
