"""PEFT's wrapped attributes (_compat/peft.py): exactly the table, installed whenever PEFT is imported.

Run in fresh interpreters, so that PEFT is imported after modelgraft (the import hook's case) or
before it (wrapped at once), and removal restores every original. A PEFT module that cannot be
imported with the installed transformers (its v5 conversion module on 4.57) has nothing wrapped.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("peft", reason="peft is not installed")

IMPORT_PEFT = """
import peft
try:
    import peft.utils.transformers_weight_conversion
except ImportError:
    pass
"""

CHECK = """
import importlib, sys
from modelgraft._compat.peft import PEFT, PEFT_SITES
from modelgraft._compat._wrapping import is_wrapped

def value(site):
    owner = sys.modules[site.module]
    *path, name = site.attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    return vars(owner)[name]

assert PEFT.installed
present = [s for s in PEFT_SITES if s.module in sys.modules]
assert {s.module for s in present} >= {"peft.peft_model", "peft.tuners.tuners_utils"}
assert [s.attribute for s in present if is_wrapped(value(s))] == [s.attribute for s in present]
installed = {id(value(s)) for s in present}
for name in {s.module for s in present}:  # nothing else of those modules is modelgraft's
    for attr, obj in vars(sys.modules[name]).items():
        # (a module importing a wrapped function by name holds the wrapper itself)
        assert not is_wrapped(obj) or id(obj) in installed, (name, attr)
PEFT.uninstall()
assert not PEFT.installed and not any(is_wrapped(value(s)) for s in present)
print("ok", len(present))
"""


@pytest.mark.parametrize("peft_first", [False, True], ids=["peft after modelgraft", "peft before modelgraft"])
def test_every_peft_site_is_wrapped_whichever_is_imported_first_and_restored(peft_first: bool) -> None:
    imports = [IMPORT_PEFT, "import modelgraft.grafts\n"]
    code = "".join(imports[::-1] if not peft_first else imports) + CHECK
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[0] == "ok"
