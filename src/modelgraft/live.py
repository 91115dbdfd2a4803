"""Graft a model that is already built and loaded: :func:`graft_model`.

Load-time patching decides which classes a model is built from. :func:`graft_model` does the same
to a model that already exists, in place, and carries its loaded weights across:

1. *Which modules, built how.* The model is rebuilt on the meta device under the patches, exactly
   as ``from_pretrained`` would build it, with each replacement class wrapped so that it records
   the constructor arguments it received (``config``, ``layer_idx``, ...). Every outermost module
   that came out replaced is a target. A model that cannot be rebuilt from its config (a plain
   ``nn.Module``) falls back to matching class names and recovering the constructor arguments
   from the module's attributes of the same names.
2. *Build everything first.* Each replacement is constructed on the original module's device,
   cast to its dtype, given its train/eval mode, and filled from the original's state dict:
   unchanged when the layouts agree; otherwise through the registered checkpoint conversions,
   starting from the checkpoint layout (transformers' own load-time conversion undone first when
   the live layout differs from the checkpoint's). A parameter nothing fills, or an original
   weight nothing takes, is an error.
3. *Then swap.* Only when every replacement is ready are they put into their parents, so a
   failure leaves the model exactly as it was.

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
from modelgraft.conversion import rules
from modelgraft.conversion._plan import plan_groups, run_convert
from modelgraft.errors import ConversionError, GraftError
from modelgraft.registry import Snapshot
from modelgraft.report import ConversionRecord, ReplacedModule, _report_for

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


def graft_model(
    model: torch.nn.Module,
    mapping: Mapping[str, type[torch.nn.Module]] | Any | None = None,
    conversions: Mapping[str, Sequence[Any]] | None = None,
) -> torch.nn.Module:
    """Replace, in place, the modules of a built model whose classes the patches replace.

    Args:
        model: a built (usually loaded) model; a ``PreTrainedModel`` or any ``nn.Module``.
        mapping: patch mapping to apply, as for ``register_patch_mapping``, or a ready-made graft
            (``modelgraft.grafts.fused_qkv("llama")``: its mapping and conversions). ``None`` uses
            what is registered (and any active ``patched(...)`` scope).
        conversions: ``{model_type_or_class_name: [WeightConverter, ...]}`` used on top of the
            registered conversions to carry weights into replacements with another layout.

    Returns:
        ``model`` itself; :func:`modelgraft.report` lists the replaced modules and conversions.

    Raises:
        ConversionError: a replacement parameter that no weight of the original fills, or an
            original weight that nothing in the replacement takes (the model is unchanged).
        GraftError: a replacement could not be constructed (the model is unchanged).
    """
    if mapping is not None and not isinstance(mapping, Mapping) and hasattr(mapping, "mapping"):
        bundle = mapping  # a ready-made graft: its mapping plus its conversions
        mapping = bundle.mapping
        if conversions is None:
            conversions = getattr(bundle, "conversions", None)
    with _scope(mapping, conversions) as snap:
        rep = _report_for(model)
        if not snap:
            return model
        targets = _plan_targets(model, snap)
        for target in targets:  # build and fill everything before touching the model
            _build(model, target, snap)
        _swap_in(model, targets)
    used = {t.key for t in targets}
    rep.replaced.extend(
        ReplacedModule(t.path, _qualname(type(t.original)), _qualname(t.replacement_cls), t.key)
        for t in targets
    )
    rep.conversions.extend(r for t in targets for r in t.records)
    if mapping is not None:
        rep.unmatched_keys.extend(k for k in mapping if k not in used and k not in rep.unmatched_keys)
    if targets:
        recorders.patch_output_recorders(
            model, replacements={type(t.original): t.replacement_cls for t in targets}
        )
    return model


@contextlib.contextmanager
def _scope(
    mapping: Mapping[str, type[torch.nn.Module]] | None, conversions: Mapping[str, Sequence[Any]] | None
) -> Iterator[Snapshot]:
    with contextlib.ExitStack() as stack:
        if conversions is not None:
            stack.enter_context(rules.scoped_conversions(conversions))
        snap = stack.enter_context(registry.scoped(mapping)) if mapping is not None else registry.snapshot()
        # One snapshot for the whole graft: its conversion lookups read it, not the live registry.
        yield stack.enter_context(registry.pinned(snap))


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


def _recording(cls: type) -> type:
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
        with _compat.meta_device():
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


def _ctor_args_from_attributes(module: torch.nn.Module, replacement: type) -> tuple[tuple, dict[str, Any]]:
    """Recover the original constructor's arguments from attributes named like its parameters."""
    signature = inspect.signature(type(module).__init__)
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
    tensors = [*original.parameters(), *original.buffers()]
    device = tensors[0].device if tensors else torch.device("cpu")
    floating = [p.dtype for p in original.parameters() if p.is_floating_point()]
    try:
        # Same patches as at load time, so replacements nested inside this one are swapped too.
        with swap.LOCK, swap.Swap(snap, (type(model),)), torch.device(device):
            built = target.replacement_cls(*target.args, **target.kwargs)
    except Exception as exc:
        raise GraftError(
            f"Building `{target.replacement_cls.__name__}` for `{target.path}` (key `{target.key}`) failed: "
            f"{type(exc).__name__}: {exc}. The model was left unchanged."
        ) from exc
    if floating:
        for p in built.parameters():
            if p.is_floating_point():
                p.data = p.data.to(floating[0])
    built.train(original.training)
    if device.type != "meta":
        _fill(model, target, built)
    if tensors and not any(p.requires_grad for p in original.parameters()):
        built.requires_grad_(False)
    target.built = built


def _fill(model: torch.nn.Module, target: _Target, built: torch.nn.Module) -> None:
    prefix = target.path + "."
    wanted = {prefix + k: v.shape for k, v in built.state_dict().items()}
    live = {prefix + k: v for k, v in target.original.state_dict().items()}
    failures: list[str] = []
    for source_of in (_as_is, _registered, _from_checkpoint_layout):
        attempt = source_of(model, target, live, wanted)
        if attempt is None:
            continue
        values, records = attempt
        problem = _coverage_problem(values, wanted)
        if problem is None:
            with torch.no_grad():
                built.load_state_dict({k[len(prefix) :]: v for k, v in values.items()}, strict=True)
            target.records = records
            return
        failures.append(problem)
    raise ConversionError(
        f"Cannot carry the weights of `{target.path}` (`{type(target.original).__qualname__}`) into "
        f"`{target.replacement_cls.__qualname__}` (key `{target.key}`): {failures[-1]} Register a checkpoint "
        "conversion for this model (`register_checkpoint_conversion_mapping`) or pass `conversions=`. "
        "The model was left unchanged."
    )


_Attempt = tuple[dict[str, torch.Tensor], list[ConversionRecord]] | None


def _as_is(model: torch.nn.Module, target: _Target, live: dict, wanted: dict) -> _Attempt:
    return dict(live), []


def _registered(model: torch.nn.Module, target: _Target, live: dict, wanted: dict) -> _Attempt:
    converters = _converters_for(model, target.path)
    if not converters:
        return None
    return _convert(converters, live, wanted)


def _from_checkpoint_layout(model: torch.nn.Module, target: _Target, live: dict, wanted: dict) -> _Attempt:
    """Undo transformers' own load-time conversion (fused experts), then apply the registered one."""
    checkpoint = _revert_builtin(model, live)
    if checkpoint is None or set(checkpoint) == set(live):
        return None
    converters = _converters_for(model, target.path)
    if not converters:
        return dict(checkpoint), []
    return _convert(converters, checkpoint, wanted)


def _revert_builtin(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    try:
        from transformers.core_model_loading import revert_weight_conversion
        from transformers.modeling_utils import PreTrainedModel
    except ImportError:  # transformers 4.x: the live layout is the checkpoint layout
        return None
    if not isinstance(model, PreTrainedModel):
        return None
    return revert_weight_conversion(model, dict(state))


def _converters_for(model: torch.nn.Module, path: str) -> list[Any]:
    """The conversion entry that loading would use for the (sub)model enclosing ``path``.

    The enclosing sub-models of the same ``model_type`` (``LlamaModel`` inside ``LlamaForCausalLM``)
    share one entry: a class-name entry of the outermost wins, then of the inner ones, then the
    ``model_type`` entry.
    """
    from transformers import PreTrainedModel

    parts = path.split(".")
    chain = [
        m
        for m in (_get(model, ".".join(parts[:i])) for i in range(len(parts)))
        if isinstance(m, PreTrainedModel)
    ]
    if not chain:
        return []
    model_type = getattr(chain[-1].config, "model_type", None)
    same = [m for m in chain if getattr(m.config, "model_type", None) == model_type]
    for owner in same:
        found = rules.lookup_conversions(type(owner).__name__, None)
        if found:
            return list(found[1])
    found = rules.lookup_conversions("", model_type)
    return list(found[1]) if found else []


def _convert(
    converters: list[Any], source: dict[str, torch.Tensor], wanted: dict[str, torch.Size]
) -> _Attempt:
    plan = plan_groups(converters, wanted, {k: v.shape for k, v in source.items()}, strict_sources=False)
    values: dict[str, torch.Tensor] = {}
    consumed: set[str] = set()
    records = []
    for group in plan.groups:
        tensors = [[source[k] for k in keys] for keys in group.sources]
        shapes = [[wanted[k] for k in keys] for keys in group.targets]
        out = run_convert(group, tensors, shapes)
        for keys, produced in zip(group.targets, out):
            values.update(zip(keys, produced))
        consumed.update(group.flat_sources)
        records.append(
            ConversionRecord(
                repr(group.converter), tuple(group.flat_sources), tuple(group.flat_targets), "graft"
            )
        )
    for key, tensor in source.items():
        if key not in consumed and key not in values:
            values[key] = tensor
    return values, records


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


# ---- step 3: swap ---------------------------------------------------------------------------------
def _swap_in(model: torch.nn.Module, targets: list[_Target]) -> None:
    for target in targets:
        parent_path, _, name = target.path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        # setattr on an nn.Module (ModuleList included) replaces the registered child in place.
        setattr(parent, name, target.built)
