"""The ``modelgraft`` command line: ``inspect``, ``explain``, ``verify`` and ``compare-routing``.

Every command takes ``--json`` (one JSON document on stdout). Exit codes: 0 success, 1 a
``verify`` check failed (or ``compare-routing --max-rate`` was exceeded), 2 the command could not run (usage error, bad target or config, bad key,
import error): then one line says why, ``{"error": "..."}`` on stdout under ``--json``, else on
stderr; never a traceback.

Example:
    >>> from modelgraft.cli import main
    >>> main(["explain", "MT5Attention", "--key", "T5Attention"])
    `MT5Attention` is not replaced: no registered or given key matches it.
    KEY          KIND   SOURCE  MATCHES  WHY
    T5Attention  exact  given   no       exact name differs
    Rules: exact class names win over patterns; among patterns the first registered wins.
    0
"""

from __future__ import annotations

# Only the standard library and modelgraft.errors (itself standard library only) at module level:
# `--help` and usage errors answer before torch and transformers load (issue 30). Each command
# imports what it needs inside its handler.
import argparse
import contextlib
import functools
import json
import operator
import re
import sys
import textwrap
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

from modelgraft.errors import GraftError, TargetError

if TYPE_CHECKING:
    import torch

    from modelgraft.graft import Graft

__all__ = ["main"]

_MAX_PARAMS_SHOWN = 16
#: The width tables and long lines are fitted to: what any terminal has (``--json`` keeps all).
_COLUMNS = 100
#: The qualified name of the ``--key`` placeholder class (built lazily, it needs torch).
_GIVEN = f"{__name__}._GivenKey"


@functools.cache
def _given_key() -> type[torch.nn.Module]:
    """The placeholder replacement for keys given with ``--key`` (only matched, never applied)."""
    import torch

    return type(
        "_GivenKey",
        (torch.nn.Module,),
        {"__module__": __name__, "__qualname__": "_GivenKey", "__doc__": _given_key.__doc__},
    )


def __getattr__(name: str) -> Any:
    # `modelgraft.cli._GivenKey` resolves (a registry entry names its replacement by qualified name).
    if name == "_GivenKey":
        return _given_key()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``) and return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    json_mode = "--json" in argv  # known before parsing, so that usage errors are JSON too
    stdout = sys.stdout
    try:
        args = _parser().parse_args(argv)
    except _UsageError as exc:
        return _refuse(exc.prog, json_mode, f"UsageError: {exc}" if json_mode else str(exc), stdout)
    except SystemExit as exc:  # --help printed the usage: an answer, returned like every other
        return exc.code if isinstance(exc.code, int) else 0
    from transformers import logging as hf_logging  # the first heavy import: a command runs

    # Progress bars and load warnings would interleave with the tables (and break --json on stdout
    # for tools that merge the streams); restored afterwards for callers of main() in process.
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    args.out = stdout
    try:
        # Under --json, stdout holds the one JSON document: whatever else prints (a graft module
        # at import, a library) goes to stderr.
        with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
            overlay = args.command != "verify"  # verify builds its own plain and grafted models
            target = getattr(args, "target", None)
            model_type = _model_type_of(target) if overlay and target and args.graft else None
            keys, grafts = (args.key or [], args.graft or []) if overlay else ([], [])
            with _extra_keys(keys, grafts, model_type):
                return int(args.run(args))
    except Exception as exc:  # a command that cannot run says why in one line: exit 2, never a traceback
        text = str(exc) if isinstance(exc, GraftError) and not args.json else f"{type(exc).__name__}: {exc}"
        return _refuse(f"modelgraft {args.command}", args.json, text, stdout)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]


class _UsageError(GraftError, ValueError):
    """What argparse would print before exiting with 2; raised instead, so that main() formats it.

    Private (main() always catches it), but a modelgraft error like every other."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(f"{message} (see `{prog} --help`)")
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """An argument parser that raises :class:`_UsageError` instead of printing usage and exiting."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # No abbreviations: `--js` must not silently mean `--json` (and --json is spotted in argv).
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise _UsageError(self.prog, message)


def _refuse(prog: str, json_mode: bool, message: str, stdout: TextIO) -> int:
    """Print why the command could not run as one line (JSON on stdout under --json) and return 2."""
    line = " ".join(message.split())  # transformers' messages span lines; ours stays one
    if json_mode:
        print(json.dumps({"error": line}), file=stdout)
    else:
        print(f"{prog}: error: {line}", file=sys.stderr)
    return 2


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="modelgraft",
        description="Inspect architectures, explain patch keys, verify grafts of transformers models, compare MoE routing traces.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def common(p: argparse.ArgumentParser, grafts: bool = True) -> None:
        p.add_argument("--json", action="store_true", help="print one JSON document instead of text")
        if grafts:
            p.add_argument(
                "--key",
                action="append",
                metavar="KEY",
                help="a patch key (exact class name or regex) to consider besides the registered ones",
            )
        p.add_argument(
            "--import",
            dest="imports",
            action="append",
            metavar="MODULE",
            default=[],
            help="import MODULE first (for modules that register patches when imported)",
        )
        if grafts:
            p.add_argument(
                "--graft",
                action="append",
                metavar="PKG.MODULE:NAME",
                help="a Graft (or a function returning one, or a mapping dict) whose keys to consider",
            )

    p_inspect = sub.add_parser("inspect", help="module classes of an architecture and the keys matching them")
    p_inspect.add_argument("target", metavar="MODEL_TYPE_OR_PATH")
    common(p_inspect)
    p_inspect.set_defaults(run=_cmd_inspect)

    p_explain = sub.add_parser("explain", help="which key replaces a class, and why")
    p_explain.add_argument("class_name", metavar="CLASS_NAME")
    common(p_explain)
    p_explain.set_defaults(run=_cmd_explain)

    p_verify = sub.add_parser("verify", help="check that a graft keeps outputs and checkpoints unchanged")
    p_verify.add_argument("target", metavar="MODEL_TYPE_OR_PATH")
    common(p_verify, grafts=False)
    p_verify.add_argument("--graft", action="append", metavar="PKG.MODULE:NAME", help="graft(s) to verify")
    p_verify.add_argument(
        "--atol", type=float, default=1e-5, help="absolute tolerance, finite and >= 0 (default 1e-5)"
    )
    p_verify.add_argument(
        "--rtol", type=float, default=0.0, help="relative tolerance, finite and >= 0 (default 0)"
    )
    p_verify.add_argument("--seed", type=int, default=0, help="seed for the tiny checkpoint and inputs")
    p_verify.set_defaults(run=_cmd_verify, key=None)

    p_compare = sub.add_parser(
        "compare-routing", help="per MoE layer, how often two routing traces of the same tokens differ"
    )
    p_compare.add_argument(
        "trace_a", metavar="TRACE_A", help="a trace file (`RoutingTrace.save`), e.g. the engine's"
    )
    p_compare.add_argument(
        "trace_b", metavar="TRACE_B", help="a trace of the same tokens, e.g. the trainer's"
    )
    p_compare.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    p_compare.add_argument(
        "--positions", type=int, default=8, help="differing positions listed per layer (default 8)"
    )
    p_compare.add_argument(
        "--max-rate",
        type=float,
        default=None,
        help="exit 1 when the share of differing token routes exceeds this (0..1)",
    )
    p_compare.set_defaults(run=_cmd_compare_routing, key=None, graft=None)
    return parser


# -- keys ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def _extra_keys(keys: list[str], grafts: list[str], model_type: str | None = None) -> Iterator[None]:
    """Layer the ``--graft`` grafts and ``--key`` placeholders over the registry for this command."""
    from modelgraft.graft import Graft, scope

    loaded = [_load_graft(ref, model_type) for ref in grafts]
    combined = functools.reduce(operator.add, loaded) if loaded else None
    taken = combined.mapping if combined is not None else {}
    given = {key: _given_key() for key in keys if key not in taken}
    if given:  # validated like a registration: a bad regex is reported with exit code 2
        placeholders = Graft(given, name="--key")
        combined = placeholders if combined is None else combined + placeholders
    if combined is None:
        yield
        return
    with scope(combined):
        yield


def _load_graft(ref: str, model_type: str | None = None) -> Graft:
    """Resolve ``--graft``: a :class:`~modelgraft.Graft`, a factory returning one, or a mapping dict.

    A factory (``modelgraft.grafts:fused_qkv``) is called with the target's model type when there is
    one (and it accepts it), else with no arguments (all its families). A family the factory
    refuses (:class:`~modelgraft.UnsupportedFamilyError`) is reported as the factory says it, not
    replaced by the keys of every other family (which would then all match nothing).
    """
    from modelgraft._model_lookup import import_object
    from modelgraft.errors import UnsupportedFamilyError
    from modelgraft.graft import Graft

    if ":" not in ref:
        raise TargetError(_bare_graft_message(ref))
    with _reported(f"Could not import `{ref}`"):
        obj = import_object(ref)
    if (
        not isinstance(obj, Graft)
        and not hasattr(obj, "mapping")
        and callable(obj)
        and not isinstance(obj, type)
    ):
        made = None
        if model_type is not None:
            try:
                made = obj(model_type)
            except UnsupportedFamilyError:
                raise  # the factory knows this family and says why its graft cannot apply
            except (GraftError, ValueError, TypeError):
                made = None  # a factory that takes no model type: all its families below
        if made is None:
            with _reported(f"`{ref}` failed when called with no arguments"):
                made = obj()
        obj = made
    if isinstance(obj, Graft):
        return obj
    if isinstance(obj, dict):
        return Graft(obj)
    mapping = getattr(obj, "mapping", None)
    if isinstance(mapping, dict):  # a graft-like object of another library
        return Graft(mapping, getattr(obj, "conversions", None))
    raise TargetError(
        f"`{ref}` is a `{type(obj).__name__}`; expected a `modelgraft.Graft` (mapping and conversions), "
        "a function returning one, or a mapping dict of key -> nn.Module subclass."
    )


def _graft_factories() -> list[str]:
    """The ready-made graft factories of :mod:`modelgraft.grafts` (the functions returning a Graft)."""
    import inspect

    import modelgraft.grafts

    names = []
    for name in modelgraft.grafts.__all__:
        obj = getattr(modelgraft.grafts, name)
        if inspect.isfunction(obj) and inspect.signature(obj).return_annotation in ("Graft", "'Graft'"):
            names.append(name)
    return names


def _bare_graft_message(ref: str) -> str:
    """Why ``--graft NAME`` (no ``module:``) cannot be imported, and the references that exist."""
    factories = _graft_factories()
    if ref in factories:
        hint = f"did you mean `modelgraft.grafts:{ref}`?"
    else:
        hint = "the ready-made grafts are " + ", ".join(f"`modelgraft.grafts:{n}`" for n in factories)
        hint += "; a graft of your own is `your_module:NAME`."
    return f"`{ref}` is not a `package.module:NAME` reference; {hint}"


@contextlib.contextmanager
def _reported(what: str) -> Iterator[None]:
    """Turn anything user code raises (even ``SystemExit``) into a :class:`TargetError` saying ``what``."""
    try:
        yield
    except TargetError:
        raise
    except (Exception, SystemExit) as exc:
        raise TargetError(f"{what}: {type(exc).__name__}: {str(exc).rstrip('.')}.") from exc


def _key_candidates(class_name: str) -> dict[str, Any]:
    """Which keys match ``class_name``, which one wins and why, as plain data."""
    from modelgraft import registry

    explanation = registry.explain(class_name, registry.snapshot())
    winner = None
    if explanation.winner is not None and explanation.replacement is not None:
        winner = {"key": explanation.winner, "replacement": _qualname(explanation.replacement)}
    return {
        "winner": winner,
        "matching_keys": [c.key for c in explanation.candidates if c.matches],
        "candidates": [
            {
                "key": c.key,
                "kind": c.kind,
                "source": "given" if c.replacement == _GIVEN else c.source,
                "matches": c.matches,
                "reason": c.reason,
            }
            for c in explanation.candidates
        ],
    }


def _qualname(cls: type) -> str:
    if cls is _given_key():
        return "(given with --key)"
    return f"{cls.__module__}.{cls.__qualname__}"


# -- inspect ------------------------------------------------------------------------------------


def inspect_architecture(target: str) -> dict[str, Any]:
    """Build ``target`` on the meta device and describe its module classes and matching keys.

    Example:
        >>> info = inspect_architecture("llama")
        >>> [c["count"] for c in info["classes"] if c["class"] == "LlamaDecoderLayer"]
        [32]
    """
    from modelgraft import _compat, registry
    from modelgraft._model_lookup import model_class_for, resolve_config

    start = time.perf_counter()
    config, _ = resolve_config(target)
    model_cls = model_class_for(config)
    # Meta tensors have shapes but no storage, so even a 70B config builds in a fraction of a second;
    # a plain constructor call (not from_config) keeps registered patches out of what we describe.
    try:
        with _compat.TRANSFORMERS.meta_device():
            model = model_cls(config)
    except Exception as exc:
        raise TargetError(
            f"`{model_cls.__name__}` could not be built from the config of `{target}`: "
            f"{type(exc).__name__}: {str(exc).rstrip('.')}; check the config's values."
        ) from exc
    classes: dict[type, dict[str, Any]] = {}
    for path, module in model.named_modules():
        entry = classes.get(type(module))
        if entry is None:
            entry = classes[type(module)] = _describe_class(type(module), module)
        entry["count"] += 1
        if len(entry["examples"]) < 3:
            entry["examples"].append(path or "(root)")
    used: set[str] = set()
    for entry in classes.values():
        used.update(entry["matching_keys"])
    all_keys = list(registry.snapshot().mapping)
    return {
        "target": str(target),
        "config_class": type(config).__name__,
        "model_class": model_cls.__name__,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "classes": list(classes.values()),
        "keys_matching_nothing": [k for k in all_keys if k not in used],
        "seconds": round(time.perf_counter() - start, 4),
    }


def _describe_class(cls: type, example: torch.nn.Module) -> dict[str, Any]:
    from modelgraft import swap

    # Classes outside the patch scope (torch, non-modeling transformers modules such as
    # activations) are never swapped at load time: say so instead of listing keys for them.
    patchable = not swap._is_library_module(cls.__module__)
    # Containers (a whole decoder stack) would list thousands of tensors; their own direct
    # parameters plus a count say more.
    shapes: dict[str, list[int]] = {}
    for name, p in example.named_parameters():
        if len(shapes) == _MAX_PARAMS_SHOWN:
            shapes = {n: list(q.shape) for n, q in example.named_parameters(recurse=False)}
            break
        shapes[name] = list(p.shape)
    info: dict[str, Any] = {
        "class": cls.__name__,
        "module": cls.__module__,
        "count": 0,
        "examples": [],
        "parameters": shapes,
        "patchable": patchable,
        "matching_keys": [],
        "winner": None,
    }
    if patchable:
        keys = _key_candidates(cls.__name__)
        info.update(matching_keys=keys["matching_keys"], winner=keys["winner"])
    return info


def _cmd_inspect(args: argparse.Namespace) -> int:
    _run_imports(args.imports)
    info = inspect_architecture(args.target)
    if args.json:
        _print_json(args, info)
        return 0
    _print_wrapped(
        f"{info['target']}: {info['model_class']} ({info['config_class']}), "
        f"{info['num_parameters']:,} parameters, built on meta in {info['seconds']:.3f} s"
    )
    rows = [("CLASS", "COUNT", "EXAMPLE", "PARAMETERS", "KEYS")]
    for c in info["classes"]:
        rows.append((c["class"], str(c["count"]), c["examples"][0], _params_cell(c), _keys_cell(c)))
    # The class and its count stay on one line (what a reader scans for); paths, shapes and keys
    # wrap within their column, at dots and commas, so that the table fits in _COLUMNS.
    _print_table(rows, wrap=(2, 3, 4))
    if info["keys_matching_nothing"]:
        _print_wrapped(
            "keys matching no class here: " + ", ".join(f"`{k}`" for k in info["keys_matching_nothing"])
        )
    return 0


def _params_cell(c: dict[str, Any]) -> str:
    """The first parameter as ``name AxB``, then how many more (``--json`` lists them all)."""
    params = list(c["parameters"].items())
    shown = [f"{n} {'x'.join(map(str, s)) or '()'}" for n, s in params[:1]]
    if len(params) > 1:
        shown.append(f"+{len(params) - 1} more")
    return ", ".join(shown) or "-"


def _keys_cell(c: dict[str, Any]) -> str:
    if not c["patchable"]:
        return "(outside patch scope)"
    if not c["matching_keys"]:
        return "-"
    winner = c["winner"]["key"] if c["winner"] else None
    return ", ".join(f"{k} (wins)" if k == winner else k for k in c["matching_keys"])


# -- explain ------------------------------------------------------------------------------------


def _cmd_explain(args: argparse.Namespace) -> int:
    _run_imports(args.imports)
    info = {"class": args.class_name, **_key_candidates(args.class_name)}
    if args.json:
        _print_json(args, info)
        return 0
    winner = info["winner"]
    if winner is None:
        print(f"`{args.class_name}` is not replaced: no registered or given key matches it.")
    else:
        by = "" if winner["replacement"] == _qualname(_given_key()) else f" by {winner['replacement']}"
        print(f"`{args.class_name}` is replaced{by}: key `{winner['key']}` wins.")
    if not info["candidates"]:
        print("No keys are registered; pass some with --key, --graft or --import.")
        return 0
    rows = [("KEY", "KIND", "SOURCE", "MATCHES", "WHY")]
    for c in info["candidates"]:
        rows.append((c["key"], c["kind"], c["source"], "yes" if c["matches"] else "no", c["reason"]))
    _print_table(rows)
    print("Rules: exact class names win over patterns; among patterns the first registered wins.")
    return 0


# -- verify -------------------------------------------------------------------------------------


def _cmd_verify(args: argparse.Namespace) -> int:
    from modelgraft.verify import verify

    _run_imports(args.imports)
    bundles = [_load_graft(ref, _model_type_of(args.target)) for ref in args.graft or ()]
    graft = functools.reduce(operator.add, bundles) if bundles else None
    result = verify(args.target, graft, atol=args.atol, rtol=args.rtol, seed=args.seed)
    if args.json:
        _print_json(args, result.to_dict())
    else:
        print(result.format_table())
    return 0 if result.passed else 1


def _cmd_compare_routing(args: argparse.Namespace) -> int:
    from modelgraft.moe import RoutingTrace, compare_routing

    if args.positions < 0:
        raise ValueError(f"--positions must be >= 0; got {args.positions}.")
    if args.max_rate is not None and not 0.0 <= args.max_rate <= 1.0:
        raise ValueError(f"--max-rate must be within 0..1; got {args.max_rate}.")
    result = compare_routing(RoutingTrace.load(args.trace_a), RoutingTrace.load(args.trace_b))
    exceeded = None if args.max_rate is None else result.mismatch_rate > args.max_rate
    if args.json:
        # `max_rate` alone would read as the --max-rate threshold: the largest per-layer rate and
        # the threshold (with its verdict, which is about mismatch_rate) get names of their own.
        data = result.to_dict(max_positions=args.positions)
        renamed = {"max_layer_rate" if k == "max_rate" else k: v for k, v in data.items()}
        layers = renamed.pop("layers")
        renamed.update(max_rate_threshold=args.max_rate, threshold_exceeded=exceeded, layers=layers)
        _print_json(args, renamed)
    else:
        print(result.summary(max_positions=args.positions))
    return 1 if exceeded else 0


# -- helpers ------------------------------------------------------------------------------------


def _model_type_of(target: str) -> str | None:
    """The model type a target names (a model type itself, or a folder's / config file's)."""
    from modelgraft._model_lookup import resolve_config

    try:
        config, _ = resolve_config(target)
    except Exception:
        return None  # reported by the command itself
    return getattr(config, "model_type", None)


def _run_imports(modules: list[str]) -> None:
    import importlib

    for name in modules:
        with _reported(f"Could not import `{name}` (from --import)"):
            importlib.import_module(name)


def _print_json(args: argparse.Namespace, data: dict[str, Any]) -> None:
    # allow_nan=False: a NaN would make the document invalid JSON; better the error of exit code 2
    print(json.dumps(data, indent=2, allow_nan=False), file=args.out)


def _print_wrapped(line: str) -> None:
    """Print a long line folded to :data:`_COLUMNS`, continuation lines indented."""
    print(textwrap.fill(line, _COLUMNS, subsequent_indent="    ", break_on_hyphens=False))


def _print_table(rows: Sequence[tuple[str, ...]], wrap: Sequence[int] = ()) -> None:
    """Print ``rows`` (the first is the header) as aligned columns.

    When the table is wider than :data:`_COLUMNS`, the widest of the ``wrap`` columns narrows
    first, down to its header's width (and at least 12); their cells continue on the next lines.
    """
    count = len(rows[0])
    widths = [max(len(r[i]) for r in rows) for i in range(count)]
    floors = {i: max(len(rows[0][i]), 12) for i in wrap}
    excess = sum(widths) + 2 * (count - 1) - _COLUMNS
    while excess > 0:
        narrowable = [i for i in wrap if widths[i] > floors[i]]
        if not narrowable:
            break  # the fixed columns alone are too wide: as narrow as it gets
        widest = max(narrowable, key=lambda i: widths[i])
        widths[widest] -= 1
        excess -= 1
    for row in rows:
        cells = [_fold(cell, widths[i]) if i in wrap else [cell] for i, cell in enumerate(row)]
        for n in range(max(map(len, cells))):
            parts = [(cell[n] if n < len(cell) else "") for cell in cells]
            line = "  ".join(part.ljust(w) for part, w in zip(parts[:-1], widths)) + "  " + parts[-1]
            print(line.rstrip())


def _fold(text: str, width: int) -> list[str]:
    """Split ``text`` into lines of at most ``width``: between list items (``, ``) when it can, else
    after dots and spaces, and only a piece longer than the whole column is cut."""
    lines: list[str] = []
    line = ""
    for item in re.split(r"(?<=, )", text):
        if len((line + item).rstrip()) <= width:
            line += item
            continue
        if line:
            lines.append(line.rstrip())
            line = ""
        for piece in re.split(r"(?<=[ .])", item):
            if len((line + piece).rstrip()) > width and line:
                lines.append(line.rstrip())
                line = ""
            while len(piece.rstrip()) > width:
                lines.append(piece[:width])
                piece = piece[width:]
            line += piece
    if line.strip() or not lines:
        lines.append(line.rstrip())
    return lines
