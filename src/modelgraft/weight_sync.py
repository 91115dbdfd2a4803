"""Weight sync: stream a (grafted) model's weights in the original checkpoint layout and names.

RL trainers push the policy's weights to the inference engine every step, and the engine
(vLLM's ``model.load_weights(iterable)``, SGLang's ``update_weights_from_tensor``) expects the
original checkpoint's names and layout, not a grafted one (``qkv_proj``, ``gate_up_proj``,
per-expert ``nn.Linear``). :func:`original_state_dict` yields ``(name, tensor)`` pairs exactly as
``save_pretrained`` of the plain model writes them, one conversion group at a time:

* a weight no conversion touches is yielded as it is (the parameter's own tensor, no copy);
* each conversion group (one fused ``qkv_proj``, one ``gate_up_proj``, one layer's experts) is
  reversed with the save path's exact reverse (:func:`modelgraft.conversion._plan.run_reverse`),
  its original tensors are yielded, and nothing of it is kept once the next group starts;
* in-place grafts (:func:`modelgraft.graft_model`) are undone newest first, as on save;
* on transformers 5.x, transformers' own conversions (fused 3D experts of Qwen2-MoE, Mixtral, ...)
  are reverted per group too, so the names are the checkpoint's (``experts.0.gate_proj.weight``);
* FSDP2 / DTensor parameters are gathered one tensor at a time (``full_tensor()``); every rank
  must iterate (the gathers are collectives), each rank gets full tensors.

Example:
    >>> import torch
    >>> from modelgraft.weight_sync import original_state_dict
    >>> layer = torch.nn.Linear(2, 1)
    >>> [(name, tuple(t.shape)) for name, t in original_state_dict(layer)]
    [('weight', (1, 2)), ('bias', (1,))]
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from modelgraft import _compat
from modelgraft._peft_sync import restoring, without_adapters
from modelgraft.conversion._plan import Group, run_reverse
from modelgraft.conversion.ops import model_config
from modelgraft.conversion.originals import _originals_bound
from modelgraft.conversion.save import GRAFT_ATTR, _plan_missing_groups, _state
from modelgraft.errors import ConversionError, IrreversibleConversionError
from modelgraft.report import report_for

__all__ = ["original_state_dict"]


@dataclass(frozen=True)
class _Live:
    """A tensor of the model's own state dict."""

    name: str


@dataclass(eq=False)
class _Node:
    """One conversion group to reverse, with where each of its grafted-side inputs comes from."""

    group: Group
    inputs: list[list[_Ref]] = field(default_factory=list)


@dataclass(frozen=True)
class _Out:
    """The ``index``-th (flattened) original-side output of a reversed group."""

    node: _Node
    index: int


_Ref = _Live | _Out


@dataclass
class _Unit:
    """What one step of the stream yields: one plain tensor, or the outputs of one group."""

    names: list[str]
    refs: list[_Ref]
    node: _Node | None = None


def _check_reversible(group: Group) -> None:
    for op in group.converter.operations:
        if not op.is_reversible:
            raise IrreversibleConversionError(
                f"Converter {group.converter!r} cannot give the original layout of `{group.flat_targets[0]}`: "
                f"operation `{type(op).__name__}` has no `reverse`. Implement `reverse(tensors, context)` on it "
                "so that `original_state_dict` (and `save_pretrained`) can write the checkpoint layout."
            )


def _node(group: Group, work: Mapping[str, _Ref]) -> _Node:
    _check_reversible(group)
    return _Node(group, [[work[k] for k in keys] for keys in group.targets])


def _apply_groups(work: dict[str, _Ref], groups: list[Group]) -> tuple[dict[str, _Ref], list[_Unit]]:
    """``work`` with each group (whose targets are all present) replaced by its sources, in place of
    its first target; also the units, in order (a unit per untouched key and per group)."""
    present = [g for g in groups if all(k in work for k in g.flat_targets)]
    first = {g.flat_targets[0]: g for g in present}
    consumed = {k for g in present for k in g.flat_targets}
    out: dict[str, _Ref] = {}
    units: list[_Unit] = []
    for key, ref in work.items():
        group = first.get(key)
        if group is not None:
            node = _node(group, work)
            names = group.flat_sources
            refs: list[_Ref] = [_Out(node, i) for i in range(len(names))]
            out.update(zip(names, refs))
            units.append(_Unit(list(names), refs, node))
        elif key not in consumed:
            out[key] = ref
            units.append(_Unit([key], [ref]))
    return out, units


def _merge_outputs(units: list[_Unit]) -> list[_Unit]:
    """Adjacent keys that one undone in-place group produces (its gate and its up) become one unit,
    so that the group is reversed once, not once per key."""
    merged: list[_Unit] = []
    for unit in units:
        ref = unit.refs[0] if unit.node is None and len(unit.refs) == 1 else None
        last = merged[-1] if merged else None
        if (
            isinstance(ref, _Out)
            and last is not None
            and last.node is None
            and isinstance(last.refs[0], _Out)
            and last.refs[0].node is ref.node
        ):
            last.names.append(unit.names[0])
            last.refs.append(ref)
        else:
            merged.append(_Unit(list(unit.names), list(unit.refs), unit.node))
    return merged


def _plan(model: torch.nn.Module, live_keys: list[str]) -> tuple[list[_Unit], bool]:
    """The units to stream, and whether transformers' own reverse conversion applies afterwards."""
    work: dict[str, _Ref] = {k: _Live(k) for k in live_keys}
    for stage in reversed(model.__dict__.get(GRAFT_ATTR) or []):  # newest in-place graft first
        work, _ = _apply_groups(work, list(stage))
    state = _state(model)
    if state is None:
        return _merge_outputs([_Unit([k], [r]) for k, r in work.items()]), True
    keys = list(work)
    present = set(keys)
    groups = [g for g in state.groups if all(k in present for k in g.flat_targets)]
    covered = {k for g in groups for k in g.flat_targets}
    groups += _plan_missing_groups(model, state.scopes, keys, covered)
    units = _merge_outputs(_apply_groups(work, groups)[1])
    # As on save: a root entry is the model's whole mapping, so transformers' built-in reverse is
    # skipped unless the model was loaded with transforms of its own to undo.
    root_claimed = any(not s.path for s in state.scopes)
    return units, not (root_claimed and getattr(model, "_weight_conversions", None) is None)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor (FSDP2, tensor parallel) is gathered, anything else is as is."""
    full_tensor = getattr(tensor, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else tensor


def _evaluate(
    ref: _Ref, live: Mapping[str, torch.Tensor], memo: dict[int, list[torch.Tensor]]
) -> torch.Tensor:
    if isinstance(ref, _Live):
        return _full(live[ref.name])
    node = ref.node
    outputs = memo.get(id(node))
    if outputs is None:
        inputs = [[_evaluate(r, live, memo) for r in refs] for refs in node.inputs]
        reversed_ = run_reverse(node.group, inputs)
        del inputs
        outputs = [t if t.is_contiguous() else t.contiguous() for ts in reversed_ for t in ts]
        memo[id(node)] = outputs
    return outputs[ref.index]


def _revert_builtin(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with transformers' own load-time conversions undone (5.x), as its save does;
    ``state`` itself where there are none (4.57, or not a transformers model)."""
    reverted = _compat.revert_builtin_conversion(model, state)
    return state if reverted is None else reverted


def _meta(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")


def _reverts_anything(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> bool:
    """Whether transformers' own reverse changes any name or shape of ``state`` (meta tensors)."""
    reverted = _revert_builtin(model, dict(state))
    return reverted.keys() != state.keys() or any(reverted[k].shape != t.shape for k, t in state.items())


@dataclass(frozen=True)
class _Original:
    """What the plain (un-grafted) model class holds: its state-dict order, and the names it streams."""

    order: dict[str, int]
    keys: frozenset[str]  # its state_dict() keys
    checkpoint_keys: frozenset[str]  # the same after transformers' own reverse (5.x)


_ORIGINALS: weakref.WeakKeyDictionary[torch.nn.Module, _Original | None] = weakref.WeakKeyDictionary()


def _original(model: torch.nn.Module) -> _Original | None:
    """The plain model class built on the ``meta`` device (no memory), cached per model; ``None``
    where it cannot be built (a model that is not a transformers model, for one)."""
    if model in _ORIGINALS:
        return _ORIGINALS[model]
    found: _Original | None = None
    config = getattr(model, "config", None)
    if config is not None:
        try:
            import copy

            with _originals_bound(), _compat.TRANSFORMERS.meta_device():
                original = type(model)(copy.deepcopy(config))
            state = original.state_dict()
            checkpoint = _revert_builtin(original, dict(state))
            found = _Original({k: i for i, k in enumerate(state)}, frozenset(state), frozenset(checkpoint))
        except Exception:  # no original to compare with: the stream keeps the model's own order
            found = None
    _ORIGINALS[model] = found
    return found


def _in_original_order(units: list[_Unit], original: _Original) -> list[_Unit]:
    """``units`` sorted by where their keys are in the plain model's ``state_dict()`` (a grafted
    module may register its parameters in another order); a unit the plain model does not know
    stays right after the one before it."""
    keyed: list[tuple[float, int, _Unit]] = []
    last = -1.0
    for i, unit in enumerate(units):
        if len(unit.names) > 1:  # a group's keys too (its sources in the plain model's order)
            inner = sorted(
                range(len(unit.names)),
                key=lambda j: (original.order.get(unit.names[j], len(original.order)), j),
            )
            unit = _Unit([unit.names[j] for j in inner], [unit.refs[j] for j in inner], unit.node)
        places = [original.order[n] for n in unit.names if n in original.order]
        last = float(min(places)) if places else last + 1e-6
        keyed.append((last, i, unit))
    return [unit for _, _, unit in sorted(keyed, key=lambda t: (t[0], t[1]))]


def _was_grafted(model: torch.nn.Module) -> bool:
    """Whether modules of ``model`` were replaced (at load time, in place, or by ``apply_patches``)."""
    found = report_for(model, create=False)
    return bool(found is not None and found.replaced)


def _check_names(
    model: torch.nn.Module,
    units: list[_Unit],
    revert: list[bool],
    live: Mapping[str, torch.Tensor],
    original: _Original,
) -> None:
    """Refuse a grafted model whose weights do not map back to exactly the plain model's names.

    A dry run of the whole stream on ``meta`` stand-ins (no memory, no collectives) gives the names.
    """
    stand_ins = {k: _meta(v) for k, v in live.items()}
    names = [n for n, _ in _stream(model, units, revert, stand_ins)]
    expected = original.checkpoint_keys
    unknown = [n for n in names if n not in expected]
    missing = sorted(expected - set(names))
    if not unknown and not missing:
        return
    what = (
        f"{len(unknown)} weight(s) such as `{unknown[0]}` are not in the original checkpoint and no conversion maps them back"
        if unknown
        else f"the original checkpoint's `{missing[0]}` is produced by nothing"
    )
    raise ConversionError(
        f"`original_state_dict` cannot give the original layout of `{type(model).__name__}`: {what} "
        f"(original keys never produced: {', '.join(f'`{k}`' for k in missing[:3]) or 'none'}). Register a "
        "`WeightConverter` from the original keys to the replacement's parameters (docs/conversion.md) so "
        "that they can be reversed."
    )


def _stream(
    model: torch.nn.Module, units: list[_Unit], revert: list[bool], live: Mapping[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    for unit, reverting in zip(units, revert):
        memo: dict[int, list[torch.Tensor]] = {}
        with model_config(getattr(model, "config", None)):
            pairs = {name: _evaluate(ref, live, memo) for name, ref in zip(unit.names, unit.refs)}
        del memo
        if reverting:
            reverted = _revert_builtin(model, pairs)
            # transformers sorts what it reverts; keys it left alone keep the stream's order
            pairs = {n: reverted[n] for n in pairs} if reverted.keys() == pairs.keys() else reverted
        yield from pairs.items()
        del pairs  # nothing of this group outlives the step that yielded it


def original_state_dict(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` of ``model`` in the original checkpoint layout, one group at a time.

    The names, shapes, dtypes and values are those of the original checkpoint (what
    ``save_pretrained`` of the plain, un-grafted model writes), bit for bit, with tied weights
    under every name, as ``state_dict()`` gives them. Where transformers does not convert the model itself (every family on transformers 4.57,
    dense families on 5.x) that is exactly the plain model's ``state_dict()``. The order is the
    plain model's ``state_dict()`` order, except that the keys reversed from one group come
    together at the place of the group's first key (a fused q/k/v bias after the q/k/v weights).

    Memory: untouched weights are the parameters themselves (no copy); each group is reversed when
    its turn comes and released when the next one starts, so the extra memory is one group, as
    long as the consumer does not keep the tensors (vLLM's ``load_weights`` copies each into the
    engine's parameter). DTensor parameters (FSDP2 ``fully_shard``, tensor parallel) are gathered
    one at a time with ``full_tensor()``: every rank must iterate, in the same order.

    Example (vLLM: ``engine_model`` is ``model_runner.model`` of the worker that holds it)::

        engine_model.load_weights(modelgraft.original_state_dict(policy))

    Raises:
        IrreversibleConversionError: a conversion of the model has an operation without ``reverse``
            (raised here, before anything is yielded).
        ConversionError: a PEFT model whose adapters are not merged (``merge_adapter()`` first: a
            PEFT model yields its base model's original names with the adapters merged, see
            docs/conversion.md), or with ``modules_to_save``.
        ConversionError: a replaced module's weights that no conversion maps back to the original
            checkpoint's keys, or an original key nothing produces (before anything is yielded);
            ``model`` is not a ``torch.nn.Module``.
    """
    if not isinstance(model, torch.nn.Module):
        raise ConversionError(
            f"`original_state_dict` expects a `torch.nn.Module`, received `{type(model).__name__}`. "
            "Pass the model itself (for a DDP/FSDP1 wrapper, its `.module`)."
        )
    base, restore = without_adapters(model)  # a PEFT model: its base, adapters merged (see _peft_sync)
    if restore is None:
        return _original_state_dict(base)
    try:
        pairs = _original_state_dict(base)
    except BaseException:
        restore()
        raise
    return restoring(pairs, restore)


def _original_state_dict(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    live = model.state_dict()
    units, revert = _prepare(model, live)
    return _stream(model, units, revert, live)


def _prepare(model: torch.nn.Module, live: Mapping[str, torch.Tensor]) -> tuple[list[_Unit], list[bool]]:
    """The units of the stream and, per unit, whether transformers' own reverse finishes it."""
    units, builtin = _plan(model, list(live))
    if builtin:  # only where transformers' own reverse changes something (a dry run on meta)
        stand_ins = {k: _meta(v) for k, v in live.items()}
        builtin = _reverts_anything(model, dict(_stream(model, units, [False] * len(units), stand_ins)))
    revert = [builtin] * len(units)
    if any(unit.node is not None for unit in units) or _was_grafted(model):
        original = _original(model)
        if original is not None:
            units = _in_original_order(units, original)
            # Where a unit's keys are not the checkpoint's, they are the plain model's layout (a model
            # grafted in place after `from_config`): transformers' own reverse finishes them, as its
            # save of the plain model would.
            revert = [not set(u.names) <= original.checkpoint_keys for u in units]
            _check_names(model, units, revert, live, original)
    return units, revert
