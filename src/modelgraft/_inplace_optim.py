"""Carry an optimizer across :func:`modelgraft.graft_model`: its parameter groups and its state.

A graft that fuses or converts weights puts *new* parameter objects into the model (``qkv_proj``
built from ``q_proj``, ``k_proj``, ``v_proj``). An optimizer built before holds the old ones: it
would never update the new weights and keep stepping dead ones. With ``optimizer=``, each old
parameter is replaced, in its group, by the new parameters made from it, and its state moves:

* a state tensor shaped like its parameter (Adam's ``exp_avg``, ``exp_avg_sq``, SGD's
  ``momentum_buffer``) is elementwise, so it goes through the very conversion the weights went
  through (concatenated, transposed, split alike): the state of ``qkv_proj`` is exactly the state of
  ``q``, ``k`` and ``v`` laid out as ``qkv_proj``;
* any other entry (Adam's ``step``) must be equal in every source and is copied.

Sources in different parameter groups, state kept for some sources and not others, or entries that
differ are refused (:class:`GraftStateError`, the model and optimizer unchanged). Without
``optimizer=``, the replaced parameters are remembered: an optimizer that still holds one refuses
to step (a global step pre-hook), naming the parameter, instead of silently updating a dead copy.

Example:
    >>> import torch
    >>> _retired_name(torch.nn.Parameter(torch.zeros(1))) is None
    True
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from modelgraft.errors import GraftStateError

__all__ = ["OptimizerMove", "plan_optimizer", "retire"]

# id(parameter) -> (weak reference, its name in the model it left). Parameters compare by value,
# so a WeakSet (which compares with ==) cannot hold them.
_RETIRED: dict[int, tuple[weakref.ref[nn.Parameter], str]] = {}
_LOCK = threading.Lock()
_HOOK: list[Any] = []


def _retired_name(param: Any) -> str | None:
    entry = _RETIRED.get(id(param))
    return entry[1] if entry is not None and entry[0]() is param else None


def _refuse_retired(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not _RETIRED:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            name = _retired_name(param)
            if name is not None:
                raise GraftStateError(
                    f"{type(optimizer).__name__}.step() would update `{name}`, a parameter `graft_model` replaced: "
                    "the model no longer uses it, and the weight that replaced it would never be updated. Pass the "
                    "optimizer to the graft (`graft_model(model, graft, optimizer=optimizer)`, which moves its groups "
                    "and state), or build the optimizer after grafting."
                )


def _forget(key: int) -> Callable[[Any], None]:
    def forget(_: Any) -> None:
        _RETIRED.pop(key, None)

    return forget


def retire(params: Mapping[str, nn.Parameter]) -> None:
    """Remember parameters a graft took out of the model (by name), so that stepping them is refused."""
    if not params:
        return
    with _LOCK:
        for name, param in params.items():
            _RETIRED[id(param)] = (weakref.ref(param, _forget(id(param))), name)
        if not _HOOK:
            _HOOK.append(register_optimizer_step_pre_hook(_refuse_retired))


@dataclass
class OptimizerMove:
    """What to change in the optimizer once the model is grafted."""

    optimizer: torch.optim.Optimizer
    groups: list[list[nn.Parameter]] = field(default_factory=list)
    state: dict[nn.Parameter, dict[str, Any]] = field(default_factory=dict)
    drop: list[nn.Parameter] = field(default_factory=list)

    def apply(self) -> None:
        """Put the new parameters into their groups and move their state (after the swap)."""
        for group, params in zip(self.optimizer.param_groups, self.groups):
            group["params"] = params
        for param in self.drop:
            self.optimizer.state.pop(param, None)
        for param, state in self.state.items():
            self.optimizer.state[param] = state


@dataclass
class Moved:
    """One grafted module: its new parameters by name, the old ones, and how the weights were converted."""

    path: str
    old: dict[str, nn.Parameter]  # key relative to the model -> the original's parameter
    new: dict[str, nn.Parameter]  # key relative to the model -> the replacement's parameter
    sources: dict[str, tuple[str, ...]]  # new key -> the old keys it was made from
    convert: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]  # old-layout tensors -> new layout
    others: dict[str, torch.Tensor]  # the original's buffers (old layout), for conversions that need them


def plan_optimizer(optimizer: torch.optim.Optimizer, moved: list[Moved]) -> OptimizerMove:
    """The groups and state the optimizer must hold after the graft, or a refusal naming the parameter."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise GraftStateError(
            f"`optimizer` must be a torch.optim.Optimizer; got `{type(optimizer).__name__}`. The model was left "
            "unchanged."
        )
    group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
    replaced: dict[int, list[nn.Parameter]] = {}  # id(old param) -> new params that take its place
    move = OptimizerMove(optimizer)
    for unit in moved:
        state_fields = _state_fields(optimizer, unit)
        converted = {name: unit.convert({**unit.others, **tensors}) for name, tensors in state_fields.items()}
        for key, param in unit.new.items():
            sources = [unit.old[s] for s in unit.sources.get(key, ()) if s in unit.old]
            if not sources or any(s is param for s in sources):
                continue
            groups = {group_of.get(id(s)) for s in sources}
            if len(groups) > 1:
                raise GraftStateError(
                    f"Cannot move the optimizer to `{key}`: it is made from "
                    f"{', '.join(f'`{_name(unit, s)}`' for s in sources)}, which sit in different parameter groups "
                    f"({sorted(g for g in groups if g is not None)}) or not all in the optimizer. Put them in one "
                    "group (or none) before grafting. The model was left unchanged."
                )
            if groups == {None}:
                continue
            for source in sources:
                replaced.setdefault(id(source), [])
                if not any(p is param for ps in replaced.values() for p in ps):
                    replaced[id(source)].append(param)
            state = _new_state(optimizer, unit, key, sources, converted)
            if state:
                move.state[param] = state
            move.drop.extend(s for s in sources if s in optimizer.state)
    for group in optimizer.param_groups:
        params: list[nn.Parameter] = []
        for param in group["params"]:
            params.extend(replaced.get(id(param), [param]))
        move.groups.append(params)
    return move


def _name(unit: Moved, param: nn.Parameter) -> str:
    return next((k for k, p in unit.old.items() if p is param), "?")


def _state_fields(optimizer: torch.optim.Optimizer, unit: Moved) -> dict[str, dict[str, torch.Tensor]]:
    """Per state entry shaped like its parameter: the old parameters' values, by old key."""
    fields: dict[str, dict[str, torch.Tensor]] = {}
    for key, param in unit.old.items():
        for name, value in optimizer.state.get(param, {}).items():
            if isinstance(value, torch.Tensor) and value.shape == param.shape and value.dim() > 0:
                fields.setdefault(name, {})[key] = value.detach()
    # A conversion needs every weight of the module: a parameter without that entry keeps its own
    # value (the state of a parameter that has none is refused below, before it could matter).
    return {
        name: {**{k: p.detach() for k, p in unit.old.items()}, **tensors} for name, tensors in fields.items()
    }


def _new_state(
    optimizer: torch.optim.Optimizer,
    unit: Moved,
    key: str,
    sources: list[nn.Parameter],
    converted: dict[str, dict[str, torch.Tensor]],
) -> dict[str, Any]:
    states = [optimizer.state.get(s, {}) for s in sources]
    names = [set(s) for s in states]
    if any(n != names[0] for n in names):
        raise GraftStateError(
            f"Cannot move the optimizer state to `{key}`: its sources "
            f"{', '.join(f'`{_name(unit, s)}`' for s in sources)} hold different state entries "
            f"({[sorted(n) for n in names]}), e.g. some were never stepped. Step all of them or none before "
            "grafting. The model was left unchanged."
        )
    out: dict[str, Any] = {}
    for name in sorted(names[0]):
        values = [s[name] for s in states]
        if name in converted and all(
            isinstance(v, torch.Tensor) and v.shape == p.shape for v, p in zip(values, sources)
        ):
            out[name] = converted[name][key].detach().clone().to(values[0].dtype).contiguous()
            continue
        first = values[0]
        same = all(
            (
                torch.equal(v, first)
                if isinstance(v, torch.Tensor) and isinstance(first, torch.Tensor)
                else v == first
            )
            for v in values
        )
        if not same:
            raise GraftStateError(
                f"Cannot move the optimizer state `{name}` to `{key}`: it differs between its sources "
                f"{', '.join(f'`{_name(unit, s)}`' for s in sources)} and is not laid out like the weights, so no "
                "single value is exact. Graft before the optimizer steps, or rebuild the optimizer. The model was "
                "left unchanged."
            )
        out[name] = first.clone() if isinstance(first, torch.Tensor) else first
    return out
