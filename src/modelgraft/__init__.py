"""modelgraft: swap the building blocks of Hugging Face transformers models at load time.

Importing modelgraft installs its load hooks into transformers (idempotent; see
``modelgraft.hooks``).

The public API is six namespaces, each exactly its ``__all__``: ``modelgraft`` (this module),
``modelgraft.grafts`` (ready-made grafts), ``modelgraft.moe`` (MoE routing record/replay),
``modelgraft.porting`` (transformers' conversion API, for ported code), ``modelgraft.testing``
(tiny configs for tests) and ``modelgraft.integrations.trl`` (routing replay in TRL, where TRL is
installed). docs/api.md lists every name, and a test keeps the two equal. Every other module, and every name outside those ``__all__`` lists, is private and may
change without notice. Every error modelgraft raises is exported here.
"""

from __future__ import annotations

import importlib.metadata as _metadata

from modelgraft import _compat  # noqa: F401  (fails early on an unsupported transformers)
from modelgraft.conversion import (
    Chunk,
    Concatenate,
    ConversionContext,
    ConversionOperation,
    MergeModulelist,
    SplitModulelist,
    Transpose,
    WeightConverter,
    WeightRenaming,
    get_checkpoint_conversion_mapping,
    register_checkpoint_conversion_mapping,
    unregister_checkpoint_conversion_mapping,
)
from modelgraft.errors import (
    ConversionError,
    ConversionShapeError,
    DoubleBackwardError,
    ExpertsAdapterError,
    ExpertsImplementationError,
    FusionError,
    GraftConflictError,
    GraftError,
    GraftStateError,
    IrreversibleConversionError,
    LossInputError,
    MissingSourceKeyError,
    OperationModelError,
    PatchRegistrationError,
    ReplacementTypeError,
    RoutingError,
    RoutingFileError,
    StrictModeError,
    TargetError,
    TargetTypeError,
    UnexpectedArgumentError,
    UnknownModelTypeError,
    UnsafePatternError,
    UnsupportedFamilyError,
    UnsupportedTransformersError,
    VerifyArgumentError,
    WrappedModelError,
)
from modelgraft.graft import Graft, register_graft, unregister_graft
from modelgraft.hooks import apply_patches, patched, unpatched
from modelgraft.inplace import graft_model
from modelgraft.recorders import patch_output_recorders
from modelgraft.registry import (
    clear_patch_mapping,
    get_patch_mapping,
    register_patch_mapping,
    unregister_patch_mapping,
)
from modelgraft.report import GraftReport, report
from modelgraft.state_load import load_original_state_dict
from modelgraft.swap import add_scope_prefix, remove_scope_prefix
from modelgraft.verify import VerifyReport, verify
from modelgraft.weight_sync import original_state_dict

# Each area appends its public names in its own block below; keep __all__ sorted at the end.
__all__ = [
    "Chunk",
    "Concatenate",
    "ConversionContext",
    "ConversionError",
    "ConversionOperation",
    "ConversionShapeError",
    "DoubleBackwardError",
    "ExpertsAdapterError",
    "ExpertsImplementationError",
    "FusionError",
    "Graft",
    "GraftConflictError",
    "GraftError",
    "GraftReport",
    "GraftStateError",
    "IrreversibleConversionError",
    "LossInputError",
    "MergeModulelist",
    "MissingSourceKeyError",
    "OperationModelError",
    "PatchRegistrationError",
    "ReplacementTypeError",
    "RoutingError",
    "RoutingFileError",
    "SplitModulelist",
    "StrictModeError",
    "TargetError",
    "TargetTypeError",
    "Transpose",
    "UnexpectedArgumentError",
    "UnknownModelTypeError",
    "UnsafePatternError",
    "UnsupportedFamilyError",
    "UnsupportedTransformersError",
    "VerifyArgumentError",
    "VerifyReport",
    "WeightConverter",
    "WeightRenaming",
    "WrappedModelError",
    "__version__",
    "add_scope_prefix",
    "apply_patches",
    "clear_patch_mapping",
    "get_checkpoint_conversion_mapping",
    "get_patch_mapping",
    "graft_model",
    "load_original_state_dict",
    "original_state_dict",
    "patch_output_recorders",
    "patched",
    "register_checkpoint_conversion_mapping",
    "register_graft",
    "register_patch_mapping",
    "remove_scope_prefix",
    "report",
    "unpatched",
    "unregister_checkpoint_conversion_mapping",
    "unregister_graft",
    "unregister_patch_mapping",
    "verify",
]

from modelgraft import hooks as _hooks  # installed last, once every part is imported

_hooks.install()

# The version of the installed distribution: pyproject.toml's `version` is its one source.
try:
    __version__ = _metadata.version("modelgraft")
except _metadata.PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"
