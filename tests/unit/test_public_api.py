"""The public contract (issue 14, point 5), checked against docs/api.md and the package itself.

* docs/api.md names the public namespaces; each one's ``__all__`` equals the names the page lists
  for it (parsed from the page), and every name in ``__all__`` exists;
* every exception class defined in the package is exported from ``modelgraft`` and subclasses both
  ``modelgraft.GraftError`` and a builtin exception (``ValueError``, ``TypeError``, ...);
* the package ships ``py.typed``, and the type check is ``mypy --strict`` on our own code with no
  module of ours exempted.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
import sys
from dataclasses import is_dataclass
from pathlib import Path

import pytest

import modelgraft
from modelgraft.errors import GraftError

ROOT = Path(__file__).resolve().parents[2]
API_DOC = ROOT / "docs" / "api.md"
PACKAGE = ROOT / "src" / "modelgraft"
NAMESPACES = (
    "modelgraft",
    "modelgraft.grafts",
    "modelgraft.moe",
    "modelgraft.porting",
    "modelgraft.testing",
    "modelgraft.integrations.trl",
)

#: Exception classes that never leave the package, with the reason. Each is a private name caught
#: where it is raised; a new entry needs the same justification.
NOT_EXPORTED = {
    ("modelgraft.cli", "_UsageError"): "argparse's usage error; main() always turns it into exit code 2",
}


def _import(namespace: str) -> object:
    if namespace == "modelgraft.integrations.trl":
        pytest.importorskip("trl", reason="the `trl` extra is not installed (TRL needs Python 3.11+)")
    return importlib.import_module(namespace)


def _documented() -> dict[str, list[str]]:
    """``{namespace: [names listed under its heading]}`` from docs/api.md."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in API_DOC.read_text().splitlines():
        heading = re.fullmatch(r"## `([\w.]+)`", line)
        if heading:
            current = sections.setdefault(heading.group(1), [])
        elif line.startswith("## "):
            current = None
        elif current is not None and (item := re.match(r"- `(\w+)`: \S", line)):
            current.append(item.group(1))
    return sections


def test_doc_names_exactly_the_public_namespaces() -> None:
    assert tuple(_documented()) == NAMESPACES


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_all_equals_the_documented_list(namespace: str) -> None:
    module = _import(namespace)
    documented = _documented()[namespace]
    assert len(documented) == len(set(documented)), f"a name is listed twice under `{namespace}`"
    assert len(module.__all__) == len(set(module.__all__)), f"`{namespace}.__all__` repeats a name"
    missing_from_doc = sorted(set(module.__all__) - set(documented))
    not_public = sorted(set(documented) - set(module.__all__))
    assert (missing_from_doc, not_public) == ([], []), (
        f"`{namespace}`: in __all__ but not in docs/api.md: {missing_from_doc}; "
        f"in docs/api.md but not in __all__: {not_public}"
    )


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_every_public_name_exists(namespace: str) -> None:
    module = _import(namespace)
    absent = [name for name in module.__all__ if not hasattr(module, name)]
    assert absent == []


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _defined_classes() -> dict[str, list[str]]:
    """``{module: [top-level class names]}`` for every module of the package (parsed, not imported)."""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        names = [node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
        found[_module_name(path)] = names
    return found


def _exception_classes() -> list[type[BaseException]]:
    """Every exception class defined in the package, from each module that imports on this line.

    The per-version modules of the other transformers line cannot be imported; the AST test below
    covers their class names.
    """
    classes: list[type[BaseException]] = []
    for module_name, names in _defined_classes().items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name in names:
            obj = getattr(module, name, None)
            if isinstance(obj, type) and issubclass(obj, BaseException) and obj.__module__ == module_name:
                classes.append(obj)
    return classes


def test_the_walk_finds_the_errors() -> None:
    # Guards the walk itself: errors defined in errors.py and elsewhere are all seen.
    found = {cls.__name__ for cls in _exception_classes()}
    assert {"GraftError", "ConversionShapeError", "RoutingError", "GraftStateError", "_UsageError"} <= found


def test_every_exception_is_exported_from_modelgraft() -> None:
    unexported = [
        f"{cls.__module__}.{cls.__qualname__}"
        for cls in _exception_classes()
        if (cls.__module__, cls.__qualname__) not in NOT_EXPORTED
        and (cls.__name__ not in modelgraft.__all__ or getattr(modelgraft, cls.__name__) is not cls)
    ]
    assert unexported == [], "export these from modelgraft (and list them in docs/api.md)"


def test_every_exception_subclasses_graft_error_and_a_builtin() -> None:
    # No exemption: the private ones (NOT_EXPORTED) too (issue 21: 6, one base error).
    wrong = []
    for cls in _exception_classes():
        builtin = [
            base
            for base in cls.__mro__
            if base.__module__ == "builtins" and base not in (Exception, BaseException, object)
        ]
        if cls is not GraftError and not (issubclass(cls, GraftError) and builtin):
            wrong.append(cls.__qualname__)
    assert wrong == [], "each must subclass GraftError and the builtin a caller would catch"


def test_errors_keep_their_old_import_paths() -> None:
    from modelgraft import grafts, testing
    from modelgraft._model_lookup import TargetError
    from modelgraft._safe_regex import UnsafePatternError
    from modelgraft.grafts._chunked_ce import DoubleBackwardError, LossInputError
    from modelgraft.verify import VerifyArgumentError

    assert (UnsafePatternError, TargetError, VerifyArgumentError) == (
        modelgraft.UnsafePatternError,
        modelgraft.TargetError,
        modelgraft.VerifyArgumentError,
    )
    assert (DoubleBackwardError, LossInputError) == (grafts.DoubleBackwardError, grafts.LossInputError)
    assert (grafts.FusionError, testing.UnknownModelTypeError) == (
        modelgraft.FusionError,
        modelgraft.UnknownModelTypeError,
    )
    # The experts errors moved from the modules that raise them; linear_experts re-exported both.
    from modelgraft.grafts.linear_experts import ExpertsAdapterError, ExpertsImplementationError

    assert (ExpertsAdapterError, ExpertsImplementationError) == (
        modelgraft.ExpertsAdapterError,
        modelgraft.ExpertsImplementationError,
    )
    assert (grafts.ExpertsAdapterError, grafts.ExpertsImplementationError) == (
        modelgraft.ExpertsAdapterError,
        modelgraft.ExpertsImplementationError,
    )


def test_no_private_exception_outside_the_known_list() -> None:
    # Also covers the modules of the other transformers line, which the runtime walk cannot import.
    private = {
        (module, name)
        for module, names in _defined_classes().items()
        for name in names
        if name.startswith("_") and re.search(r"(Error|Exception)$", name)
    }
    assert private == set(NOT_EXPORTED)


def test_package_ships_py_typed() -> None:
    assert (PACKAGE / "py.typed").is_file()
    if sys.version_info < (3, 11):
        pytest.skip("tomllib is Python 3.11+; the file check above still ran")
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in config["tool"]["setuptools"]["package-data"]["modelgraft"]


def test_type_check_is_strict_on_all_of_our_code() -> None:
    if sys.version_info < (3, 11):
        pytest.skip("tomllib is Python 3.11+")
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mypy = config["tool"]["mypy"]
    assert mypy["strict"] is True
    assert mypy["files"] == ["src/modelgraft"]
    for override in mypy.get("overrides", []):
        modules = override["module"] if isinstance(override["module"], list) else [override["module"]]
        ours = [m for m in modules if m.split(".")[0] == "modelgraft"]
        assert not (ours and (override.get("ignore_errors") or override.get("strict") is False)), override
    assert "mypy" in (ROOT / "Makefile").read_text().split("\nlint:")[1].split("\n\n")[0]


# ---- options are keyword-only (issue 21: 6) ---------------------------------------------------------

#: Parameters with a default that may still be passed by position, with the reason. Everything else
#: after a public function's primary arguments is keyword-only (``*``), as huggingface/kernels and
#: safetensors do. ``modelgraft.porting`` is not walked: it keeps transformers' signatures exactly.
POSITIONAL_DEFAULTS = {
    # transformers' own signatures, kept so that ported code runs after changing the import line
    "modelgraft.register_patch_mapping": {"overwrite"},  # transformers.monkey_patching
    "modelgraft.register_checkpoint_conversion_mapping": {"overwrite"},  # transformers.conversion_mapping
    "modelgraft.WeightConverter": {"operations"},  # WeightConverter(sources, targets, operations)
    "modelgraft.Chunk": {"dim", "chunks"},  # conversion ops are their fields, as transformers' ops
    "modelgraft.Concatenate": {"dim"},
    "modelgraft.MergeModulelist": {"dim"},
    "modelgraft.SplitModulelist": {"dim"},
    "modelgraft.Transpose": {"dim0", "dim1", "check_dims"},
    "modelgraft.integrations.trl.RoutingReplayMixin.training_step": {"num_items_in_batch"},  # Trainer's
    # primary arguments that may be omitted: the graft (a mapping and its conversions) ...
    "modelgraft.Graft": {"mapping", "conversions"},
    "modelgraft.grafts.Graft": {"mapping", "conversions"},
    "modelgraft.graft_model": {"mapping", "conversions"},
    "modelgraft.patched": {"conversions"},
    "modelgraft.verify": {"mapping", "conversions"},
    # ... the model a routing belongs to, how a batch is packed, the trace's layer ids
    "modelgraft.moe.from_vllm": {"model"},
    "modelgraft.moe.from_sglang": {"model"},
    "modelgraft.moe.pack_routes": {"packs"},
    "modelgraft.moe.pack_sequences": {"packs"},
    "modelgraft.moe.RoutingTrace": {"layer_ids"},
    "modelgraft.moe.RoutingTrace.pack": {"packs"},
    "modelgraft.moe.RoutingTrace.append_positions": {"count"},
}

#: Result types modelgraft builds and hands out; their constructors are not part of the API.
RESULT_TYPES = {"GraftReport", "VerifyReport", "RoutingComparison"}


def _public_signatures() -> dict[str, inspect.Signature]:
    found: dict[str, inspect.Signature] = {}
    for namespace in NAMESPACES:
        if namespace == "modelgraft.porting":
            continue
        if namespace == "modelgraft.integrations.trl" and importlib.util.find_spec("trl") is None:
            continue
        module = importlib.import_module(namespace)
        for name in module.__all__:
            obj = getattr(module, name)
            if (isinstance(obj, type) and issubclass(obj, BaseException)) or name in RESULT_TYPES:
                continue
            if isinstance(obj, type):
                if is_dataclass(obj) or getattr(obj.__init__, "__module__", "").startswith("modelgraft"):
                    found[f"{namespace}.{name}"] = inspect.signature(obj)
                for attr, value in vars(obj).items():
                    func = value.__func__ if isinstance(value, classmethod | staticmethod) else value
                    if not attr.startswith("_") and inspect.isfunction(func):
                        found[f"{namespace}.{name}.{attr}"] = inspect.signature(func)
            elif inspect.isfunction(obj):
                found[f"{namespace}.{name}"] = inspect.signature(obj)
    return found


def test_options_are_keyword_only() -> None:
    signatures = _public_signatures()
    # the walk sees functions, constructors and methods
    assert {"modelgraft.verify", "modelgraft.moe.RoutingTrace", "modelgraft.Graft.register"} <= set(
        signatures
    )
    if importlib.util.find_spec("trl") is not None:  # a constructor inherited from a private base
        assert "modelgraft.integrations.trl.RoutingReplayRLOOTrainer" in signatures
    positional = {
        f"{where}({param.name}=...)"
        for where, signature in signatures.items()
        for param in signature.parameters.values()
        if param.default is not inspect.Parameter.empty
        and param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD)
        and param.name not in POSITIONAL_DEFAULTS.get(where, ())
    }
    assert positional == set(), "make these keyword-only (after `*`), or justify them in POSITIONAL_DEFAULTS"
    stale = {where for where in POSITIONAL_DEFAULTS if where not in signatures}
    if importlib.util.find_spec("trl") is None:
        stale = {w for w in stale if not w.startswith("modelgraft.integrations.trl")}
    assert stale == set(), "POSITIONAL_DEFAULTS names something that is no longer public"


def test_api_doc_names_the_base_error_first() -> None:
    errors = API_DOC.read_text().split("## Errors", 1)[1]
    first = re.search(r"`(?:modelgraft\.)?(\w+Error)`", errors)
    assert first is not None and first.group(1) == "GraftError"
    assert _documented()["modelgraft"][0] == "GraftError"
