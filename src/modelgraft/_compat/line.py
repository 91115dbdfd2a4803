"""The installed transformers line behind one interface, bound once: :data:`TRANSFORMERS`.

modelgraft supports two transformers lines, 4.57 and 5.x, whose internals differ where modelgraft
reaches in: how a model is constructed, where output recorders are looked up, how MoE routers are
laid out, how checkpoints are loaded and saved. Each line implements :class:`TransformersLine` in
one module, :mod:`._v5` or :mod:`._v4` (which re-exports the conversion wiring of
:mod:`._conversion_v5` or :mod:`._conversion_v4`). :data:`TRANSFORMERS` is that module, chosen here
at import by what the installed release has (:data:`~._features.FEATURES`: its own checkpoint
conversion); callers use it directly, and nothing else tests the version.
The type checker holds both modules to the interface.

Example:
    >>> TRANSFORMERS.__name__ == ("modelgraft._compat._v5" if FEATURES.builtin_conversion else "modelgraft._compat._v4")
    True
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

from torch import nn

from modelgraft._compat._features import FEATURES
from modelgraft._compat.engine import ConversionEngine
from modelgraft._compat.wraps import Makers

__all__ = ["TRANSFORMERS", "ClassTableEntry", "TransformersLine", "restore_class_tables"]

#: One change made by :meth:`TransformersLine.rebind_class_tables`: ``(table, key, original, replacement)``.
ClassTableEntry = tuple[dict[Any, Any], Any, type, type]


class TransformersLine(Protocol):
    """What modelgraft needs from a transformers line that the lines do differently.

    The ``*_wrappers`` methods return the wrappers of one group of :mod:`.wraps` for this line
    (``{attribute: make(original) -> wrapper}``); the group installs and removes them:
    ``wraps.CONSTRUCTION.install(TRANSFORMERS.construction_wrappers(step))``.
    """

    def construction_wrappers(self, step: Callable[[], AbstractContextManager[Any]]) -> Makers:
        """Wrappers that enter ``step()`` exactly around model construction (``construction`` sites).

        Covers ``from_pretrained`` and ``_from_config`` (hence ``AutoModel*`` and the sub-models of
        composite models). On 5.x ``step()`` stands in for transformers' own ``apply_patches()`` at
        its call sites and enters it inside; on 4.57 ``step()`` is appended to the contexts that
        ``get_init_context`` returns and wraps the whole ``_from_config`` (which there does nothing
        but construct).

        Args:
            step: a zero-argument factory of context managers, called once per construction.

        Example:
            >>> from modelgraft._compat.wraps import CONSTRUCTION
            >>> import modelgraft  # installs its construction step
            >>> CONSTRUCTION.installed
            True
        """
        ...

    def recorder_wrappers(self) -> Makers:
        """Wrappers that make transformers read a model's recorders from the instance when it has
        its own (``recorders`` sites).

        ``_can_record_outputs`` is class-level state in transformers, looked up by class name in
        ``_CAN_RECORD_REGISTRY``; 5.x passes the instance to the lookup, 4.57 only the class name.
        With these installed, a model whose ``__dict__`` holds ``_can_record_outputs`` (and that
        was passed to :meth:`track_instance_recorders`) captures outputs with that map, and every
        other model with its class map.

        Example:
            >>> from modelgraft._compat.wraps import sites
            >>> sorted(TRANSFORMERS.recorder_wrappers()) == sorted({s.attribute for s in sites("recorders")})
            True
        """
        ...

    def track_instance_recorders(self, model: nn.Module) -> None:
        """Let the lookup installed by :meth:`recorder_wrappers` find ``model``'s own recorders.

        A no-op on 5.x (the lookup receives the instance). On 4.57 it adds a forward pre-hook and
        a forward hook to ``model`` that mark it as running in this thread or task. Idempotent.

        Example:
            >>> import torch
            >>> TRANSFORMERS.track_instance_recorders(torch.nn.Linear(1, 1))
        """
        ...

    def conversion_wrappers(self, engine: ConversionEngine) -> Makers:
        """Wrappers that call ``engine`` from transformers' load and save steps (``conversion``
        sites); see :mod:`.engine`: the engine passes itself here, so this layer never imports it.

        Example:
            >>> from modelgraft._compat.wraps import CONVERSION
            >>> import modelgraft  # wires its engine in
            >>> CONVERSION.installed
            True
        """
        ...

    def meta_device(self) -> AbstractContextManager[Any]:
        """Build modules inside the block with their parameters on the ``meta`` device (no memory).

        On 5.x this is ``torch.device("meta")`` (buffers on meta too). Some 4.57 modules read a
        value while constructing (Apertus' xIELU activation calls ``.item()`` on a buffer in
        ``__init__``), which a meta tensor cannot give; on 4.57 tensors are therefore created
        normally and parameters moved to ``meta`` as they are registered, buffers staying on the
        CPU (transformers' own ``init_empty_weights``, as its ``from_pretrained`` does).

        Example:
            >>> import torch
            >>> with TRANSFORMERS.meta_device():
            ...     layer = torch.nn.Linear(2, 2)
            >>> layer.weight.device.type
            'meta'
        """
        ...

    def defines_layout_moe(self, source: str) -> bool:
        """Whether a modeling file's source defines an MoE layer in the layout only this line has.

        transformers 5.x MoE families define a router class next to an experts class (found by
        name in :mod:`modelgraft.moe`); this is ``False`` there. On 4.57 many families instead
        keep a ``ModuleList`` of per-expert MLPs next to an ``nn.Linear`` gate (or a router class).

        Example:
            >>> src = "self.gate = nn.Linear(h, e); self.experts = nn.ModuleList([])"
            >>> TRANSFORMERS.defines_layout_moe(src) == (not FEATURES.fused_experts)
            True
        """
        ...

    def rebind_class_tables(self, module: ModuleType, swapped: Mapping[type, type]) -> list[ClassTableEntry]:
        """Point a modeling module's class tables at the replacements of the classes swapped in it.

        Old-style 4.57 modeling modules pick some building blocks from a module-level table, e.g.
        ``QWEN2MOE_ATTENTION_CLASSES[config._attn_implementation]`` with ``eager``/``sdpa``/
        ``flash_attention_2`` variants, so swapping the module global alone would not take effect.
        On 4.57 the entries of every ``*_CLASSES`` table whose class was swapped, or subclasses a
        swapped class (its sdpa and flash variants), get that class's replacement. 5.x dispatches
        attention by name inside one class, and its tables are left as they are.

        Args:
            module: the module whose globals were just swapped.
            swapped: ``{original class: replacement}`` for the globals swapped in ``module``.

        Returns:
            The undo log, for :func:`restore_class_tables`.

        Example:
            >>> import types, torch
            >>> class Attn(torch.nn.Module): ...
            >>> class SdpaAttn(Attn): ...
            >>> class Mine(torch.nn.Module): ...
            >>> mod = types.ModuleType("m"); mod.ATTN_CLASSES = {"eager": Attn, "sdpa": SdpaAttn}
            >>> log = TRANSFORMERS.rebind_class_tables(mod, {Attn: Mine})
            >>> mod.ATTN_CLASSES["sdpa"] is (SdpaAttn if FEATURES.builtin_conversion else Mine)
            True
            >>> restore_class_tables(log); mod.ATTN_CLASSES["sdpa"] is SdpaAttn
            True
        """
        ...

    def moe_router_candidates(
        self, modules: Mapping[str, nn.Module]
    ) -> Iterator[tuple[str, nn.Module, nn.Module]]:
        """Yield ``(name, router, parent)`` for routers that only this line's layout has.

        transformers 5.x gives every MoE family a router class (``*TopKRouter``, ``*Gate``, ...),
        which :mod:`modelgraft.moe` finds by name; this yields nothing there. On 4.57 the router of
        Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and several others is a plain ``nn.Linear`` named
        ``gate`` (or ``router``) inside the sparse-MoE block, and the block's forward does the
        softmax and top-k over a ``ModuleList`` of per-expert MLPs: this yields those gates with
        their block as parent.

        Args:
            modules: ``dict(model.named_modules())``.

        Example:
            >>> import torch
            >>> block = torch.nn.Module()
            >>> block.num_experts, block.top_k = 4, 2
            >>> block.gate = torch.nn.Linear(8, 4, bias=False)
            >>> block.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
            >>> found = [name for name, _, _ in TRANSFORMERS.moe_router_candidates(dict(block.named_modules()))]
            >>> found == ([] if FEATURES.fused_experts else ["gate"])
            True
        """
        ...


def restore_class_tables(log: list[ClassTableEntry]) -> None:
    """Undo :meth:`TransformersLine.rebind_class_tables` (the same on both lines; entries someone
    else changed meanwhile are left alone).

    Example:
        >>> restore_class_tables([])
    """
    for table, key, original, replacement in reversed(log):
        if table.get(key) is replacement:
            table[key] = original


# Each line's module is imported only on that line (the other one's internals do not exist): the
# 5.x one wherever transformers converts checkpoint layouts itself.
if FEATURES.builtin_conversion or TYPE_CHECKING:
    from modelgraft._compat import _v5 as _installed
else:
    from modelgraft._compat import _v4 as _installed
if TYPE_CHECKING:  # the checker holds the 4.57 module to the interface too
    from modelgraft._compat import _v4

    _V4: TransformersLine = _v4

#: The installed transformers line (the module :mod:`._v5` or :mod:`._v4`).
TRANSFORMERS: TransformersLine = _installed
