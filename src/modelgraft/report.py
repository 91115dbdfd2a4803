"""What modelgraft did to a model: :class:`GraftReport` and :func:`report`.

Every grafted model carries its own report on the instance (``model._modelgraft_report``);
other parts of modelgraft append to it through :func:`_report_for`. The core patching issue
fills ``replaced``/``unmatched_keys``/``dropped_checkpoint_keys``/``unloaded_parameters``;
the conversion engine fills ``conversions``.

Example:
    >>> import torch
    >>> from modelgraft.report import report
    >>> report(torch.nn.Linear(2, 2)).replaced
    []
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_ATTR = "_modelgraft_report"


@dataclass(frozen=True)
class ReplacedModule:
    """One module built from a replacement class instead of the original."""

    path: str
    original: str  # qualified name of the original class
    replacement: str  # qualified name of the replacement class
    key: str  # registry key that chose the replacement


@dataclass(frozen=True)
class ConversionRecord:
    """One converter group that ran while loading (or saving) a model."""

    converter: str  # repr of the WeightConverter / WeightRenaming
    source_keys: tuple[str, ...]
    target_keys: tuple[str, ...]
    direction: str = "load"  # "load" or "save"


@dataclass
class GraftReport:
    """Everything modelgraft knows about how a model was grafted and loaded."""

    model_class: str = ""
    replaced: list[ReplacedModule] = field(default_factory=list)
    unmatched_keys: list[str] = field(default_factory=list)
    conversions: list[ConversionRecord] = field(default_factory=list)
    unloaded_parameters: list[str] = field(default_factory=list)
    # module path -> checkpoint keys under that path that nothing in the model could take
    dropped_checkpoint_keys: dict[str, list[str]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def _report_for(model: torch.nn.Module, create: bool = True) -> GraftReport | None:
    """Return the report attached to ``model`` (creating an empty one when asked)."""
    existing = model.__dict__.get(_ATTR)
    if existing is None and create:
        existing = GraftReport(model_class=type(model).__qualname__)
        # object.__setattr__ keeps nn.Module from treating the report as state.
        object.__setattr__(model, _ATTR, existing)
    return existing


def report(model: torch.nn.Module) -> GraftReport:
    """Return what was grafted into ``model`` (an empty report for an untouched model)."""
    found = _report_for(model, create=False)
    return found if found is not None else GraftReport(model_class=type(model).__qualname__)
