"""Exceptions raised by modelgraft.

Every error subclasses :class:`GraftError` *and* the builtin a caller would naturally catch
(``ValueError``, ``TypeError``, ...), so ``except ValueError`` keeps working for code written
against ``transformers.monkey_patching``.

Example:
    >>> from modelgraft.errors import GraftError, PatchRegistrationError
    >>> issubclass(PatchRegistrationError, ValueError) and issubclass(PatchRegistrationError, GraftError)
    True
"""

from __future__ import annotations

__all__ = [
    "ConversionError",
    "ConversionShapeError",
    "DoubleBackwardError",
    "ExpertsAdapterError",
    "ExpertsImplementationError",
    "FusionError",
    "GraftConflictError",
    "GraftError",
    "GraftStateError",
    "IrreversibleConversionError",
    "LossInputError",
    "MissingSourceKeyError",
    "OperationModelError",
    "PatchRegistrationError",
    "ReplacementTypeError",
    "RoutingError",
    "RoutingFileError",
    "StrictModeError",
    "TargetError",
    "TargetTypeError",
    "UnexpectedArgumentError",
    "UnknownModelTypeError",
    "UnsafePatternError",
    "UnsupportedFamilyError",
    "UnsupportedTransformersError",
    "VerifyArgumentError",
    "WrappedModelError",
]


class GraftError(Exception):
    """Base class of every error modelgraft raises on purpose."""


class PatchRegistrationError(GraftError, ValueError):
    """A patch key is invalid, duplicated, or unknown (registry left unchanged)."""


class ReplacementTypeError(GraftError, TypeError):
    """A replacement is not a class, not a subclass of ``torch.nn.Module``, or cannot be built
    with the arguments transformers passes to the class it replaces."""


class ConversionError(GraftError, ValueError):
    """A checkpoint conversion rule is invalid or could not be applied."""


class MissingSourceKeyError(ConversionError):
    """A converter needs a checkpoint key that the checkpoint does not hold."""


class ConversionShapeError(ConversionError):
    """A converted tensor does not fit the parameter it is meant for."""


class IrreversibleConversionError(ConversionError, NotImplementedError):
    """A conversion has no reverse, so the original layout cannot be written."""


class OperationModelError(ConversionError, AttributeError):
    """An operation written for transformers reads the model (``model.get_parameter``) where
    modelgraft cannot answer: only the target parameters' shapes are known, on load, to a
    converter's last operation (an ``AttributeError``, as the ``None`` model gave before)."""


class StrictModeError(GraftError, RuntimeError):
    """Strict mode found a problem (dropped weights, uninitialised parameters, unused keys)."""


class RoutingError(GraftError, ValueError):
    """MoE routing data does not fit the model (layers, tokens, top-k, expert ids)."""


class RoutingFileError(RoutingError, FileNotFoundError):
    """A routing trace path that does not exist or is a folder (``RoutingTrace.load``, the CLI's
    ``compare-routing``); a ``RoutingError`` like every other bad trace file, and a
    ``FileNotFoundError`` as the missing file was before."""


class UnsupportedTransformersError(GraftError, ImportError):
    """The installed transformers version is not one modelgraft supports."""


class UnknownModelTypeError(GraftError, KeyError):
    """A ``model_type`` that the installed transformers does not know (``modelgraft.testing``)."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0]) if self.args else ""


class UnsupportedFamilyError(GraftError, ValueError):
    """A ready-made graft was asked for a model type it cannot handle (``modelgraft.grafts``)."""


class ExpertsImplementationError(UnsupportedFamilyError):
    """``linear_experts`` cannot run the requested ``experts_implementation`` (``modelgraft.grafts``)."""


class ExpertsAdapterError(UnsupportedFamilyError):
    """A PEFT adapter of fused 3D experts met a model whose experts ``linear_experts`` split (``modelgraft.grafts``)."""


class GraftConflictError(GraftError, ValueError):
    """Two grafts replace the same class with different replacements (``modelgraft.grafts``)."""


class FusionError(GraftError, TypeError):
    """Layers cannot be fused: missing, not ``nn.Linear``, or disagreeing (``modelgraft.grafts``)."""


class GraftStateError(GraftError, ValueError):
    """``graft_model`` cannot carry a module's state (per-parameter flags, hooks) into its
    replacement exactly; the model is left unchanged."""


class TargetError(GraftError, ValueError):
    """A model type, path or ``package.module:NAME`` reference could not be resolved
    (:func:`modelgraft.verify`, the command line)."""


class TargetTypeError(TargetError, TypeError):
    """A target that is no model type, path or config at all (``verify(42, graft)``)."""


class VerifyArgumentError(GraftError, ValueError):
    """An argument of :func:`modelgraft.verify` is out of range: a tolerance that is negative or not finite, a bad seed."""


class WrappedModelError(GraftError, TypeError):
    """A model wrapped by PEFT (``PeftModel``, ``LoraModel``) given where modelgraft needs the model
    itself (``graft_model``); the message says to graft before wrapping or to pass ``get_base_model()``."""


class UnexpectedArgumentError(GraftError, TypeError):
    """A keyword argument a modelgraft function does not take, such as ``verify(..., graft=...)``
    (a ``TypeError``, as Python's own; the message says what to pass instead)."""


class LossInputError(GraftError, ValueError):
    """Labels or arguments that the chunked loss cannot take (``modelgraft.grafts``)."""


class DoubleBackwardError(GraftError, RuntimeError):
    """A backward with ``create_graph=True`` through the chunked loss (its gradients are precomputed)."""


class UnsafePatternError(GraftError, ValueError):
    """A patch-key pattern can backtrack catastrophically (the message says which shape).

    Registration reports it as :class:`PatchRegistrationError`; it reaches callers of the pattern
    checker directly."""
