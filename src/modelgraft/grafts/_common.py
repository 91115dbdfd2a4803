"""What the ready-made grafts share: parts per model type, class discovery, built-in conversions.

Each ready-made graft is a :class:`~modelgraft.Graft` built per model type (:meth:`Graft.of
<modelgraft.graft.Graft.of>`): a :class:`_Part` says which classes it replaces there and which
converters it adds. The classes are found by building the model on the ``meta`` device from its
tiny config (no memory, no weights) and looking at its modules, so no family is hand-written; the
result is cached.

Example:
    >>> from modelgraft.grafts import fused_qkv
    >>> graft = fused_qkv("llama")
    >>> sorted(graft.mapping)
    ['LlamaAttention']
    >>> graft.conversions["llama"]
    [WeightConverter(['self_attn.q_proj', 'self_attn.k_proj', 'self_attn.v_proj'] -> ['self_attn.qkv_proj'], [Concatenate(dim=0)])]
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from modelgraft import _compat
from modelgraft._families import tiny_config
from modelgraft._forksafe import ForkSafeLock
from modelgraft.conversion import Concatenate, MergeModulelist, WeightConverter, WeightRenaming
from modelgraft.errors import GraftConflictError, UnsupportedFamilyError
from modelgraft.graft import Graft, Piece

__all__ = ["Graft", "GraftConflictError", "UnsupportedFamilyError"]


@dataclass(frozen=True)
class _Part:
    """What one ready-made graft contributes for one model type (see :meth:`piece`)."""

    mapping: dict[str, type[nn.Module]]
    converters: tuple[Any, ...] = ()
    # Drop transformers' own conversions that merge per-expert weights into 3D tensors.
    drop_expert_merges: bool = False
    # Converters for sub-models of a composite model (Llava's language model and vision tower):
    # ``(sub-model model_type, converter)``; their entries are registered under that model_type,
    # which modelgraft resolves per sub-model, so the composite's own conversions stay untouched.
    sub_model_converters: tuple[tuple[str, Any], ...] = ()

    def piece(self, model_type: str) -> Piece:
        """This part as a :class:`~modelgraft.graft.Piece` of a graft for ``model_type``.

        A modelgraft conversion entry replaces transformers' built-in one, so each entry the part
        touches keeps the built-in converters in front of its own (minus the expert merges when
        asked). A part that only converts inside sub-models leaves the composite's entry alone.
        """
        conversions: dict[str, tuple[Any, ...]] = {}
        kept: list[str] = []
        dropped: list[str] = []
        if self.converters or self.drop_expert_merges or not self.sub_model_converters:
            kept.append(model_type)
            if self.converters:
                conversions[model_type] = tuple(self.converters)
            if self.drop_expert_merges:
                dropped.append(model_type)
        for sub_type, converter in self.sub_model_converters:
            kept.append(sub_type)
            conversions[sub_type] = (*conversions.get(sub_type, ()), converter)
        # Built-ins are read when the conversions are, not when the classes are: a graft's
        # mapping resolves even for a family whose built-in conversion cannot be carried over.
        keeps = _OnUse(kept, _builtin_conversions)
        drops = _OnUse(
            dropped, lambda key: frozenset(c for c in _builtin_conversions(key) if _merges_experts(c))
        )
        return Piece(self.mapping, conversions, keeps, drops)


class _OnUse(Mapping[str, Any]):
    """A mapping with known keys whose values are computed (once) when first read."""

    def __init__(self, keys: list[str], compute: Callable[[str], Any]) -> None:
        self._keys = tuple(dict.fromkeys(keys))
        self._compute = compute

    def __getitem__(self, key: str) -> Any:
        if key not in self._keys:
            raise KeyError(key)
        return self._compute(key)  # both computations are cached per model type

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


# --- discovery ------------------------------------------------------------------------------

_META_LOCK = ForkSafeLock()


@functools.cache
def meta_model(model_type: str) -> nn.Module:
    """The base model of ``model_type`` built on the meta device from its tiny config (cached)."""
    config = tiny_config(model_type)
    model_class = _compat.auto_model_class("base", config)
    if model_class is None:
        raise UnsupportedFamilyError(
            f"`{model_type}` has no base model class in transformers' `MODEL_MAPPING`; "
            "grafts support model types that `AutoModel` can build."
        )
    with _META_LOCK, _compat.TRANSFORMERS.meta_device():
        model: nn.Module = model_class(config)
    return model


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


#: A checkpoint-side rename of transformers' table, as (source patterns, target patterns).
_Renaming = tuple[list[str], list[str]]


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
    renamings: list[_Renaming] = []
    from_regex: list[tuple[str, list[str]]] = []
    converters: list[tuple[list[str], list[str], list[Any]]] = []
    for entry in _compat.builtin_checkpoint_conversions(model_type):
        sources = [_plain(p, model_type) for p in entry.source_patterns]
        targets = [_plain(p, model_type) for p in entry.target_patterns]
        if type(entry).__name__ in ("WeightRenaming", "PrefixChange"):
            renamings.append((sources, targets))
            open_ended = [p for p in entry.source_patterns if _is_open_ended(p)]
            if open_ended:
                from_regex.append((open_ended[0], targets))
            continue
        converters.append((sources, targets, _carried_operations(entry, model_type)))
    keys = [name for name, _ in meta_model(model_type).named_parameters()] if renamings else []
    for pattern, targets in from_regex:
        _check_whole_segments(model_type, pattern, targets, keys)
    out: list[Any] = [_folded(sources, targets, ops, renamings, keys) for sources, targets, ops in converters]
    out.extend(_composed(renamings, keys))
    out.extend(WeightRenaming(sources, targets) for sources, targets in renamings)
    return tuple(out)


def _is_open_ended(pattern: str) -> bool:
    """Whether a renaming's source is a regular expression that can match inside a key segment."""
    return (
        not _PLAIN_PATTERN.match(pattern.strip("."))
        and not pattern.endswith("\\.")
        and not _PREFIX_CAPTURE.match(pattern)
    )


def _carried_operations(entry: Any, model_type: str) -> list[MergeModulelist | Concatenate]:
    """The operations of one of transformers' converters as modelgraft's, or a clear error for one
    that grafts cannot carry over."""
    ops: list[MergeModulelist | Concatenate] = []
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
    return ops


def _check_whole_segments(model_type: str, pattern: str, targets: Sequence[str], keys: Sequence[str]) -> None:
    """A regular expression that does not end on a ``\\.`` can match inside a key segment
    (``\\.hc_pre\\.hc_`` renames ``hc_pre.hc_fn`` to ``hc_fn``); as a dotted pattern it would not.
    It is carried over only where its target names whole segments of the model's keys."""
    model = meta_model(model_type)
    names = [*keys, *(name for name, _ in model.named_buffers())]
    if not any(_contains(key, t) for key in names for t in targets):
        raise UnsupportedFamilyError(
            f"transformers' conversion for `{model_type}` renames with the regular expression `{pattern}`, "
            f"whose target `{targets[0]}` is not a run of whole key segments of the model; grafts only carry "
            "over renamings of whole segments."
        )


def _folded(
    sources: list[str],
    targets: list[str],
    ops: list[Any],
    renamings: Sequence[_Renaming],
    keys: Sequence[str],
) -> WeightConverter:
    """A converter with each one-to-one renaming that sits right before its targets in the model's
    keys folded into its patterns (it then reads the checkpoint keys as they are)."""
    for (old,), (new,) in (r for r in renamings if len(r[0]) == 1 and len(r[1]) == 1):
        if any(_contains(key, f"{new}.{t}") for key in keys for t in targets):
            sources, targets = [f"{old}.{p}" for p in sources], [f"{new}.{p}" for p in targets]
    return WeightConverter(sources, targets, ops)


def _composed(renamings: Sequence[_Renaming], keys: Sequence[str]) -> list[WeightRenaming]:
    """transformers applies every renaming to a key; modelgraft renames a key once. Two renamings
    that meet in one key (Phi-MoE: ``block_sparse_moe.gate.weight`` -> ``mlp.router.weight``) are
    composed into one that comes first."""
    simple = [(s[0], t[0]) for s, t in renamings if len(s) == 1 and len(t) == 1]
    return [
        WeightRenaming(f"{old_a}.{old_b}", f"{new_a}.{new_b}")
        for old_a, new_a in simple
        for old_b, new_b in simple
        if (old_a, new_a) != (old_b, new_b) and any(_contains(k, f"{new_a}.{new_b}") for k in keys)
    ]


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
