"""Which transformers is installed, whether modelgraft supports it, and what it has.

Importing this module checks the installed version (so ``import modelgraft`` fails early, with
the supported ranges, on an unsupported transformers). It reads ``transformers.__version__`` only:
importing it loads no modeling code.

Example:
    >>> from modelgraft._compat import _version
    >>> _version.TRANSFORMERS_MAJOR in (4, 5), _version.IS_V5 == (_version.TRANSFORMERS_MAJOR == 5)
    (True, True)
"""

from __future__ import annotations

import os

import transformers
from packaging.version import Version

from modelgraft.errors import UnsupportedTransformersError

__all__ = [
    "IS_V5",
    "MINIMUM_V5",
    "SUPPORTED_RANGES",
    "TRANSFORMERS_MAJOR",
    "TRANSFORMERS_VERSION",
    "check_supported",
    "is_supported",
]

SUPPORTED_RANGES = ">=4.57,<4.58 or >=5.13,<6"
#: The first 5.x minor release the version walk (``make test-versions``) proves; older 5.x releases
#: are refused rather than guessed at (see docs/compat.md for what the walk measured on them).
MINIMUM_V5 = (5, 13)

TRANSFORMERS_VERSION = Version(transformers.__version__)
TRANSFORMERS_MAJOR = TRANSFORMERS_VERSION.major
IS_V5 = TRANSFORMERS_MAJOR == 5


def is_supported(version: Version | str = TRANSFORMERS_VERSION) -> bool:
    """Whether modelgraft supports this transformers version (pre-releases of a supported line count).

    Example:
        >>> is_supported("4.57.6"), is_supported("5.13.1"), is_supported("5.25.0")
        (True, True, True)
        >>> is_supported("4.56.2"), is_supported("5.12.1"), is_supported("6.0.0")
        (False, False, False)
    """
    version = Version(str(version))
    line = (version.major, version.minor)
    return line == (4, 57) or (version.major == 5 and line >= MINIMUM_V5)


def check_supported(version: Version | str = TRANSFORMERS_VERSION) -> None:
    """Raise :class:`~modelgraft.errors.UnsupportedTransformersError` unless ``version`` is supported.

    Runs when modelgraft is imported, so an unsupported transformers fails early with a message
    that says which versions work.

    Example:
        >>> check_supported("5.13.1")
        >>> check_supported("5.5.4")
        Traceback (most recent call last):
        ...
        modelgraft.errors.UnsupportedTransformersError: modelgraft supports transformers >=4.57,<4.58 or >=5.13,<6; found `5.5.4`. ...
    """
    if not is_supported(version):
        raise UnsupportedTransformersError(
            f"modelgraft supports transformers {SUPPORTED_RANGES}; found `{version}`. "
            "Install a supported release, e.g. `pip install 'transformers>=5.13,<6'` "
            "(or `pip install 'transformers~=4.57.0'` to stay on 4.x)."
        )


# The version walk's probe (``tools/version_walk.py --probe``) runs the smoke subset on a refused
# release to find where the declared minimum can move; nothing else sets this.
if os.environ.get("MODELGRAFT_UNSUPPORTED_TRANSFORMERS_PROBE") != "1":
    check_supported()
