"""The transformers boundary: everything modelgraft knows about the installed transformers.

modelgraft supports transformers 4.57.x (the last 4.x) and 5.x. This package is the bottom layer:
it imports nothing of modelgraft above it (only ``errors`` and ``_forksafe``), and
no module outside it imports transformers internals. The rest of the package asks it instead of
branching on versions or reaching into transformers:

* version facts and feature flags (:mod:`._version`);
* every transformers attribute modelgraft wraps, in one table, installed in a stated order
  (:mod:`.wraps`): the construction step (:func:`install_construction_step`), the loaders
  (:func:`install_loaders`), the per-instance recorder lookup (:func:`install_recorder_lookup`)
  and the conversion wiring (:func:`install_conversion_wiring`, which calls the conversion engine
  through the interface in :mod:`.engine`);
* where MoE routing happens (:func:`moe_router_candidates`), meta-device builds
  (:func:`meta_device`), 4.57 class tables (:func:`rebind_class_tables`);
* lookups into transformers' model catalogue and helpers (:mod:`.models`).

The 4.57-only code lives in :mod:`._v4` and :mod:`._conversion_v4`, the 5.x-only code in :mod:`._v5`
and :mod:`._conversion_v5`; exactly one of each pair is imported.

Example:
    >>> from modelgraft import _compat
    >>> _compat.TRANSFORMERS_MAJOR in (4, 5)
    True
    >>> _compat.IS_V5 == (_compat.TRANSFORMERS_MAJOR == 5)
    True
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from types import ModuleType
from typing import TYPE_CHECKING, Any

# Every module here imports `_version` before anything of transformers: an unsupported
# transformers is refused with a clear error before any internal of it is touched.
from modelgraft._compat import loading as _loading
from modelgraft._compat._version import (
    FUSED_MOE_EXPERTS,
    HAS_BUILTIN_CONVERSION,
    HAS_BUILTIN_PATCHING,
    IS_V5,
    SUPPORTED_RANGES,
    TRANSFORMERS_MAJOR,
    TRANSFORMERS_VERSION,
    check_supported,
    is_supported,
)
from modelgraft._compat._wrapping import Make
from modelgraft._compat.engine import ConversionEngine
from modelgraft._compat.loading import (
    builtin_checkpoint_conversions,
    builtin_conversion_exists,
    transformers_load_info_class,
)
from modelgraft._compat.models import (
    auto_model_class,
    causal_lm_loss,
    default_apply_gate,
    model_types_by_module,
    modeling_files,
    revert_builtin_conversion,
)
from modelgraft._compat.wraps import WrapGroup

__all__ = [
    "FUSED_MOE_EXPERTS",
    "HAS_BUILTIN_CONVERSION",
    "HAS_BUILTIN_PATCHING",
    "IS_V5",
    "SUPPORTED_RANGES",
    "TRANSFORMERS_MAJOR",
    "TRANSFORMERS_VERSION",
    "ConversionEngine",
    "auto_model_class",
    "builtin_checkpoint_conversions",
    "builtin_conversion_exists",
    "causal_lm_loss",
    "check_supported",
    "construction_step_installed",
    "conversion_wiring_installed",
    "default_apply_gate",
    "defines_layout_moe",
    "install_construction_step",
    "install_conversion_wiring",
    "install_loaders",
    "install_recorder_lookup",
    "is_supported",
    "loaders_installed",
    "meta_device",
    "model_types_by_module",
    "modeling_files",
    "moe_router_candidates",
    "rebind_class_tables",
    "restore_class_tables",
    "revert_builtin_conversion",
    "track_instance_recorders",
    "transformers_load_info_class",
    "uninstall_construction_step",
    "uninstall_conversion_wiring",
    "uninstall_loaders",
    "uninstall_recorder_lookup",
]

if IS_V5 or TYPE_CHECKING:  # both lines share one interface; the checker reads the 5.x one
    from modelgraft._compat import _v5 as _impl
else:
    from modelgraft._compat import _v4 as _impl

_loaders = WrapGroup("loaders")


def install_loaders(makers: Mapping[str, Make]) -> None:
    """Wrap transformers' loaders with ``makers`` (``{attribute: make(original) -> wrapper}``;
    the ``loaders`` sites of :mod:`.wraps`). Install the construction step first (idempotent).

    Example:
        >>> import modelgraft  # installs its load hooks
        >>> loaders_installed()
        True
    """
    _loaders.install(makers)


def uninstall_loaders() -> None:
    """Undo :func:`install_loaders` (idempotent)."""
    _loaders.uninstall()


def loaders_installed() -> bool:
    """Whether :func:`install_loaders` is in effect.

    Example:
        >>> import modelgraft  # installs its load hooks
        >>> loaders_installed()
        True
    """
    return _loaders.installed


def install_recorder_lookup() -> None:
    """Make transformers read a model's recorders from the instance when it has its own (idempotent).

    ``_can_record_outputs`` is class-level state in transformers, looked up by class name in
    ``_CAN_RECORD_REGISTRY``; 5.x passes the instance to the lookup, 4.57 only the class name.
    After this, a model whose ``__dict__`` holds ``_can_record_outputs`` (and that was passed to
    :func:`track_instance_recorders`) captures outputs with that map, and every other model with
    its class map. Undone by :func:`uninstall_recorder_lookup`.

    Example:
        >>> install_recorder_lookup(); install_recorder_lookup()  # idempotent
    """
    _impl.install_recorder_lookup()


def uninstall_recorder_lookup() -> None:
    """Undo :func:`install_recorder_lookup` (idempotent).

    Example:
        >>> callable(uninstall_recorder_lookup)  # (not run here: it is process-wide)
        True
    """
    _impl.uninstall_recorder_lookup()


def track_instance_recorders(model: Any) -> None:
    """Let the lookup of :func:`install_recorder_lookup` find ``model``'s own recorders.

    A no-op on 5.x (the lookup receives the instance). On 4.57 it adds a forward pre-hook and a
    forward hook to ``model`` that mark it as running in this thread or task. Idempotent.

    Example:
        >>> import torch
        >>> track_instance_recorders(torch.nn.Linear(1, 1))
    """
    _impl.track_instance_recorders(model)


def install_conversion_wiring(engine: ConversionEngine) -> None:
    """Wire ``engine`` into transformers' load and save steps (the ``conversion`` sites; idempotent).

    See :mod:`.loading`: the conversion engine passes itself here, so this layer never imports it.
    """
    _loading.install(engine)


def uninstall_conversion_wiring() -> None:
    """Undo :func:`install_conversion_wiring` (idempotent)."""
    _loading.uninstall()


def conversion_wiring_installed() -> bool:
    """Whether a conversion engine is wired in.

    Example:
        >>> import modelgraft  # wires its engine in
        >>> conversion_wiring_installed()
        True
    """
    return _loading.installed()


def install_construction_step(step: Callable[[], AbstractContextManager[Any]]) -> None:
    """Have transformers enter ``step()`` exactly around model construction (idempotent).

    Covers ``from_pretrained`` and ``_from_config`` (hence ``AutoModel*`` and the sub-models of
    composite models). On 5.x ``step()`` stands in for transformers' own ``apply_patches()`` at its
    call sites and enters it inside; on 4.57 ``step()`` is appended to the contexts that
    ``get_init_context`` returns and wraps the whole ``_from_config`` (which there does nothing
    but construct). Undone by :func:`uninstall_construction_step`.

    Args:
        step: a zero-argument factory of context managers, called once per construction.

    Example:
        >>> isinstance(construction_step_installed(), bool)  # modelgraft's hooks install one
        True
    """
    _impl.install_construction_step(step)


def construction_step_installed() -> bool:
    """Whether :func:`install_construction_step` is in effect.

    Example:
        >>> import modelgraft  # installs its load hooks
        >>> construction_step_installed() in (True, False)
        True
    """
    return _impl.construction_step_installed()


def uninstall_construction_step() -> None:
    """Undo :func:`install_construction_step` (idempotent).

    Example:
        >>> callable(uninstall_construction_step)  # (not run here: it is process-wide)
        True
    """
    _impl.uninstall_construction_step()


def meta_device() -> AbstractContextManager[Any]:
    """Build modules inside the block with their parameters on the ``meta`` device (no memory).

    On 5.x this is ``torch.device("meta")`` (buffers on meta too). Some 4.57 modules read a
    value while constructing (Apertus' xIELU activation calls ``.item()`` on a buffer in
    ``__init__``), which a meta tensor cannot give; on 4.57 tensors are therefore created normally
    and parameters moved to ``meta`` as they are registered, buffers staying on the CPU
    (transformers' own ``init_empty_weights``, as its ``from_pretrained`` does).

    Example:
        >>> import torch
        >>> with meta_device():
        ...     layer = torch.nn.Linear(2, 2)
        >>> layer.weight.device.type
        'meta'
    """
    return _impl.meta_device()


def defines_layout_moe(source: str) -> bool:
    """Whether a modeling file's source defines an MoE layer in the layout only this version has.

    transformers 5.x MoE families define a router class next to an experts class (found by name
    in :mod:`modelgraft.moe`); this is ``False`` there. On 4.57 many families instead keep a
    ``ModuleList`` of per-expert MLPs next to an ``nn.Linear`` gate (or a router class).

    Example:
        >>> src = "self.gate = nn.Linear(h, e); self.experts = nn.ModuleList([])"
        >>> defines_layout_moe(src) == (not IS_V5)
        True
    """
    return _impl.defines_layout_moe(source)


def rebind_class_tables(
    module: ModuleType, swapped: Mapping[type, type]
) -> list[tuple[dict[Any, Any], Any, type, type]]:
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
        >>> log = rebind_class_tables(mod, {Attn: Mine})
        >>> mod.ATTN_CLASSES["sdpa"] is (SdpaAttn if IS_V5 else Mine)
        True
        >>> restore_class_tables(log); mod.ATTN_CLASSES["sdpa"] is SdpaAttn
        True
    """
    return _impl.rebind_class_tables(module, swapped)


def restore_class_tables(log: list[tuple[dict[Any, Any], Any, type, type]]) -> None:
    """Undo :func:`rebind_class_tables` (entries someone else changed meanwhile are left alone).

    Example:
        >>> restore_class_tables([])
    """
    for table, key, original, replacement in reversed(log):
        if table.get(key) is replacement:
            table[key] = original


def moe_router_candidates(modules: Mapping[str, Any]) -> Iterator[tuple[str, Any, Any]]:
    """Yield ``(name, router, parent)`` for routers that only the installed layout has.

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
        >>> found = [name for name, _, _ in moe_router_candidates(dict(block.named_modules()))]
        >>> found == ([] if IS_V5 else ["gate"])
        True
    """
    return _impl.moe_router_candidates(modules)
