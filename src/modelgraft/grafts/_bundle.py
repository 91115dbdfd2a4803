"""The :class:`Graft` bundle (patch mapping plus checkpoint conversions) and what grafts share.

A graft is built for a set of model types. For each, it finds the classes to replace by building
the model on the ``meta`` device from :func:`modelgraft.testing.tiny_config` (no memory, no
weights) and looking at its modules, so no family is hand-written; the result is cached.

Example:
    >>> from modelgraft.grafts import fused_qkv
    >>> graft = fused_qkv("llama")
    >>> sorted(graft.mapping)
    ['LlamaAttention']
    >>> graft.conversions["llama"]
    [WeightConverter(['self_attn.q_proj', 'self_attn.k_proj', 'self_attn.v_proj'] -> ['self_attn.qkv_proj'], [Concatenate(dim=0)])]
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from modelgraft import _compat
from modelgraft._forksafe import ForkSafeLock
from modelgraft.errors import GraftConflictError, UnsupportedFamilyError

if TYPE_CHECKING:
    from modelgraft.conversion import WeightConverter

__all__ = ["Graft", "GraftConflictError", "UnsupportedFamilyError", "build_grafted", "graft_built_model"]


@dataclass(frozen=True)
class _Part:
    """What one graft contributes for one model type."""

    mapping: dict[str, type[nn.Module]]
    converters: tuple[Any, ...] = ()
    # Drop transformers' own conversions that merge per-expert weights into 3D tensors.
    drop_expert_merges: bool = False
    # Converters for sub-models of a composite model (Llava's language model and vision tower):
    # ``(sub-model model_type, converter)``; their entries are registered under that model_type,
    # which modelgraft resolves per sub-model, so the composite's own conversions stay untouched.
    sub_model_converters: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class Graft:
    """A ready-made graft: which classes to replace, and how checkpoints convert, per model type.

    Use it globally (:meth:`register` / :meth:`unregister`) or for one block
    (:meth:`applied`, or ``modelgraft.patched(graft.mapping, conversions=graft.conversions)``).
    Grafts add up: ``fused_qkv() + linear_experts()`` replaces both and merges the conversions.

    Attributes:
        name: a short description, for reports and ``repr``.
        model_types: the model types this graft was built for.
    """

    name: str
    model_types: tuple[str, ...]
    _parts: tuple[tuple[str, Callable[[], _Part]], ...] = field(repr=False)

    @classmethod
    def of(
        cls,
        name: str,
        requested: tuple[str, ...],
        default: tuple[str, ...],
        part: Callable[[str], _Part],
    ) -> Graft:
        """Build a graft from a per-model-type ``part`` factory.

        Model types the caller names are checked now (a clear error for one the graft cannot
        handle); the default set is resolved on first use, so importing costs nothing.
        """
        types = tuple(requested) or tuple(default)
        graft = cls(name, types, tuple((t, functools.partial(part, t)) for t in types))
        if requested:
            graft._resolved  # noqa: B018
        return graft

    @functools.cached_property
    def _resolved(self) -> dict[str, list[_Part]]:
        resolved: dict[str, list[_Part]] = {}
        for model_type, make in self._parts:
            resolved.setdefault(model_type, []).append(make())
        return resolved

    @property
    def mapping(self) -> dict[str, type[nn.Module]]:
        """Exact original class name -> replacement class, for ``register_patch_mapping``."""
        merged: dict[str, type[nn.Module]] = {}
        for parts in self._resolved.values():
            for part in parts:
                for key, cls in part.mapping.items():
                    if merged.get(key, cls) is not cls:
                        raise GraftConflictError(
                            f"`{key}` is replaced by both `{merged[key].__qualname__}` and `{cls.__qualname__}`; "
                            "expected one replacement per class. Combine grafts that touch different classes."
                        )
                    merged[key] = cls
        return merged

    @property
    def conversions(self) -> dict[str, list[WeightConverter]]:
        """``model_type`` -> the whole conversion mapping to use for it (built-ins folded in)."""
        out: dict[str, list[WeightConverter]] = {}
        for model_type, parts in self._resolved.items():
            drop = any(p.drop_expert_merges for p in parts)
            converters = list(dict.fromkeys(c for p in parts for c in p.converters))  # a graft added twice
            if converters or drop or not any(p.sub_model_converters for p in parts):
                builtin = [c for c in _builtin_conversions(model_type) if not (drop and _merges_experts(c))]
                # converters before renamings, so a key a graft converts is not renamed first
                merged = builtin + converters
                out[model_type] = [c for c in merged if not _is_renaming(c)] + [
                    c for c in merged if _is_renaming(c)
                ]
            for p in parts:
                for sub_type, converter in p.sub_model_converters:
                    if sub_type not in out:
                        out[sub_type] = list(_builtin_conversions(sub_type))
                    if converter not in out[sub_type]:
                        out[sub_type].append(converter)
        return out

    def __add__(self, other: Graft) -> Graft:
        if not isinstance(other, Graft):
            return NotImplemented
        types = self.model_types + tuple(t for t in other.model_types if t not in self.model_types)
        combined = Graft(f"{self.name} + {other.name}", types, self._parts + other._parts)
        combined.mapping  # noqa: B018  (fail now, not at load time, on conflicting replacements)
        return combined

    def register(self, overwrite: bool = False) -> None:
        """Register the mapping and the conversions globally (all or nothing).

        Args:
            overwrite: replace patch keys and conversion entries already registered in modelgraft.
                transformers' own conversions for these model types are always replaced (the
                graft's conversions already contain what it still needs of them).

        Raises:
            PatchRegistrationError: a class is already patched and ``overwrite`` is false.
            ConversionError: a model type already has a modelgraft conversion and ``overwrite``
                is false.
        """
        from modelgraft import registry
        from modelgraft.conversion.rules import validate_conversions

        conversions = validate_conversions(self.conversions)
        if not overwrite:
            taken = [t for t in conversions if t in registry._global_entries(registry.CONVERSIONS)]
            if taken:
                raise self._taken(taken)
        # One step: a load that starts meanwhile sees the whole graft or none of it.
        registry.register(self.mapping, conversions, overwrite, lambda key, _old: self._taken([key]))

    def _taken(self, model_types: list[str]) -> Exception:
        from modelgraft.errors import ConversionError

        return ConversionError(
            f"Cannot register graft `{self.name}`: modelgraft already has conversions for "
            f"{', '.join(f'`{t}`' for t in model_types)}. Unregister them or pass `overwrite=True`."
        )

    def unregister(self) -> None:
        """Remove what :meth:`register` added (the patch keys and the conversion entries), in one step."""
        from modelgraft import registry
        from modelgraft.conversion.rules import unknown_conversions

        registry.unregister(list(self.mapping), list(self.conversions), unknown_conversions)

    @contextlib.contextmanager
    def applied(self, strict: bool = False) -> Iterator[Graft]:
        """Apply the graft in this thread or task for the ``with`` block only.

        Same as ``modelgraft.patched(graft.mapping, conversions=graft.conversions, strict=strict)``.
        """
        import modelgraft

        with modelgraft.patched(self.mapping, conversions=self.conversions, strict=strict):
            yield self


# --- discovery ------------------------------------------------------------------------------

_META_LOCK = ForkSafeLock()


@functools.cache
def meta_model(model_type: str) -> nn.Module:
    """The base model of ``model_type`` built on the meta device from its tiny config (cached)."""
    from modelgraft.testing import tiny_config

    config = tiny_config(model_type)
    model_class = _compat.auto_model_class("base", config)
    if model_class is None:
        raise UnsupportedFamilyError(
            f"`{model_type}` has no base model class in transformers' `MODEL_MAPPING`; "
            "grafts support model types that `AutoModel` can build."
        )
    with _META_LOCK, _compat.meta_device():
        return model_class(config)


def original_class(cls: type[nn.Module]) -> type[nn.Module]:
    """The transformers class a (possibly already grafted) class stands for."""
    return getattr(cls, "_modelgraft_original", cls)


def find_modules(model_type: str, accept: Callable[[nn.Module], bool]) -> dict[type[nn.Module], set[str]]:
    """Original classes of the modules ``accept`` selects, with the attribute names they sit under."""
    found: dict[type[nn.Module], set[str]] = {}
    for cls, places in find_modules_by_sub_model(model_type, accept).items():
        found[cls] = {attribute for _, attribute in places}
    return found


def find_modules_by_sub_model(
    model_type: str, accept: Callable[[nn.Module], bool]
) -> dict[type[nn.Module], set[tuple[str | None, str]]]:
    """Like :func:`find_modules`, each attribute name paired with the ``model_type`` of the
    sub-model holding it (``None`` for the model itself; Llava's language model is ``llama``)."""
    model = meta_model(model_type)
    sub_models = {
        path: module.config.model_type
        for path, module in model.named_modules()
        if path
        and hasattr(module, "base_model_prefix")
        and hasattr(getattr(module, "config", None), "model_type")
    }
    found: dict[type[nn.Module], set[tuple[str | None, str]]] = {}
    for path, module in model.named_modules():
        if not path or not accept(module):
            continue
        holders = [p for p in sub_models if path.startswith(p + ".")]
        sub_type = sub_models[max(holders, key=len)] if holders else None
        found.setdefault(original_class(type(module)), set()).add((sub_type, path.rsplit(".", 1)[-1]))
    return found


def fused_linears_part(
    model_type: str,
    names: tuple[str, ...],
    fused_name: str,
    make_class: Callable[[type[nn.Module]], type[nn.Module]],
    describe: tuple[str, str, tuple[str, ...]],
) -> _Part:
    """The part of a "fuse these sibling linears" graft for ``model_type``.

    Every module class with fusable ``names`` (see :func:`~modelgraft.grafts._fused.can_fuse_linears`)
    is mapped to ``make_class(cls)``, and each attribute such modules sit under gets one
    ``Concatenate(dim=0)`` converter from ``names`` to ``fused_name``. ``describe`` is
    ``(module kind, graft name, families known to work)`` for the error when nothing fits.
    """
    from modelgraft.conversion import Concatenate, WeightConverter
    from modelgraft.grafts._fused import can_fuse_linears

    found = find_modules_by_sub_model(model_type, lambda module: can_fuse_linears(module, names))
    if not found:
        kind, graft_name, families = describe
        listed = ", ".join(f"`{n}`" for n in names[:-1]) + f" and `{names[-1]}`"
        raise UnsupportedFamilyError(
            f"No {kind} of `{model_type}` has plain {listed} linear layers; the {graft_name} graft "
            f"cannot apply. Families known to work: {', '.join(families)}."
        )
    mapping = {cls.__name__: make_class(cls) for cls in found}
    places = sorted(set().union(*found.values()), key=lambda place: (place[0] or "", place[1]))

    def converter(attribute: str) -> WeightConverter:
        return WeightConverter(
            [f"{attribute}.{n}" for n in names], [f"{attribute}.{fused_name}"], [Concatenate(dim=0)]
        )

    own = tuple(converter(a) for sub_type, a in places if sub_type is None)
    in_sub_models = tuple((sub_type, converter(a)) for sub_type, a in places if sub_type is not None)
    return _Part(mapping, own, sub_model_converters=in_sub_models)


# --- transformers' own conversions, in modelgraft terms ----------------------------------------

_PLAIN_PATTERN = re.compile(r"^[A-Za-z0-9_*]+(\.[A-Za-z0-9_*]+)*$")


@functools.cache
def _builtin_conversions(model_type: str) -> tuple[Any, ...]:
    """transformers' own conversions for ``model_type``, rewritten as modelgraft converters.

    A graft's entry replaces the built-in one for its model type, so it must carry what it still
    needs of it (for example the expert merge of ``qwen2_moe`` when only attention is grafted).
    transformers renames checkpoint keys before its converters see them; modelgraft's converters
    read checkpoint keys as they are, so a renaming that sits right before a converter's pattern
    (Mixtral's ``block_sparse_moe`` -> ``mlp`` before ``experts.*.w1.weight``) is folded into that
    converter, and converters come before renamings so that each parameter is claimed once.
    """
    from modelgraft import _compat
    from modelgraft.conversion import Concatenate, MergeModulelist, WeightConverter, WeightRenaming

    entries = _compat.builtin_checkpoint_conversions(model_type)
    renamings: list[tuple[list[str], list[str]]] = []
    from_regex: list[tuple[str, list[str]]] = []
    converters: list[tuple[list[str], list[str], list[Any]]] = []
    for entry in entries:
        sources = [_plain(p, model_type) for p in entry.source_patterns]
        targets = [_plain(p, model_type) for p in entry.target_patterns]
        if type(entry).__name__ in ("WeightRenaming", "PrefixChange"):
            renamings.append((sources, targets))
            open_ended = [
                p
                for p in entry.source_patterns
                if not _PLAIN_PATTERN.match(p.strip("."))
                and not p.endswith("\\.")
                and not _PREFIX_CAPTURE.match(p)
            ]
            if open_ended:
                from_regex.append((open_ended[0], targets))
            continue
        ops = []
        for op in entry.operations:
            name = type(op).__name__
            if name == "MergeModulelist":
                ops.append(MergeModulelist(dim=op.dim))
            elif name == "Concatenate" and getattr(op, "num_shards_attribute", None) is None:
                ops.append(Concatenate(dim=op.dim))
            else:
                raise UnsupportedFamilyError(
                    f"transformers converts `{model_type}` checkpoints with `{name}`, which grafts cannot "
                    "carry over; expected only renamings, `MergeModulelist` and `Concatenate`."
                )
        converters.append((sources, targets, ops))
    keys = [name for name, _ in meta_model(model_type).named_parameters()] if renamings else []
    # A regular expression that does not end on a `\\.` can match inside a key segment
    # (`\\.hc_pre\\.hc_` renames `hc_pre.hc_fn` to `hc_fn`); as a dotted pattern it would not.
    # Carried over only where its target names whole segments of the model's keys.
    for pattern, targets in from_regex:
        model = meta_model(model_type)
        names = [*keys, *(name for name, _ in model.named_buffers())]
        if not any(_contains(key, t) for key in names for t in targets):
            raise UnsupportedFamilyError(
                f"transformers' conversion for `{model_type}` renames with the regular expression `{pattern}`, "
                f"whose target `{targets[0]}` is not a run of whole key segments of the model; grafts only carry "
                "over renamings of whole segments."
            )
    out: list[Any] = []
    for sources, targets, ops in converters:
        for (old,), (new,) in (r for r in renamings if len(r[0]) == 1 and len(r[1]) == 1):
            if any(_contains(key, f"{new}.{t}") for key in keys for t in targets):
                sources, targets = [f"{old}.{p}" for p in sources], [f"{new}.{p}" for p in targets]
        out.append(WeightConverter(sources, targets, ops))
    # transformers applies every renaming to a key; modelgraft renames a key once. Two renamings
    # that meet in one key (Phi-MoE: `block_sparse_moe.gate.weight` -> `mlp.router.weight`) are
    # composed into one that comes first.
    simple = [(s[0], t[0]) for s, t in renamings if len(s) == 1 and len(t) == 1]
    for old_a, new_a in simple:
        for old_b, new_b in simple:
            if (old_a, new_a) != (old_b, new_b) and any(_contains(k, f"{new_a}.{new_b}") for k in keys):
                out.append(WeightRenaming(f"{old_a}.{old_b}", f"{new_a}.{new_b}"))
    out.extend(WeightRenaming(sources, targets) for sources, targets in renamings)
    return tuple(out)


def _contains(key: str, run: str) -> bool:
    """Whether the dotted ``run`` occurs in ``key`` on segment boundaries."""
    return re.search(rf"(?:^|\.){re.escape(run)}(?:\.|$)", key) is not None


# A regular expression that is only a dotted key (``block_sparse_moe\\.input_linear\\.weight``,
# ``\\.experts\\.``) means the same as that key matched on segment boundaries, which is how
# modelgraft matches; so does a prefix capture (``^model\\.language_model\\.(.+)`` -> ``model.\\1``).
_ESCAPED_DOTTED = re.compile(r"^(?:\\\.)?([A-Za-z0-9_]+(?:\\\.[A-Za-z0-9_]+)*)(?:\\\.)?$")
_PREFIX_CAPTURE = re.compile(r"^\^([A-Za-z0-9_]+(?:\\\.[A-Za-z0-9_]+)*)\\\.\(\.\+\)$")
_PREFIX_TARGET = re.compile(r"^([A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*)\.\\1$")


def _plain(pattern: str, model_type: str) -> str:
    text = pattern.strip(".")
    if _PLAIN_PATTERN.match(text):
        return text
    for form in (_ESCAPED_DOTTED, _PREFIX_CAPTURE, _PREFIX_TARGET):
        found = form.match(pattern)
        if found:
            return found.group(1).replace("\\.", ".")
    raise UnsupportedFamilyError(
        f"transformers' conversion for `{model_type}` uses the regular expression `{pattern}`; "
        "grafts only carry over plain dotted patterns."
    )


def _is_renaming(converter: Any) -> bool:
    return type(converter).__name__ == "WeightRenaming"


def _merges_experts(converter: Any) -> bool:
    return any(type(op).__name__ == "MergeModulelist" for op in converter.operations)


def builtin_expert_names(model_type: str) -> tuple[str, str, str] | None:
    """The checkpoint's per-expert linear names (gate, up, down) read off transformers' merges.

    ``qwen2_moe`` gives ``("gate_proj", "up_proj", "down_proj")``, ``mixtral`` ``("w1", "w3", "w2")``.
    """
    gate_up: list[str] = []
    down: list[str] = []
    for converter in _builtin_conversions(model_type):
        if not _merges_experts(converter):
            continue
        names = []
        for pattern in converter.source_patterns:
            segments = pattern.split(".")
            if "*" not in segments or segments.index("*") + 1 >= len(segments):
                return None
            names.append(segments[segments.index("*") + 1])
        if len(names) == 2:
            gate_up = names
        elif len(names) == 1:
            down = names
    if len(gate_up) != 2 or len(down) != 1:
        return None
    return gate_up[0], gate_up[1], down[0]


# --- grafting modules that are already built (tests, benchmarks) -------------------------------


def graft_built_model(graft: Graft, model: nn.Module) -> int:
    """Replace, in place, every module of ``model`` that ``graft`` maps, keeping its weights.

    Each replacement class knows how to take over a built original (``_from_original``).

    Returns:
        The number of modules replaced.
    """
    mapping = graft.mapping
    replaced = 0
    for path, module in list(model.named_modules()):
        replacement = mapping.get(type(module).__name__)
        if not path or replacement is None or isinstance(module, replacement):
            continue
        new = replacement._from_original(module)
        if new is not module:
            parent_path, _, name = path.rpartition(".")
            setattr(model.get_submodule(parent_path), name, new)
        replaced += 1
    return replaced


def build_grafted(
    graft: Graft, model_class: type[nn.Module], config: Any, state_dict: dict[str, torch.Tensor]
) -> nn.Module:
    """Build ``model_class(config)``, load the original-layout ``state_dict``, then graft it."""
    model = model_class(config)
    model.load_state_dict(state_dict)
    graft_built_model(graft, model)
    return model
