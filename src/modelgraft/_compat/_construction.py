"""Where transformers constructs a model: the ``construction`` sites' wrappers, on every release.

The class swap must be live exactly while a model's modules are built. Where that is depends on
the release (:attr:`~._features.Features.construction`):

* ``apply_patches`` (5.3 on): ``from_pretrained`` (through ``get_init_context``) and
  ``_from_config`` enter the ``modeling_utils`` global ``apply_patches()`` (transformers' own
  patching) right around ``cls(config)``; replacing that global puts the step exactly there, with
  transformers' own context still entered inside.
* ``init_contexts`` (4.57, 5.0 to 5.2): ``from_pretrained`` enters the list returned by
  ``get_init_context`` right around ``cls(config)``, so the step is appended to it;
  ``_from_config`` only sets the default dtype and calls ``cls(config)``, so the step wraps all of
  it. These are installed *before* the loaders' own wrapper of ``_from_config``, so that they run
  inside it (and are removed after it: each attribute is restored only where it still holds this
  wrapper).

Example:
    >>> from modelgraft._compat.wraps import sites
    >>> sorted(construction_wrappers(step=None)) == sorted(s.attribute for s in sites("construction"))
    True
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from modelgraft._compat._features import FEATURES
from modelgraft._compat.wraps import Makers

__all__ = ["construction_wrappers"]

Step = Callable[[], AbstractContextManager[Any]]


def _around_apply_patches(step: Step) -> Makers:
    def wrap(builtin: Callable[..., AbstractContextManager[Any]]) -> Callable[..., Any]:
        @contextmanager
        def construction_site(*args: Any, **kwargs: Any) -> Iterator[None]:
            with step(), builtin(*args, **kwargs):
                yield

        return construction_site

    return {"apply_patches": wrap}


def _in_init_contexts(step: Step) -> Makers:
    def wrap_init_context(original: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
        def get_init_context(cls: type, *args: Any, **kwargs: Any) -> list[Any]:
            return [*original(cls, *args, **kwargs), step()]

        return get_init_context

    def wrap_from_config(original: Callable[..., Any]) -> Callable[..., Any]:
        def _from_config(cls: type, *args: Any, **kwargs: Any) -> Any:
            with step():
                return original(cls, *args, **kwargs)

        return _from_config

    return {"get_init_context": wrap_init_context, "_from_config": wrap_from_config}


def construction_wrappers(step: Step) -> Makers:
    """See :meth:`~modelgraft._compat.line.TransformersLine.construction_wrappers`."""
    if FEATURES.construction == "apply_patches":
        return _around_apply_patches(step)
    return _in_init_contexts(step)
