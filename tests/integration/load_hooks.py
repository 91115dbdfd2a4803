"""Helpers for tests that act in the middle of a load: a hook at a chosen stage, and a bit-for-bit
comparison with a plain load."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

#: Where :func:`hooked` can fire, in load order.
STAGES = ("before construction", "during construction", "after construction")


def hooked(cls: type, stage: str, fire: Callable[[], None], monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Make the next load of ``cls`` call ``fire()`` once, at ``stage``; return the list it marks.

    The class is patched in place for the test (a subclass would change the class name, which
    transformers keys some of its own conversions on).
    """
    fired: list[bool] = []

    def once(at: str) -> None:
        if at == stage and not fired:
            fired.append(True)
            fire()

    init_context, init, post_init = cls.get_init_context, cls.__init__, cls.post_init

    def get_init_context(klass: type, *args: Any, **kwargs: Any) -> Any:
        once("before construction")
        return init_context(*args, **kwargs)

    def __init__(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        once("during construction")
        init(self, config, *args, **kwargs)

    def patched_post_init(self: Any) -> None:
        post_init(self)
        if type(self) is cls:
            once("after construction")

    monkeypatch.setattr(cls, "get_init_context", classmethod(get_init_context))
    monkeypatch.setattr(cls, "__init__", __init__)
    monkeypatch.setattr(cls, "post_init", patched_post_init)
    return fired


def assert_same_as_plain(model: torch.nn.Module, plain: torch.nn.Module) -> None:
    """Bit for bit: the same module classes, state-dict keys, shapes, dtypes and values."""
    assert [type(m) for _, m in model.named_modules()][1:] == [type(m) for _, m in plain.named_modules()][1:]
    ours, theirs = model.state_dict(), plain.state_dict()
    assert list(ours) == list(theirs)
    for key, value in theirs.items():
        assert ours[key].shape == value.shape and ours[key].dtype == value.dtype, key
        assert torch.equal(ours[key], value), key
