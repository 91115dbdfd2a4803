"""The MoE families of the installed transformers, found at run time, and tiny models of them (tests only).

Families are found by reading (not importing) each ``models/*/modeling_*.py`` for a router class, so
the list follows whatever transformers is installed. Each is built with a routing-test profile of
sizes (8 experts in 4 groups with top-2, every layer MoE, exercising group-limited routing) rather
than :func:`modelgraft.testing.tiny_config`'s, which has 4 experts in 1 group; that profile and the
few fixes some families need under it are rows of the one family table
(``modelgraft._families.ROUTING_SIZES``/``ROUTING_FIXES``), applied here.

Example:
    >>> "qwen3_moe" in moe_model_types()
    True
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from functools import cache, lru_cache
from typing import Any

import pytest
import torch
from torch import nn

# Test infrastructure, not a test: family discovery reads the version layer's modeling-file index
# (private _compat); no public name lists the installed modeling files.
from modelgraft import RoutingError, _compat
from modelgraft._families import ROUTING_FIXES, ROUTING_NESTED, ROUTING_SIZES
from modelgraft.moe import moe_layers

__all__ = [
    "BATCH",
    "SEQ",
    "TINY",
    "TOKEN_TYPES",
    "build_tiny",
    "forward_inputs",
    "model_output",
    "moe_model_types",
    "plain_failure",
    "routed_tokens",
    "tiny_or_skip",
    "tiny_with_random_routers",
]

_ROUTER_DEF = re.compile(r"^class \w+(Router|Gate|Gating)\(", re.M)
_EXPERTS_DEF = re.compile(r"^class \w*Expert", re.M)

# The routing profile and its family fixes live in the one family table (modelgraft._families).
TINY: dict[str, Any] = ROUTING_SIZES
_OVERRIDES: dict[str, dict[str, Any]] = ROUTING_FIXES
_NESTED: dict[str, dict[str, str]] = ROUTING_NESTED

_MAX_PARAMS = 2_000_000

# Families whose routers each take only the tokens of one type, chosen by a forward input: the input's
# name, and per MoE block (by module name) the type it routes. ERNIE 4.5 VL sends text and vision
# tokens through separate blocks; on text-only input its vision router never runs, so the routing
# tests give every other position the vision type and every router routes tokens.
TOKEN_TYPES: dict[str, tuple[str, dict[str, int]]] = {
    "ernie4_5_vl_moe_text": ("moe_mm_token_type_ids", {"text_moe": 0, "vision_moe": 1}),
}


@lru_cache(maxsize=1)
def moe_model_types() -> tuple[str, ...]:
    """Model types of the installed transformers whose modeling file defines a router next to experts.

    For a multimodal family the text model type is used (``qwen3_vl_moe_text``), since the
    routing lives in the language model.
    """
    by_module = _compat.model_types_by_module()
    found: list[str] = []
    for path in _compat.modeling_files():
        with open(path, encoding="utf-8") as handle:
            source = handle.read()
        if not (
            _ROUTER_DEF.search(source) and _EXPERTS_DEF.search(source)
        ) and not _compat.TRANSFORMERS.defines_layout_moe(source):
            continue
        module = os.path.basename(os.path.dirname(path))
        types = by_module.get(module, [])
        if types:
            found.append(_pick_type(module, types))
    return tuple(dict.fromkeys(found))


def _pick_type(module: str, types: list[str]) -> str:
    text = [t for t in types if t.endswith("_text") and "talker" not in t]
    if text:
        return text[0]
    return module if module in types else types[0]


def build_tiny(model_type: str, seed: int = 0, **overrides: Any) -> nn.Module:
    """A tiny randomly initialised model of ``model_type`` (causal LM head where there is one).

    Raises whatever transformers raises when the family cannot be built this small.
    """
    from transformers import AutoConfig

    kwargs = _tiny_kwargs(model_type)
    kwargs.update(overrides)
    config = AutoConfig.for_model(model_type, **kwargs)
    build = _builder(config)
    with torch.device("meta"):
        size = sum(p.numel() for p in build().parameters())
    if size > _MAX_PARAMS:
        raise ValueError(
            f"`{model_type}` is not tiny with these overrides ({size:,} parameters > {_MAX_PARAMS:,}); "
            "its config nests sizes this table does not set"
        )
    torch.manual_seed(seed)
    return build().eval()


def forward_inputs(model_type: str, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The routing tests' forward inputs: ``input_ids`` and, for a family in ``TOKEN_TYPES``, token
    types alternating along the sequence (0 at even positions, 1 at odd ones).

    Example:
        >>> sorted(forward_inputs("ernie4_5_vl_moe_text", torch.ones(1, 4, dtype=torch.long)))
        ['input_ids', 'moe_mm_token_type_ids']
    """
    inputs = {"input_ids": ids}
    if model_type in TOKEN_TYPES:
        name, _ = TOKEN_TYPES[model_type]
        inputs[name] = (torch.arange(ids.shape[-1]) % 2).expand_as(ids).clone()
    return inputs


def routed_tokens(model_type: str, layer_name: str, ids: torch.Tensor) -> int:
    """How many tokens the router ``layer_name`` routes in a forward on :func:`forward_inputs`.

    Example:
        >>> ids = torch.ones(2, 3, dtype=torch.long)
        >>> routed_tokens("qwen3_moe", "model.layers.0.mlp.gate", ids)
        6
        >>> routed_tokens("ernie4_5_vl_moe_text", "layers.0.mlp.vision_moe.gate", ids)
        2
    """
    if model_type not in TOKEN_TYPES:
        return ids.numel()
    name, types = TOKEN_TYPES[model_type]
    (kind,) = [kind for block, kind in types.items() if block in layer_name.split(".")]
    return int((forward_inputs(model_type, ids)[name] == kind).sum())


# ---- shared by the routing tests on every family (test_moe_families.py, unit/test_moe_intercept.py):
# one cache of tiny models, so a session builds each family once.
BATCH, SEQ = 2, 4


@cache
def tiny_with_random_routers(model_type: str) -> tuple[torch.nn.Module | None, str]:
    """The tiny model with randomised routers, or None and why it cannot be used."""
    try:
        model = build_tiny(model_type)
    except Exception as exc:  # any failure to build tiny is a skip reason, reported verbatim
        return None, f"cannot be built tiny: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    try:
        layers = moe_layers(model)
    except RoutingError as exc:
        return None, str(exc)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in layers:
            # Initialisers often zero the router; random routers make the selection non-trivial.
            for tensor in [*layer.router.parameters(), *layer.router.buffers()]:
                if tensor.is_floating_point():
                    tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.5)
    return model, ""


def tiny_or_skip(model_type: str) -> torch.nn.Module:
    """The model of :func:`tiny_with_random_routers`, or a skip with the reason it cannot be used."""
    model, reason = tiny_with_random_routers(model_type)
    if model is None:
        pytest.skip(f"{model_type}: {reason}")
    return model


def model_output(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The logits of a forward on :func:`forward_inputs` (the last hidden state without a head)."""
    out = model(**forward_inputs(model.config.model_type, ids), use_cache=False)
    logits = getattr(out, "logits", None)
    return logits if logits is not None else out.last_hidden_state


@cache
def plain_failure(model_type: str) -> str:
    """Why the family's own forward fails at tiny size (without modelgraft), or ''."""
    model, _ = tiny_with_random_routers(model_type)
    try:
        with torch.no_grad():
            model_output(model, torch.ones(BATCH, SEQ, dtype=torch.long))
    except Exception as exc:
        return f"plain forward fails when tiny: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return ""


def _tiny_kwargs(model_type: str) -> dict[str, Any]:
    """The config kwargs of ``model_type``'s tiny profile: the TINY sizes its config has, its fixes,
    and the tiny profile of each sub-config listed in ``_NESTED``."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    known = set(default.to_dict()) | set(getattr(default, "attribute_map", {}))
    kwargs = {k: v for k, v in TINY.items() if k in known}
    if "qk_rope_head_dim" in known:
        # Multi-head latent attention derives its head sizes itself (an override may still set one).
        kwargs.pop("head_dim", None)
    kwargs.update(_OVERRIDES.get(model_type, {}))
    for key, sub_type in _NESTED.get(model_type, {}).items():
        kwargs[key] = {**_tiny_kwargs(sub_type), **kwargs.get(key, {})}
    return kwargs


def _builder(config: Any) -> Callable[[], nn.Module]:
    from transformers import AutoModel, AutoModelForCausalLM

    for kind, auto in (("causal_lm", AutoModelForCausalLM), ("base", AutoModel)):
        if _compat.auto_model_class(kind, config) is None:
            continue
        return lambda: auto.from_config(config)  # type: ignore[no-untyped-call]
    cls = _model_class(config)
    return lambda: cls(config)


def _model_class(config: Any) -> type[nn.Module]:
    """The family's own model class for a config no auto class maps (a multimodal text tower)."""
    import importlib

    from transformers import PreTrainedModel

    module = importlib.import_module(type(config).__module__.replace(".configuration_", ".modeling_"))
    candidates = [
        obj
        for obj in vars(module).values()
        if isinstance(obj, type)
        and issubclass(obj, PreTrainedModel)
        and getattr(obj, "config_class", None) is type(config)
        and not obj.__name__.endswith("PreTrainedModel")
    ]
    candidates.sort(
        key=lambda cls: (not cls.__name__.endswith("ForCausalLM"), not cls.__name__.endswith("Model"))
    )
    if not candidates:
        raise ValueError(f"no model class in `{module.__name__}` takes `{type(config).__name__}`")
    return candidates[0]
