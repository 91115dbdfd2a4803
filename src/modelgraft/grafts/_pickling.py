"""Pickling support for the classes grafts create at run time.

``FusedQKVLlamaAttention`` or ``LinearQwen2MoeExperts`` are made by a factory when a graft is
used, so a fresh process cannot import them by name, and ``torch.save(model)`` or
multiprocessing would fail to rebuild a grafted model there. Such classes are made with the
metaclass :class:`GraftedClass` and record their recipe (an importable factory and picklable
arguments, such as the transformers class they replace); pickle stores the recipe instead of a
reference, and unpickling calls the factory again, which returns the one cached class of that
process. Classes users derive from them pickle by reference, as usual.

Example:
    >>> import pickle
    >>> from transformers.models.llama.modeling_llama import LlamaMLP
    >>> from modelgraft.grafts import fused_gate_up_class
    >>> cls = fused_gate_up_class(LlamaMLP)
    >>> b"fused_subclass" in pickle.dumps(cls), pickle.loads(pickle.dumps(cls)) is cls
    (True, True)
"""

from __future__ import annotations

import copyreg
from typing import Any

__all__ = ["RECIPE_ATTR", "GraftedClass"]

#: Class attribute ``(factory, args)`` such that ``factory(*args)`` returns the class.
RECIPE_ATTR = "_modelgraft_recipe"


class GraftedClass(type):
    """Metaclass of the classes grafts make at run time: they pickle as their recipe."""


def _reduce_class(cls: GraftedClass) -> Any:
    recipe = cls.__dict__.get(RECIPE_ATTR)
    if recipe is None:  # a user's subclass of a grafted class: importable, so by reference
        return cls.__qualname__
    return recipe


copyreg.pickle(GraftedClass, _reduce_class)
