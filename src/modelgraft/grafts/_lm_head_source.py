"""Read, from a ``*ForCausalLM.forward``'s source, what it does between ``lm_head`` and the loss.

The chunked loss reproduces that part of the forward itself, so it must know it exactly: the logit
scale (Cohere multiplies by ``logit_scale``, Granite divides by ``logits_scaling``), Gemma's
soft-capping, the arguments of the loss call, and the MoE router auxiliary loss. Rather than a
hand-written table that a new transformers release could silently contradict, :func:`read_head`
parses the installed forward (``ast``, so formatting and comments do not matter) and accepts only
statements it recognises; any other statement after the ``lm_head`` call is refused, quoted.

Example:
    >>> from transformers.models.gemma2.modeling_gemma2 import Gemma2ForCausalLM
    >>> spec = read_head(Gemma2ForCausalLM)
    >>> spec.softcap_attr, spec.scale_op, spec.aux_loss
    ('config.final_logit_softcapping', None, False)
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any, cast

from modelgraft.errors import UnsupportedFamilyError
from modelgraft.grafts._chunked_ce import LogitTransform

__all__ = ["HeadSpec", "read_head"]


@dataclass(frozen=True)
class HeadSpec:
    """What a causal-LM forward does with ``lm_head``'s output, read from its source.

    Attributes:
        vocab_attr: where the loss call reads the vocabulary size (``config.vocab_size``).
        scale_op: ``"mul"``, ``"div"`` or ``None``; ``scale_attr`` says where the factor lives.
        scale_attr: attribute path on the model (``logit_scale``, ``config.logits_scaling``).
        softcap_attr: attribute path of the soft-capping value, or ``None``.
        aux_loss: the forward adds ``router_aux_loss_coef * aux_loss`` to the loss.
        return_dict_param: the forward takes ``return_dict`` (transformers 4.57 style).
    """

    vocab_attr: str
    scale_op: str | None = None
    scale_attr: str | None = None
    softcap_attr: str | None = None
    aux_loss: bool = False
    return_dict_param: bool = False

    def transform(self, model: Any) -> LogitTransform:
        """The model's current logit transform (values are read from the model on every call)."""
        scale = float(_resolve(model, self.scale_attr)) if self.scale_attr else 1.0
        softcap = _resolve(model, self.softcap_attr) if self.softcap_attr else None
        return LogitTransform(self.scale_op, scale, None if softcap is None else float(softcap))

    def vocab_size(self, model: Any) -> int:
        return int(_resolve(model, self.vocab_attr))


def _resolve(model: Any, path: str) -> Any:
    value = model
    for name in path.split("."):
        value = getattr(value, name)
    return value


def _canon(source: str) -> str:
    return ast.unparse(ast.parse(textwrap.dedent(source)))


_SCALES = {
    _canon("logits = logits / self.config.logits_scaling"): ("div", "config.logits_scaling"),
    _canon("logits = logits * self.logit_scale"): ("mul", "logit_scale"),
}
_SOFTCAP = _canon(
    """
    if self.config.final_logit_softcapping is not None:
        logits = logits / self.config.final_logit_softcapping
        logits = torch.tanh(logits)
        logits = logits * self.config.final_logit_softcapping
    """
)
_AUX_BLOCK = """
    if output_router_logits:
        aux_loss = load_balancing_loss_func({router_logits}, self.num_experts, self.num_experts_per_tok, attention_mask)
        if labels is not None:
            loss += self.router_aux_loss_coef * aux_loss.to(loss.device)
    """
_AUX = {
    _canon(_AUX_BLOCK.format(router_logits="outputs.router_logits")),
    _canon(_AUX_BLOCK.format(router_logits="outputs.router_logits if return_dict else outputs[-1]")),
}
_LOSS_NONE = _canon("loss = None")
_AUX_NONE = _canon("aux_loss = None")
_UPCAST = _canon("logits = logits.float()")
_VOCAB = {_canon("self.config.vocab_size"): "config.vocab_size", _canon("self.vocab_size"): "vocab_size"}
_KNOWN = (
    "`logits / self.config.logits_scaling`, `logits * self.logit_scale`, Gemma's soft-capping, "
    "`self.loss_function(logits, labels, vocab_size, **kwargs)` and the router auxiliary loss"
)


def _is_self_attr(node: ast.AST, attr: str) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == attr
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    )


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _head_call(stmt: ast.stmt) -> bool:
    """``logits = self.lm_head(<one argument>)``."""
    return (
        isinstance(stmt, ast.Assign)
        and len(stmt.targets) == 1
        and isinstance(stmt.targets[0], ast.Name)
        and stmt.targets[0].id == "logits"
        and isinstance(stmt.value, ast.Call)
        and _is_self_attr(stmt.value.func, "lm_head")
        and len(stmt.value.args) == 1
        and not stmt.value.keywords
    )


def _loss_call(stmt: ast.stmt) -> str | None:
    """The vocabulary attribute of ``loss = self.loss_function(logits, labels, <vocab>, **kwargs)``
    (positional or keyword), or ``None`` when ``stmt`` is something else."""
    if not (
        isinstance(stmt, ast.Assign)
        and len(stmt.targets) == 1
        and isinstance(stmt.targets[0], ast.Name)
        and stmt.targets[0].id == "loss"
        and isinstance(stmt.value, ast.Call)
        and _is_self_attr(stmt.value.func, "loss_function")
    ):
        return None
    call = stmt.value
    if len(call.args) > 3 or any(isinstance(a, ast.Starred) for a in call.args):
        return None
    bound = dict(zip(("logits", "labels", "vocab_size"), call.args))
    spread = [k for k in call.keywords if k.arg is None]
    for keyword in call.keywords:
        if keyword.arg is not None:
            if keyword.arg in bound:
                return None
            bound[keyword.arg] = keyword.value
    if sorted(bound) != ["labels", "logits", "vocab_size"] or len(spread) != 1:
        return None
    if _canon(ast.unparse(spread[0].value)) != "kwargs":
        return None
    if not all(isinstance(node := bound[n], ast.Name) and node.id == n for n in ("logits", "labels")):
        return None
    return _VOCAB.get(ast.unparse(bound["vocab_size"]))


def _labels_block(stmt: ast.stmt) -> str | None:
    """The vocabulary attribute of ``if labels is not None: [logits = logits.float()]; loss = ...``."""
    if not isinstance(stmt, ast.If) or stmt.orelse or _canon(ast.unparse(stmt.test)) != "labels is not None":
        return None
    body = list(stmt.body)
    if len(body) == 2 and ast.unparse(body[0]) == _UPCAST:
        body = body[1:]  # upcasting is what the loss function does first anyway
    return _loss_call(body[0]) if len(body) == 1 else None


def _return_fields(stmt: ast.stmt) -> dict[str, str] | None:
    """``{keyword: source}`` of ``return SomeOutput(...)`` with keyword arguments only."""
    if not (isinstance(stmt, ast.Return) and isinstance(stmt.value, ast.Call)) or stmt.value.args:
        return None
    if any(k.arg is None for k in stmt.value.keywords):
        return None
    return {k.arg: ast.unparse(k.value) for k in stmt.value.keywords if k.arg is not None}


@functools.cache
def read_head(causal_lm_class: type) -> HeadSpec:
    """The :class:`HeadSpec` of ``causal_lm_class.forward``, or a clear refusal.

    Raises:
        UnsupportedFamilyError: the forward's source is unavailable, calls ``lm_head`` other than
            once as ``logits = self.lm_head(hidden_states...)``, reads ``labels`` before that call,
            or does anything after it that is not recognised (the statement is quoted).
    """
    name = causal_lm_class.__name__
    forward = inspect.unwrap(cast(Any, causal_lm_class).forward)  # a model class, typed as any class
    try:
        source = textwrap.dedent(inspect.getsource(forward))
    except (OSError, TypeError):
        raise UnsupportedFamilyError(
            f"The source of `{name}.forward` is not available, so the chunked loss cannot check what it "
            "does with the logits; only transformers' own causal-LM classes are supported."
        ) from None
    function = ast.parse(source).body[0]
    if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
        raise UnsupportedFamilyError(f"`{name}.forward` is not a plain function; cannot read its head.")
    body = function.body
    heads = [i for i, stmt in enumerate(body) if _head_call(stmt)]
    uses = [n for n in ast.walk(function) if _is_self_attr(n, "lm_head")]
    if len(heads) != 1 or len(uses) != 1:
        raise UnsupportedFamilyError(
            f"`{name}.forward` does not call `lm_head` exactly once as `logits = self.lm_head(hidden_states)` "
            "at its top level; the chunked loss cannot take its place."
        )
    head = heads[0]
    if any("labels" in _names(stmt) for stmt in body[:head]):
        raise UnsupportedFamilyError(
            f"`{name}.forward` uses `labels` before `lm_head`; the chunked loss runs the forward without labels, "
            "so it would change what that code does."
        )
    params = inspect.signature(forward).parameters
    found: dict[str, Any] = {"return_dict_param": "return_dict" in params}
    seen_loss = False
    for stmt in body[head + 1 :]:
        text = _canon(ast.unparse(stmt))
        if not seen_loss and text in _SCALES and "scale_op" not in found:
            found["scale_op"], found["scale_attr"] = _SCALES[text]
        elif not seen_loss and text == _SOFTCAP and "softcap_attr" not in found:
            found["softcap_attr"] = "config.final_logit_softcapping"
        elif text == _LOSS_NONE and not seen_loss:
            seen_loss = True
        elif seen_loss and "vocab_attr" not in found and _labels_block(stmt) is not None:
            found["vocab_attr"] = _labels_block(stmt)
        elif "vocab_attr" in found and text == _AUX_NONE:
            continue
        elif "vocab_attr" in found and text in _AUX and "aux_loss" not in found:
            found["aux_loss"] = True
        elif (
            found["return_dict_param"]
            and isinstance(stmt, ast.If)
            and _canon(ast.unparse(stmt.test)) == "not return_dict"
        ):
            continue  # the tuple output; the chunked forward asks for the dataclass and converts itself
        elif (fields := _return_fields(stmt)) is not None and "vocab_attr" in found:
            _check_return(name, fields, bool(found.get("aux_loss")))
            return HeadSpec(**found)
        else:
            raise UnsupportedFamilyError(
                f"`{name}.forward` does `{ast.unparse(stmt).splitlines()[0]}` after `lm_head`, which the chunked "
                f"loss does not reproduce (it knows {_KNOWN}). Use the plain model for this family."
            )
    raise UnsupportedFamilyError(
        f"`{name}.forward` does not compute `loss = self.loss_function(logits, labels, ...)` and return it; "
        "the chunked loss cannot take its place."
    )


def _check_return(name: str, fields: dict[str, str], aux: bool) -> None:
    expected = {"loss": "loss", "logits": "logits", **({"aux_loss": "aux_loss"} if aux else {})}
    wrong = {k: v for k, v in expected.items() if fields.get(k) != v}
    others = {k: v for k, v in fields.items() if k not in expected}
    leaked = [k for k, v in others.items() if _names(ast.parse(v)) & {"logits", "loss", "aux_loss"}]
    if wrong or leaked:
        raise UnsupportedFamilyError(
            f"`{name}.forward` returns {', '.join(f'`{k}={fields.get(k)}`' for k in [*wrong, *leaked])}; "
            f"the chunked loss expects {', '.join(f'`{k}={v}`' for k, v in expected.items())} and no other field "
            "made from them."
        )
