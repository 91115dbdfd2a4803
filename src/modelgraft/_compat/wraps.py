"""Every transformers attribute modelgraft wraps, per version, in the order it is installed.

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

from modelgraft._compat._version import TRANSFORMERS_MAJOR
from modelgraft._compat._wrapping import Make, Restore, Wrappers

__all__ = [
    "CONSTRUCTION",
    "CONVERSION",
    "GROUPS",
    "LOADERS",
    "RECORDERS",
    "SITES",
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


@dataclass(frozen=True)
class Site:
    """One transformers attribute that modelgraft replaces.

    Attributes:
        group: one of :data:`GROUPS`.
        owner: dotted path of the object holding the attribute (a module, a class, or an object
            such as a registry).
        attribute: the attribute replaced on ``owner``.
        majors: the transformers major versions on which modelgraft replaces it.
        why: what the wrapper does there.
    """

    group: str
    owner: str
    attribute: str
    majors: tuple[int, ...]
    why: str


SITES: tuple[Site, ...] = (
    # 1. construction
    Site(
        "construction",
        _MU,
        "apply_patches",
        (5,),
        "entered by from_pretrained and _from_config around cls(config)",
    ),
    Site(
        "construction", _PTM, "get_init_context", (4,), "its contexts surround cls(config) in from_pretrained"
    ),
    Site("construction", _PTM, "_from_config", (4,), "calls cls(config) directly; wrapped whole"),
    # 2. loaders
    Site("loaders", _PTM, "from_pretrained", (4, 5), "one registry snapshot per load; report; strict mode"),
    Site("loaders", _PTM, "_from_config", (4, 5), "one registry snapshot per build (AutoModel.from_config)"),
    Site("loaders", _PTM, "initialize_weights", (4, 5), "initialise with the original classes bound"),
    # 3. recorders
    Site(
        "recorders",
        "transformers.utils.output_capturing._CAN_RECORD_REGISTRY",
        "get",
        (5,),
        "receives the model: an instance's own `_can_record_outputs` comes first",
    ),
    Site(
        "recorders",
        "transformers.utils.generic",
        "_CAN_RECORD_REGISTRY",
        (4,),
        "a plain dict read by class name: replaced by one that knows the running instance",
    ),
    Site("recorders", _MU, "_CAN_RECORD_REGISTRY", (4,), "the same registry, imported there"),
    # 4. conversion
    Site(
        "conversion", _MU, "get_model_conversion_mapping", (5,), "drop built-in transforms an entry replaces"
    ),
    Site("conversion", _MU, "revert_weight_conversion", (5,), "save: reverse modelgraft's conversions"),
    Site("conversion", _MU, "_find_missing_and_unexpected_keys", (4,), "fill converted parameters"),
    Site(
        "conversion",
        _PTM,
        "_load_pretrained_model",
        (4, 5),
        "5.x: fill converted parameters; 4.57: share the load",
    ),
    Site("conversion", _PTM, "_adjust_missing_and_unexpected_keys", (4,), "drop consumed checkpoint keys"),
    Site("conversion", _PTM, "post_init", (4, 5), "remember the conversion entries a model was built under"),
    Site("conversion", _PTM, "save_pretrained", (4,), "save: reverse modelgraft's conversions"),
)


def sites(group: str | None = None, major: int = TRANSFORMERS_MAJOR) -> list[Site]:
    """The sites of ``group`` (all groups by default) on transformers ``major``, in installation order.

    Example:
        >>> [s.attribute for s in sites("construction", major=4)]
        ['get_init_context', '_from_config']
    """
    if group is not None and group not in GROUPS:
        raise ValueError(f"unknown wrap group `{group}`; expected one of {GROUPS}")
    return [s for s in SITES if major in s.majors and (group is None or s.group == group)]


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
            made = makers[site.attribute]
            pair: tuple[Callable[..., Any], ...] = made if isinstance(made, tuple) else (made,)
            steps.append((owner_of(site), site.attribute, *pair))
        self._wrappers.install(steps)

    def uninstall(self) -> None:
        """Restore what :meth:`install` replaced (idempotent)."""
        self._wrappers.uninstall()


#: The one wrapper set of each group, in :data:`GROUPS` order.
CONSTRUCTION = WrapGroup("construction")
LOADERS = WrapGroup("loaders")
RECORDERS = WrapGroup("recorders")
CONVERSION = WrapGroup("conversion")
