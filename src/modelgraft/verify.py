"""Check that a graft keeps a model what it was: :func:`verify` and :class:`VerifyReport`.

One verdict per check, in this order (a check that cannot run because an earlier one failed
fails with the reason):

``builds``
    the grafted model loads from the checkpoint and at least one module was replaced.
``all_weights_loaded``
    every parameter comes from the checkpoint: none missing, none left at random init. Besides
    what the load reports, the grafted model is loaded a second time under another seed; a
    parameter that differs between the two loads was initialised, not loaded.
``logits_match`` / ``hidden_states_match``
    the same input through the plain and the grafted model gives logits and hidden states of the
    same shape and dtype, all finite, within ``atol + rtol * |plain|`` (fp32). A NaN or inf in the
    grafted outputs fails and is named; so does one in the plain outputs (a non-finite reference
    hides any difference, so nothing can be vouched for there).
``save_roundtrip``
    ``save_pretrained`` of the grafted model writes the original checkpoint again: the same keys
    with bit-identical tensors, and a plain transformers load of it gives the plain model's tensors.

Weights are compared bit for bit (a NaN weight equals itself, ``-0.0`` differs from ``0.0``).

The target is a model type (a tiny config, as :func:`modelgraft.testing.tiny_config` makes it, and a
temporary checkpoint, all offline), a config, or a local checkpoint folder.

Example:
    >>> from modelgraft import verify
    >>> from modelgraft.grafts import fused_qkv
    >>> result = verify("llama", fused_qkv("llama"))
    >>> result.passed, [c.name for c in result.checks]
    (True, ['builds', 'all_weights_loaded', 'logits_match', 'hidden_states_match', 'save_roundtrip'])
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NoReturn, cast

import torch
from safetensors.torch import load_file
from transformers import PretrainedConfig, PreTrainedModel
from transformers import logging as hf_logging

from modelgraft._compare import compare_outputs, few, same_bits
from modelgraft._families import tiny_config
from modelgraft._model_lookup import (
    TargetError,
    ensure_model_class,
    looks_like_path,
    model_class_for,
    resolve_config,
)
from modelgraft.errors import TargetTypeError, UnexpectedArgumentError, VerifyArgumentError
from modelgraft.graft import Graft, as_graft, scope
from modelgraft.hooks import unpatched
from modelgraft.report import report

__all__ = ["Check", "VerifyArgumentError", "VerifyReport", "verify"]


CHECKS = ("builds", "all_weights_loaded", "logits_match", "hidden_states_match", "save_roundtrip")


@dataclass(frozen=True)
class Check:
    """One verdict: the check's name, whether it passed, and what was seen."""

    name: str
    passed: bool
    detail: str


@dataclass
class VerifyReport:
    """The verdicts of :func:`verify`, one :class:`Check` per check, in order."""

    target: str
    model_class: str
    checks: list[Check] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True when every check passed."""
        return bool(self.checks) and all(c.passed for c in self.checks)

    def __getitem__(self, name: str) -> Check:
        for check in self.checks:
            if check.name == name:
                return check
        raise KeyError(f"No check named `{name}`; checks are {[c.name for c in self.checks]}.")

    def to_dict(self) -> dict[str, Any]:
        """Plain data (what ``modelgraft verify --json`` prints)."""
        return {
            "target": self.target,
            "model_class": self.model_class,
            "passed": self.passed,
            "checks": [asdict(c) for c in self.checks],
        }

    def format_table(self) -> str:
        """The verdicts as an aligned text table, with a final summary line.

        Example:
            >>> print(VerifyReport("llama", "LlamaForCausalLM", [Check("builds", True, "2 modules")]).format_table())
            verify llama (LlamaForCausalLM)
            CHECK   RESULT  DETAIL
            builds  PASS    2 modules
            all 1 checks passed
        """
        width = max([len("CHECK"), *(len(c.name) for c in self.checks)])
        lines = [f"verify {self.target} ({self.model_class})", f"{'CHECK'.ljust(width)}  RESULT  DETAIL"]
        for c in self.checks:
            lines.append(f"{c.name.ljust(width)}  {'PASS' if c.passed else 'FAIL'}    {c.detail}")
        failed = [c.name for c in self.checks if not c.passed]
        lines.append(
            f"all {len(self.checks)} checks passed" if not failed else f"FAILED: {', '.join(failed)}"
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format_table()


def verify(
    target: str | Path | PretrainedConfig,
    mapping: Graft | Mapping[str, type[torch.nn.Module]] | None = None,
    conversions: Mapping[str, Sequence[Any]] | None = None,
    *,
    atol: float = 1e-5,
    rtol: float = 0.0,
    seed: int = 0,
    model_class: type | None = None,
    workdir: str | Path | None = None,
    **unexpected: NoReturn,  # only to name the fix for `graft=`; type checkers refuse any keyword here
) -> VerifyReport:
    """Load ``target`` plain and grafted, and check that the graft changes nothing but the classes.

    Args:
        target: a model type (``"llama"``; a tiny config and checkpoint are made), a
            ``PretrainedConfig`` (a checkpoint is made from it), or a local checkpoint folder.
        mapping: the graft, as ``patched`` and ``graft_model`` take it: a :class:`~modelgraft.Graft`
            (grafts add up: ``fused_qkv("llama") + my_graft``), or a patch mapping. With no
            mapping and no conversions, the globally registered patches are verified.
        conversions: ``{model_type_or_class_name: [WeightConverter, ...]}`` added to the graft.
        atol: absolute tolerance of the output comparisons (a finite number >= 0; 0 asks for
            bit-identical outputs).
        rtol: relative tolerance of the output comparisons (a finite number >= 0).
        seed: seed of the tiny checkpoint's weights and of the input ids (an int >= 0).
        model_class: the class to load, a ``PreTrainedModel`` subclass (default: the config's
            architecture, else its causal LM).
        workdir: where to write checkpoints (default: a temporary folder, removed afterwards).

    Returns:
        A :class:`VerifyReport`; ``report.passed`` is True when every check passed.

    Raises:
        UnexpectedArgumentError: a keyword ``verify`` does not take, such as ``graft=`` (the graft
            is the second argument).
        VerifyArgumentError: a tolerance that is negative or not finite (NaN would pass anything),
            or a seed that is not an int >= 0.
        TargetTypeError: a target that is none of a model type, a path and a config (``verify(42, graft)``).
        TargetError: a target that does not exist or cannot be read, a model class that is not a
            ``PreTrainedModel`` subclass, or a plain model that cannot be built from the target.
        GraftError: a graft whose keys or replacements are invalid, or grafts that replace one
            key with different classes (nothing is registered).
    """
    if unexpected:
        raise _unexpected(unexpected)
    if not isinstance(target, (str, os.PathLike, PretrainedConfig)):
        raise TargetTypeError(
            f"`verify` takes a model type (`'llama'`), a local checkpoint folder or `config.json` path (a `str` or "
            f"`Path`), or a `PretrainedConfig`; received `{target!r}` of type `{type(target).__name__}`. Write "
            "`verify('llama', graft)` or `verify(model.config, graft)`."
        )
    atol, rtol = _tolerance("atol", atol), _tolerance("rtol", rtol)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise VerifyArgumentError(f"`seed` must be an int >= 0; received `{seed!r}`.")
    combined = as_graft(mapping, conversions)
    with _grafting(combined):
        pass  # an invalid key or replacement is an error of the call, not a failed check
    config, checkpoint = _resolve(target)
    if model_class is not None:
        cls = ensure_model_class(
            model_class, f"`model_class` `{getattr(model_class, '__name__', model_class)}`"
        )
    else:
        cls = model_class_for(config)
    result = VerifyReport(str(getattr(target, "model_type", target)), cls.__name__)
    with _workdir(workdir) as work, _quiet():
        _run(result, cls, config, checkpoint, work, combined, atol, rtol, seed)
    return result


# ---- inputs ---------------------------------------------------------------------------------------
def _tolerance(name: str, value: object) -> float:
    # `diff > nan` is never true and `diff > inf` neither: such a tolerance would pass anything.
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value < 0
    ):
        raise VerifyArgumentError(
            f"`{name}` must be a finite number >= 0; received `{value!r}`. A NaN or infinite tolerance "
            "would pass any output; use 0 to ask for bit-identical outputs."
        )
    return float(value)


def _unexpected(keywords: Mapping[str, object]) -> UnexpectedArgumentError:
    if "graft" in keywords:
        return UnexpectedArgumentError(
            "`verify` takes the graft as its second argument, as `patched` and `graft_model` do; "
            f"received `graft={keywords['graft']!r}`. Write `verify(target, graft)`, and add grafts "
            "together with `+`: `verify(target, fused_qkv(...) + linear_experts(...))`."
        )
    names = ", ".join(f"`{name}`" for name in sorted(keywords))
    return UnexpectedArgumentError(
        f"`verify` got unexpected keyword arguments {names}; it takes `target`, `mapping`, "
        "`conversions`, and the keywords `atol`, `rtol`, `seed`, `model_class`, `workdir`."
    )


def _resolve(target: str | Path | PretrainedConfig) -> tuple[PretrainedConfig, Path | None]:
    if isinstance(target, str) and not looks_like_path(target) and not Path(target).expanduser().exists():
        return tiny_config(target), None
    return resolve_config(target)


@contextlib.contextmanager
def _workdir(workdir: str | Path | None) -> Iterator[Path]:
    if workdir is not None:
        Path(workdir).mkdir(parents=True, exist_ok=True)
        yield Path(workdir)
        return
    with tempfile.TemporaryDirectory(prefix="modelgraft-verify-") as tmp:
        yield Path(tmp)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No progress bars for the half-dozen loads and saves of one verification."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]


def _from_pretrained(cls: type[PreTrainedModel], path: str | Path, **kwargs: Any) -> Any:
    """``cls.from_pretrained(path, **kwargs)``; transformers' decorators hide its signature (and the
    ``(model, info)`` pair it returns with ``output_loading_info=True``) from type checkers."""
    load = cast(Callable[..., Any], cls.from_pretrained)
    return load(path, **kwargs)


def _grafting(graft: Graft | None) -> contextlib.AbstractContextManager[Any]:
    """The graft's scope for one load, or nothing: then what is registered globally is verified."""
    return scope(graft) if graft is not None else contextlib.nullcontext()


# ---- the checks -------------------------------------------------------------------------------------
def _run(
    result: VerifyReport,
    cls: type[PreTrainedModel],
    config: PretrainedConfig,
    checkpoint: Path | None,
    work: Path,
    graft: Graft | None,
    atol: float,
    rtol: float,
    seed: int,
) -> None:
    checks = result.checks
    try:
        plain, checkpoint = _plain_model(cls, config, checkpoint, work, seed)
    except Exception as exc:  # the target itself is unusable: nothing about the graft can be said
        raise TargetError(
            f"The plain `{cls.__name__}` could not be built from `{result.target}`: "
            f"{type(exc).__name__}: {str(exc).rstrip('.')}; check the config's values and the checkpoint's files."
        ) from exc

    try:
        with _grafting(graft):
            torch.manual_seed(seed + 1)
            grafted, info = _from_pretrained(cls, checkpoint, dtype=torch.float32, output_loading_info=True)
    except Exception as exc:
        checks.append(Check("builds", False, f"{type(exc).__name__}: {exc}"))
        return _skip_rest(checks, "the grafted model did not build")
    grafted.eval()
    checks.append(_check_builds(grafted))

    try:
        with _grafting(graft):
            torch.manual_seed(seed + 2)
            second = _from_pretrained(cls, checkpoint, dtype=torch.float32)
        checks.append(_check_loaded(grafted, second, info))
        del second
    except Exception as exc:
        checks.append(Check("all_weights_loaded", False, f"second load failed: {type(exc).__name__}: {exc}"))

    checks.extend(_check_outputs(plain, grafted, config, atol, rtol, seed))
    checks.append(_check_roundtrip(cls, plain, grafted, checkpoint, work))


def _skip_rest(checks: list[Check], why: str) -> None:
    done = {c.name for c in checks}
    checks.extend(Check(name, False, f"not run: {why}") for name in CHECKS if name not in done)


def _plain_model(
    cls: type[PreTrainedModel], config: PretrainedConfig, checkpoint: Path | None, work: Path, seed: int
) -> tuple[torch.nn.Module, Path]:
    """The reference model and the checkpoint both models load from.

    Without a checkpoint, the reference is built by its constructor (which no patch reaches: only
    loads are patched) and saved; it holds exactly the checkpoint's tensors.
    """
    if checkpoint is None:
        torch.manual_seed(seed)
        built = cls(config)
        module: torch.nn.Module = built  # PreTrainedModel.to's decorators hide its signature from mypy
        module.to(torch.float32).eval()  # both in place
        checkpoint = work / "original"
        built.save_pretrained(checkpoint)
        return built, checkpoint
    with unpatched():  # a plain reference even while grafts are registered globally
        plain = _from_pretrained(cls, checkpoint, dtype=torch.float32).eval()
    return plain, checkpoint


def _check_builds(grafted: torch.nn.Module) -> Check:
    replaced = report(grafted).replaced
    if not replaced:
        keys = report(grafted).unmatched_keys
        hint = f"; keys matching nothing: {', '.join(f'`{k}`' for k in keys)}" if keys else ""
        return Check("builds", False, f"built, but no module was replaced{hint}")
    counts: dict[str, int] = {}
    for r in replaced:
        pair = f"{r.original.rsplit('.', 1)[-1]} -> {r.replacement.rsplit('.', 1)[-1]}"
        counts[pair] = counts.get(pair, 0) + 1
    summary = ", ".join(f"{pair} x{n}" for pair, n in counts.items())
    return Check("builds", True, f"{len(replaced)} modules replaced: {summary}")


def _check_loaded(grafted: torch.nn.Module, second: torch.nn.Module, info: dict[Any, Any] | None) -> Check:
    rep = report(grafted)
    problems: list[str] = []
    missing = sorted((info or {}).get("missing_keys", ()))
    if missing:
        problems.append(f"missing from the checkpoint: {few(missing)}")
    if rep.unloaded_parameters:
        problems.append(f"uninitialised: {few(rep.unloaded_parameters)}")
    dropped = sorted(k for keys in rep.dropped_checkpoint_keys.values() for k in keys)
    if dropped:
        problems.append(f"checkpoint keys nothing took: {few(dropped)}")
    other = dict(second.named_parameters())
    differing = [n for n, p in grafted.named_parameters() if n in other and not same_bits(p, other[n])]
    if differing:
        problems.append(f"differ between two loads (random init): {few(differing)}")
    total = sum(1 for _ in grafted.parameters())
    if problems:
        return Check("all_weights_loaded", False, "; ".join(problems))
    return Check("all_weights_loaded", True, f"{total} parameters loaded, identical across two loads")


def _check_outputs(
    plain: torch.nn.Module,
    grafted: torch.nn.Module,
    config: PretrainedConfig,
    atol: float,
    rtol: float,
    seed: int,
) -> list[Check]:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = int(getattr(text, "vocab_size", 0) or 128)
    ids = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(seed))
    inputs: dict[str, Any] = {"input_ids": ids, "output_hidden_states": True}
    if getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = ids[:, :5]
    try:
        with torch.no_grad():
            ref = plain(**inputs)
            out = grafted(**inputs)
    except Exception as exc:
        why = f"forward failed: {type(exc).__name__}: {exc}"
        return [Check("logits_match", False, why), Check("hidden_states_match", False, why)]
    label, ref_logits = _first(ref, "logits", "last_hidden_state")
    logits = getattr(out, label, None) if label != "output[0]" else out[0]
    checks = [Check("logits_match", *compare_outputs([label], [ref_logits], [logits], atol, rtol))]
    ref_hidden, hidden = _hidden_states(ref), _hidden_states(out)
    if not ref_hidden and not hidden:
        checks.append(
            Check("hidden_states_match", True, "the model returns no hidden states; nothing to compare")
        )
    elif [n for n, _ in ref_hidden] != [n for n, _ in hidden]:
        checks.append(
            Check(
                "hidden_states_match",
                False,
                f"expected {len(ref_hidden)} hidden states, received {len(hidden)}"
                + ("" if len(ref_hidden) != len(hidden) else f": {few([n for n, _ in hidden])}"),
            )
        )
    else:
        names = [n for n, _ in ref_hidden]
        compared = compare_outputs(names, [t for _, t in ref_hidden], [t for _, t in hidden], atol, rtol)
        checks.append(Check("hidden_states_match", *compared))
    return checks


def _hidden_states(output: Any) -> list[tuple[str, Any]]:
    """``(name, value)`` of every hidden state of an output; encoder then decoder for seq2seq models."""
    found: list[tuple[str, Any]] = []
    for name in ("hidden_states", "encoder_hidden_states", "decoder_hidden_states"):
        value = getattr(output, name, None)
        if isinstance(value, tuple | list):
            found.extend((f"{name}[{i}]", t) for i, t in enumerate(value))
    return found


def _first(output: Any, *names: str) -> tuple[str, Any]:
    for name in names:
        value = getattr(output, name, None)
        if isinstance(value, torch.Tensor):
            return name, value
    return "output[0]", output[0]


def _check_roundtrip(
    cls: type[PreTrainedModel], plain: torch.nn.Module, grafted: PreTrainedModel, checkpoint: Path, work: Path
) -> Check:
    name = "save_roundtrip"
    resaved = work / "resaved"
    try:
        grafted.save_pretrained(resaved)
    except Exception as exc:
        return Check(name, False, f"save_pretrained failed: {type(exc).__name__}: {exc}")
    original, written = _read_tensors(checkpoint), _read_tensors(resaved)
    if not original:  # a `.bin` checkpoint: only the plain reload below can compare
        same = "the checkpoint has no safetensors files to compare byte for byte"
    elif set(original) != set(written):
        lost, extra = sorted(set(original) - set(written)), sorted(set(written) - set(original))
        parts = [f"missing {few(lost)}" if lost else "", f"unexpected {few(extra)}" if extra else ""]
        return Check(
            name, False, "saved keys differ from the checkpoint's: " + "; ".join(p for p in parts if p)
        )
    else:
        # A checkpoint stored in another dtype was loaded as fp32; cast back before comparing bits.
        changed = [k for k, t in original.items() if not same_bits(written[k].to(t.dtype), t)]
        if changed:
            return Check(
                name, False, f"{len(changed)} saved tensors differ from the checkpoint: {few(changed)}"
            )
        same = f"{len(original)} checkpoint tensors written back bit-identical"
    try:
        with unpatched():
            reloaded = _from_pretrained(cls, resaved, dtype=torch.float32)
    except Exception as exc:
        return Check(
            name, False, f"plain transformers could not load the saved model: {type(exc).__name__}: {exc}"
        )
    expected, got = plain.state_dict(), reloaded.state_dict()
    differ = sorted(k for k in expected if k not in got or not same_bits(expected[k], got[k]))
    if differ or set(got) - set(expected):
        return Check(name, False, f"plain reload differs from the plain model: {few(differ or sorted(got))}")
    return Check(name, True, same + "; plain reload equals the plain model")


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors
