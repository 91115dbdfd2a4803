"""Every PEFT attribute modelgraft wraps, installed through the same wrapper sets as transformers'.

:data:`PEFT_SITES` is the whole list, as :data:`~modelgraft._compat.wraps.SITES` is for
transformers: nothing else of PEFT is replaced. What each wrapper does is the features' business
(:mod:`modelgraft.grafts._peft` hands the makers in); this module only installs and removes them.

modelgraft never imports PEFT. A PEFT module already imported is wrapped at once; one imported
later is wrapped right after it executes, by the only import hook modelgraft has: a meta-path
finder that answers for the PEFT modules of the table alone and hands them to the real loader.
Each PEFT module gets one :class:`~modelgraft._compat._wrapping.Wrappers` set (all of its sites
or none; on removal an attribute is restored only where it still holds modelgraft's wrapper).

Example:
    >>> sorted({site.module for site in PEFT_SITES})
    ['peft.peft_model', 'peft.tuners.tuners_utils', 'peft.utils.transformers_weight_conversion']
    >>> PeftWraps().installed
    False
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from modelgraft._compat._wrapping import Wrappers
from modelgraft._forksafe import ForkSafeLock

__all__ = ["PEFT", "PEFT_SITES", "PeftMaker", "PeftSite", "PeftWraps"]


@dataclass(frozen=True)
class PeftSite:
    """One PEFT attribute that modelgraft replaces.

    Attributes:
        module: the PEFT module holding it.
        attribute: its path in the module (``"PeftModel.save_pretrained"``: a class attribute).
        why: what the wrapper does there.
    """

    module: str
    attribute: str
    why: str


PEFT_SITES: tuple[PeftSite, ...] = (
    PeftSite(
        "peft.peft_model",
        "set_peft_model_state_dict",
        "per-expert adapters on a model without them are refused; fused expert pairs split on grafted ones",
    ),
    PeftSite(
        "peft.peft_model",
        "PeftModel.save_pretrained",
        "LoRA of grafted per-expert layers is written in PEFT's fused 3D experts layout",
    ),
    PeftSite(
        "peft.tuners.tuners_utils",
        "_maybe_include_all_linear_layers",
        '"all-linear" leaves fused layers out, picking the plain model\'s layers',
    ),
    PeftSite(
        "peft.tuners.tuners_utils",
        "BaseTuner.inject_adapter",
        "a config of fused 3D experts is pointed at grafted per-expert layers",
    ),
    PeftSite(
        "peft.utils.transformers_weight_conversion",
        "_convert_peft_config_moe",
        "expert layer names stay module targets on grafted experts",
    ),
    PeftSite(
        "peft.utils.transformers_weight_conversion",
        "get_model_conversion_mapping",
        "adapter files load without the expert merges on grafted experts",
    ),
)

#: Makes the wrapper of a site from the original and the PEFT module holding it.
PeftMaker = Callable[[Callable[..., Any], ModuleType], Callable[..., Any]]


def _owner(module: ModuleType, attribute: str) -> tuple[Any, str]:
    *path, name = attribute.split(".")
    owner: Any = module
    for part in path:
        owner = getattr(owner, part)
    return owner, name


class PeftWraps:
    """The wrappers of :data:`PEFT_SITES`, installed per PEFT module as it is (or was) imported."""

    def __init__(self) -> None:
        self._lock = ForkSafeLock()
        self._makers: Mapping[str, PeftMaker] | None = None
        self._sets: dict[str, Wrappers] = {}
        self._finder = _Finder(self)

    @property
    def installed(self) -> bool:
        return self._makers is not None

    def install(self, makers: Mapping[str, PeftMaker]) -> None:
        """Wrap each site by ``makers[attribute]`` now where PEFT's module is imported, else when
        it is. ``makers`` must name exactly the sites' attributes; idempotent."""
        wanted = {site.attribute for site in PEFT_SITES}
        if set(makers) != wanted:
            raise ValueError(f"PEFT wrappers must name {sorted(wanted)}; received {sorted(makers)}")
        with self._lock:
            if self._makers is not None:
                return
            self._makers = dict(makers)
            for name in {site.module for site in PEFT_SITES}:
                module = sys.modules.get(name)
                if module is not None:
                    self.wrap_module(module)
            if self._finder not in sys.meta_path:
                sys.meta_path.insert(0, self._finder)

    def wrap_module(self, module: ModuleType) -> None:
        """Install the wrappers of ``module``'s sites (a PEFT without an attribute: skipped)."""
        makers = self._makers
        if makers is None or module.__name__ in self._sets:
            return
        steps: list[Any] = []
        for site in PEFT_SITES:
            if site.module != module.__name__:
                continue
            try:
                owner, name = _owner(module, site.attribute)
                getattr(owner, name)
            except AttributeError:
                continue  # a PEFT without it: nothing to adjust there
            steps.append((owner, name, lambda f, make=makers[site.attribute]: make(f, module)))
        wrappers = Wrappers()
        wrappers.install(steps)
        self._sets[module.__name__] = wrappers

    def uninstall(self) -> None:
        """Remove the import hook and restore PEFT's attributes (idempotent)."""
        with self._lock:
            sys.meta_path[:] = [f for f in sys.meta_path if f is not self._finder]
            for wrappers in reversed(list(self._sets.values())):
                wrappers.uninstall()
            self._sets.clear()
            self._makers = None


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then wraps the sites of the freshly executed module."""

    def __init__(self, loader: importlib.abc.Loader, wraps: PeftWraps) -> None:
        self._loader = loader
        self._wraps = wraps

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._wraps.wrap_module(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: hands the PEFT modules of the table to the next finder, with our loader."""

    _watched = frozenset(site.module for site in PEFT_SITES)

    def __init__(self, wraps: PeftWraps) -> None:
        self._wraps = wraps

    def find_spec(
        self, fullname: str, path: Any, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self._watched:
            return None
        for finder in _other_finders():
            spec: importlib.machinery.ModuleSpec | None = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, self._wraps)
                return spec
        return None


def _other_finders() -> Iterator[Any]:
    return (f for f in list(sys.meta_path) if not isinstance(f, _Finder) and hasattr(f, "find_spec"))


#: The one set of PEFT wrappers.
PEFT = PeftWraps()
