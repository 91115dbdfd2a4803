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
    "GraftError",
    "IrreversibleConversionError",
    "MissingSourceKeyError",
    "PatchRegistrationError",
    "ReplacementTypeError",
    "RoutingError",
    "StrictModeError",
    "UnsupportedTransformersError",
]


class GraftError(Exception):
    """Base class of every error modelgraft raises on purpose."""


class PatchRegistrationError(GraftError, ValueError):
    """A patch key is invalid, duplicated, or unknown (registry left unchanged)."""


class ReplacementTypeError(GraftError, TypeError):
    """A replacement is not a class, or not a subclass of ``torch.nn.Module``."""


class ConversionError(GraftError, ValueError):
    """A checkpoint conversion rule is invalid or could not be applied."""


class MissingSourceKeyError(ConversionError):
    """A converter needs a checkpoint key that the checkpoint does not hold."""


class ConversionShapeError(ConversionError):
    """A converted tensor does not fit the parameter it is meant for."""


class IrreversibleConversionError(ConversionError, NotImplementedError):
    """A conversion has no reverse, so the original layout cannot be written."""


class StrictModeError(GraftError, RuntimeError):
    """Strict mode found a problem (dropped weights, uninitialised parameters, unused keys)."""


class RoutingError(GraftError, ValueError):
    """MoE routing data does not fit the model (layers, tokens, top-k, expert ids)."""


class UnsupportedTransformersError(GraftError, ImportError):
    """The installed transformers version is not one modelgraft supports."""
