"""The shape of the package's imports (issue 14: layers, no cycles, the transformers boundary).

Every module under ``src/modelgraft`` is parsed with :mod:`ast` (nothing is imported), so a cycle
or a layer violation is found whether or not a test happens to import the modules involved:

* the import graph has no cycle: neither the module-level graph (what runs at import time) nor
  the graph that also counts imports inside functions (a deferred import hides a dependency, it
  does not remove it); ``if TYPE_CHECKING:`` blocks are skipped;
* ``modelgraft._compat`` (the transformers boundary, the bottom layer) imports nothing of
  modelgraft above it, anywhere in its code;
* no module outside ``_compat`` imports a transformers submodule: only public names of the
  top-level ``transformers`` package (``from transformers import AutoConfig``);
* every module sits in one layer of :data:`LAYERS` (the layers of docs/architecture.md, as data)
  and imports only from its own layer or the layers below it, deferred imports included; the
  architecture page lists every module in its layer.

A fresh ``import modelgraft`` must not resolve transformers' Auto model classes (``modeling_auto``
stays unimported), so importing modelgraft costs no more of transformers than it needs.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "modelgraft"
#: What the bottom layer may import from the rest of modelgraft: leaves that import nothing of it.
COMPAT_MAY_IMPORT = {"modelgraft.errors", "modelgraft._forksafe"}

#: The layers of the package, bottom first: a module imports only from its own layer and the ones
#: below. Each lists modules (a package name covers its whole package); the deepest match wins.
#: docs/architecture.md draws the same layers and names every module.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "leaves",
        (
            "modelgraft.errors",
            "modelgraft._forksafe",
            "modelgraft._safe_regex",
            "modelgraft._registry_snapshot",
            "modelgraft.report",
            "modelgraft._compare",
            "modelgraft._model_lookup",
        ),
    ),
    ("transformers boundary", ("modelgraft._compat",)),
    (
        "registry and class swap",
        ("modelgraft.registry", "modelgraft.swap", "modelgraft.recorders", "modelgraft._families"),
    ),
    ("conversion", ("modelgraft.conversion", "modelgraft.graft")),
    (
        "loading, in-place grafts, weight sync, porting",
        (
            "modelgraft.hooks",
            "modelgraft.inplace",
            "modelgraft._inplace_state",
            "modelgraft._inplace_optim",
            "modelgraft.weight_sync",
            "modelgraft._peft_sync",
            "modelgraft.state_load",
            "modelgraft.porting",
            "modelgraft._porting_mapping",
            "modelgraft._porting_load",
        ),
    ),
    ("features", ("modelgraft.grafts", "modelgraft.moe", "modelgraft.verify", "modelgraft.testing")),
    ("entry points", ("modelgraft", "modelgraft.cli", "modelgraft.__main__", "modelgraft.integrations")),
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _targets(node: ast.Import | ast.ImportFrom, module: str) -> list[str]:
    """The modules an import statement loads: ``from a import b`` is ``a.b`` when that is a module
    of the package, else ``a`` (``b`` is then a name defined in ``a``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: resolved against the importing module's package
        package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
        parts = package.split(".")
        base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, module: str, module_level_only: bool) -> Iterator[tuple[str, int]]:
    """``(imported module, line)`` for each import of ``tree``."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield from ((t, node.lineno) for t in _targets(node, module))
            continue
        if isinstance(node, ast.If) and _is_type_checking(node):
            continue
        if module_level_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        stack.extend(ast.iter_child_nodes(node))


def _own(name: str) -> str | None:
    """The package module that ``import name`` loads last (``modelgraft.x.Y`` -> ``modelgraft.x``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


TREES = {name: ast.parse(path.read_text(encoding="utf-8"), str(path)) for name, path in MODULES.items()}


def _graph(module_level_only: bool = True) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, tree in TREES.items():
        for target, _line in _imports(tree, name, module_level_only):
            found = _own(target)
            if found is not None and found != name:
                graph[name].add(found)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_a_cycle(graph, set(c)) for c in components]


def _a_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A closed path inside ``component``, starting from its smallest module."""
    start = min(component)
    path, seen = [start], {start}
    while True:
        step = min(w for w in graph[path[-1]] if w in component)
        if step in seen:
            return [*path[path.index(step) :], step]
        path.append(step)
        seen.add(step)


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_every_module_is_parsed_and_the_graph_has_edges() -> None:
    graph = _graph()
    assert {"modelgraft", "modelgraft._compat", "modelgraft.conversion.keys", "modelgraft.hooks"} <= set(
        graph
    )
    assert "modelgraft.conversion.scopes" in graph["modelgraft.conversion.save"]
    assert "modelgraft.conversion.load" not in graph["modelgraft.conversion.save"]


@pytest.mark.parametrize("module_level_only", [True, False], ids=["module-level", "with-deferred-imports"])
def test_the_package_has_no_import_cycle(module_level_only: bool) -> None:
    cycles = _cycles(_graph(module_level_only))
    for cycle in cycles:
        print("import cycle:", " -> ".join(cycle))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("modelgraft._compat")))
def test_the_transformers_boundary_imports_nothing_above_it(module: str) -> None:
    upward = sorted(
        f"{target} (line {line})"
        for target, line in _imports(TREES[module], module, module_level_only=False)
        if (own := _own(target)) is not None
        and not own.startswith("modelgraft._compat")
        and own not in COMPAT_MAY_IMPORT
    )
    assert not upward, f"`{module}` imports upward: {upward}"


def test_no_transformers_internals_outside_the_boundary() -> None:
    found = sorted(
        f"{module}: {target} (line {line})"
        for module, tree in TREES.items()
        if not module.startswith("modelgraft._compat")
        for target, line in _imports(tree, module, module_level_only=False)
        if target.startswith("transformers.") and _is_submodule(tree, target, line)
    )
    assert not found, "transformers internals imported outside `modelgraft._compat`: " + ", ".join(found)


def _is_submodule(tree: ast.AST, target: str, line: int) -> bool:
    """Whether the import at ``line`` loads ``target`` as a module (``import transformers.x`` or
    ``from transformers.x import y``), rather than naming ``target``'s last part as a public name
    of the top-level package (``from transformers import AutoConfig``)."""
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) != line:
            continue
        if isinstance(node, ast.ImportFrom) and node.module == "transformers" and not node.level:
            return False
    return True


def test_import_modelgraft_does_not_resolve_the_auto_model_classes() -> None:
    probe = (
        "import sys, modelgraft; "
        "print(sorted(m for m in sys.modules if m == 'transformers.models.auto.modeling_auto'))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


def _layer_of(module: str) -> int | None:
    """The index in :data:`LAYERS` of ``module`` (deepest listed prefix), or ``None``."""
    best: tuple[int, int] | None = None
    for index, (_name, members) in enumerate(LAYERS):
        for member in members:
            if (module == member or module.startswith(member + ".")) and (
                best is None or len(member) > best[0]
            ):
                best = (len(member), index)
    return None if best is None else best[1]


def test_every_module_is_in_a_layer() -> None:
    missing = sorted(m for m in MODULES if _layer_of(m) is None)
    assert not missing, f"modules in no layer (add them to LAYERS and docs/architecture.md): {missing}"


def test_the_layer_checker_finds_an_upward_import() -> None:
    assert _layer_of("modelgraft.conversion.load") == _layer_of("modelgraft.graft")
    assert _layer_of("modelgraft.moe.routing") > _layer_of("modelgraft.registry")  # type: ignore[operator]
    assert _layer_of("modelgraft") > _layer_of("modelgraft.moe")  # type: ignore[operator]


def test_imports_point_down_the_layers() -> None:
    upward = sorted(
        f"{module} ({LAYERS[low][0]}) imports {target} ({LAYERS[high][0]}) at line {line}"
        for module, tree in TREES.items()
        if (low := _layer_of(module)) is not None
        for target, line in _imports(tree, module, module_level_only=False)
        if (own := _own(target)) is not None
        and own != module
        and (high := _layer_of(own)) is not None
        and high > low
    )
    assert not upward, "imports pointing up a layer:\n" + "\n".join(upward)


def test_the_architecture_page_lists_every_module_in_its_layer() -> None:
    page = (SRC.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    sections = re.split(r"^### ", page, flags=re.M)
    listed: dict[str, str] = {}
    for section in sections[1:]:
        title = section.splitlines()[0].strip()
        for name in re.findall(r"`(modelgraft[\w.]*)`", section):
            listed.setdefault(name, title)
    layer_names = [name for name, _ in LAYERS]
    assert [t for t in (s.splitlines()[0].strip() for s in sections[1:]) if t in layer_names] == layer_names[
        ::-1
    ]
    wrong = sorted(
        f"{m}: page says {listed.get(m)!r}, LAYERS says {LAYERS[_layer_of(m)][0]!r}"  # type: ignore[index]
        for m in MODULES
        if listed.get(m) != LAYERS[_layer_of(m)][0]  # type: ignore[index]
    )
    assert not wrong, "docs/architecture.md does not list these modules in their layer:\n" + "\n".join(wrong)
