"""Root pytest configuration: modules that exist for one transformers line only.

``--doctest-modules`` imports every module under ``src/modelgraft``. A module that wires
modelgraft into the internals of one transformers line cannot be imported on the other; it is
left out of collection there, and the run says so in its header and summary (never silently).
A doctest whose example only exists on 5.x is reported as skipped, with its reason, on 4.57.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from _pytest.doctest import DoctestItem

from modelgraft import _compat

_ROOT = Path(__file__).resolve().parent
# path -> why it cannot be collected on the other line
_V5_ONLY = {
    "src/modelgraft/_compat/_conversion_v5.py": "wires the conversion engine into transformers 5.x "
    "(`conversion_mapping`, `revert_weight_conversion`); 4.57 uses `modelgraft/_compat/_conversion_v4.py`",
    "src/modelgraft/_compat/_v5.py": "the transformers 5.x line (it re-exports `_conversion_v5`'s wiring); "
    "4.57 uses `modelgraft/_compat/_v4.py`",
}
_NOT_HERE = {} if _compat.IS_V5 else _V5_ONLY
if importlib.util.find_spec("trl") is None:  # the `trl` extra (TRL needs Python 3.11+)
    _NOT_HERE = {
        **_NOT_HERE,
        "src/modelgraft/integrations/trl.py": "needs `trl` (pip install 'modelgraft[trl]'; Python 3.11+)",
    }

_FUSED = "shows fused 3D MoE experts of transformers 5.x; 4.57 already builds per-expert `nn.Linear` experts"
# doctest name -> why its example needs transformers 5.x (the test is reported as skipped on 4.57)
_V5_ONLY_DOCTESTS = {
    "modelgraft.grafts.linear_experts": _FUSED,
    "modelgraft.grafts.linear_experts.linear_experts": _FUSED,
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _compat.IS_V5:
        return
    for item in items:
        why = _V5_ONLY_DOCTESTS.get(item.name)
        if why is not None and isinstance(item, DoctestItem):
            item.add_marker(pytest.mark.skip(reason=f"needs transformers 5.x: {why}"))


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    try:
        rel = collection_path.resolve().relative_to(_ROOT).as_posix()
    except ValueError:  # outside the repository
        return None
    return True if rel in _NOT_HERE else None


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [f"transformers {_compat.TRANSFORMERS_VERSION}"] + [
        f"not collected on this version: {path} ({why})" for path, why in _NOT_HERE.items()
    ]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for path, why in _NOT_HERE.items():
        terminalreporter.write_line(
            f"NOT COLLECTED on transformers {_compat.TRANSFORMERS_VERSION}: {path} ({why})"
        )
