"""Load weights in the original checkpoint layout into a built model, plain or grafted.

:func:`modelgraft.original_state_dict` streams a model's weights under the checkpoint's names and
layout; :func:`load_original_state_dict` is the way back into a transformers model that is already
built (a second policy copy, a reference model, a model grafted at load time or in place): each
incoming tensor is written to the places of the model's own tensors it corresponds to.

Where each checkpoint element goes is found with the model's own reverse conversions, the ones
``original_state_dict`` and ``save_pretrained`` use (fused ``qkv_proj``, ``gate_up_proj``,
per-expert ``nn.Linear``, in-place grafts newest first, and on transformers 5.x its own fused
experts): run on tensors that hold each model element's index instead of its value, the reverse
says, for every element of every checkpoint tensor, which model element it is. The conversions
modelgraft ships only move elements (concatenate, split, stack, transpose), so the load is an
exact copy; a conversion that computes (a scale, a cast of values) is refused, as is any element
of the model that no checkpoint tensor gives.

Example:
    >>> import torch
    >>> layer = torch.nn.Linear(2, 1)
    >>> state = {"weight": torch.ones(1, 2), "bias": torch.zeros(1)}
    >>> load_original_state_dict(layer, state)
    LoadedKeys(missing_keys=[], unexpected_keys=[])
    >>> layer.weight.tolist()
    [[1.0, 1.0]]
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple

import torch

from modelgraft.errors import ConversionError
from modelgraft.weight_sync import _meta, _prepare, _stream

__all__ = ["LoadedKeys", "load_original_state_dict"]

_SHOWN = 6  # names shown per kind of problem; the rest is counted


class LoadedKeys(NamedTuple):
    """What :func:`load_original_state_dict` did not find (empty lists after a strict load)."""

    missing_keys: list[str]  # checkpoint names the model needs and the state did not hold
    unexpected_keys: list[str]  # names of the state that are not the model's checkpoint names


def _collect(
    state: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    pairs = state.items() if isinstance(state, Mapping) else state
    found: dict[str, torch.Tensor] = {}
    for item in pairs:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise ConversionError(
                f"`load_original_state_dict` takes a mapping or an iterable of `(name, tensor)` pairs (what "
                f"`original_state_dict` yields); got an item of type `{type(item).__name__}`."
            )
        name, tensor = item
        if not isinstance(name, str):
            raise ConversionError(
                f"`load_original_state_dict`: names must be strings; got the name {name!r} of type "
                f"`{type(name).__name__}`. Pass the checkpoint names as `original_state_dict` yields them "
                "(`model.layers.0.self_attn.q_proj.weight`)."
            )
        if not isinstance(tensor, torch.Tensor):
            raise ConversionError(f"`{name}` holds a `{type(tensor).__name__}`, not a tensor.")
        if tensor.is_meta:
            raise ConversionError(
                f"`{name}` is a meta tensor: it has a shape but no values to load. Pass the state of a model "
                "whose weights are loaded (not one built under `torch.device('meta')` or `init_empty_weights`)."
            )
        if name in found:
            raise ConversionError(f"`{name}` is given twice; a state holds each name once.")
        found[name] = tensor
    return found


def _listed(names: list[str]) -> str:
    shown = ", ".join(f"`{n}`" for n in names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def _check(
    model: torch.nn.Module,
    incoming: Mapping[str, torch.Tensor],
    expected: Mapping[str, tuple[torch.Size, torch.dtype]],
    strict: bool,
) -> LoadedKeys:
    missing = [n for n in expected if n not in incoming]
    unexpected = [n for n in incoming if n not in expected]
    shapes = [
        f"`{n}`: expected {tuple(expected[n][0])}, received {tuple(t.shape)}"
        for n, t in incoming.items()
        if n in expected and t.shape != expected[n][0]
    ]
    dtypes = [
        f"`{n}`: expected {expected[n][1]}, received {t.dtype}"
        for n, t in incoming.items()
        if n in expected and t.shape == expected[n][0] and t.dtype != expected[n][1]
    ]
    problems = []
    if strict and missing:
        problems.append(f"{len(missing)} missing key(s): {_listed(missing)}")
    if strict and unexpected:
        problems.append(f"{len(unexpected)} unexpected key(s): {_listed(unexpected)}")
    if shapes:
        problems.append(f"{len(shapes)} shape mismatch(es): " + "; ".join(shapes[:_SHOWN]))
    if dtypes:
        problems.append(f"{len(dtypes)} dtype mismatch(es): " + "; ".join(dtypes[:_SHOWN]))
    if problems:
        raise ConversionError(
            f"Cannot load the state into `{type(model).__name__}` (its checkpoint layout, as `original_state_dict` "
            f"gives it, has {len(expected)} tensors): "
            + "; ".join(problems)
            + ". Nothing was loaded. Pass the "
            "checkpoint-layout state of the same architecture (`original_state_dict(source)`), cast it to the "
            "model's dtype first, or `strict=False` to load what is there (missing and unexpected keys only)."
        )
    return LoadedKeys(missing, unexpected)


class _Positions:
    """Each model tensor's elements numbered in one range (tied tensors share theirs)."""

    def __init__(self, live: Mapping[str, torch.Tensor]) -> None:
        self.canonical: dict[str, str] = {}
        self.keys: list[str] = []
        starts: list[int] = []
        seen: dict[tuple[object, ...], str] = {}
        total = 0
        for key, tensor in live.items():
            if callable(getattr(tensor, "full_tensor", None)):
                raise ConversionError(
                    f"`{key}` is a sharded DTensor (FSDP2, tensor parallel); `load_original_state_dict` loads "
                    "whole tensors. Load into the unsharded model, then shard it."
                )
            identity = (
                tensor.device,
                tensor.untyped_storage().data_ptr(),
                tensor.storage_offset(),
                tensor.shape,
            )
            first = seen.get(identity) if tensor.numel() else None
            if first is not None:  # a tied weight: the same elements under another name
                self.canonical[key] = first
                continue
            seen[identity] = key
            self.canonical[key] = key
            self.keys.append(key)
            starts.append(total)
            total += tensor.numel()
        self.starts = torch.tensor(starts, dtype=torch.long)
        self.total = total
        made: dict[str, torch.Tensor] = {}
        for index, key in enumerate(self.keys):
            start = int(self.starts[index])
            made[key] = torch.arange(start, start + live[key].numel(), dtype=torch.long).reshape(
                live[key].shape
            )
        self.ids = {key: made[self.canonical[key]] for key in live}


def load_original_state_dict(
    model: torch.nn.Module,
    state: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    *,
    strict: bool = True,
) -> LoadedKeys:
    """Load ``state``, in the original checkpoint layout, into ``model`` (plain or grafted), exactly.

    ``state`` is what :func:`modelgraft.original_state_dict` yields (the stream itself, or a dict of
    it), or a checkpoint's tensors: the names, shapes and dtypes ``save_pretrained`` of the plain
    model writes (tied weights may be given under every name; they must then be equal). Every
    tensor is copied into the model's own tensors, through the conversions of the model's grafts,
    so afterwards ``original_state_dict(model)`` yields ``state`` bit for bit.

    Args:
        model: a built model (``from_pretrained``, ``from_config``, ``graft_model``), not sharded.
        state: a mapping or an iterable of ``(name, tensor)`` pairs. An iterable is consumed whole
            before anything is written (its tensors are kept until the load ends).
        strict: refuse a missing or unexpected key (default). With ``False`` they are reported in
            the result and the model's elements that no given tensor covers keep their values.
            Shapes and dtypes must match in both modes.

    Returns:
        ``LoadedKeys(missing_keys, unexpected_keys)``, empty after a strict load.

    Raises:
        ConversionError: missing or unexpected keys (strict), a shape or dtype that differs from
            the model's checkpoint layout (all listed; nothing is loaded), tied names with
            different values, a conversion that is not a pure rearrangement of elements, sharded
            (DTensor) parameters, ``model`` not a ``torch.nn.Module``, a name that is not a string,
            a meta tensor in the state (no values) or in the model (no storage).

    Example (a second transformers model from the trainer's policy)::

        reference = AutoModelForCausalLM.from_config(policy.config)
        modelgraft.load_original_state_dict(reference, modelgraft.original_state_dict(policy))
    """
    if not isinstance(model, torch.nn.Module):
        raise ConversionError(
            f"`load_original_state_dict` expects a `torch.nn.Module`, received `{type(model).__name__}`. "
            "Build the model first (`AutoModelForCausalLM.from_config(config)`), then load into it."
        )
    incoming = _collect(state)
    live = model.state_dict()
    on_meta = [key for key, tensor in live.items() if tensor.is_meta]
    if on_meta:
        raise ConversionError(
            f"`{on_meta[0]}` of the model is on the meta device ({len(on_meta)} such tensor(s)): it has no storage, "
            "so nothing can be loaded into it. Materialise the model first (`model.to_empty(device='cpu')`, or "
            "build it without `torch.device('meta')`), then load."
        )
    positions = _Positions(live)
    units, revert = _prepare(model, live)
    stand_ins = {k: _meta(v) for k, v in live.items()}
    expected = {n: (t.shape, t.dtype) for n, t in _stream(model, units, revert, stand_ins)}
    result = _check(model, incoming, expected, strict)

    values = {key: live[key].detach().clone(memory_format=torch.contiguous_format) for key in positions.keys}
    written = {key: torch.zeros(live[key].numel(), dtype=torch.bool) for key in positions.keys}
    for name, ids in _stream(model, units, revert, positions.ids):
        if ids.dtype != torch.long or ids.shape != expected[name][0]:
            raise ConversionError(
                f"The conversion that gives `{name}` is not a rearrangement of the model's elements (it "
                f"computes new values), so the model's tensors cannot be recovered from it exactly; load a "
                "checkpoint of this layout with `from_pretrained` instead."
            )
        given = incoming.get(name)
        if given is None:
            continue
        _scatter(name, ids.reshape(-1), given.detach().reshape(-1), positions, values, written)
    if strict:
        for key in positions.keys:
            if not bool(written[key].all()):
                raise ConversionError(
                    f"{int((~written[key]).sum())} element(s) of `{key}` come from no checkpoint tensor: the model's "
                    "conversions do not give them (a conversion that is not a pure rearrangement). Nothing was "
                    "loaded."
                )
    with torch.no_grad():
        for key in positions.keys:
            if bool(written[key].any()):
                live[key].copy_(values[key])
    return result


def _scatter(
    name: str,
    ids: torch.Tensor,
    given: torch.Tensor,
    positions: _Positions,
    values: dict[str, torch.Tensor],
    written: dict[str, torch.Tensor],
) -> None:
    """Write ``given`` (flat) to the model elements ``ids``; a tied element written twice must agree."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= positions.total):
        raise ConversionError(
            f"The conversion that gives `{name}` is not a rearrangement of the model's elements; cannot load it."
        )
    owner = torch.searchsorted(positions.starts, ids, right=True) - 1
    for index in torch.unique(owner).tolist():
        key = positions.keys[index]
        chosen = owner == index
        local = ids[chosen] - positions.starts[index]
        incoming = given[chosen].to(device=values[key].device)
        flat = values[key].view(-1)
        again = written[key][local]
        if bool(again.any()) and not torch.equal(flat[local[again]], incoming[again].to(flat.dtype)):
            raise ConversionError(
                f"`{name}` and another name give different values for the same elements of `{key}` (tied "
                "weights must be equal)."
            )
        flat[local] = incoming.to(flat.dtype)
        written[key][local] = True
