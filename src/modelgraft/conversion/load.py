"""Streaming load: fill the grafted model's missing parameters from the checkpoint, group by group.

transformers loads every key that fits the model as it is; what is left missing and has a
registered converter is filled here, before transformers initialises missing weights, so no
converted parameter is randomly initialised first. Source tensors are read with safetensors
``safe_open`` one group at a time, so the extra memory is bounded by the largest group.

Example:
    >>> import torch
    >>> apply_load_conversions(torch.nn.Linear(1, 1), None, set(), set()) is None
    True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from modelgraft.conversion._checks import check_sources, expected_sources
from modelgraft.conversion._filemap import map_ranges
from modelgraft.conversion._layout import ByteLayout, convert_layouts
from modelgraft.conversion._plan import Group, Plan, plan_groups, run_convert
from modelgraft.conversion._safetensors import read_ranges_into
from modelgraft.conversion._sources import FileSource, StateDictSource, TensorSource
from modelgraft.conversion.keys import translate_checkpoint_keys
from modelgraft.conversion.ops import model_config
from modelgraft.conversion.originals import cached_original_shapes
from modelgraft.conversion.scopes import STATE_ATTR, ConversionState, Scope, resolve_scopes, scope_for
from modelgraft.errors import ConversionError
from modelgraft.report import ConversionRecord, GraftReport, report_for

__all__ = ["apply_load_conversions", "device_for_map"]


def device_for_map(device_map: Mapping[str, object] | None) -> Callable[[str], torch.device | str | int]:
    """Where a parameter goes under a loader's ``device_map``: the value of its longest matching
    prefix (``""`` matches everything), ``"cpu"`` without a map. Accelerator indices are kept as
    they are (``tensor.to(0)`` means the first accelerator) and ``"disk"`` is passed on (the load
    step offloads, or refuses where it cannot).

    Example:
        >>> where = device_for_map({"": "cpu", "model.layers.1": "disk", "lm_head": 0})
        >>> where("model.layers.1.mlp.up_proj.weight"), where("model.norm.weight"), where("lm_head.weight")
        ('disk', 'cpu', 0)
    """

    def device_for(key: str) -> torch.device | str | int:
        if not device_map:
            return "cpu"
        best = max(
            (p for p in device_map if p == "" or key == p or key.startswith(p + ".")), key=len, default=None
        )
        return device_map.get(best, "cpu") if best is not None else "cpu"  # type: ignore[return-value]

    return device_for


# ---- the load step ------------------------------------------------------------------------------
def _set_tensor(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if leaf in parent._parameters:
        old = parent._parameters[leaf]
        new = torch.nn.Parameter(value, requires_grad=old.requires_grad if old is not None else True)
        new._is_hf_initialized = True  # type: ignore[attr-defined]  # transformers' init skips tensors carrying this flag
        parent._parameters[leaf] = new
    else:
        value._is_hf_initialized = True  # type: ignore[attr-defined]
        parent._buffers[leaf] = value


def apply_load_conversions(
    model: torch.nn.Module,
    checkpoint_files: Sequence[str] | None,
    missing_keys: set[str],
    unexpected_keys: set[str],
    device_for: Callable[[str], torch.device | str | int] = lambda _key: "cpu",
    rename: Callable[[str], str] | None = None,
    offload: Callable[[str, torch.Tensor], None] | None = None,
    place: Callable[[str, torch.Tensor], bool] | None = None,
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> ConversionState | None:
    """Fill ``missing_keys`` of ``model`` that a registered converter can produce, in place.

    The tensors come from ``state_dict`` when one is given (``from_pretrained(..., state_dict=)``),
    else from ``checkpoint_files``. Converted targets are removed from ``missing_keys`` and consumed
    sources from ``unexpected_keys``. ``rename`` maps a checkpoint key through the loader's own
    renamings (legacy layouts such as ``language_model.model.*``) before the base-model prefix is
    adjusted. A target whose ``device_for`` is ``"disk"`` is handed, converted, to
    ``offload(key, tensor)`` (the loader writes it to its offload folder) and its parameter stays
    on the meta device. ``place(key, tensor)``, when given, may put a converted tensor into the
    model itself (a quantizing loader quantizes it) and returns whether it did; otherwise it is set
    as it is. Every group's sources are checked (see ``_checks``) before any group runs.
    Returns the state saved on the model, or ``None`` when no entry applies.

    Raises:
        MissingSourceKeyError: a group finds only some of its source keys.
        ConversionShapeError: a source does not fit what the original model expects there, the
            sources of a group mix dtypes or skip a ``*`` index, an operation fails on them, or a
            converted tensor does not fit its parameter.
    """
    with model_config(getattr(model, "config", None)):
        return _apply_load_conversions(
            model,
            checkpoint_files,
            missing_keys,
            unexpected_keys,
            device_for,
            rename,
            offload,
            place,
            state_dict,
        )


def _apply_load_conversions(
    model: torch.nn.Module,
    checkpoint_files: Sequence[str] | None,
    missing_keys: set[str],
    unexpected_keys: set[str],
    device_for: Callable[[str], torch.device | str | int],
    rename: Callable[[str], str] | None,
    offload: Callable[[str, torch.Tensor], None] | None,
    place: Callable[[str, torch.Tensor], bool] | None,
    state_dict: Mapping[str, torch.Tensor] | None,
) -> ConversionState | None:
    scopes = resolve_scopes(model)
    if not scopes:
        return None
    from_memory = state_dict is not None
    state = ConversionState(scopes=scopes, loaded=checkpoint_files is not None or from_memory)
    object.__setattr__(model, STATE_ATTR, state)
    if not checkpoint_files and not from_memory:
        return state
    params: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    params.update(dict(model.named_buffers(remove_duplicate=False)))
    rep = report_for(model)
    source = _open_source(checkpoint_files, state_dict, rep)
    keys = _KeyMap.of(model, params, source, rename)
    plans = [p for scope in scopes if (p := _plan_scope(model, scope, scopes, params, missing_keys, keys))]
    # Every group is checked before any runs: a bad checkpoint changes nothing in the model.
    _check_all(model, [(p.scope, p.plan, p.groups) for p in plans], params, source, keys.name)
    for planned in plans:
        for group in planned.groups:
            _run_group(model, group, params, keys.locate, device_for, offload, place, keys.name)
            _record_group(state, rep, group, keys, planned.in_checkpoint_space, missing_keys, unexpected_keys)
        _report_unsourced(rep, planned.scope, planned.plan)
    return state


def _open_source(
    checkpoint_files: Sequence[str] | None, state_dict: Mapping[str, torch.Tensor] | None, rep: GraftReport
) -> TensorSource:
    """The load's tensors: ``state_dict`` when given, else the checkpoint files (a file that is not
    safetensors holds no key modelgraft can read, which the report says)."""
    if state_dict is not None:
        return StateDictSource(state_dict)
    source = FileSource(checkpoint_files or ())
    if not list(source.keys()):
        rep.problems.append(
            f"modelgraft converts weights from safetensors files only; `{source.files[0]}` is not one, so "
            "no conversion ran. Re-save the checkpoint with `save_pretrained` (safetensors is the default)."
        )
    return source


@dataclass
class _KeyMap:
    """The two names of every checkpoint tensor: its checkpoint key and the model key it loads as.

    ``to_ckpt`` grows while scopes are planned (a scope planned on renamed checkpoint keys adds its
    own), so :meth:`name` and :meth:`locate` read it when a group runs, not when it is built.
    """

    source: TensorSource
    renamed: dict[str, str]  # checkpoint key -> the key after the loader's own renamings
    to_model: dict[str, str]  # checkpoint key -> model key
    to_ckpt: dict[str, str] = field(default_factory=dict)  # model key -> checkpoint key

    @classmethod
    def of(
        cls,
        model: torch.nn.Module,
        params: Mapping[str, torch.Tensor],
        source: TensorSource,
        rename: Callable[[str], str] | None,
    ) -> _KeyMap:
        ckpt_keys = list(source.keys())
        renamed = {k: rename(k) for k in ckpt_keys} if rename is not None else {k: k for k in ckpt_keys}
        by_renamed = translate_checkpoint_keys(model, set(params), renamed.values())
        to_model = {ckpt_key: by_renamed[new_key] for ckpt_key, new_key in renamed.items()}
        return cls(source, renamed, to_model, {m: c for c, m in to_model.items()})

    def locate(self, model_key: str) -> tuple[TensorSource, str]:
        return self.source, self.to_ckpt[model_key]

    def name(self, model_key: str) -> str:
        return self.to_ckpt.get(model_key, model_key)


@dataclass(frozen=True)
class _ScopePlan:
    """The groups planned for one scope, and whether they were planned on checkpoint keys."""

    scope: Scope
    plan: Plan
    groups: list[Group]  # the plan's groups with model-wide keys
    in_checkpoint_space: bool


def _plan_scope(
    model: torch.nn.Module,
    scope: Scope,
    scopes: Sequence[Scope],
    params: Mapping[str, torch.Tensor],
    missing_keys: set[str],
    keys: _KeyMap,
) -> _ScopePlan | None:
    """Plan the groups of ``scope`` over the keys it owns; ``None`` when it owns nothing to fill."""
    hf = any(c._hf for c in scope.converters)
    # With transformers' renaming semantics a renamed checkpoint key never loads as itself, so
    # every key of the scope may be a target (a group then overwrites what loaded by name).
    pool = params if hf else missing_keys
    owned_missing = sorted(scope.local(k) for k in pool if scope_for(scopes, k) is scope)
    if not owned_missing:
        return None
    source = keys.source
    if hf and not scope.path:
        # transformers renames checkpoint keys before it adds or strips the base model prefix.
        src_shapes = {new: source.shape(c) for c, new in keys.renamed.items()}
        keys.to_ckpt.update((new, c) for c, new in keys.renamed.items() if new not in keys.to_ckpt)
        base = getattr(model, "base_model_prefix", "") or None
        plan = plan_groups(
            scope.converters, owned_missing, src_shapes, base_model_prefix=base, unfilled=missing_keys
        )
        keys.to_ckpt.update((saved, keys.to_ckpt[key]) for saved, key in plan.read_from.items())
        return _ScopePlan(scope, plan, [_globalise(g, scope) for g in plan.groups], True)
    src_shapes = {scope.local(m): source.shape(c) for c, m in keys.to_model.items() if scope.owns(m)}
    plan = plan_groups(scope.converters, owned_missing, src_shapes)
    return _ScopePlan(scope, plan, [_globalise(g, scope) for g in plan.groups], False)


def _record_group(
    state: ConversionState,
    rep: GraftReport,
    group: Group,
    keys: _KeyMap,
    in_checkpoint_space: bool,
    missing_keys: set[str],
    unexpected_keys: set[str],
) -> None:
    """After ``group`` ran: remember it on the model's state, take its targets off the missing keys
    and its sources off the unexpected ones, and add it to the report."""
    state.groups.append(group)
    state.checkpoint_keys.update((k, keys.name(k)) for k in group.flat_sources)
    if in_checkpoint_space:
        state.checkpoint_space.update(group.flat_sources)
    missing_keys.difference_update(group.flat_targets)
    for k in group.flat_sources:
        ckpt_key = keys.to_ckpt.get(k, k)
        unexpected_keys.discard(k)
        unexpected_keys.discard(ckpt_key)
        unexpected_keys.discard(keys.to_model.get(ckpt_key, k))  # a raw key planned as is
    rep.conversions.append(
        ConversionRecord(repr(group.converter), tuple(group.flat_sources), tuple(group.flat_targets))
    )


def _report_unsourced(rep: GraftReport, scope: Scope, plan: Plan) -> None:
    """Report each target that a converter of ``plan`` found no source key for: it stays unloaded."""
    for conv, key in plan.unsourced_targets:
        target = scope.glob(key)
        if target not in rep.unloaded_parameters:
            rep.unloaded_parameters.append(target)
        rep.problems.append(
            f"`{target}` was produced by no converter: {conv!r} found none of its source keys in the "
            "checkpoint, so the parameter keeps its random init. Check the converter's source patterns."
        )


def _check_all(
    model: torch.nn.Module,
    plans: Sequence[tuple[Scope, Plan, list[Group]]],
    params: Mapping[str, torch.Tensor],
    source: TensorSource,
    name: Callable[[str], str],
) -> None:
    """Check each group's sources against what the original model expects (see ``_checks``)."""
    if not any(groups for _, _, groups in plans):
        return
    original = cached_original_shapes(model)
    model_name = f"`{type(model).__name__}`"
    for scope, _plan, groups in plans:
        # The same converters planned over the original model's own keys: where they find the
        # sources, the original holds them, with the shapes they must have.
        local = {scope.local(k): s for k, s in original.items() if scope.owns(k)}
        targets = sorted({scope.local(k) for g in groups for k in g.flat_targets})
        found = plan_groups(scope.converters, targets, local, strict_sources=False).groups
        in_original = {g.targets: g for g in (_globalise(g, scope) for g in found)}
        for group in groups:
            target_shapes = [[params[k].shape for k in keys] for keys in group.targets]
            expected = expected_sources(
                group, in_original.get(group.targets), original, target_shapes, model_name
            )
            dtypes = [[source.dtype(name(k)) for k in keys] for keys in group.sources]
            check_sources(group, group.source_shapes, dtypes, expected, name)


def _globalise(group: Group, scope: Scope) -> Group:
    return Group(
        group.converter,
        tuple(tuple(scope.glob(k) for k in keys) for keys in group.sources),
        tuple(tuple(scope.glob(k) for k in keys) for keys in group.targets),
        group.source_shapes,
    )


def _run_group(
    model: torch.nn.Module,
    group: Group,
    params: Mapping[str, torch.Tensor],
    locate: Callable[[str], tuple[TensorSource, str]],
    device_for: Callable[[str], torch.device | str | int],
    offload: Callable[[str, torch.Tensor], None] | None,
    place: Callable[[str, torch.Tensor], bool] | None = None,
    name: Callable[[str], str] = lambda key: key,
) -> None:
    target_shapes = [[params[k].shape for k in keys] for keys in group.targets]
    devices = {
        k: params[k].device if params[k].device.type != "meta" else device_for(k) for k in group.flat_targets
    }
    to_disk = {k for k, d in devices.items() if d == "disk"}
    if to_disk and offload is None:
        raise ConversionError(
            f'`{sorted(to_disk)[0]}` is converted by {group.converter!r} and placed on "disk" by the device_map, '
            "but this transformers version gives modelgraft no way to offload a converted weight. Keep the "
            'converted modules on "cpu" or a GPU in the device_map, or use transformers 5.x.'
        )
    # A weight bound for the disk is built on the CPU, written to the offload folder, then dropped.
    devices.update((k, "cpu") for k in to_disk)
    out = _rearranged_targets(group, params, locate, devices) if not to_disk else None
    if out is None:
        tensors = [[_read(locate, k) for k in keys] for keys in group.sources]
        out = run_convert(group, tensors, target_shapes, name)
        del tensors
    for keys, values in zip(group.targets, out):
        for key, value in zip(keys, values):
            value = value.to(device=devices[key], dtype=params[key].dtype).contiguous()
            if key in to_disk:
                assert offload is not None
                offload(key, value)
                continue
            if value._base is not None:  # a view into a shared buffer would look like a tied weight
                value = value.clone()
            if place is None or not place(key, value):
                _set_tensor(model, key, value)


def _read(locate: Callable[[str], tuple[TensorSource, str]], key: str) -> torch.Tensor:
    source, ckpt_key = locate(key)
    return source.read(ckpt_key)


def _rearranged_targets(
    group: Group,
    params: Mapping[str, torch.Tensor],
    locate: Callable[[str], tuple[TensorSource, str]],
    devices: Mapping[str, torch.device | str | int],
) -> list[list[torch.Tensor]] | None:
    """Fast path of conversions that only rearrange rows (fused QKV and gate/up, MoE expert merges;
    see ``_layout``): each target is built straight from the file, from private mappings where the
    layout allows (as lazy as a plain load, see ``_filemap``), else read range by range into it, so
    every byte is copied once. ``None`` when the group does not qualify (other operations, a dtype
    cast, a non-CPU target, shapes that do not fit; the generic path then runs and reports errors)."""
    found = _source_layouts(group, locate)
    if found is None:
        return None
    sources, dtype = found
    converted = convert_layouts(group.converter.operations, sources)
    if converted is None or not _layouts_fit(group, converted, params, devices, dtype):
        return None
    return [
        [_build(layout, dtype, key) for key, layout in zip(keys, layouts)]
        for keys, layouts in zip(group.targets, converted)
    ]


def _source_layouts(
    group: Group, locate: Callable[[str], tuple[TensorSource, str]]
) -> tuple[list[list[ByteLayout]], torch.dtype] | None:
    """The byte layout of every source of ``group`` and their one dtype; ``None`` when a source has
    no layout (not in a file) or the sources mix dtypes, or there are none."""
    sources: list[list[ByteLayout]] = []
    dtype = None
    for keys in group.sources:
        layouts = []
        for key in keys:
            source, ckpt_key = locate(key)
            layout = source.layout(ckpt_key)
            if dtype is None:
                dtype = source.dtype(ckpt_key)
            if layout is None or dtype is None or source.dtype(ckpt_key) != dtype:
                return None
            layouts.append(layout)
        sources.append(layouts)
    return None if dtype is None else (sources, dtype)


def _layouts_fit(
    group: Group,
    converted: Sequence[Sequence[ByteLayout]],
    params: Mapping[str, torch.Tensor],
    devices: Mapping[str, torch.device | str | int],
    dtype: torch.dtype,
) -> bool:
    """Whether the converted layouts are the targets as they are: one per target key, each of the
    parameter's dtype and shape, not a scalar, bound for the CPU."""
    if len(converted) != len(group.targets):
        return False
    for keys, layouts in zip(group.targets, converted):
        if len(keys) != len(layouts):
            return False
        for key, layout in zip(keys, layouts):
            ref = params[key]
            if (
                ref.dtype != dtype
                or tuple(ref.shape) != layout.shape
                or ref.dim() == 0
                or str(devices[key]) != "cpu"
            ):
                return False
    return True


def _build(layout: ByteLayout, dtype: torch.dtype, key: str) -> torch.Tensor:
    """A target from its byte layout: mapped from the file where it can be, else read into place."""
    tensor = map_ranges(layout.ranges, dtype, layout.shape)
    if tensor is None:
        tensor = torch.empty(layout.shape, dtype=dtype)
        read_ranges_into(layout.ranges, tensor, key)
    return tensor
