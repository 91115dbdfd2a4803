"""Plan conversion groups for entries that match keys as transformers 5 does.

Used by :func:`modelgraft.conversion._plan.plan_groups` when an entry holds a converter with
transformers' semantics (see :mod:`modelgraft.conversion._hf_patterns`). Every checkpoint key is
renamed as transformers renames it: by each renaming (a converter without operations) in order,
then by at most one converter. Keys that one converter renames to the same name form one group;
its targets are the converter's target patterns around the same prefix and suffix. A key that
only renamings change forms a one-to-one group. Only groups whose every target is a key of the
model are planned.

Example:
    >>> import torch
    >>> from modelgraft.conversion import WeightRenaming
    >>> from modelgraft.conversion._hf_plan import plan_hf_groups
    >>> plan = plan_hf_groups([WeightRenaming("^backbone\\\\.", "model.")], ["model.w"], {"backbone.w": torch.Size([2])})
    >>> [(g.sources, g.targets) for g in plan.groups]
    [((('backbone.w',),), (('model.w',),))]
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from modelgraft.conversion._groups import Group, Plan
from modelgraft.conversion._hf_patterns import HFTargetPattern
from modelgraft.conversion.keys import are_segment_patterns
from modelgraft.conversion.rules import WeightConverter, WeightRenaming
from modelgraft.errors import MissingSourceKeyError

__all__ = ["AS_IS", "natural_key", "plan_hf_groups", "rename_key"]

#: The converter recorded for a checkpoint key loaded under its own name by modelgraft's engine.
AS_IS = WeightRenaming("as_is", "as_is")

#: One key's rename: (new key, source pattern, ``*`` index, prefix, suffix, captured group).
_Found = tuple[str, int, int | None, str, str, str | None]


def natural_key(key: str) -> list[tuple[int, int | str]]:
    """Sort key that orders ``layers.10`` after ``layers.9`` (transformers' checkpoint order)."""
    return [(0, int(p)) if p.isdigit() else (1, p) for p in key.split(".")]


def _rename_plain(conv: WeightConverter, key: str) -> _Found | None:
    """A segment-pattern converter's rename of ``key``: the i-th source becomes the i-th target."""
    assert are_segment_patterns(conv._targets)  # a converter without `_hf`
    for i, pattern in enumerate(conv._sources):
        m = pattern.match(key)
        if m is None:
            continue
        target = conv._targets[min(i, len(conv._targets) - 1) if not conv.operations else 0]
        pre = f"{m.prefix}." if m.prefix else ""
        suf = f".{m.suffix}" if m.suffix else ""
        body = target.text if m.index is None else target.text.replace("*", str(m.index))
        return pre + body + suf, i, m.index, pre, suf, None
    return None


def _rename(conv: WeightConverter, key: str) -> _Found | None:
    custom = getattr(conv, "renamed", None)
    if custom is not None:  # a renaming whose rule is code (LayerPairCollapse, IndexOffsetRenaming)
        new = custom(key)
        return None if new is None else (new, 0, None, "", "", None)
    if not conv._hf:
        return _rename_plain(conv, key)
    matcher = conv._matcher
    assert matcher is not None  # set whenever `_hf` is
    pair = not conv.operations and len(conv._targets) == len(conv._sources)
    found = matcher.rename(key)
    if found is None:
        return None
    if pair and found.source:
        # A renaming with as many targets as sources pairs them (transformers' GroupWeightRename).
        found = matcher.rename(key, target=found.source)
        assert found is not None  # the key matched this source, and the paired target is the same
    return found.key, found.source, found.index, found.prefix, found.suffix, found.captured


def rename_key(
    key: str, renamings: Sequence[WeightConverter], converters: Sequence[WeightConverter]
) -> tuple[str, WeightConverter | None, _Found | None, list[WeightConverter]]:
    """``key`` after every renaming in turn, then at most one converter.

    Returns the new key, the converter that matched (or ``None``) with its match, and the
    renamings that fired.
    """
    fired = []
    for renaming in renamings:
        found = _rename(renaming, key)
        if found is not None:
            key = found[0]
            fired.append(renaming)
    for conv in converters:
        found = _rename(conv, key)
        if found is not None:
            return found[0], conv, found, fired
    return key, None, None, fired


def _guard_seen(renaming: WeightConverter, keys: Sequence[str]) -> bool:
    matcher = renaming._matcher
    assert matcher is not None  # guarded renamings always have transformers' semantics
    for key in keys:
        scoped = matcher._scope(key)
        if scoped is not None and matcher.sources[0].search(scoped[1]) is not None:
            return True
    return False


def _targets_of(conv: WeightConverter, found: _Found, keys: Sequence[str]) -> list[list[str]]:
    _name, _i, _index, prefix, suffix, captured = found
    if not conv._hf:  # a segment-pattern converter in an entry with transformers' semantics
        return [HFTargetPattern(t.text).expand(None, keys, prefix, suffix) for t in conv._targets]
    assert conv._matcher is not None  # set whenever `_hf` is; its targets are `conv._targets`
    return [t.expand(captured, keys, prefix, suffix) for t in conv._matcher.targets]


def _base_adjust(key: str, base: str | None, model_keys: set[str]) -> str:
    """As transformers does after renaming: add or strip ``base`` where that names a model key."""
    if not base or key in model_keys:
        return key
    dotted = base + "."
    if key.startswith(dotted) and key[len(dotted) :] in model_keys:
        return key[len(dotted) :]
    if dotted + key in model_keys:
        return dotted + key
    return key


def _saved_name(key: str, renamed: str, adjusted: str, base: str | None) -> str:
    """``key`` with the base model prefix added or stripped as the load did to its renamed form.

    A save writes what the model's keys reverse to, and transformers never puts back a base
    prefix it stripped (or takes off one it added) on the way in.
    """
    if adjusted == renamed or not base:
        return key
    dotted = f"{base}."
    if adjusted == dotted + renamed:
        return key if key.startswith(dotted) else dotted + key
    if renamed.startswith(dotted) and key.startswith(dotted):
        return key[len(dotted) :]
    return key


def _shift(found: _Found, renamed: str, adjusted: str, base: str | None) -> _Found | None:
    """``found`` with its prefix moved by the base-prefix adjustment of ``renamed`` to ``adjusted``."""
    if adjusted == renamed:
        return found
    _name, i, index, prefix, suffix, captured = found
    dotted = f"{base}."
    if adjusted == dotted + renamed:
        return adjusted, i, index, dotted + prefix, suffix, captured
    if prefix.startswith(dotted):
        return adjusted, i, index, prefix[len(dotted) :], suffix, captured
    return None


def plan_hf_groups(
    converters: Sequence[WeightConverter],
    target_keys: Iterable[str],
    source_shapes: Mapping[str, torch.Size],
    strict_sources: bool = True,
    base_model_prefix: str | None = None,
    unfilled: Collection[str] = (),
) -> Plan:
    """Plan the groups of an entry with transformers' semantics (see the module docstring).

    With ``base_model_prefix``, ``source_shapes`` holds checkpoint keys as they are (not yet moved
    into the model's key space) and, as in transformers, a renamed key gains or loses that prefix
    where this names one of ``target_keys``. A key that no transform changes also forms a group
    when it names a key of ``unfilled`` (what the loader left empty): transformers' engine, which
    no longer holds the entry, may have put that key elsewhere.
    """
    plan = Plan()
    targets = list(target_keys)
    wanted = set(targets)
    convs = [c for c in converters if c.operations]
    keys = sorted(source_shapes, key=natural_key)
    # A guarded group renaming (transformers' GroupWeightRename) acts only where its first source
    # pattern is present: a checkpoint already in the new layout is left as it is.
    renamings = [
        r
        for r in converters
        if not r.operations and (not getattr(r, "guarded", False) or _guard_seen(r, keys))
    ]
    renames = _Renames(renamings, convs, set(targets), base_model_prefix)
    collected = renames.collect(plan, keys, source_shapes, wanted, unfilled)

    def shape_of(key: str) -> torch.Size:
        return torch.Size(source_shapes[plan.read_from.get(key, key)])

    for (position, _renamed), (found, items) in collected.items():
        group = _converter_group(convs[position], found, items, targets, wanted, shape_of, strict_sources)
        if group is None:
            continue
        plan.groups.append(group)
        wanted.difference_update(group.flat_targets)
    return plan


#: The keys one converter renames to one name: (source pattern, ``*`` index, checkpoint key) each.
_Items = list[tuple[int, int | None, str]]


@dataclass(frozen=True)
class _Renames:
    """How transformers renames each checkpoint key of an entry: renamings in turn, at most one
    converter, then the base model prefix added or stripped where that names a model key."""

    renamings: Sequence[WeightConverter]
    converters: Sequence[WeightConverter]
    model_keys: set[str]
    base_model_prefix: str | None

    def collect(
        self,
        plan: Plan,
        keys: Sequence[str],
        source_shapes: Mapping[str, torch.Size],
        wanted: set[str],
        unfilled: Collection[str],
    ) -> dict[tuple[int, str], tuple[_Found, _Items]]:
        """Rename every key (as in transformers, also one that names a model key itself). A key
        only renamings change becomes a one-to-one group of ``plan`` at once; the keys a converter
        renames are returned per (converter position, renamed key), with the first match."""
        base = self.base_model_prefix
        collected: dict[tuple[int, str], tuple[_Found, _Items]] = {}
        for key in keys:
            renamed, conv, found, fired = rename_key(key, self.renamings, self.converters)
            adjusted = _base_adjust(renamed, base, self.model_keys)
            saved = _saved_name(key, renamed, adjusted, base)
            if saved != key:
                plan.read_from[saved] = key
            if conv is None:
                moved = bool(fired) and adjusted != key
                if adjusted in wanted and (moved or adjusted in unfilled):
                    label = fired[0] if fired else AS_IS
                    shapes = [[torch.Size(source_shapes[key])]]
                    plan.groups.append(Group(label, ((saved,),), ((adjusted,),), shapes))
                    wanted.discard(adjusted)
                continue
            assert found is not None  # rename_key returns the match with its converter
            shifted = _shift(found, renamed, adjusted, base)
            if shifted is not None:
                slot = (self.converters.index(conv), adjusted)
                collected.setdefault(slot, (shifted, []))[1].append((shifted[1], shifted[2], saved))
        return collected


def _converter_group(
    conv: WeightConverter,
    found: _Found,
    items: _Items,
    targets: Sequence[str],
    wanted: set[str],
    shape_of: Callable[[str], torch.Size],
    strict_sources: bool,
) -> Group | None:
    """The group of ``conv`` over ``items`` (``shape_of`` a source key gives its shape), or ``None``
    when its targets are not this converter's layout, are already planned, or (without
    ``strict_sources``) a source pattern found no key."""
    target_groups = _targets_of(conv, found, targets)
    if not all(target_groups) or not all(k in wanted for g in target_groups for k in g):
        return None  # not this converter's layout, or already loaded
    per_pattern: list[list[tuple[int, str]]] = [[] for _ in conv._sources]
    for i, index, key in items:
        per_pattern[i].append((-1 if index is None else index, key))
    if any(not p for p in per_pattern):
        if strict_sources:
            absent = [conv.source_patterns[i] for i, p in enumerate(per_pattern) if not p]
            raise MissingSourceKeyError(
                f"Converter {conv!r} needs a checkpoint key for source pattern `{absent[0]}` to build "
                f"`{target_groups[0][0]}`, but the checkpoint holds none. Check the converter's source "
                "patterns against the checkpoint's keys."
            )
        return None
    sources = tuple(tuple(k for _, k in sorted(p, key=lambda x: x[0])) for p in per_pattern)
    shapes = [[shape_of(k) for k in ks] for ks in sources]
    return Group(conv, sources, tuple(tuple(g) for g in target_groups), shapes)
