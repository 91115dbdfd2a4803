"""Every transformers attribute modelgraft wraps, per feature of the release, in the order it is installed.

:data:`SITES` is the whole list: nothing in modelgraft replaces an attribute of transformers that
is not in it (a test checks that each entry exists on the installed transformers, is wrapped
after ``import modelgraft``, and that no other attribute of these owners is). The sites form four
groups, installed in this order by :func:`modelgraft.hooks.install` and removed in reverse:

1. ``construction``: where transformers constructs a model, so that the class swap is live
   exactly while modules are built. On 4.57 it wraps ``_from_config`` *underneath* the loaders'
   wrapper of the same method (hence first).
2. ``loaders``: ``from_pretrained`` and ``_from_config`` (each load takes one registry snapshot)
   and ``initialize_weights`` (run with the original classes bound).
3. ``recorders``: the lookup of ``_can_record_outputs``, so that a model instance may carry its
   own output recorders.
4. ``conversion``: the load and save steps where the conversion engine fills converted
   parameters and writes the original layout back.

Each group has one :class:`WrapGroup` (a :class:`~modelgraft._compat._wrapping.Wrappers` set):
:data:`CONSTRUCTION`, :data:`LOADERS`, :data:`RECORDERS` and :data:`CONVERSION`. It installs all of
its sites or none, and on removal restores an attribute only where it still holds modelgraft's
wrapper. The wrappers come from the installed transformers line
(:data:`modelgraft._compat.TRANSFORMERS`), except the loaders' (:mod:`modelgraft.hooks`, the same
on both lines): ``CONSTRUCTION.install(TRANSFORMERS.construction_wrappers(step))``.

Example:
    >>> [s.attribute for s in sites("loaders")]
    ['from_pretrained', '_from_config', 'initialize_weights']
    >>> GROUPS
    ('construction', 'loaders', 'recorders', 'conversion')
    >>> import modelgraft  # installs every group
    >>> LOADERS.installed, CONVERSION.group
    (True, 'conversion')
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from modelgraft._compat._features import FEATURES, Features
from modelgraft._compat._wrapping import Make, Restore, Wrappers
from modelgraft.errors import UnsupportedTransformersError

__all__ = [
    "CONSTRUCTION",
    "CONVERSION",
    "GROUPS",
    "LOADERS",
    "RECORDERS",
    "SITES",
    "WHEN",
    "Makers",
    "Site",
    "WrapGroup",
    "owner_of",
    "sites",
]

#: ``{attribute: make}`` (or ``{attribute: (make, restore)}``) for one group's sites; see
#: :meth:`WrapGroup.install`.
Makers = Mapping[str, Make | tuple[Make, Restore]]

#: The groups, in installation order.
GROUPS = ("construction", "loaders", "recorders", "conversion")

_MU = "transformers.modeling_utils"
_PTM = "transformers.modeling_utils.PreTrainedModel"
_GENERIC = "transformers.utils.generic"
_CAPTURING = "transformers.utils.output_capturing"

#: When a site is wrapped: a condition on the release's :class:`~._features.Features` (what the
#: release has, never its version number), by name.
WHEN: dict[str, Callable[[Features], bool]] = {
    "always": lambda f: True,
    "builtin conversion": lambda f: f.builtin_conversion,
    "no builtin conversion": lambda f: not f.builtin_conversion,
    "apply_patches": lambda f: f.construction == "apply_patches",
    "init contexts": lambda f: f.construction == "init_contexts",
    "registry by instance": lambda f: f.recorder_registry == "by_instance",
    "registry by class name in generic": lambda f: (
        f.recorder_registry == "by_class_name" and _GENERIC in f.recorder_holders
    ),
    "registry by class name in output_capturing": lambda f: (
        f.recorder_registry == "by_class_name" and _CAPTURING in f.recorder_holders
    ),
    "registry by class name": lambda f: f.recorder_registry == "by_class_name",
}


@dataclass(frozen=True)
class Site:
    """One transformers attribute that modelgraft replaces.

    Attributes:
        group: one of :data:`GROUPS`.
        owner: dotted path of the object holding the attribute (a module, a class, or an object
            such as a registry).
        attribute: the attribute replaced on ``owner``.
        when: the name of the condition (a key of :data:`WHEN`) under which modelgraft replaces it.
        why: what the wrapper does there.
    """

    group: str
    owner: str
    attribute: str
    when: str
    why: str


SITES: tuple[Site, ...] = (
    # 1. construction
    Site(
        "construction",
        _MU,
        "apply_patches",
        "apply_patches",
        "entered by from_pretrained and _from_config around cls(config)",
    ),
    Site(
        "construction",
        _PTM,
        "get_init_context",
        "init contexts",
        "its contexts surround cls(config) in from_pretrained",
    ),
    Site("construction", _PTM, "_from_config", "init contexts", "calls cls(config) directly; wrapped whole"),
    # 2. loaders
    Site("loaders", _PTM, "from_pretrained", "always", "one registry snapshot per load; report; strict mode"),
    Site(
        "loaders", _PTM, "_from_config", "always", "one registry snapshot per build (AutoModel.from_config)"
    ),
    Site("loaders", _PTM, "initialize_weights", "always", "initialise with the original classes bound"),
    # 3. recorders
    Site(
        "recorders",
        f"{_CAPTURING}._CAN_RECORD_REGISTRY",
        "get",
        "registry by instance",
        "receives the model: an instance's own `_can_record_outputs` comes first",
    ),
    Site(
        "recorders",
        _GENERIC,
        "_CAN_RECORD_REGISTRY",
        "registry by class name in generic",
        "a plain dict read by class name: replaced by one that knows the running instance",
    ),
    Site(
        "recorders",
        _CAPTURING,
        "_CAN_RECORD_REGISTRY",
        "registry by class name in output_capturing",
        "a plain dict read by class name: replaced by one that knows the running instance",
    ),
    Site(
        "recorders",
        _MU,
        "_CAN_RECORD_REGISTRY",
        "registry by class name",
        "the same registry, imported there",
    ),
    # 4. conversion
    Site(
        "conversion",
        _MU,
        "get_model_conversion_mapping",
        "builtin conversion",
        "drop built-in transforms an entry replaces",
    ),
    Site(
        "conversion",
        _MU,
        "revert_weight_conversion",
        "builtin conversion",
        "save: reverse modelgraft's conversions",
    ),
    Site(
        "conversion",
        _MU,
        "_find_missing_and_unexpected_keys",
        "no builtin conversion",
        "fill converted parameters",
    ),
    Site(
        "conversion",
        _PTM,
        "_load_pretrained_model",
        "always",
        "with builtin conversion: fill converted parameters; else share the load",
    ),
    Site(
        "conversion",
        _PTM,
        "_adjust_missing_and_unexpected_keys",
        "no builtin conversion",
        "drop consumed checkpoint keys",
    ),
    Site(
        "conversion", _PTM, "post_init", "always", "remember the conversion entries a model was built under"
    ),
    Site(
        "conversion",
        _PTM,
        "save_pretrained",
        "no builtin conversion",
        "save: reverse modelgraft's conversions",
    ),
)


def sites(group: str | None = None, features: Features = FEATURES) -> list[Site]:
    """The sites of ``group`` (all groups by default) on a release with ``features`` (the
    installed one by default), in installation order.

    Example:
        >>> from dataclasses import replace
        >>> older = replace(FEATURES, construction="init_contexts")
        >>> [s.attribute for s in sites("construction", features=older)]
        ['get_init_context', '_from_config']
    """
    if group is not None and group not in GROUPS:
        raise ValueError(f"unknown wrap group `{group}`; expected one of {GROUPS}")
    return [s for s in SITES if WHEN[s.when](features) and (group is None or s.group == group)]


def owner_of(site: Site) -> Any:
    """The object ``site.owner`` names on the installed transformers (imports its module).

    Example:
        >>> owner_of(sites("loaders")[0]).__name__
        'PreTrainedModel'
    """
    parts = site.owner.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            if not hasattr(found, name):
                raise UnsupportedTransformersError(
                    f"transformers `{FEATURES.release}` has no `{site.owner}` (for `{site.attribute}`: "
                    f"{site.why}); modelgraft cannot hook this release. docs/compat.md lists the supported ones."
                )
            found = getattr(found, name)
        return found
    raise ModuleNotFoundError(f"no module of `{site.owner}` can be imported")


class WrapGroup:
    """The wrappers of one group of :data:`SITES`, installed and removed together (idempotent).

    Example:
        >>> group = WrapGroup("loaders")
        >>> group.installed
        False
    """

    def __init__(self, group: str) -> None:
        self.group = group
        self._sites = sites(group)
        self._wrappers = Wrappers()

    @property
    def installed(self) -> bool:
        return self._wrappers.installed

    def install(self, makers: Makers) -> None:
        """Replace each site of the group by ``makers[attribute]`` (see :meth:`Wrappers.install`).

        ``makers`` must name exactly the group's attributes on the installed transformers; a value
        may be ``(make, restore)``. Nothing happens when the group is installed already.
        """
        if self.installed:
            return
        wanted = {s.attribute for s in self._sites}
        if set(makers) != wanted:
            raise ValueError(
                f"wrap group `{self.group}` has sites {sorted(wanted)} on this transformers; "
                f"received wrappers for {sorted(makers)}"
            )
        steps: list[Any] = []
        for site in self._sites:
            owner = owner_of(site)
            if not hasattr(owner, site.attribute):
                raise UnsupportedTransformersError(
                    f"transformers `{FEATURES.release}` has no `{site.owner}.{site.attribute}` "
                    f"({site.why}); modelgraft cannot hook this release. docs/compat.md lists the supported ones."
                )
            made = makers[site.attribute]
            pair: tuple[Callable[..., Any], ...] = made if isinstance(made, tuple) else (made,)
            steps.append((owner, site.attribute, *pair))
        self._wrappers.install(steps)

    def uninstall(self) -> None:
        """Restore what :meth:`install` replaced (idempotent)."""
        self._wrappers.uninstall()


#: The one wrapper set of each group, in :data:`GROUPS` order.
CONSTRUCTION = WrapGroup("construction")
LOADERS = WrapGroup("loaders")
RECORDERS = WrapGroup("recorders")
CONVERSION = WrapGroup("conversion")
