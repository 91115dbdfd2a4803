"""Sub-model scopes: which conversion entry applies to which part of a model (one place).

A composite model (a vision-language model, say) holds several transformers sub-models; each may
have its own conversion entry (found by class name, then ``model_type``). :func:`resolve_scopes`
decides, once, which (sub)model each entry covers; the load step, the save step and
``graft_model`` all ask it, and a model remembers its scopes (:class:`ConversionState`, under
:data:`STATE_ATTR`) so that it saves its original layout after the ``patched`` block has ended.

Example:
    >>> import torch
    >>> resolve_scopes(torch.nn.Linear(1, 1))
    []
    >>> Scope("model.language_model", "qwen2", (), "Qwen2Model", "qwen2").local("model.language_model.norm.weight")
    'norm.weight'
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from modelgraft import registry
from modelgraft.conversion._chain import chained_entry
from modelgraft.conversion._plan import Group
from modelgraft.conversion.rules import Conversions

__all__ = ["STATE_ATTR", "ConversionState", "Scope", "remember_conversions", "resolve_scopes", "scope_for"]

STATE_ATTR = "_modelgraft_conversion_state"


@dataclass(frozen=True)
class Scope:
    """A (sub)model with a conversion entry: its module path, the entry's key and converters."""

    path: str
    key: str
    converters: Conversions
    class_name: str
    model_type: str | None
    #: Sub-model paths whose entries (modelgraft's or transformers') are chained into this root
    #: scope's converters, as transformers chains them (see :mod:`modelgraft.conversion._chain`).
    absorbed: tuple[str, ...] = ()

    def owns(self, param: str) -> bool:
        return not self.path or param.startswith(self.path + ".")

    def local(self, param: str) -> str:
        return param[len(self.path) + 1 :] if self.path else param

    def glob(self, local: str) -> str:
        return f"{self.path}.{local}" if self.path else local

    def glob_group(self, group: Group) -> Group:
        """``group`` (planned on keys local to this scope) with global keys."""
        if not self.path:
            return group
        return Group(
            group.converter,
            tuple(tuple(map(self.glob, keys)) for keys in group.sources),
            tuple(tuple(map(self.glob, keys)) for keys in group.targets),
            group.source_shapes,
        )


@dataclass
class ConversionState:
    """What a model needs to write its original layout: its scopes and the groups that ran on load."""

    scopes: list[Scope]
    groups: list[Group] = field(default_factory=list)
    loaded: bool = False
    #: The checkpoint key each source of a load group was read from (transformers may have renamed
    #: it before modelgraft planned the group).
    checkpoint_keys: dict[str, str] = field(default_factory=dict)
    #: Sources of load groups planned on checkpoint keys (an entry with transformers' semantics at
    #: the root): a save writes them under these names, and transformers' own reverse must not
    #: rename them again (its renamings need not be invertible: llava's ``lm_head``).
    checkpoint_space: set[str] = field(default_factory=set)


def _is_pretrained(module: torch.nn.Module) -> bool:
    return hasattr(module, "config") and hasattr(module, "base_model_prefix")


def resolve_scopes(model: torch.nn.Module) -> list[Scope]:
    """Find the conversion entry of the model and each sub-model (class name before ``model_type``).

    A sub-model of the same ``model_type`` as an enclosing scope (``XModel`` inside ``XForY``) is
    covered by it unless it has an entry under its own class name; a sub-model of another type
    (the text or vision part of a composite model) gets its own scope, owning the keys under it.
    """
    snap = registry.current()
    if not snap.conversions:
        return []
    scopes: list[Scope] = []
    for path, module in model.named_modules():
        if not _is_pretrained(module):
            continue
        model_type = getattr(module.config, "model_type", None)
        found = snap.lookup_conversions(type(module).__name__, model_type)
        if found is None:
            continue
        key, converters = found
        enclosing = [s for s in scopes if not s.path or path.startswith(s.path + ".")]
        # `XModel` inside `XForY` is the same model: the entry chosen for the outer one covers it,
        # unless the inner one has an entry under its own class name.
        same_model = any(s.model_type == model_type for s in enclosing) and key != type(module).__name__
        if same_model or (enclosing and enclosing[-1].converters == converters):
            continue
        scopes.append(Scope(path, key, converters, type(module).__name__, model_type))
    if scopes and not scopes[0].path:
        chain = chained_entry(model, snap)
        if chain is not None:
            root = scopes[0]
            return [Scope("", root.key, chain[0], root.class_name, root.model_type, chain[1])]
    return scopes


def remember_conversions(model: torch.nn.Module) -> ConversionState | None:
    """Attach the conversion entries visible now to ``model``, so that it saves its original
    layout later, after a ``patched(...)`` block has ended (a no-op when no entry applies)."""
    scopes = resolve_scopes(model)
    if not scopes:
        return None
    state = model.__dict__.get(STATE_ATTR)
    if state is None or state.scopes != scopes:
        state = ConversionState(scopes=scopes, groups=list(state.groups) if state is not None else [])
        object.__setattr__(model, STATE_ATTR, state)
    return state


def scope_for(scopes: Sequence[Scope], param: str) -> Scope | None:
    """The deepest scope owning ``param``."""
    best = None
    for s in scopes:
        if s.owns(param) and (best is None or len(s.path) > len(best.path)):
            best = s
    return best
