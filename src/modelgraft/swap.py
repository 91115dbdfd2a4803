"""Swap classes in module namespaces for the duration of a block, and restore them exactly.

Modeling code looks its building blocks up in its module's globals when a model is constructed
(``self.self_attn = LlamaAttention(...)``), so binding a replacement under that global name for the
duration of the construction is enough to build the model from the replacement.

Scope: the loaded ``transformers.models.*.modeling_*`` modules and ``transformers.integrations.*``,
remote-code modules (``transformers_modules.*``), the modules defining the model class being built
(see :meth:`Swap.add_class`), and package prefixes added with :func:`add_scope_prefix`.

Cost: each in-scope module is indexed once (the names bound to ``nn.Module`` subclasses, read from
its ``__dict__``, never ``dir()``), and re-indexed only when its namespace grows or shrinks. The
names that match a snapshot are cached per snapshot version, so a block whose registry did not
change costs a few dictionary operations per swapped binding. Nothing is imported by a scan.

Example:
    >>> import torch
    >>> from transformers.models.llama import modeling_llama
    >>> from modelgraft import registry, swap
    >>> class MyMLP(modeling_llama.LlamaMLP):
    ...     pass
    >>> with registry.scoped({"LlamaMLP": MyMLP}) as snap, swap.Swap(snap):
    ...     modeling_llama.LlamaMLP is MyMLP
    True
    >>> modeling_llama.LlamaMLP is MyMLP
    False
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType, TracebackType
from typing import Any

import torch

from modelgraft import _compat
from modelgraft._forksafe import ForkSafeLock
from modelgraft.errors import GraftError, ReplacementTypeError
from modelgraft.registry import Snapshot
from modelgraft.report import ReplacedModule

__all__ = [
    "LOCK",
    "STATS",
    "Swap",
    "add_scope_prefix",
    "in_scope_modules",
    "remove_scope_prefix",
    "replaced_modules",
    "suspended",
    "undecorated_init",
]


#: Serialises every construction that runs under patches (and every load through the hooks), so a
#: thread never builds from another thread's swapped classes. Re-entrant for nested loads; free
#: again in a forked child (see :func:`_after_fork_in_child`).
LOCK = ForkSafeLock()

#: Internal counters, for tests and benchmarks: ``scans`` counts plans computed (name matching over
#: the index), ``swaps`` counts outermost entries of a non-empty :class:`Swap` (one per load).
STATS = {"scans": 0, "swaps": 0}

_user_prefixes: tuple[str, ...] = ()
# module name -> (module object, namespace size when indexed, names bound to nn.Module classes)
_index: dict[str, tuple[ModuleType, int, tuple[str, ...]]] = {}
_index_generation = 0
_scope_cache: tuple[tuple[object, ...], list[tuple[str, ModuleType]]] | None = None
# (snapshot version, index generation, module names) -> {module name: (attr, ...)}. Names only:
# the replacement of each name comes from the snapshot, so no cache keeps a replacement class alive.
_plan_cache: dict[tuple[object, ...], dict[str, tuple[str, ...]]] = {}
_LIBRARY_ROOTS = ("builtins", "torch", "typing", "abc", "collections", "transformers")

_Applied = tuple[ModuleType, str, type, type, str]  # module, attr, original, replacement, key
_active: list[Swap] = []  # swaps currently bound, outermost first (changed under LOCK)


def add_scope_prefix(prefix: str) -> None:
    """Also swap classes in loaded modules named ``prefix`` or ``prefix.*`` (e.g. ``"mypkg.models"``).

    Example:
        >>> add_scope_prefix("mypkg"); remove_scope_prefix("mypkg")
    """
    global _user_prefixes
    if prefix not in _user_prefixes:
        _user_prefixes = (*_user_prefixes, prefix)


def remove_scope_prefix(prefix: str) -> None:
    """Undo :func:`add_scope_prefix` (unknown prefixes are ignored)."""
    global _user_prefixes
    _user_prefixes = tuple(p for p in _user_prefixes if p != prefix)


def _name_in_scope(name: str) -> bool:
    # A prefix the user added counts first, also inside transformers (`transformers.generation`).
    if any(name == p or name.startswith(p + ".") for p in _user_prefixes):
        return True
    if name.startswith("transformers."):
        parts = name.split(".")
        if parts[1] == "models":
            return len(parts) >= 4 and parts[-1].startswith("modeling_")
        return parts[1] == "integrations"
    return name.startswith("transformers_modules.")


def in_scope_modules() -> list[tuple[str, ModuleType]]:
    """Return ``(name, module)`` for every loaded module in the swap scope (cached until imports change).

    Example:
        >>> import transformers.models.llama.modeling_llama
        >>> "transformers.models.llama.modeling_llama" in dict(in_scope_modules())
        True
    """
    global _scope_cache
    modules = sys.modules
    # New imports are appended to sys.modules, so its size and last key detect them cheaply.
    token = (len(modules), next(reversed(modules)) if modules else None, _user_prefixes)
    if _scope_cache is not None and _scope_cache[0] == token:
        return _scope_cache[1]
    found = [
        (name, mod)
        for name, mod in list(modules.items())
        if isinstance(mod, ModuleType) and _name_in_scope(name)
    ]
    _scope_cache = (token, found)
    return found


def _class_names(module: ModuleType) -> tuple[int, tuple[str, ...]]:
    namespace = module.__dict__
    names = tuple(
        name
        for name, value in list(namespace.items())
        if isinstance(value, type) and issubclass(value, torch.nn.Module)
    )
    return len(namespace), names


def _refresh_index(modules: list[tuple[str, ModuleType]]) -> None:
    """(Re)index the modules that are new, were replaced in sys.modules, or whose namespace changed size."""
    global _index_generation
    for name, module in modules:
        cached = _index.get(name)
        if cached is not None and cached[0] is module and cached[1] == len(module.__dict__):
            continue
        size, names = _class_names(module)
        _index[name] = (module, size, names)
        _index_generation += 1


def _plan(
    snap: Snapshot, modules: list[tuple[str, ModuleType]], extra: tuple[str, ...]
) -> dict[str, tuple[str, ...]]:
    """Return, per module name, the names bound there that ``snap`` replaces."""
    _refresh_index(modules)
    cache_key = (snap.version, _index_generation, extra, _user_prefixes)  # the scope changes with prefixes
    plan = _plan_cache.get(cache_key)
    if plan is not None:
        return plan
    STATS["scans"] += 1
    plan = {}
    for name, _module in modules:
        hits = [attr for attr in _index[name][2] if snap.find(attr) is not None]
        if hits:
            plan[name] = tuple(hits)
    if len(_plan_cache) > 32:
        _plan_cache.clear()
    _plan_cache[cache_key] = plan
    return plan


def _bound_by_enclosing(module: ModuleType, attr: str, replacement: type) -> type | None:
    """The original that an active swap replaced by ``replacement`` at ``module.attr``, if any."""
    for bound in _active:
        for mod, name, original, repl, _key in bound._applied:
            if mod is module and name == attr and repl is replacement:
                return original
    return None


def _is_library_module(name: str) -> bool:
    root = name.partition(".")[0]
    return root in _LIBRARY_ROOTS and not _name_in_scope(name)


def undecorated_init(init: Any) -> Any:
    """The ``__init__`` under decorators that replace it with ``(self, *args, **kwargs)`` without
    ``functools.wraps`` (``kernels``' ``use_kernelized_func``, which transformers 5.25 puts on
    some attention classes): the one function named ``__init__`` the wrapper closes over."""
    for _ in range(8):  # decorators stack; a handful deep at most
        parameters = list(inspect.signature(init).parameters.values())[1:]
        if any(p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters) or not parameters:
            return init
        inner = [
            cell.cell_contents
            for cell in getattr(init, "__closure__", None) or ()
            if inspect.isfunction(getattr(cell, "cell_contents", None))
            and cell.cell_contents.__name__ == "__init__"
        ]
        if len(inner) != 1:
            return init
        init = inner[0]
    return init


class Swap:
    """Context manager binding the replacements of ``snap`` in the in-scope modules, re-entrantly.

    The first ``__enter__`` swaps; nested ``__enter__`` calls only extend the swap to modules
    imported (or classes added with :meth:`add_class`) since; the matching outermost ``__exit__``
    restores every binding it changed (exceptions included), in reverse order. A binding that
    someone else changed in the meantime is left as they set it. Modules imported during the
    block that bound a replacement (``from ..modeling_x import XAttention``) get the original back.

    Callers serialise through :data:`LOCK`; ``Swap`` itself does not lock.
    """

    def __init__(self, snap: Snapshot, classes: tuple[type, ...] = ()) -> None:
        self.snap = snap
        self._extra: dict[str, ModuleType] = {}
        self._applied: list[_Applied] = []
        self._applied_log: list[_Applied] = []  # kept after restore, for reports
        self._tables: list[tuple[dict[Any, Any], object, type, type]] = []  # class-table entries changed
        self._covered: set[str] = set()
        self._depth = 0
        self._owner = 0  # the thread that entered it (a forked child restores other threads' swaps)
        self._start: tuple[int, object] = (0, None)
        #: replacement class -> {original qualified name: key}, for every binding swapped
        self.replaced_by: dict[type, dict[str, str]] = {}
        for cls in classes:
            self.add_class(cls)

    def add_class(self, cls: type) -> None:
        """Bring the modules defining ``cls`` and its module bases into scope (library modules excluded)."""
        for klass in cls.__mro__:
            if not issubclass(klass, torch.nn.Module):
                continue  # mixins (generation, hub) define no building blocks
            name = klass.__module__
            module = sys.modules.get(name)
            if module is not None and not _is_library_module(name):
                self._extra[name] = module

    def __enter__(self) -> Swap:
        self._depth += 1
        if not self.snap:
            return self
        if self._depth == 1:
            STATS["swaps"] += 1
            self._owner = threading.get_ident()
            _active.append(self)
            modules = sys.modules
            self._start = (len(modules), next(reversed(modules)))
        try:
            self._apply()
        except BaseException:
            self._depth -= 1
            if self._depth == 0:
                self._restore()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._depth -= 1
        if self._depth == 0 and self.snap:
            self._restore()
        if isinstance(exc, TypeError) and not isinstance(exc, GraftError):
            named = self._call_error(exc)
            if named is not None:
                raise named from exc

    def _call_error(self, exc: TypeError) -> ReplacementTypeError | None:
        """The error naming the key and the class, where ``exc`` is Python refusing the arguments
        of a call to a replacement class (its ``__init__`` does not take the original's); an error
        raised inside a replacement's own code is left as it is."""
        innermost = exc.__traceback__
        while innermost is not None and innermost.tb_next is not None:
            innermost = innermost.tb_next
        running = innermost.tb_frame.f_locals.get("self") if innermost is not None else None
        text = str(exc)
        for _module, _attr, original, replacement, key in self._applied_log:
            if isinstance(running, replacement):
                return None  # raised while its own __init__ ran: the user's code, left as it is
            if text.startswith(f"{replacement.__qualname__}.__init__()"):
                try:
                    init = undecorated_init(vars(original).get("__init__") or getattr(original, "__init__"))  # noqa: B009
                    expected = f"`{original.__name__}.__init__{inspect.signature(init)}`"
                except (TypeError, ValueError):
                    expected = f"the arguments of `{original.__name__}`"
                return ReplacementTypeError(
                    f"The replacement `{replacement.__name__}` (key `{key}`) cannot be built where "
                    f"`{original.__name__}` was: {text}. transformers builds it with the original's "
                    f"arguments, so its `__init__` must accept {expected} (subclass `{original.__name__}` "
                    "or take the same parameters). Nothing stays swapped."
                )
        return None

    def replacements(self) -> dict[type, type]:
        """``{original class: replacement}`` for every binding this swap changed."""
        return {original: replacement for _m, _a, original, replacement, _k in self._applied_log}

    # ---- internals ------------------------------------------------------------------------------
    def _apply(self) -> None:
        modules = in_scope_modules()
        extra = tuple(n for n in self._extra if not _name_in_scope(n))
        if extra:
            modules = [*modules, *((n, self._extra[n]) for n in extra)]
        plan = _plan(self.snap, modules, extra)
        for name, hits in plan.items():
            if name in self._covered:
                continue
            self._covered.add(name)
            module = _index[name][0]
            namespace = module.__dict__
            for attr in hits:
                found = self.snap.find(attr)
                assert found is not None  # the plan lists only names the snapshot replaces
                key, replacement = found
                current = namespace.get(attr)
                if current is replacement:  # an enclosing swap bound it already: report its original
                    current = _bound_by_enclosing(module, attr, replacement)
                    if current is not None:
                        self._note(current, replacement, key)
                    continue
                if not isinstance(current, type):
                    continue
                setattr(module, attr, replacement)
                self._applied.append((module, attr, current, replacement, key))
                self._applied_log.append(self._applied[-1])
                self._note(current, replacement, key)
            swapped = {a[2]: a[3] for a in self._applied if a[0] is module}
            self._tables += _compat.TRANSFORMERS.rebind_class_tables(
                module, swapped
            )  # 4.57 `*_CLASSES` tables

    def _note(self, original: type, replacement: type, key: str) -> None:
        self.replaced_by.setdefault(replacement, {})[f"{original.__module__}.{original.__qualname__}"] = key

    def _restore(self) -> None:
        if self in _active:
            position = _active.index(self)
            self._hand_over(_active[position + 1 :])
            _active.remove(self)
        self._unbind_from_new_modules()
        self._rebind(originals=True)
        _compat.restore_class_tables(self._tables)
        self._tables = []
        self._applied = []
        self._covered.clear()

    def _hand_over(self, later: list[Swap]) -> None:
        """Leaving before swaps entered after this one (blocks exited out of order): where a later
        swap replaced this one's replacement, it must restore this one's original, not ours."""
        if not later or not self._applied:
            return
        originals = {(id(m), a, id(r)): o for m, a, o, r, _k in self._applied}
        for other in later:
            other._applied = [
                (m, a, originals.get((id(m), a, id(o)), o), r, k) for m, a, o, r, k in other._applied
            ]

    def _rebind(self, originals: bool) -> None:
        """Bind the originals back (``originals=True``) or the replacements again, where unchanged."""
        entries = reversed(self._applied) if originals else self._applied
        for module, attr, original, replacement, _key in entries:
            old, new = (replacement, original) if originals else (original, replacement)
            if module.__dict__.get(attr) is old:
                setattr(module, attr, new)

    def _unbind_from_new_modules(self) -> None:
        """Give modules imported during the block the originals they copied from swapped modules."""
        modules = sys.modules
        if not self._applied or (len(modules), next(reversed(modules))) == self._start:
            return
        by_binding = {(attr, id(repl)): orig for _m, attr, orig, repl, _k in self._applied}
        replacements = {id(a[3]) for a in self._applied}
        names = list(modules)
        start_len, start_last = self._start
        grew = 0 < start_len <= len(names) and names[start_len - 1] == start_last
        tail = names[start_len:] if grew else names
        for name in tail:
            module = modules.get(name)
            namespace = getattr(module, "__dict__", None)
            if not isinstance(namespace, dict):
                continue
            for attr, value in list(namespace.items()):
                if id(value) in replacements:
                    original = by_binding.get((attr, id(value)))
                    if original is not None:
                        setattr(module, attr, original)


@contextmanager
def suspended() -> Iterator[None]:
    """Bind the original classes back for the duration of the block, then the replacements again.

    Weight initialisation runs while the model is constructed, and modeling code picks its init
    branch with ``isinstance(module, <module global>)``; it must see the originals, or a
    replacement would be initialised as if it were the class it replaced.

    Example:
        >>> import torch
        >>> from transformers.models.llama import modeling_llama
        >>> from modelgraft import registry
        >>> with registry.scoped({"LlamaMLP": torch.nn.Identity}) as snap, Swap(snap):
        ...     with suspended():
        ...         modeling_llama.LlamaMLP is torch.nn.Identity
        ...     modeling_llama.LlamaMLP is torch.nn.Identity
        False
        True
    """
    active = list(_active)
    for bound in reversed(active):
        bound._rebind(originals=True)
    try:
        yield
    finally:
        for bound in active:
            bound._rebind(originals=False)


def replaced_modules(model: torch.nn.Module, swap: Swap) -> list[ReplacedModule]:
    """Return the modules of ``model`` built from a replacement bound by ``swap``.

    When one replacement stood in for several originals (a broad pattern), the candidates are
    narrowed to those defined next to the parent module's class and, if several remain, given
    joined with `` | `` (the report's diagnostics narrow them further when weights were dropped).
    """
    found = []
    modules = dict(model.named_modules())
    for path, module in modules.items():
        originals = swap.replaced_by.get(type(module))
        if not originals:
            continue
        names = sorted(originals)
        if len(names) > 1:
            parent = modules.get(path.rpartition(".")[0])
            home = type(parent).__module__ + "." if parent is not None else ""
            names = [n for n in names if n.startswith(home)] or names
        replacement = type(module)
        found.append(
            ReplacedModule(
                path=path,
                original=" | ".join(names),
                replacement=f"{replacement.__module__}.{replacement.__qualname__}",
                key=" | ".join(sorted({originals[n] for n in names})),
            )
        )
    return found


def _after_fork_in_child() -> None:
    """In a forked child, free the construction lock and undo the swaps of threads that do not
    exist there (a load in progress in another thread at the time of the fork)."""
    # ``LOCK`` itself is renewed by modelgraft._forksafe.
    me = threading.get_ident()
    for bound in reversed(list(_active)):
        if bound._owner != me:
            bound._depth = 0
            bound._restore()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
