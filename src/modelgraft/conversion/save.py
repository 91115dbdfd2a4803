"""Reverse on save: turn a grafted model's state dict back into the original checkpoint layout.

For a model loaded through a conversion, the groups recorded at load give the exact source keys
and shapes. For a model that was never loaded (``from_config``, manual construction), the
original keys and shapes come from building the original, unpatched model class on the
``meta`` device (no memory, no patches active).

A model grafted in place (``graft_model``) carries what each graft did (:func:`remember_graft`):
the groups that converted its weights, undone first, newest graft first, and the conversion
entries in effect when it was grafted, which then apply as for a load-time graft. So the
original layout is written whatever is registered at save time.

Example:
    >>> import torch
    >>> from modelgraft.conversion.save import reverse_state_dict
    >>> reverse_state_dict(torch.nn.Linear(1, 1), {}) is None
    True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch

from modelgraft.conversion._plan import Group, plan_groups, run_reverse
from modelgraft.conversion.ops import model_config
from modelgraft.conversion.originals import original_shapes
from modelgraft.conversion.scopes import STATE_ATTR, ConversionState, Scope, resolve_scopes, scope_for
from modelgraft.report import ConversionRecord, report_for

__all__ = ["GRAFT_ATTR", "Reversal", "remember_graft", "reverse_state_dict"]

#: The conversion groups of each ``graft_model`` call on a model, oldest first.
GRAFT_ATTR = "_modelgraft_graft_stages"


def _state(model: torch.nn.Module) -> ConversionState | None:
    state: ConversionState | None = model.__dict__.get(STATE_ATTR)
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
        plan = plan_groups(scope.converters, local, src, strict_sources=False)
        groups.extend(map(scope.glob_group, plan.groups))
    return groups


def remember_graft(model: torch.nn.Module, groups: Sequence[Group], scopes: Sequence[Scope]) -> None:
    """Record on ``model`` what ``graft_model`` just did to it, so that saving undoes it exactly.

    ``groups`` are the conversion groups that filled the replacements (global keys, with the source
    shapes); ``scopes`` the conversion entries in effect for the graft. A model without conversion
    state gets these scopes; one that has some (a load-time graft) keeps its own and gains scopes
    only for sub-models it had none for: its scopes describe its checkpoint, which is what the
    undone graft leaves.
    """
    state = model.__dict__.get(STATE_ATTR)
    if state is None:
        state = ConversionState(scopes=list(scopes))
    else:
        known = {s.path for s in state.scopes}
        extra = [s for s in scopes if s.path not in known]
        if extra:
            state = ConversionState([*state.scopes, *extra], list(state.groups), state.loaded)
    object.__setattr__(model, STATE_ATTR, state)
    if groups:
        stages = [*model.__dict__.get(GRAFT_ATTR, ()), tuple(groups)]
        object.__setattr__(model, GRAFT_ATTR, stages)


def _undo_stage(
    model: torch.nn.Module, stage: Sequence[Group], work: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``work`` with the groups of one in-place graft reversed (each where all its targets are present)."""
    groups = [g for g in stage if all(k in work for k in g.flat_targets)]
    if not groups:
        return work
    first_target = {g.flat_targets[0]: g for g in groups}
    consumed = {k for g in groups for k in g.flat_targets}
    rep = report_for(model)
    out: dict[str, torch.Tensor] = {}
    for key, tensor in work.items():
        group = first_target.get(key)
        if group is not None:
            out.update(_reverse_group(group, work))
            rep.conversions.append(
                ConversionRecord(
                    repr(group.converter), tuple(group.flat_targets), tuple(group.flat_sources), "save"
                )
            )
        elif key not in consumed:
            out[key] = tensor
    return out


def _reverse_group(group: Group, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    tensors = [[state_dict[k] for k in ks] for ks in group.targets]
    out = run_reverse(group, tensors)
    # Split outputs stay views of the fused tensor: safetensors writes non-overlapping views as
    # they are, and transformers drops tied weights before this step. A non-contiguous view (the
    # reverse of a `Transpose`) is copied: it would be anyway to be written, and transformers 4.57
    # cannot check views sharing a storage for overlap unless they are contiguous.
    return {
        name: value if value.is_contiguous() else value.contiguous()
        for names, values in zip(group.sources, out)
        for name, value in zip(names, values)
    }


class Reversal(NamedTuple):
    """A state dict with the model's conversions reversed (see :func:`reverse_state_dict`)."""

    converted: dict[str, torch.Tensor]
    untouched: list[str]
    scopes: list[Scope]
    from_checkpoint: bool
    #: Keys of ``converted`` already under the checkpoint names they were loaded from.
    exact: frozenset[str]


def reverse_state_dict(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> Reversal | None:
    """Reverse the model's conversions in ``state_dict``.

    Returns ``(converted, untouched_keys, scopes, from_checkpoint, exact)``: ``converted`` maps original
    keys to tensors (in the state dict's order), ``untouched_keys`` are keys of ``state_dict`` no
    conversion covers, ``from_checkpoint`` tells whether the model was loaded through modelgraft's
    conversions (the result is then the checkpoint's layout; otherwise it is the plain model's own
    layout, which transformers' built-in reverse still has to turn into the checkpoint's). ``exact``
    holds the keys of ``converted`` that a load group planned on checkpoint keys read: they carry
    the names the checkpoint had, and no renaming of transformers' must touch them again. ``None``
    when no conversion entry applies to the model.

    Raises:
        IrreversibleConversionError: an operation without a reverse.
    """
    with model_config(getattr(model, "config", None)):
        return _reverse_state_dict(model, state_dict)


def _reverse_state_dict(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> Reversal | None:
    stages = model.__dict__.get(GRAFT_ATTR) or []
    state = _state(model)
    if state is None:
        return None
    work = dict(state_dict)
    for stage in reversed(stages):  # newest graft first: each one undoes onto the layout before it
        work = _undo_stage(model, stage, work)
    keys = list(work)
    present = set(keys)
    groups = [g for g in state.groups if all(k in present for k in g.flat_targets)]
    loaded = {id(g) for g in groups}
    covered = {k for g in groups for k in g.flat_targets}
    groups += _plan_missing_groups(model, state.scopes, keys, covered)
    first_target = {g.flat_targets[0]: g for g in groups}
    consumed = {k for g in groups for k in g.flat_targets}
    converted: dict[str, torch.Tensor] = {}
    untouched: list[str] = []
    exact: set[str] = set()
    for key in keys:
        group = first_target.get(key)
        if group is not None:
            rebuilt = _reverse_group(group, work)
            if id(group) in loaded:
                exact.update(k for k in rebuilt if k in state.checkpoint_space)
            converted.update(rebuilt)
            report_for(model).conversions.append(
                ConversionRecord(
                    repr(group.converter), tuple(group.flat_targets), tuple(group.flat_sources), "save"
                )
            )
        elif key in consumed:
            continue
        elif key in state_dict and work[key] is state_dict[key]:
            untouched.append(key)
        else:  # made by undoing an in-place graft: not in the caller's state dict
            converted[key] = work[key]
    return Reversal(converted, untouched, state.scopes, state.loaded, frozenset(exact))
