"""What differs between the supported transformers versions, in one place.

The rest of modelgraft asks this module instead of branching on versions itself.

Example:
    >>> from modelgraft import _compat
    >>> _compat.TRANSFORMERS_MAJOR in (4, 5)
    True
"""

from __future__ import annotations

import transformers
from packaging.version import Version

from modelgraft.errors import UnsupportedTransformersError

SUPPORTED_RANGES = ">=4.57,<4.58 or >=5.0,<6"

TRANSFORMERS_VERSION = Version(transformers.__version__)
TRANSFORMERS_MAJOR = TRANSFORMERS_VERSION.major
IS_V5 = TRANSFORMERS_MAJOR == 5


def check_supported(version: Version = TRANSFORMERS_VERSION) -> None:
    """Raise :class:`UnsupportedTransformersError` unless ``version`` is supported."""
    ok = (version.major == 4 and version.minor == 57) or version.major == 5
    if not ok:
        raise UnsupportedTransformersError(
            f"modelgraft supports transformers {SUPPORTED_RANGES}; found `{version}`. "
            "Install a supported release, e.g. `pip install 'transformers>=5,<6'`."
        )


check_supported()
