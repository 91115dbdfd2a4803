"""Output recorders that follow replaced classes, per model instance.

transformers captures ``output_attentions``/``output_router_logits``/... with forward hooks placed
on the modules named by ``_can_record_outputs``: a *class* attribute (a dict of output name to a
module class, a class-name string, an ``OutputRecorder`` or a list of those), looked up through
``transformers.utils.output_capturing._CAN_RECORD_REGISTRY`` keyed by ``str(model class)``. When
a recorded class is replaced by one that does not subclass it, the hooks would miss it.

:func:`patch_output_recorders` never touches class-level state: it stores a patched copy of the
dict on the model *instance* (``model._can_record_outputs``), and modelgraft makes the registry
lookup consult the instance first. Every other model keeps the class-level recorders.

Example:
    >>> import torch
    >>> from modelgraft.recorders import patch_output_recorders
    >>> patch_output_recorders(torch.nn.Linear(2, 2))  # nothing to patch on a plain module
    0
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch

from modelgraft import _compat, registry
from modelgraft.registry import Snapshot

__all__ = ["install_instance_lookup", "patch_output_recorders", "uninstall_instance_lookup"]

_ATTR = "_can_record_outputs"


# ---- where transformers reads the recorders: version-specific, in modelgraft._compat ---------------
def install_instance_lookup() -> None:
    """Make transformers' recorder lookup consult the model instance first (idempotent).

    A model whose ``__dict__`` holds ``_can_record_outputs`` then records with that map; see
    :meth:`modelgraft._compat.TransformersLine.recorder_wrappers`. Undone by :func:`uninstall_instance_lookup`.
    """
    _compat.RECORDERS.install(_compat.TRANSFORMERS.recorder_wrappers())


def uninstall_instance_lookup() -> None:
    """Remove what :func:`install_instance_lookup` added."""
    _compat.RECORDERS.uninstall()


# ---- patching -----------------------------------------------------------------------------------
def _patched_spec(
    spec: object, replace: Callable[[type], type | None], by_name: Callable[[str], type | None]
) -> object:
    """Return ``spec`` with recorded classes replaced (a new object; ``spec`` is never mutated).

    As in transformers, a class-name string (or an ``OutputRecorder`` with only a ``class_name``)
    that names a patched class is replaced by the replacement class; other strings stay as they
    are (they match module paths, which a swap does not change).
    """
    if isinstance(spec, list):
        new = [_patched_spec(s, replace, by_name) for s in spec]
        return new if any(a is not b for a, b in zip(new, spec)) else spec
    if isinstance(spec, type):
        return replace(spec) or spec
    if isinstance(spec, str):
        return by_name(spec) or spec
    target = getattr(spec, "target_class", None)
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type) and isinstance(target, type):
        replacement = replace(target)
        if replacement is not None:
            return dataclasses.replace(spec, target_class=replacement)
    name = getattr(spec, "class_name", None)
    # (`spec` is never a class here, as returned above; the isinstance says so to the type checker.)
    if (
        dataclasses.is_dataclass(spec)
        and not isinstance(spec, type)
        and target is None
        and isinstance(name, str)
    ):
        replacement = by_name(name)
        if replacement is not None:
            return dataclasses.replace(spec, target_class=replacement)
    return spec


def patch_output_recorders(
    model: torch.nn.Module,
    *,
    snap: Snapshot | None = None,
    replacements: Mapping[type, type] | None = None,
) -> int:
    """Point the output recorders of ``model`` (and its sub-models) at their replacement classes.

    Args:
        model: a model built under patches (``from_pretrained``/``from_config`` call this for you).
        snap: the mapping to follow; defaults to the current effective mapping.
        replacements: explicit ``{original class: replacement}``; when given, ``snap`` is unused.

    Returns:
        How many sub-models got their own patched recorders.

    Example:
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaModel
        >>> from transformers.models.llama.modeling_llama import LlamaAttention
        >>> class StandaloneAttention(torch.nn.Module):
        ...     pass
        >>> model = LlamaModel(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        ...     num_attention_heads=2, num_key_value_heads=2, vocab_size=32))
        >>> patch_output_recorders(model, replacements={LlamaAttention: StandaloneAttention})
        1
        >>> model._can_record_outputs["attentions"] is StandaloneAttention
        True
        >>> type(model)._can_record_outputs["attentions"] is LlamaAttention
        True
    """
    if replacements is not None:
        by_class = dict(replacements)
        names = {cls.__name__: new for cls, new in by_class.items()}

        def replace(cls: type) -> type | None:
            return by_class.get(cls)

        def by_name(name: str) -> type | None:
            return names.get(name)

    else:
        current = snap or registry.snapshot()
        if not current:
            return 0

        def replace(cls: type) -> type | None:
            found = current.find(cls.__name__)
            return None if found is None or found[1] is cls else found[1]

        def by_name(name: str) -> type | None:
            found = current.find(name)
            return None if found is None else found[1]

    install_instance_lookup()
    patched = 0
    for module in model.modules():
        recorders = getattr(module, _ATTR, None)
        if not isinstance(recorders, Mapping):
            continue
        new = {name: _patched_spec(spec, replace, by_name) for name, spec in recorders.items()}
        if any(new[name] is not spec for name, spec in recorders.items()):
            # An instance attribute: the class-level dict stays as transformers defined it.
            object.__setattr__(module, _ATTR, new)
            _compat.TRANSFORMERS.track_instance_recorders(module)
            patched += 1
    return patched
