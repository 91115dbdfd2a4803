"""The transformers boundary: everything modelgraft knows about the installed transformers.

modelgraft supports transformers 4.57.x (the last 4.x) and 5.x. This package is the bottom layer:
it imports nothing of modelgraft above it (only ``errors`` and ``_forksafe``), and no module
outside it imports transformers internals. The rest of the package asks it instead of branching
on versions or reaching into transformers:

* version facts (:mod:`._version`) and what the installed release has, detected from it
  (:data:`FEATURES`, :mod:`._features`): everything below binds to features, not version numbers;
* :data:`TRANSFORMERS`, the installed line behind one interface (:class:`TransformersLine`, in
  :mod:`.line`): the wrappers each group needs on this line, where MoE routing happens, meta-device
  builds, 4.57 class tables. It is the module :mod:`._v5` or :mod:`._v4` (with the conversion
  wiring of :mod:`._conversion_v5` or :mod:`._conversion_v4`), chosen once at import;
* every transformers attribute modelgraft wraps, in one table, in four groups installed in a
  stated order (:mod:`.wraps`): :data:`CONSTRUCTION`, :data:`LOADERS`, :data:`RECORDERS`,
  :data:`CONVERSION`, each installing the wrappers it is given and removing them;
* the interface the conversion engine offers the wiring (:mod:`.engine`), so that this layer never
  imports it;
* lookups into transformers' model catalogue and helpers (:mod:`.models`).

Example:
    >>> from modelgraft import _compat
    >>> _compat.TRANSFORMERS_MAJOR in (4, 5)
    True
    >>> _compat.IS_V5 == (_compat.TRANSFORMERS_MAJOR == 5)
    True
    >>> import torch
    >>> with _compat.TRANSFORMERS.meta_device():
    ...     layer = torch.nn.Linear(2, 2)
    >>> layer.weight.is_meta
    True
"""

from __future__ import annotations

# Every module here imports `_version` before anything of transformers: an unsupported
# transformers is refused with a clear error before any internal of it is touched.
from modelgraft._compat._features import FEATURES, Features
from modelgraft._compat._version import (
    IS_V5,
    SUPPORTED_RANGES,
    TRANSFORMERS_MAJOR,
    TRANSFORMERS_VERSION,
    check_supported,
    is_supported,
)
from modelgraft._compat.engine import ConversionEngine, LoadRequest
from modelgraft._compat.line import TRANSFORMERS, TransformersLine, restore_class_tables
from modelgraft._compat.models import (
    auto_model_class,
    builtin_checkpoint_conversions,
    builtin_conversion_exists,
    causal_lm_loss,
    default_apply_gate,
    model_types_by_module,
    modeling_files,
    revert_builtin_conversion,
    transformers_load_info_class,
)
from modelgraft._compat.wraps import CONSTRUCTION, CONVERSION, LOADERS, RECORDERS

#: transformers ships its own ``monkey_patching`` module (5.3 on).
HAS_BUILTIN_PATCHING = FEATURES.builtin_patching
#: transformers converts checkpoint layouts itself (``WeightConverter``, ``conversion_mapping``,
#: ``revert_weight_conversion`` on save): every 5.x. On 4.57 a checkpoint key maps to one parameter.
HAS_BUILTIN_CONVERSION = FEATURES.builtin_conversion
#: MoE experts are one module with 3D parameters (5.x) rather than a ``ModuleList`` of per-expert
#: MLPs (4.57). Checkpoints use per-expert keys on both.
FUSED_MOE_EXPERTS = FEATURES.fused_experts

__all__ = [
    "CONSTRUCTION",
    "CONVERSION",
    "FEATURES",
    "FUSED_MOE_EXPERTS",
    "HAS_BUILTIN_CONVERSION",
    "HAS_BUILTIN_PATCHING",
    "IS_V5",
    "LOADERS",
    "RECORDERS",
    "SUPPORTED_RANGES",
    "TRANSFORMERS",
    "TRANSFORMERS_MAJOR",
    "TRANSFORMERS_VERSION",
    "ConversionEngine",
    "Features",
    "LoadRequest",
    "TransformersLine",
    "auto_model_class",
    "builtin_checkpoint_conversions",
    "builtin_conversion_exists",
    "causal_lm_loss",
    "check_supported",
    "default_apply_gate",
    "is_supported",
    "model_types_by_module",
    "modeling_files",
    "restore_class_tables",
    "revert_builtin_conversion",
    "transformers_load_info_class",
]
