"""Conversion groups and plans: the values the planners produce and the engine runs.

A *group* is one application of a converter (the ``q_proj``, ``k_proj`` and ``v_proj`` weights of
layer 0 and the ``qkv_proj`` weight they become); a *plan* is the groups that can run, plus the
target keys whose sources are entirely absent. Both planners (segment patterns in ``_plan``,
transformers' semantics in ``_hf_plan``) build them.

Example:
    >>> from modelgraft.conversion import WeightRenaming
    >>> Group(WeightRenaming("a", "b"), (("x.a",),), (("x.b",),)).flat_targets
    ['x.b']
"""

from __future__ import annotations

from dataclasses import dataclass, field

from modelgraft.conversion.ops import ShapeGroups
from modelgraft.conversion.rules import WeightConverter

__all__ = ["Group", "Plan"]


@dataclass(frozen=True)
class Group:
    """One converter application: source keys per source pattern, target keys per target pattern."""

    converter: WeightConverter
    sources: tuple[tuple[str, ...], ...]
    targets: tuple[tuple[str, ...], ...]
    source_shapes: ShapeGroups = field(default_factory=list, compare=False)

    @property
    def flat_sources(self) -> list[str]:
        return [k for keys in self.sources for k in keys]

    @property
    def flat_targets(self) -> list[str]:
        return [k for keys in self.targets for k in keys]


@dataclass
class Plan:
    """Groups that can run, and target keys whose sources are entirely absent."""

    groups: list[Group] = field(default_factory=list)
    unsourced_targets: list[tuple[WeightConverter, str]] = field(default_factory=list)
    #: Source names of groups that differ from the key they are read from (the base model prefix
    #: added or stripped as the load did): name -> key of the planner's ``source_shapes``.
    read_from: dict[str, str] = field(default_factory=dict)
