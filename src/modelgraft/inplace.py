"""Graft a model that is already built and loaded: :func:`graft_model`.

Load-time patching decides which classes a model is built from. :func:`graft_model` does the same
to a model that already exists, in place, and carries its loaded weights across:

1. *Which modules, built how.* The model is rebuilt on the meta device under the patches, exactly
   as ``from_pretrained`` would build it, with each replacement class wrapped so that it records
   the constructor arguments it received (``config``, ``layer_idx``, ...). Every outermost module
   that came out replaced is a target. A model that cannot be rebuilt from its config (a plain
   ``nn.Module``) falls back to matching class names and recovering the constructor arguments
   from the module's attributes of the same names.
2. *Build everything first.* Each replacement is constructed on the original module's device and
   filled from the original's parameters and buffers: unchanged when the layouts agree (then the
   original parameter objects themselves go in); otherwise through the registered checkpoint
   conversions, starting from the checkpoint layout (transformers' own load-time conversion undone
   first when the live layout differs from the checkpoint's). A parameter nothing fills, or an
   original weight nothing takes, is an error. Per parameter ``requires_grad``, dtype and device,
   per submodule train/eval mode, and hooks are carried over, or refused where they cannot be
   exactly (see :mod:`modelgraft._inplace_state`).
3. *Then swap.* Only when every replacement is ready are they put into their parents, so a
   failure leaves the model exactly as it was. The model then remembers the conversion groups
   that ran and the conversion entries in effect, so that ``save_pretrained`` writes the original
   layout whatever is registered at save time (:func:`modelgraft.conversion.save.remember_graft`).

Example:
    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from transformers.models.llama.modeling_llama import LlamaMLP
    >>> from modelgraft import graft_model, report
    >>> class LoudMLP(LlamaMLP):
    ...     pass
    >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    ...     num_attention_heads=2, num_key_value_heads=2, vocab_size=32))
    >>> before = model(torch.tensor([[1, 2, 3]])).logits
    >>> graft_model(model, {"LlamaMLP": LoudMLP}) is model
    True
    >>> type(model.model.layers[1].mlp).__name__, len(report(model).replaced)
    ('LoudMLP', 2)
    >>> torch.equal(before, model(torch.tensor([[1, 2, 3]])).logits)
    True
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from modelgraft import _compat, recorders, registry, swap
from modelgraft._inplace_optim import Moved, plan_optimizer, retire
from modelgraft._inplace_state import (
    HookMove,
    copy_modes,
    move_hooks,
    place_tensors,
    plan_hooks,
    raw_state,
    refuse_wrapped,
    same_dtype_and_device,
)
from modelgraft.conversion._plan import Group, plan_groups, run_convert
from modelgraft.conversion.save import remember_graft
from modelgraft.conversion.scopes import Scope, resolve_scopes, scope_for
from modelgraft.errors import (
    ConversionError,
    GraftError,
    GraftStateError,
    ReplacementTypeError,
    WrappedModelError,
)
from modelgraft.graft import Graft, as_graft, scope
from modelgraft.registry import Snapshot
from modelgraft.report import ConversionRecord, ReplacedModule, report_for

__all__ = ["graft_model"]

_CTOR = "_modelgraft_ctor_args"


@dataclass
class _Target:
    """One module to replace, and (once built) its replacement and what filled it."""

    path: str
    original: torch.nn.Module
    key: str
    replacement_cls: type
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    built: torch.nn.Module | None = None
    records: list[ConversionRecord] = field(default_factory=list)
    groups: list[Group] = field(default_factory=list)  # the conversions that filled it, for saving
    hooks: list[HookMove] = field(default_factory=list)  # hook tables to hand over at swap time
    scope: Scope | None = None  # the conversion scope a load would use for it (resolve_scopes)
    filled: Any = None  # the _Filled that made `built` (its sources and conversion, for optimizer state)


def graft_model(
    model: torch.nn.Module,
    mapping: Graft | Mapping[str, type[torch.nn.Module]] | None = None,
    conversions: Mapping[str, Sequence[Any]] | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
) -> torch.nn.Module:
    """Replace, in place, the modules of a built model whose classes the patches replace.

    Args:
        model: a built (usually loaded) model; a ``PreTrainedModel`` or any ``nn.Module``.
        mapping: the graft to apply: a :class:`~modelgraft.Graft` (``modelgraft.grafts.fused_qkv("llama")``:
            its classes and conversions), or a patch mapping as for ``register_patch_mapping``.
            It applies over what is registered (and any active ``patched(...)`` scope); ``None``
            applies only what is registered.
        conversions: ``{model_type_or_class_name: [WeightConverter, ...]}`` added to the graft, to
            carry weights into replacements with another layout.
        optimizer: an optimizer already built on the model: each parameter the graft replaces by a
            new one is replaced in its parameter group too, and its state moves exactly (state shaped
            like the weight goes through the weights' own conversion; ``step`` and other entries
            must agree between the sources). Without it, an optimizer that still holds a replaced
            parameter refuses to ``step()`` (:class:`GraftStateError` naming the parameter).

    A key that matches the model's own class (``chunked_lm_loss()`` replaces ``*ForCausalLM``)
    switches the class of the model object itself, in place, when the replacement is a subclass
    that adds no constructor state (its ``__init__`` is the original's): parameters, buffers and
    hooks stay as they are.

    Returns:
        ``model`` itself; :func:`modelgraft.report` lists the replaced modules and conversions.

    Raises:
        ConversionError: a replacement parameter that no weight of the original fills, or an
            original weight that nothing in the replacement takes (the model is unchanged).
        GraftStateError: state that cannot be carried exactly: a weight fused from originals whose
            ``requires_grad``, dtype or device differ, a hook on a module the replacement does not
            keep, an accelerate hook, a replacement of the model's own class that has a constructor
            of its own (the model is unchanged).
        ReplacementTypeError: a key matches the model's own class and its replacement is not a
            subclass of it (the model is unchanged).
        GraftError: a replacement could not be constructed (the model is unchanged).
        GraftStateError: the optimizer's state cannot be moved exactly (sources in different
            groups, or with different entries); the model and the optimizer are unchanged.
        WrappedModelError: ``model`` is a PEFT wrapper (``PeftModel``, ``LoraModel``): graft the
            model before wrapping it, or pass ``get_base_model()``.
    """
    _refuse_peft_wrapper(model)
    graft = as_graft(mapping, conversions)
    with _scope(graft) as snap:
        if not snap:
            return model
        root = _plan_root(model, snap)  # refused here, before anything else is looked at
        targets = _plan_targets(model, snap)
        # The conversions in effect for this model, as a load resolves them: they fill the
        # replacements, and a save undoes this graft with them whatever is registered then
        # (see conversion/save.py).
        scopes = resolve_scopes(model) if targets else []
        for target in targets:  # build, fill and check everything before touching the model
            target.scope = scope_for(scopes, target.path + ".")
            _build(model, target, snap)
        moved = [_moved(model, t) for t in targets]
        move = plan_optimizer(optimizer, moved) if optimizer is not None else None
        _swap_in(model, targets)
        if move is not None:
            move.apply()
        kept = {id(p) for p in model.parameters()}
        retire({k: p for unit in moved for k, p in unit.old.items() if id(p) not in kept})
        if root is not None:
            model.__class__ = root.replacement_cls
        if targets:
            remember_graft(model, [g for t in targets for g in t.groups], scopes)
    _report(model, graft, root, targets)
    if targets:
        recorders.patch_output_recorders(
            model, replacements={type(t.original): t.replacement_cls for t in targets}
        )
    return model


def _refuse_peft_wrapper(model: object) -> None:
    """A PEFT wrapper is not the model: its adapters wrap the layers a graft would replace."""
    cls = type(model)
    if not cls.__module__.startswith("peft."):
        return
    raise WrappedModelError(
        f"`graft_model` got a PEFT wrapper (`{cls.__name__}` from `{cls.__module__}`), not the model it wraps: "
        "PEFT's adapter layers sit in place of the modules a graft replaces, and replacing them would drop the "
        "adapters. Graft the model before wrapping it (`graft_model(model, graft)`, then "
        "`get_peft_model(model, config)`), or pass `peft_model.get_base_model()` when the graft replaces no "
        "module that holds an adapter. The model was left unchanged."
    )


def _report(
    model: torch.nn.Module, graft: Graft | None, root: _Root | None, targets: Sequence[_Target]
) -> None:
    """Add what the graft replaced and converted to the model's report, and the graft's keys that
    matched nothing."""
    rep = report_for(model)
    used = {t.key for t in targets}
    if root is not None:
        used.add(root.key)
        if root.original is not None:  # a new class for the model object: one entry for the root
            rep.replaced[:] = [r for r in rep.replaced if r.path != ""]
            rep.replaced.append(
                ReplacedModule("", _qualname(root.original), _qualname(root.replacement_cls), root.key)
            )
    rep.replaced.extend(
        ReplacedModule(t.path, _qualname(type(t.original)), _qualname(t.replacement_cls), t.key)
        for t in targets
    )
    rep.conversions.extend(r for t in targets for r in t.records)
    if graft is not None:
        rep.unmatched_keys.extend(k for k in graft.mapping if k not in used and k not in rep.unmatched_keys)


@contextlib.contextmanager
def _scope(graft: Graft | None) -> Iterator[Snapshot]:
    with scope(graft) if graft is not None else contextlib.nullcontext(registry.snapshot()) as snap:
        # One snapshot for the whole graft: its conversion lookups read it, not the live registry.
        with registry.pinned(snap):
            yield snap


@dataclass(frozen=True)
class _Root:
    """The new class of the model object itself, and the key that chose it."""

    key: str
    replacement_cls: type
    original: type | None  # the class the model stands for; None when it already has the replacement


def _plan_root(model: torch.nn.Module, snap: Snapshot) -> _Root | None:
    """Whether a key replaces the model's own class, and with what; refuse what cannot be exact.

    A switch of ``model.__class__`` keeps every parameter, buffer and hook, so it is exact only
    when the replacement (and the model's current class) add nothing to the state the original
    constructor builds: the same ``__init__`` and the same instance layout.
    """
    current = type(model)
    original = current.__dict__.get("_modelgraft_original", current)  # a grafted class stands for this
    found = snap.find(original.__name__)
    if found is None or found[1] is original:
        return None
    key, replacement = found
    if replacement is current:
        return _Root(key, replacement, None)
    if not isinstance(replacement, type) or not issubclass(replacement, original):
        raise ReplacementTypeError(
            f"Patch key `{key}` matches the model's own class `{original.__name__}`, but its replacement "
            f"`{getattr(replacement, '__qualname__', replacement)}` is not a subclass of it, so the model object "
            f"cannot become one. Derive the replacement from `{original.__name__}`, or anchor the key so that "
            "it does not match the model's class. The model was left unchanged."
        )
    classes: tuple[type[torch.nn.Module], ...] = (replacement, current)
    for cls in classes:
        if cls.__init__ is not original.__init__ or cls.__basicsize__ != original.__basicsize__:
            raise GraftStateError(
                f"Patch key `{key}` matches the model's own class `{original.__name__}`, and `{cls.__qualname__}` "
                "has a constructor (or instance layout) of its own: switching the class of the built model would "
                "skip the state it sets up. Load the model under the graft instead (`with modelgraft.patched(graft): "
                "...from_pretrained(...)`), or give the replacement no `__init__` of its own. The model was left "
                "unchanged."
            )
    return _Root(key, replacement, original)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# ---- step 1: which modules, with which constructor arguments --------------------------------------
def _plan_targets(model: torch.nn.Module, snap: Snapshot) -> list[_Target]:
    targets: list[_Target] = []
    if getattr(model, "config", None) is not None:
        try:
            targets = _targets_from_meta_rebuild(model, snap)
        except (TypeError, ValueError, AttributeError, RuntimeError, NotImplementedError):
            targets = []  # not rebuildable from its config: names and attributes only
    # Modules the rebuild could not reach (a class picked from a dict bound at import time, as
    # transformers 4.57 does for attention implementations) are still replaced by name.
    covered = [t.path for t in targets]
    for path, module, key, replacement in _matches_by_name(model, snap):
        if any(_related(path, p) for p in covered):
            continue
        args, kwargs = _ctor_args_from_attributes(module, replacement)
        targets.append(_Target(path, module, key, replacement, args, kwargs))
    order = {p: i for i, (p, _) in enumerate(model.named_modules())}
    return sorted(targets, key=lambda t: order[t.path])


def _related(path: str, other: str) -> bool:
    return path == other or path.startswith(other + ".") or other.startswith(path + ".")


def _recording(cls: type[torch.nn.Module]) -> type:
    """A subclass of ``cls`` that remembers the arguments its constructor received."""

    def __init__(self: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        object.__setattr__(self, _CTOR, (args, kwargs))
        cls.__init__(self, *args, **kwargs)

    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__})


def _targets_from_meta_rebuild(model: torch.nn.Module, snap: Snapshot) -> list[_Target]:
    wrapped: dict[type, type] = {}
    overlay = {}
    for key, cls in snap.mapping.items():
        overlay[key] = wrapped.setdefault(cls, _recording(cls))
    by_recorder = {rec: cls for cls, rec in wrapped.items()}
    # The overlay keeps the snapshot's keys in the snapshot's order, so each class resolves to
    # the same key as under the real patches; the recording subclasses only add bookkeeping.
    with registry.scoped(overlay) as rec_snap, swap.LOCK, swap.Swap(rec_snap, (type(model),)):
        with _compat.TRANSFORMERS.meta_device():
            shadow = type(model)(model.config)
    targets: list[_Target] = []
    skip: str | None = None
    for path, module in shadow.named_modules():
        if skip is not None and (path == skip or path.startswith(skip + ".")):
            continue
        real_cls = by_recorder.get(type(module))
        if real_cls is None or not path:
            continue
        skip = path
        original = _get(model, path)
        if original is None or type(original) is real_cls:
            continue  # structure differs here, or this module is already grafted
        found = snap.find(type(original).__name__)
        if found is None or found[1] is not real_cls:
            continue
        args, kwargs = module.__dict__[_CTOR]
        targets.append(_Target(path, original, found[0], real_cls, args, dict(kwargs)))
    return targets


def _matches_by_name(model: torch.nn.Module, snap: Snapshot) -> list[tuple[str, torch.nn.Module, str, type]]:
    """Outermost modules whose class name the snapshot replaces (in the patch scope, not yet grafted)."""
    found = []
    skip: str | None = None
    for path, module in model.named_modules():
        if not path or (skip is not None and path.startswith(skip + ".")):
            continue
        cls = type(module)
        if swap._is_library_module(cls.__module__):
            continue  # torch and non-modeling transformers classes are never swapped at load either
        match = snap.find(cls.__name__)
        if match is None or match[1] is cls:
            continue
        skip = path
        found.append((path, module, match[0], match[1]))
    return found


def _ctor_args_from_attributes(
    module: torch.nn.Module, replacement: type
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Recover the original constructor's arguments from attributes named like its parameters."""
    signature = inspect.signature(swap.undecorated_init(type(module).__init__))
    kwargs: dict[str, Any] = {}
    for name, param in list(signature.parameters.items())[1:]:
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if name in module.__dict__ or hasattr(module, name):
            kwargs[name] = getattr(module, name)
        elif param.default is param.empty:
            raise GraftError(
                f"Cannot rebuild `{type(module).__name__}` as `{replacement.__name__}`: its constructor argument "
                f"`{name}` is not stored on the module under that name, so it cannot be recovered. Store it as "
                "an attribute of the same name, or load the model with the patch registered instead of grafting "
                "it afterwards. The model was left unchanged."
            )
    return (), kwargs


def _get(model: torch.nn.Module, path: str) -> torch.nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


# ---- step 2: build and fill -----------------------------------------------------------------------
def _build(model: torch.nn.Module, target: _Target, snap: Snapshot) -> None:
    original = target.original
    refuse_wrapped(target.path, original)
    tensors = [*original.parameters(), *original.buffers()]
    device = tensors[0].device if tensors else torch.device("cpu")
    try:
        # Same patches as at load time, so replacements nested inside this one are swapped too.
        with swap.LOCK, swap.Swap(snap, (type(model),)), torch.device(device):
            built = target.replacement_cls(*target.args, **target.kwargs)
    except Exception as exc:
        raise GraftError(
            f"Building `{target.replacement_cls.__name__}` for `{target.path}` (key `{target.key}`) failed: "
            f"{type(exc).__name__}: {exc}. The model was left unchanged."
        ) from exc
    with torch.no_grad():
        filled = _fill(model, target, built)
        local = {_local(target.path, k): v for k, v in filled.values.items()}
        sources = {
            _local(target.path, k): tuple(_local(target.path, s) for s in v)
            for k, v in filled.sources.items()
        }
        unchanged = place_tensors(target.path, original, built, local, sources)
    copy_modes(original, built)
    target.hooks = plan_hooks(target.path, original, built, unchanged)
    target.records, target.groups = filled.records, filled.groups
    target.built = built
    target.filled = filled


def _moved(model: torch.nn.Module, target: _Target) -> Moved:
    """The parameters one target trades, and how old-layout tensors convert (for optimizer state)."""
    prefix = target.path + "."
    assert target.built is not None and target.filled is not None
    old_state = {prefix + k: v for k, v in raw_state(target.original).items()}
    new_state = {prefix + k: v for k, v in raw_state(target.built).items()}
    wanted = {k: v.shape for k, v in new_state.items()}
    method = target.filled.method

    def convert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            converted = method(model, target, tensors, wanted)
        return converted.values if converted is not None else {}

    return Moved(
        target.path,
        {k: v for k, v in old_state.items() if isinstance(v, torch.nn.Parameter)},
        {k: v for k, v in new_state.items() if isinstance(v, torch.nn.Parameter)},
        dict(target.filled.sources),
        convert,
        {k: v.detach() for k, v in old_state.items() if not isinstance(v, torch.nn.Parameter)},
    )


@dataclass
class _Filled:
    """The replacement's tensors by global key, the original keys each was made from, and the
    conversions that made them."""

    values: dict[str, torch.Tensor]
    sources: dict[str, tuple[str, ...]]
    records: list[ConversionRecord] = field(default_factory=list)
    groups: list[Group] = field(default_factory=list)
    method: Any = None  # the function that made them (to convert optimizer state the same way)


def _fill(model: torch.nn.Module, target: _Target, built: torch.nn.Module) -> _Filled:
    prefix = target.path + "."
    wanted = {prefix + k: v.shape for k, v in raw_state(built).items()}
    live = {prefix + k: v.detach() for k, v in raw_state(target.original).items()}
    failures: list[str] = []
    for source_of in (_as_is, _registered, _from_checkpoint_layout):
        attempt = source_of(model, target, live, wanted)
        if attempt is None:
            continue
        problem = _coverage_problem(attempt.values, wanted)
        if problem is None:
            attempt.method = source_of
            return attempt
        failures.append(problem)
    raise ConversionError(
        f"Cannot carry the weights of `{target.path}` (`{type(target.original).__qualname__}`) into "
        f"`{target.replacement_cls.__qualname__}` (key `{target.key}`): {failures[-1]} Register a checkpoint "
        "conversion for this model (`register_checkpoint_conversion_mapping`) or pass `conversions=`. "
        "The model was left unchanged."
    )


def _as_is(
    model: torch.nn.Module, target: _Target, live: dict[Any, Any], wanted: dict[Any, Any]
) -> _Filled | None:
    return _Filled(dict(live), {k: (k,) for k in live})


def _registered(
    model: torch.nn.Module, target: _Target, live: dict[Any, Any], wanted: dict[Any, Any]
) -> _Filled | None:
    if target.scope is None or not target.scope.converters:
        return None
    return _convert(target.scope, target.path, live, wanted)


def _from_checkpoint_layout(
    model: torch.nn.Module, target: _Target, live: dict[Any, Any], wanted: dict[Any, Any]
) -> _Filled | None:
    """Undo transformers' own load-time conversion (fused experts), then apply the registered one."""
    checkpoint = _revert_builtin(model, live)
    if checkpoint is None or set(checkpoint) == set(live):
        return None
    origin = _checkpoint_origins(model, live, checkpoint)
    if target.scope is None or not target.scope.converters:
        return _Filled(dict(checkpoint), origin)
    filled = _convert(target.scope, target.path, checkpoint, wanted)
    filled.sources = {
        k: tuple(dict.fromkeys(o for s in srcs for o in origin[s])) for k, srcs in filled.sources.items()
    }
    return filled


def _checkpoint_origins(
    model: torch.nn.Module, live: dict[str, torch.Tensor], checkpoint: dict[str, torch.Tensor]
) -> dict[str, tuple[str, ...]]:
    """The live keys each checkpoint-layout tensor comes from, found by reverting each live tensor
    alone (transformers' revert copies, so storage cannot tell); where that does not say, every
    live tensor of the module (so their states must agree)."""
    found: dict[str, list[str]] = {}
    for key in live:
        try:
            alone = _revert_builtin(model, {key: live[key]}) or {}
        except Exception:  # a reverse that needs other tensors too: no answer from this one
            alone = {}
        for made in alone:
            if made in checkpoint:
                found.setdefault(made, []).append(key)
    return {key: tuple(found.get(key) or live) for key in checkpoint}


def _revert_builtin(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    return _compat.revert_builtin_conversion(model, state)


def _convert(
    scope: Scope, path: str, source: dict[str, torch.Tensor], wanted: dict[str, torch.Size]
) -> _Filled:
    # Planned on keys local to the scope, as a load plans them; run and recorded on global keys.
    plan = plan_groups(
        list(scope.converters),
        {scope.local(k): v for k, v in wanted.items()},
        {scope.local(k): v.shape for k, v in source.items()},
        strict_sources=False,
    )
    filled = _Filled({}, {})
    consumed: set[str] = set()
    for group in map(scope.glob_group, plan.groups):
        # Tensors of several dtypes or devices cannot become one exactly: refuse before converting.
        local = {_local(path, k): source[k] for k in group.flat_sources}
        same_dtype_and_device(path, _local(path, group.flat_targets[0]), local)
        tensors = [[source[k] for k in keys] for keys in group.sources]
        shapes = [[wanted[k] for k in keys] for keys in group.targets]
        out = run_convert(group, tensors, shapes)
        for keys, produced in zip(group.targets, out):
            filled.values.update(zip(keys, produced))
            filled.sources.update((k, tuple(group.flat_sources)) for k in keys)
        consumed.update(group.flat_sources)
        filled.groups.append(group)
        filled.records.append(
            ConversionRecord(
                repr(group.converter), tuple(group.flat_sources), tuple(group.flat_targets), "graft"
            )
        )
    for key, tensor in source.items():
        if key not in consumed and key not in filled.values:
            filled.values[key] = tensor
            filled.sources[key] = (key,)
    return filled


def _local(path: str, key: str) -> str:
    """``key`` relative to the module at ``path`` (as it is when it lies elsewhere: a checkpoint key)."""
    return key[len(path) + 1 :] if key.startswith(path + ".") else key


def _coverage_problem(values: dict[str, torch.Tensor], wanted: dict[str, torch.Size]) -> str | None:
    missing = [k for k in wanted if k not in values]
    if missing:
        return (
            f"no weight fills `{missing[0]}`"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            + "."
        )
    for key, shape in wanted.items():
        if tuple(values[key].shape) != tuple(shape):
            return f"`{key}` expects shape {tuple(shape)} but received {tuple(values[key].shape)}."
    dropped = [k for k in values if k not in wanted]
    if dropped:
        return f"the original weight `{dropped[0]}` has no place in the replacement ({len(dropped)} such)."
    return None


# ---- step 3: swap (nothing here can fail) ---------------------------------------------------------
def _swap_in(model: torch.nn.Module, targets: list[_Target]) -> None:
    for target in targets:
        parent_path, _, name = target.path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        # setattr on an nn.Module (ModuleList included) replaces the registered child in place.
        setattr(parent, name, target.built)
        move_hooks(target.hooks)
