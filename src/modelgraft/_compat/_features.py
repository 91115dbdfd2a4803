"""What the installed transformers has, detected from the release itself: :data:`FEATURES`.

modelgraft binds its version layer to *features*, not to version numbers: each piece of
transformers that it wraps or calls is looked up where the releases put it, and the matching
implementation is chosen from what is found. A piece that modelgraft needs and cannot find is
refused here, at ``import modelgraft``, with :class:`~modelgraft.errors.UnsupportedTransformersError`
naming the release and the missing piece (never a bare ``AttributeError`` in a later load).

What differs between the supported releases (docs/compat.md has the table):

* where a model's ``_can_record_outputs`` is registered (``_CAN_RECORD_REGISTRY``): a plain
  ``dict`` keyed by ``str(model class)`` in ``transformers.utils.generic`` (4.57, 5.0, 5.1) or in
  ``transformers.utils.output_capturing`` (5.2 to 5.22), or a registry object whose ``get``
  receives the model instance (5.23 on);
* where a model is constructed: around transformers' own ``apply_patches()`` (5.3 on, which ships
  ``transformers.monkey_patching``), else inside the contexts of ``get_init_context`` and the
  body of ``_from_config`` (4.57, 5.0 to 5.2);
* whether transformers converts checkpoint layouts itself (``core_model_loading``,
  ``conversion_mapping``: every 5.x) and stores MoE experts as fused 3D parameters (every 5.x).

Detection imports only what it inspects (``transformers.utils`` submodules and module specs); it
never imports a modeling module.

Example:
    >>> FEATURES.recorder_registry in ("by_instance", "by_class_name")
    True
    >>> FEATURES.construction in ("apply_patches", "init_contexts")
    True
    >>> FEATURES.builtin_patching == (FEATURES.construction == "apply_patches")
    True
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any, Literal

from modelgraft._compat._version import IS_V5, TRANSFORMERS_VERSION
from modelgraft.errors import UnsupportedTransformersError

__all__ = ["FEATURES", "Features", "detect"]

_MU = "transformers.modeling_utils"


@dataclass(frozen=True)
class Features:
    """The pieces of the installed transformers that modelgraft binds to.

    Attributes:
        release: the installed release (``transformers.__version__``).
        builtin_conversion: transformers converts checkpoint layouts itself (``WeightConverter``,
            ``conversion_mapping``, ``revert_weight_conversion`` on save).
        fused_experts: MoE experts are one module with 3D parameters, not a ``ModuleList``.
        builtin_patching: transformers ships ``monkey_patching`` (its own ``apply_patches``).
        construction: where a model is built: ``"apply_patches"`` (around transformers'
            ``apply_patches()`` global of ``modeling_utils``) or ``"init_contexts"`` (the contexts
            of ``get_init_context`` and the whole of ``_from_config``).
        recorder_registry: ``"by_instance"`` (the registry's ``get`` receives the model) or
            ``"by_class_name"`` (a plain ``dict`` keyed by ``str(model class)``).
        recorder_holders: the modules that bind the name ``_CAN_RECORD_REGISTRY`` (the one that
            defines it first), all of which a by-class-name registry replacement must reach.
    """

    release: str
    builtin_conversion: bool
    fused_experts: bool
    builtin_patching: bool
    construction: Literal["apply_patches", "init_contexts"]
    recorder_registry: Literal["by_instance", "by_class_name"]
    recorder_holders: tuple[str, ...]


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def _refuse(piece: str) -> UnsupportedTransformersError:
    return UnsupportedTransformersError(
        f"transformers `{TRANSFORMERS_VERSION}` lacks {piece}, which modelgraft needs; "
        "install a supported release (docs/compat.md lists them), e.g. `pip install 'transformers>=5,<6'`."
    )


def _recorder_registry() -> tuple[Literal["by_instance", "by_class_name"], tuple[str, ...]]:
    # The module that defines the registry: `output_capturing` where it exists, else `generic`.
    for name in ("transformers.utils.output_capturing", "transformers.utils.generic"):
        if not _has_module(name):
            continue
        module = importlib.import_module(name)
        registry: Any = vars(module).get("_CAN_RECORD_REGISTRY")
        if registry is None:
            continue
        if type(registry) is dict:
            # `modeling_utils` imports the name too (it writes each model's recorders through it).
            return "by_class_name", (name, _MU)
        if callable(getattr(registry, "get", None)):
            return "by_instance", (name,)
        raise _refuse(f"a usable `_CAN_RECORD_REGISTRY` (found a `{type(registry).__name__}` in `{name}`)")
    raise _refuse("the output-recorder registry `_CAN_RECORD_REGISTRY` (`transformers.utils`)")


def detect() -> Features:
    """Look the pieces up on the installed transformers (see :class:`Features`).

    Raises:
        UnsupportedTransformersError: a piece modelgraft needs is not there.
    """
    builtin_conversion = _has_module("transformers.core_model_loading") and _has_module(
        "transformers.conversion_mapping"
    )
    if IS_V5 and not builtin_conversion:
        raise _refuse("`transformers.core_model_loading` and `transformers.conversion_mapping`")
    builtin_patching = _has_module("transformers.monkey_patching")
    recorder_registry, holders = _recorder_registry()
    return Features(
        release=str(TRANSFORMERS_VERSION),
        builtin_conversion=builtin_conversion,
        fused_experts=builtin_conversion and _has_module("transformers.integrations.moe"),
        builtin_patching=builtin_patching,
        construction="apply_patches" if builtin_patching else "init_contexts",
        recorder_registry=recorder_registry,
        recorder_holders=holders,
    )


#: The installed transformers' features, detected once at import.
FEATURES = detect()
