"""Chunked causal-LM loss: the ``lm_head`` and the cross-entropy without the ``(tokens, vocab)`` logits.

In training, a causal LM's head materialises ``tokens * vocab`` logits, their log-softmax and their
gradient; at 4k tokens and a 64k vocabulary that is three 1 GiB tensors, often more than the rest of
the step. :func:`chunked_lm_loss_class` builds a subclass of a family's ``*ForCausalLM`` whose forward,
when it only needs the loss, runs the family's own forward up to ``lm_head`` and computes the loss a
chunk of tokens at a time (:mod:`~modelgraft.grafts._chunked_ce`), with a custom autograd function.
Same parameters under the same names: nothing converts, and a save writes the plain checkpoint.

When are logits materialised? Exactly as plain, except in one case:

* ``skip_logits`` (a keyword of the grafted forward) defaults to ``model.training and labels is not None``.
* ``skip_logits`` false (eval, generation, no labels, or asked for): the family's own forward runs
  unchanged, so outputs (loss and logits) are the plain ones.
* ``skip_logits`` true: ``loss`` is the chunked loss (the family's scale, soft-capping,
  ``ignore_index``, ``shift_labels``, ``num_items_in_batch`` and MoE router auxiliary loss included)
  and ``logits`` is ``None``; every other output field is the family's own.

Which families? Any whose forward the chunked loss can reproduce, checked by reading the installed
forward's source (:mod:`~modelgraft.grafts._lm_head_source`); :data:`CHUNKED_LM_LOSS_FAMILIES` are
the ones tested against the plain model. A model whose ``lm_head`` is not a plain ``nn.Linear``
(quantized, hooked, offloaded) or whose ``loss_function`` was replaced runs the plain forward, with a
warning, rather than an approximation.

Example:
    >>> import torch
    >>> from transformers import AutoModelForCausalLM
    >>> from modelgraft.testing import tiny_config
    >>> model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    >>> ids = torch.randint(0, 100, (2, 12))
    >>> plain_loss = model(input_ids=ids, labels=ids).loss
    >>> graft_chunked_lm_loss(model) is model, type(model).__name__
    (True, 'ChunkedLossLlamaForCausalLM')
    >>> out = model(input_ids=ids, labels=ids)  # training mode and labels: loss only
    >>> out.logits is None, torch.allclose(out.loss, plain_loss)
    (True, True)
"""

from __future__ import annotations

import functools
import inspect
import threading
import warnings
from collections.abc import Hashable
from typing import Any, cast

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.modules import module as _torch_module
from transformers import PreTrainedModel

from modelgraft import _compat
from modelgraft._families import CHUNKED_LM_LOSS, covered_by, tiny_config
from modelgraft._forksafe import ForkSafeLock
from modelgraft.errors import UnsupportedFamilyError
from modelgraft.grafts._chunked_ce import DoubleBackwardError, LossInputError, linear_cross_entropy
from modelgraft.grafts._common import Graft, _Part, original_class
from modelgraft.grafts._lm_head_source import HeadSpec, read_head
from modelgraft.grafts._pickling import RECIPE_ATTR, GraftedClass
from modelgraft.hooks import unpatched
from modelgraft.inplace import graft_model
from modelgraft.report import _defined_at, _forward_bypass

__all__ = [
    "CHUNKED_LM_LOSS_FAMILIES",
    "DoubleBackwardError",
    "LossInputError",
    "chunked_lm_loss",
    "chunked_lm_loss_class",
    "graft_chunked_lm_loss",
]

#: Model types :func:`chunked_lm_loss` covers by default, each tested against the plain model (loss
#: and every parameter gradient) on transformers 5.x and 4.57.
CHUNKED_LM_LOSS_FAMILIES: tuple[str, ...] = covered_by(CHUNKED_LM_LOSS)

_PREFIX = "ChunkedLoss"


# --- the grafted forward ----------------------------------------------------------------------


def _grafted_original(cls: type) -> type:
    for klass in cls.__mro__:
        original: type | None = klass.__dict__.get("_modelgraft_original")
        if original is not None:
            return original
    raise TypeError(f"`{cls.__name__}` is not a chunked-loss class")  # unreachable for our classes


def _with_skip_logits(signature: inspect.Signature) -> inspect.Signature:
    """The original forward's signature plus the keyword-only ``skip_logits``.

    transformers (generation, the Trainer) reads ``forward``'s signature to decide which inputs to
    pass; the grafted forward must advertise the same parameters.
    """
    params = [p for p in signature.parameters.values() if p.name != "skip_logits"]
    extra = inspect.Parameter(
        "skip_logits", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="bool | None"
    )
    at = next((i for i, p in enumerate(params) if p.kind is inspect.Parameter.VAR_KEYWORD), len(params))
    return signature.replace(parameters=[*params[:at], extra, *params[at:]])


def _why_plain(model: nn.Module, spec: HeadSpec) -> str | None:
    """Why the chunked loss cannot stand in for this model's head right now (``None`` if it can)."""
    head = getattr(model, "lm_head", None)
    if type(head) is not nn.Linear or "forward" in head.__dict__:
        return (
            f"`lm_head` is a `{type(head).__name__}`, not a plain `nn.Linear` (quantized, adapted or wrapped)"
        )
    if head._forward_hooks or head._forward_pre_hooks or head._backward_hooks or head._backward_pre_hooks:
        return "`lm_head` has hooks (offloading, sharding or user hooks) that a chunked matmul would skip"
    if any(getattr(_torch_module, n, None) for n in ("_global_forward_hooks", "_global_forward_pre_hooks")):
        return "global module hooks are registered, and a chunked matmul would skip them"
    for name, tensor in (("weight", head.weight), ("bias", head.bias)):
        if tensor is None:
            continue
        if (
            type(tensor) not in (nn.Parameter, torch.Tensor)
            or not tensor.is_floating_point()
            or tensor.is_meta
        ):
            return f"`lm_head.{name}` is a `{type(tensor).__name__}` of dtype `{tensor.dtype}`, not a plain floating tensor"
    vocab = spec.vocab_size(model)
    if head.weight.shape[0] != vocab:
        return (
            f"`lm_head` has {head.weight.shape[0]} outputs but the loss reads `{spec.vocab_attr}` = {vocab}; "
            "the plain forward decides what that means"
        )
    loss_function = _causal_lm_loss()
    if model.loss_function is not loss_function:
        return "`loss_function` is not transformers' `ForCausalLMLoss`"
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    if active is not None and active():
        return "a `torch.func` transform is active"
    return None


def _causal_lm_loss() -> Any:
    return _compat.causal_lm_loss()


_WARNED: set[tuple[type, str]] = set()
_WARNED_LOCK = ForkSafeLock()


def _warn_plain(cls: type, reason: str) -> None:
    with _WARNED_LOCK:
        if (cls, reason) in _WARNED:
            return
        _WARNED.add((cls, reason))
    warnings.warn(
        f"`{cls.__name__}` computes this loss with the plain forward (full logits in memory): {reason}.",
        RuntimeWarning,
        stacklevel=4,
    )


def _targets(labels: torch.Tensor, extra: dict[str, Any]) -> tuple[torch.Tensor, int]:
    """The flattened targets and ``ignore_index``, as transformers' ``ForCausalLMLoss`` makes them."""
    ignore_index = extra.get("ignore_index", -100)
    shift_labels = extra.get("shift_labels")
    if shift_labels is None:
        padded = F.pad(labels, (0, 1), value=ignore_index)
        shift_labels = padded[..., 1:]
    return shift_labels.reshape(-1), int(ignore_index)


def _chunked_forward(model: nn.Module, plain: Any, spec: HeadSpec, bound: inspect.BoundArguments) -> Any:
    arguments = bound.arguments
    var_kw = next(
        (p.name for p in bound.signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None
    )
    extra = dict(arguments.get(var_kw, {})) if var_kw else {}
    labels = arguments["labels"]
    arguments["labels"] = None
    # Ask for the output dataclass, whatever the caller wants; converted back at the end.
    if spec.return_dict_param:
        wants_dict = arguments.get("return_dict")
        arguments["return_dict"] = True
    else:
        wants_dict = extra.pop("return_dict", None)
        extra["return_dict"] = True
    if var_kw:
        arguments[var_kw] = extra
    if wants_dict is None:
        wants_dict = getattr(model.config, "return_dict", True)

    # The family's forward runs as usual up to `lm_head`; its input is taken here and an empty
    # slice goes on, so the forward's own logits (and their soft-capping) cost nothing.
    captured: list[torch.Tensor] = []
    owner = threading.get_ident()

    def take_input(_module: nn.Module, inputs: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if threading.get_ident() != owner or captured:
            return None
        captured.append(inputs[0])
        return (inputs[0].narrow(-2, 0, 0), *inputs[1:])

    handle = cast(nn.Module, model.lm_head).register_forward_pre_hook(take_input)
    try:
        out = plain(*bound.args, **bound.kwargs)
    finally:
        handle.remove()
    if len(captured) != 1:
        raise UnsupportedFamilyError(
            f"`{type(model).__name__}.forward` did not call `lm_head` once; the chunked loss cannot stand in for it."
        )
    hidden = captured[0]
    targets, ignore_index = _targets(labels, extra)
    flat = hidden.reshape(-1, hidden.shape[-1])
    if targets.numel() != flat.shape[0]:
        raise LossInputError(
            f"The head sees {flat.shape[0]} tokens (hidden states {tuple(hidden.shape)}) but the shifted labels "
            f"hold {targets.numel()} (labels {tuple(labels.shape)}). Pass labels with one entry per position the "
            "head computes (with `logits_to_keep`, per kept position); plain transformers fails here too."
        )
    head = cast(nn.Linear, model.lm_head)  # an nn.Linear, or a layer with its weight and bias
    loss = linear_cross_entropy(
        flat,
        head.weight,
        head.bias,
        targets,
        ignore_index=ignore_index,
        num_items_in_batch=extra.get("num_items_in_batch"),
        transform=spec.transform(model),
        chunk_size=cast(Any, type(model))._modelgraft_chunk_size,
    )
    aux_loss = getattr(out, "aux_loss", None) if spec.aux_loss else None
    if aux_loss is not None:
        loss = loss + model.router_aux_loss_coef * aux_loss.to(loss.device)
    fields = {key: value for key, value in out.items() if key not in ("loss", "logits")}
    result = type(out)(loss=loss, **fields)
    return result if wants_dict else result.to_tuple()


def _make_forward(original: type) -> Any:
    plain = cast(Any, original).forward  # a model class, typed as any class
    signature = inspect.signature(plain)

    def forward(self: nn.Module, *args: Any, skip_logits: bool | None = None, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:
            return plain(self, *args, **kwargs)  # the plain forward raises its own error
        labels = bound.arguments.get("labels")
        if skip_logits is None:
            skip_logits = self.training and labels is not None
        if not skip_logits:
            return plain(self, *args, **kwargs)
        if labels is None:
            raise LossInputError(
                f"`{type(self).__name__}` was called with `skip_logits=True` but no `labels`; without labels there "
                "is no loss and the logits are the output. Pass labels or leave `skip_logits` unset."
            )
        spec = read_head(original)
        reason = _why_plain(self, spec)
        if reason is not None:
            _warn_plain(type(self), reason)
            return plain(self, *args, **kwargs)
        return _chunked_forward(self, plain, spec, bound)

    forward.__signature__ = _with_skip_logits(signature)  # type: ignore[attr-defined]
    forward.__doc__ = (
        f"`{original.__name__}.forward`, with the loss computed in chunks when only the loss is needed.\n\n"
        "``skip_logits`` (default: ``self.training and labels is not None``) returns ``logits=None`` and the "
        "chunked loss; otherwise the plain forward runs."
    )
    return forward


_BYPASS_WARNED: set[tuple[type, str]] = set()


def _make_setattr(original: type) -> Any:
    set_attribute = cast(Any, original).__setattr__

    def __setattr__(self: nn.Module, name: str, value: Any) -> None:
        set_attribute(self, name, value)
        if name == "forward":  # a trainer's own LM-head path (TRL's fused LM head) replaces it
            _warn_bypassed(self)

    return __setattr__


def _warn_bypassed(model: nn.Module) -> None:
    note = _forward_bypass(model)
    if note is None:
        return
    key = (
        type(model),
        _defined_at(getattr(model.__dict__["forward"], "__func__", model.__dict__["forward"])),
    )
    with _WARNED_LOCK:
        if key in _BYPASS_WARNED:
            return
        _BYPASS_WARNED.add(key)
    warnings.warn(note + "; `report(model)` lists this.", RuntimeWarning, stacklevel=3)


def _save_pretrained(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``save_pretrained`` of the plain class, so the saved config names the plain architecture."""
    grafted = type(self)
    self.__class__ = _grafted_original(grafted)
    try:
        return cast(Any, self).save_pretrained(*args, **kwargs)  # now the plain PreTrainedModel
    finally:
        self.__class__ = grafted


# --- the classes ---------------------------------------------------------------------------------

_CLASSES: dict[tuple[type, int | None], type] = {}
_CLASSES_LOCK = ForkSafeLock()


def _check_chunk_size(chunk_size: int | None) -> int | None:
    if chunk_size is None:
        return None
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise LossInputError(
            f"`chunk_size` must be a positive number of tokens or None; received {chunk_size!r}."
        )
    return chunk_size


def chunked_lm_loss_class(causal_lm_class: type, *, chunk_size: int | None = None) -> type:
    """Return the chunked-loss subclass of a transformers ``*ForCausalLM`` class (cached).

    Args:
        causal_lm_class: ``LlamaForCausalLM``, ``Qwen2MoeForCausalLM``, ...
        chunk_size: tokens per chunk; default: as many as fit 2**25 logits (512 at a 64k vocabulary).

    Raises:
        UnsupportedFamilyError: the class's forward does something with the logits that the chunked
            loss does not reproduce (the message quotes it).
        LossInputError: ``chunk_size`` is not a positive integer.

    Example:
        >>> from transformers import Qwen2ForCausalLM
        >>> cls = chunked_lm_loss_class(Qwen2ForCausalLM)
        >>> cls.__name__, issubclass(cls, Qwen2ForCausalLM), chunked_lm_loss_class(Qwen2ForCausalLM) is cls
        ('ChunkedLossQwen2ForCausalLM', True, True)
    """
    causal_lm_class = original_class(causal_lm_class)
    chunk_size = _check_chunk_size(chunk_size)
    key = (causal_lm_class, chunk_size)
    with _CLASSES_LOCK:
        found = _CLASSES.get(key)
        if found is not None:
            return found
        # refuse now, not at the first training step (a class is hashable; torch's stubs hide it)
        read_head(cast(Hashable, causal_lm_class))
        name = f"{_PREFIX}{causal_lm_class.__name__}"
        found = GraftedClass(
            name,
            (causal_lm_class,),
            {
                "__qualname__": name,
                "__doc__": f"`{causal_lm_class.__name__}` whose training loss is computed in chunks of tokens.",
                "forward": _make_forward(causal_lm_class),
                "__setattr__": _make_setattr(causal_lm_class),
                "save_pretrained": _save_pretrained,
                "_modelgraft_original": causal_lm_class,
                "_modelgraft_chunk_size": chunk_size,
                RECIPE_ATTR: (
                    functools.partial(chunked_lm_loss_class, chunk_size=chunk_size),
                    (causal_lm_class,),
                ),
            },
        )
        _CLASSES[key] = found
        return found


def _grafted_original_or_none(cls: type) -> type | None:
    return cls.__dict__.get("_modelgraft_original") if cls.__name__.startswith(_PREFIX) else None


def graft_chunked_lm_loss(model: nn.Module, *, chunk_size: int | None = None) -> nn.Module:
    """Switch a built causal LM to the chunked loss, in place, and return it.

    The same as ``graft_model(model, graft)`` with a graft that replaces only the model's own class
    by :func:`chunked_lm_loss_class` of it (whatever else is registered): the class of the model
    object changes; parameters, buffers, hooks and device placement are untouched, so this is free
    and exact. ``report(model)`` lists it. Calling it again (with another ``chunk_size``) switches
    to that class.

    Raises:
        UnsupportedFamilyError: the model is not a transformers ``*ForCausalLM`` whose head the chunked
            loss reproduces (the model is left as it was).

    Example:
        >>> from transformers import AutoModelForCausalLM
        >>> from modelgraft import report
        >>> from modelgraft.testing import tiny_config
        >>> model = graft_chunked_lm_loss(AutoModelForCausalLM.from_config(tiny_config("qwen3")), chunk_size=8)
        >>> [(r.path, r.replacement.rsplit(".", 1)[-1]) for r in report(model).replaced]
        [('', 'ChunkedLossQwen3ForCausalLM')]
    """
    current = type(model)
    original = _grafted_original_or_none(current) or current
    if not isinstance(model, PreTrainedModel) or "lm_head" not in dict(model.named_children()):
        raise UnsupportedFamilyError(
            f"`{current.__name__}` is not a transformers causal LM with an `lm_head`; the chunked loss grafts "
            "`*ForCausalLM` models (for a PEFT model, pass `model.get_base_model()`)."
        )
    graft = Graft(
        {original.__name__: chunked_lm_loss_class(original, chunk_size=chunk_size)}, name="chunked LM loss"
    )
    with unpatched():  # this graft alone, as documented
        return graft_model(model, graft)


# --- the graft -------------------------------------------------------------------------------------


def _part(model_type: str, chunk_size: int | None = None) -> _Part:
    config = tiny_config(model_type)
    causal_lm = _compat.auto_model_class("causal_lm", config)
    if causal_lm is None:
        raise UnsupportedFamilyError(
            f"`{model_type}` has no causal-LM class in transformers' `MODEL_FOR_CAUSAL_LM_MAPPING`; the chunked "
            f"loss grafts `*ForCausalLM` models. Families known to work: {', '.join(CHUNKED_LM_LOSS_FAMILIES)}."
        )
    return _Part({causal_lm.__name__: chunked_lm_loss_class(causal_lm, chunk_size=chunk_size)})


def chunked_lm_loss(*model_types: str, chunk_size: int | None = None) -> Graft:
    """The chunked-loss graft for ``model_types`` (default: :data:`CHUNKED_LM_LOSS_FAMILIES`).

    Its mapping replaces each family's ``*ForCausalLM`` class; it has no conversions of its own.
    A load under it (``AutoModelForCausalLM.from_pretrained`` included) builds the grafted class;
    ``modelgraft.graft_model(model, graft)`` switches a model that is already built.

    Example:
        >>> graft = chunked_lm_loss("gemma2", "mixtral")
        >>> sorted((k, v.__name__) for k, v in graft.mapping.items())
        [('Gemma2ForCausalLM', 'ChunkedLossGemma2ForCausalLM'), ('MixtralForCausalLM', 'ChunkedLossMixtralForCausalLM')]
    """
    chunk_size = _check_chunk_size(chunk_size)

    def part(model_type: str) -> _Part:
        return _part(model_type, chunk_size)

    return Graft.of("chunked LM loss", model_types, CHUNKED_LM_LOSS_FAMILIES, part)
