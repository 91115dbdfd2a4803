"""What modelgraft did to a model: :class:`GraftReport` and :func:`report`.

Every grafted model carries its own report on the instance (``model._modelgraft_report``);
other parts of modelgraft append to it through :func:`report_for`. The load hooks fill
``replaced``/``unmatched_keys``/``dropped_checkpoint_keys``/``randomly_initialised``/
``unloaded_parameters``; the conversion engine fills ``conversions``.

Example:
    >>> import torch
    >>> from modelgraft.report import report
    >>> report(torch.nn.Linear(2, 2)).replaced
    []
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Literal, cast, overload

import torch

from modelgraft.errors import StrictModeError

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
    # parameters the checkpoint did not fill: the weight init filled them (randomly) ...
    randomly_initialised: list[str] = field(default_factory=list)
    # ... or nothing did (they hold uninitialised memory)
    unloaded_parameters: list[str] = field(default_factory=list)
    # module path -> checkpoint keys under that path that nothing in the model could take
    dropped_checkpoint_keys: dict[str, list[str]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    # what the caller should know that is not an error (a graft that a replaced forward bypasses)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing strict mode would reject was found."""
        return not (
            self.problems
            or self.randomly_initialised
            or self.unloaded_parameters
            or self.dropped_checkpoint_keys
        )

    @property
    def not_loaded(self) -> list[str]:
        """Every parameter that the checkpoint did not fill in this load, sorted.

        Example:
            >>> GraftReport(randomly_initialised=["b"], unloaded_parameters=["a"]).not_loaded
            ['a', 'b']
        """
        return sorted({*self.randomly_initialised, *self.unloaded_parameters})

    def summary(self) -> str:
        """Return the report as readable lines (the demo prints this).

        Example:
            >>> print(GraftReport(model_class="LlamaForCausalLM").summary())
            GraftReport for LlamaForCausalLM: 0 module(s) replaced
        """
        lines = [f"GraftReport for {self.model_class}: {len(self.replaced)} module(s) replaced"]
        lines += [f"  {r.path}: {r.original} -> {r.replacement} (key `{r.key}`)" for r in self.replaced]
        if self.unmatched_keys:
            lines.append(f"  keys that matched nothing in this load: {self.unmatched_keys}")
        if self.conversions:
            lines.append(f"  conversions: {len(self.conversions)}")
        if self.randomly_initialised:
            lines.append(
                f"  randomly initialised parameters (not in the checkpoint): {self.randomly_initialised}"
            )
        if self.unloaded_parameters:
            lines.append(f"  uninitialised parameters: {self.unloaded_parameters}")
        for path, keys in self.dropped_checkpoint_keys.items():
            lines.append(f"  dropped checkpoint keys under `{path}`: {keys}")
        lines += [f"  problem: {p}" for p in self.problems]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


@overload
def report_for(model: torch.nn.Module, create: Literal[True] = True) -> GraftReport: ...
@overload
def report_for(model: torch.nn.Module, create: bool) -> GraftReport | None: ...
def report_for(model: torch.nn.Module, create: bool = True) -> GraftReport | None:
    """Return the report attached to ``model`` (creating an empty one when asked)."""
    existing = model.__dict__.get(_ATTR)
    if existing is None and create:
        existing = GraftReport(model_class=type(model).__qualname__)
        # object.__setattr__ keeps nn.Module from treating the report as state.
        object.__setattr__(model, _ATTR, existing)
    return existing


def report(model: torch.nn.Module) -> GraftReport:
    """Return what was grafted into ``model`` (an empty report for an untouched model).

    A note says when a graft that works through the model's own ``forward`` (the chunked LM
    loss) is bypassed right now because ``forward`` was replaced on the instance.
    """
    found = report_for(model, create=False)
    if found is None:
        return GraftReport(model_class=type(model).__qualname__)
    found.notes[:] = [n for n in found.notes if not n.startswith(_BYPASS)]
    note = _forward_bypass(model)
    if note is not None:
        found.notes.append(note)
    return found


_BYPASS = "chunked_lm_loss is bypassed"


def _defined_at(function: Any) -> str:
    """Where a function was written: its code's names, not those ``functools.wraps`` copied onto it."""
    code = getattr(function, "__code__", None)
    module = getattr(function, "__globals__", {}).get("__name__", getattr(function, "__module__", "?"))
    name = getattr(code, "co_qualname", None) or getattr(function, "__qualname__", type(function).__name__)
    return f"{module}.{name}"


def _forward_bypass(model: torch.nn.Module) -> str | None:
    """The note for a chunked-loss model whose ``forward`` is replaced on the instance (TRL's fused
    LM head does that), or ``None``."""
    replacement = model.__dict__.get("forward")
    if replacement is None or getattr(type(model), "_modelgraft_chunk_size", False) is False:
        return None
    where = _defined_at(getattr(replacement, "__func__", replacement))
    return (
        f"{_BYPASS} where the replaced `forward` computes the loss itself: `{type(model).__name__}.forward` is "
        f"replaced on this model by `{where}` (TRL's `add_fused_lm_head` does that: its `fused_lm_head=True` path "
        "computes log-probabilities in chunks itself); calls it passes on to the original forward still use the "
        "chunked loss"
    )


# ---- diagnostics --------------------------------------------------------------------------------
def _owner(key: str, paths: list[str]) -> str | None:
    """The deepest replaced module path that ``key`` (a parameter or checkpoint key) lies under."""
    best = None
    for path in paths:
        if path and key.startswith(path + ".") and (best is None or len(path) > len(best)):
            best = path
    return best


def _nearest_pretrained(model: torch.nn.Module, path: str) -> torch.nn.Module:
    """The closest ancestor of ``path`` that has ``_init_weights`` (the sub-model that would init it)."""
    parts = path.split(".")
    for i in range(len(parts), -1, -1):
        module = model.get_submodule(".".join(parts[:i]))
        if hasattr(module, "_init_weights"):
            return module
    return model


def _init_fills(model: torch.nn.Module, param_name: str, cache: dict[tuple[type, str, type], bool]) -> bool:
    """Whether the model's weight init writes ``param_name`` (probed on a NaN-filled copy of its owner).

    The verdict depends on the owner's class and the sub-model's init, so it is probed once per
    ``(owner class, parameter name)`` and cached in ``cache`` for the rest of the load.
    """
    owner_path, _, leaf = param_name.rpartition(".")
    owner = model.get_submodule(owner_path)
    param = owner._parameters.get(leaf)
    if param is None or not param.is_floating_point() or param.device.type == "meta":
        return True  # buffers, integer or offloaded tensors: nothing we can probe honestly
    initializer = _nearest_pretrained(model, owner_path)
    cache_key = (type(owner), leaf, type(initializer))
    if cache_key in cache:
        return cache[cache_key]
    with torch.no_grad():
        try:
            probe = copy.deepcopy(owner)  # the init may write children too: never probe the real module
            for tensor in probe.parameters(recurse=False):
                # Only floating tensors can hold the NaN marker; the owner's integer placeholders
                # (a quantizer's packed weights, int32) keep their values: only `leaf` is judged.
                if tensor.is_floating_point():
                    tensor.fill_(float("nan"))
                tensor.__dict__.pop("_is_hf_initialized", None)
            probe.__dict__.pop("_is_hf_initialized", None)
            cast(Any, initializer)._init_weights(probe)  # a PreTrainedModel method, untyped on Module
            probed = probe._parameters[leaf]
            assert probed is not None  # the leaf was a parameter of the original owner
            filled = not bool(torch.isnan(probed).all())
        except Exception:  # a module that cannot be copied or probed, or an init that cannot handle it,
            filled = False  # is not known to be filled: reported as holding uninitialised memory
    cache[cache_key] = filled
    return filled


def _resolve(qualified: str) -> type | None:
    """The class named ``module.Qualname``, looked up in loaded modules only (nothing is imported)."""
    for cut in range(qualified.count("."), 0, -1):
        parts = qualified.split(".")
        module = sys.modules.get(".".join(parts[:cut]))
        if module is not None:
            obj: object = module
            for attr in parts[cut:]:
                obj = getattr(obj, attr, None)
            return obj if isinstance(obj, type) else None
    return None


def _narrow(model: torch.nn.Module, replaced: ReplacedModule, children: set[str]) -> ReplacedModule:
    """Pick, among ambiguous originals, the one whose instances have the dropped ``children``.

    Each candidate is built on the meta device from the config of the sub-model holding it; only
    reached when weights were dropped, so the cost stays off the normal load path.
    """
    candidates = replaced.original.split(" | ")
    if len(candidates) == 1:
        return replaced
    config = getattr(_nearest_pretrained(model, replaced.path), "config", None)
    fitting = []
    for name in candidates:
        cls = _resolve(name)
        try:
            with torch.device("meta"):
                instance = cls(config)  # type: ignore[misc]
        except Exception:  # a signature we cannot satisfy: keep the candidate out of the verdict
            continue
        if children <= {child for child, _ in instance.named_children()}:
            fitting.append(name)
    if len(fitting) != 1:
        return replaced
    return dataclasses.replace(replaced, original=fitting[0])


def _short(qualified: str) -> str:
    return " | ".join(name.rpartition(".")[2] for name in qualified.split(" | "))


def diagnose_load(
    model: torch.nn.Module,
    rep: GraftReport,
    loading_info: dict[Any, Any] | None,
    scoped_keys: tuple[str, ...] = (),
) -> None:
    """Fill ``rep`` with what the replacements broke in this load.

    ``rep.replaced`` and ``rep.unmatched_keys`` must be filled already. With ``loading_info``
    (``from_pretrained``'s ``missing_keys``/``unexpected_keys``): checkpoint keys under a replaced
    module that the replacement could not take (the BERT ``.*Attention`` trap), and every parameter
    missing from the checkpoint, split into randomly initialised ones (``randomly_initialised``)
    and ones neither the checkpoint nor the weight init fills (``unloaded_parameters``); both are
    problems. Called for loads modelgraft takes part in (a class replaced or a conversion registered).
    ``scoped_keys`` (keys of a ``patched`` block, meant for this load) that matched nothing are
    problems too.
    """
    for key in scoped_keys:
        if key in rep.unmatched_keys:
            rep.problems.append(
                f"Scoped patch key `{key}` matched no module of `{rep.model_class}`. Check the class name "
                "(`modelgraft explain <ClassName>`) or drop the key."
            )
    if not loading_info:
        return
    by_path = {r.path: r for r in rep.replaced}
    paths = list(by_path)

    dropped: dict[str, list[str]] = {}
    for key in loading_info.get("unexpected_keys", ()):
        path = _owner(key, paths)
        if path is not None:
            dropped.setdefault(path, []).append(key)
    groups: dict[tuple[str, str, str], list[str]] = {}
    for path, keys in sorted(dropped.items()):
        rep.dropped_checkpoint_keys[path] = sorted(keys)
        r = by_path[path] = _narrow(model, by_path[path], {k[len(path) + 1 :].split(".")[0] for k in keys})
        groups.setdefault((r.original, r.replacement, r.key), []).append(path)
    rep.replaced[:] = [by_path.get(r.path, r) for r in rep.replaced]
    for (original, replacement, key), group in groups.items():
        children = sorted({k[len(p) + 1 :].split(".")[0] for p in group for k in dropped[p]})
        count = sum(len(dropped[p]) for p in group)
        rep.problems.append(
            f"`{_short(original)}` was replaced by `{_short(replacement)}` (key `{key}`) at {len(group)} "
            f"path(s) (first `{group[0]}`), which has no place for the checkpoint's `{'`, `'.join(children)}`: "
            f"{count} checkpoint key(s) could not be loaded (see `dropped_checkpoint_keys`). Use a narrower key "
            "(e.g. `.*SelfAttention$` or an exact class name), or register a conversion."
        )

    _diagnose_missing(model, rep, loading_info, paths)


def _diagnose_missing(
    model: torch.nn.Module, rep: GraftReport, loading_info: dict[Any, Any], paths: list[str]
) -> None:
    """Sort every parameter the checkpoint did not fill into ``randomly_initialised`` (the weight init
    filled it) or ``unloaded_parameters`` (nothing did), with one problem sentence per kind.

    Every one is reported, not only those under replaced modules: a conversion taking part in the
    load can leave an unreplaced parameter without its checkpoint keys too. Buffers are reported
    only under replaced modules (transformers recomputes the others).
    """
    parameters = {name for name, _ in model.named_parameters()}
    random_init, in_replaced = [], 0
    probed: dict[tuple[type, str, type], bool] = {}
    for name in sorted(loading_info.get("missing_keys", ())):
        under_replaced = _owner(name, paths) is not None
        if name not in parameters and not under_replaced:
            continue
        if _init_fills(model, name, probed):
            random_init.append(name)
            in_replaced += under_replaced
        else:
            rep.unloaded_parameters.append(name)
    rep.randomly_initialised.extend(random_init)
    if random_init:
        where = "of replaced modules " if in_replaced == len(random_init) else ""
        rep.problems.append(
            f"{len(random_init)} parameter(s) {where}are not in the checkpoint and were randomly "
            f"initialised: `{'`, `'.join(random_init[:6])}`{' ...' if len(random_init) > 6 else ''}. Register a "
            "conversion that produces them, or keep the original parameter names (see `report().not_loaded`)."
        )
    if rep.unloaded_parameters:
        rep.problems.append(
            f"{len(rep.unloaded_parameters)} parameter(s) were filled neither from the checkpoint nor by the "
            f"weight init and hold uninitialised memory: `{'`, `'.join(rep.unloaded_parameters[:6])}`. "
            "Initialise them in the replacement (an `_init_weights`-friendly submodule such as `nn.Linear`), "
            "or load them from the checkpoint through a conversion."
        )


def strict_requested() -> bool:
    """Whether ``MODELGRAFT_STRICT`` asks for strict mode (``1``, ``true``, ``yes``).

    Example:
        >>> import os
        >>> os.environ.pop("MODELGRAFT_STRICT", None) and None
        >>> strict_requested()
        False
    """
    return os.environ.get("MODELGRAFT_STRICT", "").strip().lower() in {"1", "true", "yes", "on"}


def check_strict(model: torch.nn.Module) -> None:
    """Raise :class:`StrictModeError` when the report of ``model`` lists a problem.

    Example:
        >>> import torch
        >>> check_strict(torch.nn.Linear(2, 2))  # no report, nothing to reject
    """
    rep = report_for(model, create=False)
    if rep is None or rep.ok:
        return
    details = list(rep.problems)
    if rep.unloaded_parameters and not any("uninitialised" in p for p in details):
        details.append(f"uninitialised parameters: {rep.unloaded_parameters}")
    if rep.dropped_checkpoint_keys and not details:
        details.append(f"dropped checkpoint keys: {rep.dropped_checkpoint_keys}")
    raise StrictModeError(
        f"Strict mode: loading `{rep.model_class}` found {len(details)} problem(s):\n- "
        + "\n- ".join(details)
        + "\nFix them, or load without `strict=True` / `MODELGRAFT_STRICT=1` and inspect `modelgraft.report(model)`."
    )
