"""Reverse on save: turn a grafted model's state dict back into the original checkpoint layout.

For a model loaded through a conversion, the groups recorded at load give the exact source keys
and shapes. For a model that was never loaded (``from_config``, manual construction), the
original keys and shapes come from building the original, unpatched model class on the
``meta`` device (no memory, no patches active).

Example:
    >>> import torch
    >>> from modelgraft.conversion.save import reverse_state_dict
    >>> reverse_state_dict(torch.nn.Linear(1, 1), {}) is None
    True
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Mapping

import torch

from modelgraft import _compat
from modelgraft.conversion._plan import Group, plan_groups, run_reverse
from modelgraft.conversion.load import STATE_ATTR, ConversionState, Scope, resolve_scopes, scope_for
from modelgraft.report import ConversionRecord, _report_for

__all__ = ["original_shapes", "reverse_state_dict"]


@contextlib.contextmanager
def _originals_bound() -> Iterator[None]:
    """Hold the core's construction lock (no other thread's class swap goes live meanwhile) and
    bind the original classes back, in case the save runs inside an ``apply_patches()`` block."""
    try:
        from modelgraft import swap
    except ImportError:  # the core patching module is optional for this engine
        yield
        return
    with swap.LOCK, swap.suspended():
        yield


def original_shapes(model: torch.nn.Module) -> dict[str, torch.Size]:
    """Keys and shapes of the original (unpatched) model class, built on the meta device."""
    with _originals_bound(), _compat.meta_device():
        original = type(model)(copy.deepcopy(model.config))
    return {k: v.shape for k, v in original.state_dict().items()}


def _state(model: torch.nn.Module) -> ConversionState | None:
    state = model.__dict__.get(STATE_ATTR)
    if state is not None:
        return state
    scopes = resolve_scopes(model)
    return ConversionState(scopes=scopes) if scopes else None


def _plan_missing_groups(
    model: torch.nn.Module, scopes: list[Scope], keys: list[str], covered: set[str]
) -> list[Group]:
    """Groups for grafted keys that no recorded load group covers, from the meta original."""
    shapes: dict[str, torch.Size] | None = None
    groups: list[Group] = []
    for scope in scopes:
        local = [scope.local(k) for k in keys if k not in covered and scope_for(scopes, k) is scope]
        # Cheap first pass: build the original model only if some key matches a target pattern.
        if not any(p.match(k) for conv in scope.converters for p in conv._targets for k in local):
            continue
        if shapes is None:
            shapes = original_shapes(model)
        src = {scope.local(k): s for k, s in shapes.items() if scope.owns(k)}
        for g in plan_groups(scope.converters, local, src, strict_sources=False).groups:
            groups.append(
                Group(
                    g.converter,
                    tuple(tuple(scope.glob(k) for k in ks) for ks in g.sources),
                    tuple(tuple(scope.glob(k) for k in ks) for ks in g.targets),
                    g.source_shapes,
                )
            )
    return groups


def reverse_state_dict(
    model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], list[str], list[Scope]] | None:
    """Reverse the model's conversions in ``state_dict``.

    Returns ``(converted, untouched_keys, scopes)``: ``converted`` maps original keys to tensors
    (in the state dict's order), ``untouched_keys`` are the keys no conversion covers. ``None``
    when no conversion entry applies to the model.

    Raises:
        IrreversibleConversionError: an operation without a reverse.
    """
    state = _state(model)
    if state is None:
        return None
    keys = list(state_dict)
    present = set(keys)
    groups = [g for g in state.groups if all(k in present for k in g.flat_targets)]
    covered = {k for g in groups for k in g.flat_targets}
    groups += _plan_missing_groups(model, state.scopes, keys, covered)
    if not groups:
        return {}, keys, state.scopes
    first_target = {g.flat_targets[0]: g for g in groups}
    consumed = {k for g in groups for k in g.flat_targets}
    converted: dict[str, torch.Tensor] = {}
    untouched: list[str] = []
    rep = _report_for(model)
    for key in keys:
        group = first_target.get(key)
        if group is not None:
            tensors = [[state_dict[k] for k in ks] for ks in group.targets]
            out = run_reverse(group, tensors)
            for names, values in zip(group.sources, out):
                for name, value in zip(names, values):
                    # Split outputs stay views of the fused tensor: safetensors writes non-overlapping
                    # views as they are, and transformers drops tied weights before this step.
                    converted[name] = value
            rep.conversions.append(
                ConversionRecord(
                    repr(group.converter), tuple(group.flat_targets), tuple(group.flat_sources), "save"
                )
            )
        elif key not in consumed:
            untouched.append(key)
    return converted, untouched, state.scopes
