"""What differs between the supported transformers versions, in one place.

modelgraft supports transformers 4.57.x (the last 4.x) and 5.x. The rest of the package asks
this module instead of branching on versions itself: version facts and feature flags, how a
load is put together (:func:`loading_internals`), how output recorders are looked up and made
per instance (:func:`install_recorder_lookup`), where a class swap can wrap construction
(:func:`install_construction_step`), and where MoE routing happens
(:func:`moe_router_candidates`). The 4.57-only code lives in :mod:`modelgraft._compat._v4` and
the 5.x-only code in :mod:`modelgraft._compat._v5`; exactly one of them is imported.

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
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import transformers
from packaging.version import Version

from modelgraft.errors import UnsupportedTransformersError

__all__ = [
    "FUSED_MOE_EXPERTS",
    "HAS_BUILTIN_CONVERSION",
    "HAS_BUILTIN_PATCHING",
    "IS_V5",
    "SUPPORTED_RANGES",
    "TRANSFORMERS_MAJOR",
    "TRANSFORMERS_VERSION",
    "LoadingInternals",
    "bind_instance_recorders",
    "builtin_checkpoint_conversions",
    "check_supported",
    "class_recorders",
    "construction_step_installed",
    "conversion_hooks",
    "defines_layout_moe",
    "initialize_missing_keys",
    "install_construction_step",
    "install_recorder_lookup",
    "instance_recorders",
    "is_supported",
    "loading_internals",
    "meta_device",
    "moe_router_candidates",
    "output_recorder_class",
    "rebind_class_tables",
    "recorder_lookup_installed",
    "restore_class_tables",
    "track_instance_recorders",
    "uninstall_construction_step",
    "uninstall_recorder_lookup",
]

SUPPORTED_RANGES = ">=4.57,<4.58 or >=5.0,<6"

TRANSFORMERS_VERSION = Version(transformers.__version__)
TRANSFORMERS_MAJOR = TRANSFORMERS_VERSION.major
IS_V5 = TRANSFORMERS_MAJOR == 5


def is_supported(version: Version | str = TRANSFORMERS_VERSION) -> bool:
    """Whether modelgraft supports this transformers version (pre-releases of a supported line count).

    Example:
        >>> is_supported("4.57.6"), is_supported("5.23.0"), is_supported("4.56.2"), is_supported("6.0.0")
        (True, True, False, False)
    """
    version = Version(str(version))
    return (version.major, version.minor) == (4, 57) or version.major == 5


def check_supported(version: Version | str = TRANSFORMERS_VERSION) -> None:
    """Raise :class:`~modelgraft.errors.UnsupportedTransformersError` unless ``version`` is supported.

    Runs when modelgraft is imported, so an unsupported transformers fails early with a message
    that says which versions work.

    Example:
        >>> check_supported("5.0.0")
        >>> check_supported("4.46.0")
        Traceback (most recent call last):
        ...
        modelgraft.errors.UnsupportedTransformersError: modelgraft supports transformers >=4.57,<4.58 or >=5.0,<6; found `4.46.0`. ...
    """
    if not is_supported(version):
        raise UnsupportedTransformersError(
            f"modelgraft supports transformers {SUPPORTED_RANGES}; found `{version}`. "
            "Install a supported release, e.g. `pip install 'transformers>=5,<6'` "
            "(or `pip install 'transformers~=4.57.0'` to stay on 4.x)."
        )


check_supported()

# Feature flags. Each says what the installed transformers has, so callers need no version test.
#: transformers ships its own ``monkey_patching`` module (5.x); 4.57 has none.
HAS_BUILTIN_PATCHING = IS_V5
#: transformers converts checkpoint layouts itself (``WeightConverter``, ``conversion_mapping``,
#: ``revert_weight_conversion`` on save): 5.x. On 4.57 a checkpoint key maps to one parameter.
HAS_BUILTIN_CONVERSION = IS_V5
#: MoE experts are one module with 3D parameters (5.x) rather than a ``ModuleList`` of per-expert
#: MLPs (4.57). Checkpoints use per-expert keys on both.
FUSED_MOE_EXPERTS = IS_V5

if IS_V5:
    from modelgraft._compat import _v5 as _impl
else:
    from modelgraft._compat import _v4 as _impl


@dataclass(frozen=True)
class LoadingInternals:
    """How the installed transformers builds and loads a model (facts, not behaviour).

    Attributes:
        init_context_method: classmethod of ``PreTrainedModel`` that returns the context managers
            ``from_pretrained`` builds the model under (both versions).
        from_config_has_init_contexts: ``_from_config`` enters a list of context managers around
            ``cls(config)`` (5.x); on 4.57 it calls ``cls(config)`` directly, so a swap must wrap
            the whole ``_from_config``.
        builtin_patch_context: transformers enters its own ``apply_patches()`` around construction
            (5.x). It is a no-op while its own registry is empty.
        from_pretrained_builds_on_meta: ``from_pretrained`` constructs on the meta device and only
            missing keys get ``_init_weights`` (both versions; 4.57 via ``init_empty_weights`` plus
            ``no_init_weights``, 5.x via ``torch.device("meta")``).
        missing_keys_argument: ``_initialize_missing_keys`` takes the missing keys (4.57:
            ``(missing_keys, is_quantized)``); 5.x takes ``(is_quantized)`` and initialises every
            tensor without ``_is_hf_initialized``.
        save_reverts_conversions: ``save_pretrained`` reverses the load-time conversions itself
            (5.x ``revert_weight_conversion``); 4.57 writes ``state_dict()`` as is.
        record_registry_module: module holding ``_CAN_RECORD_REGISTRY`` and ``OutputRecorder``.
    """

    init_context_method: str
    from_config_has_init_contexts: bool
    builtin_patch_context: bool
    from_pretrained_builds_on_meta: bool
    missing_keys_argument: bool
    save_reverts_conversions: bool
    record_registry_module: str


def loading_internals() -> LoadingInternals:
    """The :class:`LoadingInternals` of the installed transformers.

    Example:
        >>> facts = loading_internals()
        >>> facts.init_context_method, facts.save_reverts_conversions == IS_V5
        ('get_init_context', True)
    """
    return LoadingInternals(
        init_context_method="get_init_context",
        from_config_has_init_contexts=IS_V5,
        builtin_patch_context=IS_V5,
        from_pretrained_builds_on_meta=True,
        missing_keys_argument=not IS_V5,
        save_reverts_conversions=IS_V5,
        record_registry_module=_impl.RECORD_REGISTRY_MODULE,
    )


def initialize_missing_keys(model: Any, missing_keys: list[str] | set[str]) -> None:
    """Run transformers' own initialisation for ``missing_keys`` of ``model`` (and nothing else).

    Tensors not in ``missing_keys`` are marked initialised first, so their values are kept; the
    model's ``_init_weights`` then fills the modules that own a missing tensor. Tensors on the
    meta device must have been materialised by the caller.

    Args:
        model: a ``PreTrainedModel``.
        missing_keys: state-dict keys of ``model`` that no checkpoint tensor filled.

    Example:
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        ...     num_attention_heads=2, num_key_value_heads=1, vocab_size=32)
        >>> model = LlamaForCausalLM(config)
        >>> with torch.no_grad():
        ...     _ = model.model.norm.weight.fill_(7.0), model.lm_head.weight.fill_(7.0)
        >>> initialize_missing_keys(model, ["model.norm.weight"])
        >>> model.model.norm.weight.unique().tolist(), bool((model.lm_head.weight == 7.0).all())
        ([1.0], True)
    """
    _impl.initialize_missing_keys(model, set(missing_keys))


def output_recorder_class() -> type:
    """transformers' ``OutputRecorder`` dataclass (it moved between modules in 5.x).

    Example:
        >>> output_recorder_class().__name__
        'OutputRecorder'
    """
    return _impl.output_recorder_class()


def class_recorders(model: Any) -> dict[str, Any]:
    """The ``_can_record_outputs`` transformers defines for ``model``'s class (a shallow copy).

    Example:
        >>> import torch
        >>> class_recorders(torch.nn.Linear(1, 1))
        {}
    """
    return dict(getattr(type(model), "_can_record_outputs", None) or {})


def install_recorder_lookup() -> None:
    """Make transformers read a model's recorders from the instance when it has its own (idempotent).

    ``_can_record_outputs`` is class-level state in transformers, looked up by class name in
    ``_CAN_RECORD_REGISTRY``; 5.x passes the instance to the lookup, 4.57 only the class name.
    After this, a model whose ``__dict__`` holds ``_can_record_outputs`` (and that was passed to
    :func:`track_instance_recorders`) captures outputs with that map, and every other model with
    its class map. Undone by :func:`uninstall_recorder_lookup`.

    Example:
        >>> install_recorder_lookup(); install_recorder_lookup()  # idempotent
        >>> recorder_lookup_installed()
        True
    """
    _impl.install_recorder_lookup()


def recorder_lookup_installed() -> bool:
    """Whether :func:`install_recorder_lookup` is in effect.

    Example:
        >>> isinstance(recorder_lookup_installed(), bool)
        True
    """
    return _impl.recorder_lookup_installed()


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


def bind_instance_recorders(model: Any, recorders: Mapping[str, Any]) -> None:
    """Make transformers capture outputs of ``model`` (and of no other model) with ``recorders``.

    Sets ``model.__dict__["_can_record_outputs"]`` (the class attribute is untouched), installs
    the lookup and tracks the instance. Call it before the model's first forward that requests
    outputs (5.x installs its capture hooks once, on that forward).

    Args:
        model: a ``PreTrainedModel`` instance (a sub-model of a composite model is fine).
        recorders: output name to recorder, as in ``_can_record_outputs`` (a class, a class-name
            suffix, an ``OutputRecorder`` or a list of them).

    Example:
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaModel
        >>> config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        ...     num_attention_heads=2, num_key_value_heads=1, vocab_size=32, attn_implementation="eager")
        >>> model, other = LlamaModel(config), LlamaModel(config)
        >>> bind_instance_recorders(model, {})  # record nothing on this instance only
        >>> ids = torch.tensor([[1, 2, 3]])
        >>> model(ids, output_attentions=True).attentions, len(other(ids, output_attentions=True).attentions)
        (None, 2)
    """
    object.__setattr__(model, "_can_record_outputs", dict(recorders))
    install_recorder_lookup()
    track_instance_recorders(model)


def instance_recorders(model: Any) -> dict[str, Any] | None:
    """The recorder map bound to the ``model`` instance itself, or ``None``.

    Example:
        >>> import torch
        >>> instance_recorders(torch.nn.Linear(1, 1)) is None
        True
    """
    return getattr(model, "__dict__", {}).get("_can_record_outputs")


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


def conversion_hooks() -> ModuleType:
    """The module that wires modelgraft's conversion engine into the installed transformers.

    It has ``install()``, ``uninstall()``, ``installed()`` and ``builtin_conversion_exists(key)``:
    :mod:`modelgraft._compat._loading_v5` on 5.x, :mod:`modelgraft._compat._loading_v4`
    on 4.57 (which has no built-in conversions).

    Example:
        >>> conversion_hooks().builtin_conversion_exists("qwen2_moe") == HAS_BUILTIN_CONVERSION
        True
    """
    if IS_V5:
        from modelgraft._compat import _loading_v5 as hooks
    else:
        from modelgraft._compat import _loading_v4 as hooks
    return hooks


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
) -> list[tuple[dict, Any, type, type]]:
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


def restore_class_tables(log: list[tuple[dict, Any, type, type]]) -> None:
    """Undo :func:`rebind_class_tables` (entries someone else changed meanwhile are left alone).

    Example:
        >>> restore_class_tables([])
    """
    for table, key, original, replacement in reversed(log):
        if table.get(key) is replacement:
            table[key] = original


def builtin_checkpoint_conversions(model_type: str) -> list[Any]:
    """transformers' own conversion entries for ``model_type`` (its ``WeightConverter``/``WeightRenaming``).

    Empty on 4.57, which converts no checkpoint layout, and for model types 5.x does not convert.

    Example:
        >>> (len(builtin_checkpoint_conversions("qwen2_moe")) > 0) == HAS_BUILTIN_CONVERSION
        True
        >>> builtin_checkpoint_conversions("llama")
        []
    """
    if not HAS_BUILTIN_CONVERSION:
        return []
    from transformers import conversion_mapping

    return list(conversion_mapping.get_checkpoint_conversion_mapping(model_type) or [])


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
