"""Pair checkpoint keys with model keys for each converter, and run converters both ways.

A *group* is one application of a converter: for example the ``q_proj``, ``k_proj`` and
``v_proj`` weights of layer 0 and the ``qkv_proj`` weight they become. Groups are planned from
key names and shapes only; no tensor is read here.

Example:
    >>> import torch
    >>> from modelgraft.conversion import Concatenate, WeightConverter
    >>> from modelgraft.conversion._plan import plan_groups
    >>> conv = WeightConverter(["q_proj", "k_proj", "v_proj"], "qkv_proj", [Concatenate(dim=0)])
    >>> src = {f"l.0.{n}.weight": torch.Size([2, 2]) for n in ("q_proj", "k_proj", "v_proj")}
    >>> [g.targets for g in plan_groups([conv], ["l.0.qkv_proj.weight"], src).groups]
    [(('l.0.qkv_proj.weight',),)]
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

import torch

from modelgraft.conversion._groups import Group, Plan
from modelgraft.conversion.keys import are_segment_patterns, bucket_keys
from modelgraft.conversion.ops import ConversionContext, ShapeGroups, TensorGroups
from modelgraft.conversion.rules import WeightConverter
from modelgraft.errors import (
    ConversionError,
    ConversionShapeError,
    IrreversibleConversionError,
    MissingSourceKeyError,
)

__all__ = ["Group", "Plan", "plan_groups", "run_convert", "run_reverse"]


def _ordered(slot: dict[int | None, str]) -> tuple[str, ...]:
    return tuple(slot[i] for i in sorted(slot, key=lambda i: -1 if i is None else i))


def plan_groups(
    converters: Sequence[WeightConverter],
    target_keys: Iterable[str],
    source_shapes: Mapping[str, torch.Size],
    strict_sources: bool = True,
    base_model_prefix: str | None = None,
    unfilled: Collection[str] = (),
) -> Plan:
    """Plan the groups of ``converters`` for a model whose parameters are ``target_keys``.

    Args:
        converters: the (sub)model's conversion entry.
        target_keys: model-side keys (the grafted model's parameter names).
        source_shapes: checkpoint-side keys (already in the model's key space) and their shapes.
        strict_sources: raise :class:`MissingSourceKeyError` when a group finds some but not all
            of its source patterns.
        base_model_prefix, unfilled: only for entries with transformers' semantics, see
            :func:`modelgraft.conversion._hf_plan.plan_hf_groups`.
    """
    if any(conv._hf for conv in converters):
        from modelgraft.conversion._hf_plan import plan_hf_groups

        return plan_hf_groups(
            converters, target_keys, source_shapes, strict_sources, base_model_prefix, unfilled
        )
    plan = Plan()
    target_keys = list(target_keys)
    taken: dict[str, tuple[WeightConverter, str | None]] = {}  # target key -> converter, renamed-from key
    for conv in converters:
        assert are_segment_patterns(conv._targets) and are_segment_patterns(conv._sources)  # no `_hf` here
        tgt_buckets = bucket_keys(conv._targets, target_keys)
        if not tgt_buckets:
            continue
        src_buckets = bucket_keys(conv._sources, source_shapes)
        for (prefix, suffix), tslots in tgt_buckets.items():
            if not all(tslots):
                continue  # not every target pattern exists here: not this converter's layout
            sslots = src_buckets.get((prefix, suffix))
            targets = tuple(_ordered(s) for s in tslots)
            claimed = next((k for keys in targets for k in keys if k in taken), None)
            if claimed is not None:
                if (
                    sslots is not None
                    and all(sslots)
                    and not _same_renaming(taken[claimed], conv, claimed, targets, sslots)
                ):
                    # Two converters that would both build this parameter from the checkpoint: which one
                    # fills it must not depend on their order.
                    raise ConversionError(
                        f"Converters {taken[claimed][0]!r} and {conv!r} both build `{claimed}` from this checkpoint: "
                        "their patterns overlap, so which one fills it would depend on their order. Make the "
                        "patterns disjoint (anchor them to the module path), or register one converter for "
                        "these keys."
                    )
                continue
            if sslots is None or not any(sslots):
                plan.unsourced_targets.extend((conv, k) for keys in targets for k in keys)
                continue
            missing = [
                p.build(prefix, suffix, 0 if p.has_star else None)
                for p, slot in zip(conv._sources, sslots)
                if not slot
            ]
            if missing and strict_sources:
                raise MissingSourceKeyError(
                    f"Converter {conv!r} needs checkpoint key `{missing[0]}` to build "
                    f"`{targets[0][0]}`, but the checkpoint does not hold it. Check the converter's "
                    "source patterns against the checkpoint's keys."
                )
            if missing:
                continue
            sources = tuple(_ordered(s) for s in sslots)
            shapes = [[torch.Size(source_shapes[k]) for k in keys] for keys in sources]
            plan.groups.append(Group(conv, sources, targets, shapes))
            renamed = _renamed_from(conv, targets, sources)
            taken.update((k, (conv, renamed.get(k))) for keys in targets for k in keys)
    return plan


def _renamed_from(
    conv: WeightConverter, targets: tuple[tuple[str, ...], ...], sources: tuple[tuple[str, ...], ...]
) -> dict[str, str]:
    """For a pure renaming, the source key each target key is renamed from (empty otherwise)."""
    if conv.operations or len(targets) != len(sources):
        return {}
    return {
        t: s
        for tkeys, skeys in zip(targets, sources)
        if len(tkeys) == len(skeys)
        for t, s in zip(tkeys, skeys)
    }


def _same_renaming(
    previous: tuple[WeightConverter, str | None],
    conv: WeightConverter,
    claimed: str,
    targets: tuple[tuple[str, ...], ...],
    sslots: Sequence[dict[int | None, str]],
) -> bool:
    """Two renamings that move the same checkpoint key to the same parameter (a general rule and a
    specific one in one table): the same result whichever runs, so no conflict."""
    renamed = _renamed_from(conv, targets, tuple(_ordered(s) for s in sslots))
    return previous[1] is not None and renamed.get(claimed) == previous[1]


def run_convert(
    group: Group,
    tensors: TensorGroups,
    target_shapes: ShapeGroups | None,
    name: Callable[[str], str] = lambda key: key,
) -> TensorGroups:
    """Run the group's operations in order (checkpoint layout to grafted layout).

    An operation that fails on the tensors it receives (a torch error, or a refusal of a modelgraft
    operation) raises :class:`ConversionShapeError` naming the converter, the operation, the source
    keys (through ``name``, model key to checkpoint key) with their shapes, and the target shapes.
    """
    ops = group.converter.operations
    n = len(group.targets)
    sources = tensors
    for i, op in enumerate(ops):
        last = i == len(ops) - 1
        try:
            tensors = op.convert(
                tensors, ConversionContext(num_targets=n, target_shapes=target_shapes if last else None)
            )
        except (IrreversibleConversionError, NotImplementedError):
            raise  # not about the tensors
        except (RuntimeError, ValueError, IndexError, TypeError) as e:
            raise _operation_error(group, op, sources, target_shapes, name, e) from e
    _check_shapes(group, tensors, target_shapes, "load", name)
    _check_user_reverse(group, sources, tensors, name)
    return tensors


_CHECKED = "_modelgraft_reverse_checked"


def _user_ops(group: Group) -> list[object]:
    """Operations a user wrote (modelgraft's and transformers' own are tested as inverses)."""
    from modelgraft.conversion._hf_ops import TransformersOperation

    return [
        op
        for op in group.converter.operations
        if not isinstance(op, TransformersOperation)
        and not type(op).__module__.startswith(("modelgraft.", "transformers."))
    ]


def _check_user_reverse(
    group: Group, sources: TensorGroups, converted: TensorGroups, name: Callable[[str], str]
) -> None:
    """Once per converter with a user operation: ``reverse(convert(x)) == x`` on the tensors being loaded.

    A reverse that is not the inverse would otherwise surface only at save (a checkpoint that
    differs from the one loaded) or never (weight sync sending other numbers).
    """
    converter = group.converter
    if getattr(converter, _CHECKED, False) or not _user_ops(group):
        return
    if any(not op.is_reversible for op in converter.operations):
        return  # irreversible: refused at save, where the way back is needed
    if any(t.device.type == "meta" for g in [*sources, *converted] for t in g):
        return  # no values to compare yet: checked on the first load with values
    # The way back needs the shapes each operation received: those of the tensors loaded here.
    exact = Group(converter, group.sources, group.targets, [[t.shape for t in g] for g in sources])
    back = run_reverse(exact, converted)
    for keys, originals, returned in zip(group.sources, sources, back):
        for key, original, got in zip(keys, originals, returned):
            if got.shape != original.shape or got.dtype != original.dtype or not torch.equal(got, original):
                ops = ", ".join(f"`{type(op).__name__}`" for op in _user_ops(group))
                raise ConversionError(
                    f"Converter {converter!r}: the reverse of {ops} does not undo its convert on `{name(key)}` "
                    f"(convert then reverse gives {tuple(got.shape)} {got.dtype}, "
                    f"{'other values' if got.shape == original.shape else 'another shape'}; loaded "
                    f"{tuple(original.shape)} {original.dtype}). Saving and weight sync would write other weights "
                    "than were loaded: make `reverse` the exact inverse of `convert`."
                )
    try:
        setattr(converter, _CHECKED, True)
    except (AttributeError, TypeError):  # a frozen converter: checked again next time, still correct
        pass


def _operation_error(
    group: Group,
    op: object,
    sources: TensorGroups,
    target_shapes: ShapeGroups | None,
    name: Callable[[str], str],
    error: BaseException,
) -> ConversionShapeError:
    received = ", ".join(
        f"`{name(k)}` {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
        for keys, ts in zip(group.sources, sources)
        for k, t in zip(keys, ts)
    )
    targets = (
        ", ".join(
            f"`{k}` {tuple(s)}" for keys, ss in zip(group.targets, target_shapes) for k, s in zip(keys, ss)
        )
        if target_shapes is not None
        else ", ".join(f"`{k}`" for k in group.flat_targets)
    )
    # A user operation without a __repr__ of its own is shown by its class name, not its address.
    shown = type(op).__name__ if type(op).__repr__ is object.__repr__ else repr(op)
    return ConversionShapeError(
        f"Converter {group.converter!r} could not run `{shown}` on checkpoint key(s) {received} "
        f"({type(error).__name__}: {str(error).strip().rstrip('.')}). The checkpoint tensors do not have the shapes this converter expects; it must produce {targets}. "
        "Check the checkpoint against the model's config, and the operations' dims against the tensors."
    )


def _check_shapes(
    group: Group,
    tensors: TensorGroups,
    expected: ShapeGroups | None,
    where: str,
    name: Callable[[str], str] = lambda key: key,
) -> None:
    keys = group.targets if where == "load" else group.sources
    if len(tensors) != len(keys) or any(len(t) != len(k) for t, k in zip(tensors, keys)):
        got = [len(t) for t in tensors]
        raise ConversionShapeError(
            f"Converter {group.converter!r} produced {got} tensor(s) per pattern but `{keys[0][0]}` and its group "
            f"need {[len(k) for k in keys]}. Check the operations against the patterns."
        )
    if expected is None:
        return
    for names, ts, shapes in zip(keys, tensors, expected):
        for key, t, shape in zip(names, ts, shapes):
            if tuple(t.shape) != tuple(shape):
                if where == "save" and not group.converter.operations and _quantized(t):
                    # A renaming writes the tensor as it is, under its checkpoint name, as
                    # transformers writes a quantized model's renamed tensors: a quantizer's packed
                    # storage (bitsandbytes 4-bit: (N, 1) uint8) is not the float shape, nor need be.
                    continue
                origin = ""
                if where == "load":
                    shown = ", ".join(
                        f"`{name(k)}` {tuple(s)}"
                        for ks, ss in zip(group.sources, group.source_shapes)
                        for k, s in zip(ks, ss)
                    )
                    origin = f" from checkpoint key(s) {shown}" if shown else ""
                raise ConversionShapeError(
                    f"Converter {group.converter!r} produced shape {tuple(t.shape)} for `{key}`, but the "
                    f"{'model parameter' if where == 'load' else 'original checkpoint key'} has shape "
                    f"{tuple(shape)}{origin}. Check the operations' dims, or the replacement module's sizes."
                )


def _quantized(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a quantizer's storage rather than a plain float weight: integer packed
    data, or a tensor subclass (bitsandbytes' ``Params4bit``, quanto's ``QTensor``, torchao's)."""
    return not tensor.is_floating_point() or type(tensor) not in (torch.Tensor, torch.nn.Parameter)


def _op_input_shapes(group: Group, target_shapes: ShapeGroups) -> list[ShapeGroups]:
    """Shapes each operation received on load, recomputed by running the ops on meta tensors."""
    tensors: TensorGroups = [
        [torch.empty(s, device="meta") for s in shapes] for shapes in group.source_shapes
    ]
    seen: list[ShapeGroups] = []
    ops = group.converter.operations
    for i, op in enumerate(ops):
        seen.append([[t.shape for t in g] for g in tensors])
        last = i == len(ops) - 1
        ctx = ConversionContext(num_targets=len(group.targets), target_shapes=target_shapes if last else None)
        tensors = op.convert(tensors, ctx)
    return seen


def run_reverse(group: Group, tensors: TensorGroups) -> TensorGroups:
    """Undo the group's operations (grafted layout back to the checkpoint layout), exactly."""
    ops = group.converter.operations
    from modelgraft.conversion._hf_ops import TransformersOperation

    for op in ops:
        if not op.is_reversible:
            shown, method = (
                (type(op.op).__name__, "reverse_op")
                if isinstance(op, TransformersOperation)
                else (type(op).__name__, "reverse")
            )
            raise IrreversibleConversionError(
                f"Converter {group.converter!r} cannot write the original layout of `{group.flat_targets[0]}`: "
                f"operation `{shown}` has no `{method}`. Implement `{method}` on it, "
                "or save the grafted layout with `model.save_pretrained(path, save_original_format=False)`."
            )
    given = tensors
    try:
        target_shapes = [[t.shape for t in g] for g in tensors]
        inputs = _op_input_shapes(group, target_shapes)
        for op, shapes in zip(reversed(ops), reversed(inputs)):
            tensors = op.reverse(tensors, ConversionContext(num_targets=len(shapes), source_shapes=shapes))
        _check_shapes(group, tensors, group.source_shapes, "save")
    except (ConversionShapeError, RuntimeError, ValueError, NotImplementedError) as exc:
        quantized = [(k, t) for ks, ts in zip(group.targets, given) for k, t in zip(ks, ts) if _quantized(t)]
        if not (ops and quantized):
            raise
        key, t = quantized[0]
        raise ConversionShapeError(
            f"Converter {group.converter!r} cannot write `{key}` in the original layout: that tensor is "
            f"quantized ({type(t).__name__}, {t.dtype}, shape {tuple(t.shape)}), and the reverse operations "
            f"({', '.join(type(op).__name__ for op in ops)}) cannot rearrange the quantizer's storage into the "
            f"original weights ({type(exc).__name__}: {exc}). Save the grafted layout with "
            "`model.save_pretrained(path, save_original_format=False)`, or save the model before quantizing it."
        ) from exc
    return tensors
