"""Fuse sibling ``nn.Linear`` layers of a module into one, leaving the module's forward untouched.

:func:`fuse_linears` replaces, say, ``q_proj``, ``k_proj`` and ``v_proj`` of an attention module by
light stand-ins (:class:`FusedSlice`) that share ONE ``nn.Linear`` (``qkv_proj``). The first
stand-in called with a given input computes every part from the fused weight; the others
return their part of that same result. The family's own forward (rotary embeddings, q/k norms,
sliding windows, caches) therefore runs unchanged, while the parameters live only in the fused
layer, so the state dict holds ``qkv_proj.weight`` and no ``q_proj``/``k_proj``/``v_proj``.

The parts come from :func:`~modelgraft.grafts._split_linear.split_linear` (one matmul per part,
a backward that never concatenates gradients), so the fused layer is not slower than the separate
ones; a fused layer that is no longer a plain ``nn.Linear`` (quantized, hooked, offloaded) is
called as a module instead and its output split.

Example:
    >>> import torch
    >>> from torch import nn
    >>> block = nn.Module()
    >>> block.a, block.b = nn.Linear(4, 3), nn.Linear(4, 2)
    >>> x = torch.randn(2, 4)
    >>> expected = torch.cat([block.a(x), block.b(x)], -1)
    >>> fused = fuse_linears(block, ("a", "b"), "ab")
    >>> sorted(n for n, _ in block.named_parameters())
    ['ab.bias', 'ab.weight']
    >>> torch.allclose(torch.cat([block.a(x), block.b(x)], -1), expected)
    True
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from typing import Any, TypeGuard, cast

import torch
from torch import nn
from torch.nn.modules import module as _torch_module

from modelgraft._forksafe import ForkSafeLock
from modelgraft.errors import FusionError
from modelgraft.grafts import _peft
from modelgraft.grafts._pickling import RECIPE_ATTR, GraftedClass
from modelgraft.grafts._split_linear import split_linear

__all__ = ["FusedSlice", "FusionError", "can_fuse_linears", "fuse_linears", "fused_subclass"]


@dataclass
class _Cached:
    """The split output of one fused matmul, valid for exactly one input and weight version."""

    source: torch.Tensor
    source_version: int
    weight_version: int
    grad_enabled: bool
    parts: tuple[torch.Tensor, ...]
    pending: set[int]


class _FusionGroup:
    """Shared state of the stand-ins of one fused layer (not an ``nn.Module``: holds no weights).

    It keeps a strong reference to the owning module and looks the fused layer up by name on
    every call, so a quantizer that swaps ``owner.qkv_proj`` for its own layer is picked up.
    """

    def __init__(
        self, owner: nn.Module, fused_name: str, sizes: tuple[int, ...], names: tuple[str, ...] = ()
    ) -> None:
        self.owner = owner
        self.fused_name = fused_name
        self.sizes = sizes
        self.names = names
        self._local = threading.local()
        self._traced: tuple[torch.Tensor, tuple[torch.Tensor, ...], set[int]] | None = None

    def __getstate__(self) -> dict[str, object]:
        # Cached activations are neither copyable nor worth copying; thread-locals not picklable.
        return {
            "owner": self.owner,
            "fused_name": self.fused_name,
            "sizes": self.sizes,
            "names": self.names,
            "_parts": self.__dict__.get("_parts", {}),
            "_traced": None,
        }

    def __setstate__(self, state: dict[str, object]) -> None:
        state.setdefault("names", ())  # pickled before the part names were kept
        self.__dict__.update(state)
        self._local = threading.local()

    def fused(self) -> nn.Module:
        fused: nn.Module = getattr(self.owner, self.fused_name)
        return fused

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        fused = self.fused()
        if torch.compiler.is_compiling():
            return self._traced_part(fused, x, index)
        weight = getattr(fused, "weight", None)
        weight_version = weight._version if isinstance(weight, torch.Tensor) else -1
        grad_enabled = torch.is_grad_enabled()
        cached: _Cached | None = getattr(self._local, "cached", None)
        if (
            cached is not None
            and cached.source is x
            and index in cached.pending
            and cached.source_version == x._version
            and cached.weight_version == weight_version
            and cached.grad_enabled == grad_enabled
        ):
            cached.pending.discard(index)
            if not cached.pending:
                self._local.cached = None  # every part handed out: release the activations
            return cached.parts[index]
        parts = self._compute(fused, x)
        pending = set(range(len(parts))) - {index}
        self._local.cached = _Cached(x, x._version, weight_version, grad_enabled, parts, pending)
        return parts[index]

    def _compute(self, fused: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.check_parts()
        if _plain_linear(fused, x):
            return split_linear(x, fused.weight, fused.bias, self.sizes)
        check_not_adapted(self.owner, self.fused_name, self.names)
        return tuple(fused(x).split(self.sizes, dim=-1))

    def check_parts(self) -> None:
        """Refuse a part that was replaced by a module that does not read the fused layer.

        A stand-in may be wrapped (a PEFT LoRA layer whose base layer it is: its output still comes
        from the fused weight), but a module put in its place, say a quantizer's linear layer,
        would compute with weights of its own while ``qkv_proj`` keeps and saves the old ones.
        """
        modules = self.owner._modules
        for index, name in enumerate(self.names):
            found = modules.get(name)
            if found is None or _unwrapped(found) is self.part_module(index):
                continue
            owner = type(self.owner).__name__
            raise FusionError(
                f"`{owner}.{name}` was replaced by `{type(found).__name__}`, which does not read the fused "
                f"`{self.fused_name}`: its output would no longer be the one `{self.fused_name}` holds and "
                f"saves. Replace or quantize `{self.fused_name}` itself, or load the model without the graft."
            )

    def part_module(self, index: int) -> nn.Module | None:
        part: nn.Module | None = self.__dict__.get("_parts", {}).get(index)
        return part

    def _traced_part(self, fused: nn.Module, x: torch.Tensor, index: int) -> torch.Tensor:
        # Under torch.compile the identity of ``x`` is known while tracing, but version counters
        # are not; a compiled graph always runs with the weights it is given, so identity is enough.
        traced: tuple[torch.Tensor, tuple[torch.Tensor, ...], set[int]] | None = self.__dict__.get("_traced")
        if traced is not None and traced[0] is x and index in traced[2]:
            traced[2].discard(index)
            if not traced[2]:
                self._traced = None
            return traced[1][index]
        parts: tuple[torch.Tensor, ...] = tuple(fused(x).split(self.sizes, dim=-1))
        self._traced = (x, parts, set(range(len(parts))) - {index})
        return parts[index]


def _plain_linear(fused: nn.Module, x: torch.Tensor) -> TypeGuard[nn.Linear]:
    """Whether ``fused`` is an untouched ``nn.Linear`` that :func:`split_linear` may run for it.

    Anything else keeps going through ``fused(x)``: a quantizer's or adapter's own layer, hooks
    and wrapped forwards (accelerate's offloading replaces ``forward`` on the instance and loads
    the weight inside it) that :func:`split_linear` would skip, tensor subclasses, and autocast
    (whose casts a custom backward would have to repeat), and ``torch.func`` transforms (which
    refuse an autograd function without a ``setup_context``/vmap rule).
    """
    if type(fused) is not nn.Linear or type(x) is not torch.Tensor or "forward" in fused.__dict__:
        return False
    weight, bias = fused.weight, fused.bias
    if type(weight) is not nn.Parameter or not weight.is_floating_point() or weight.is_meta:
        return False
    if bias is not None and type(bias) is not nn.Parameter:
        return False
    if fused._forward_hooks or fused._forward_pre_hooks or fused._backward_hooks or fused._backward_pre_hooks:
        return False
    if _global_hooks() or torch.is_autocast_enabled(x.device.type):
        return False
    return not _functorch_active()


_GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)


def _global_hooks() -> bool:
    # Hooks registered for every module (nn.modules.module.register_module_forward_hook & co.);
    # private names, so a torch that renames them simply has none to find.
    return any(getattr(_torch_module, name, None) for name in _GLOBAL_HOOKS)


def _functorch_active() -> bool:
    # The very check torch.autograd.Function.apply makes (a private name, hence the getattr).
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    return bool(active()) if active is not None else False


def _unwrapped(module: nn.Module) -> nn.Module:
    """The module under adapter wrappers (PEFT keeps the wrapped layer as ``base_layer``)."""
    for _ in range(16):  # adapters nest (an adapter added on top of another), never this deep
        inner = module._modules.get("base_layer")
        if inner is None:
            return module
        module = inner
    return module


def _is_peft_module(module: nn.Module) -> bool:
    # By module name: importing peft to test isinstance would import it for every user.
    return any(cls.__module__.split(".")[0] == "peft" for cls in type(module).__mro__)


def check_not_adapted(owner: nn.Module, fused_name: str, names: tuple[str, ...]) -> None:
    """Refuse a PEFT adapter (LoRA, ``modules_to_save``, ...) on the fused layer itself.

    Such an adapter has no counterpart in the plain model: it would save ``qkv_proj.lora_A``
    keys that a plain model does not load. Adapters on the parts (``q_proj``, ...) are exact.
    """
    fused = owner._modules.get(fused_name)
    if fused is None or not _is_peft_module(fused):
        return
    parts = ", ".join(f'"{n}"' for n in names)
    raise FusionError(
        f"`{type(owner).__name__}.{fused_name}` is wrapped by the PEFT module `{type(fused).__module__}.{type(fused).__qualname__}`: an "
        f"adapter on the fused layer has no counterpart in the plain model (its adapter file would hold "
        f"`{fused_name}` keys that a plain model drops). Target the plain layers instead: "
        f"`target_modules=[{parts}, ...]` (with `target_modules='all-linear'`, modelgraft leaves "
        f"`{fused_name}` out by itself)."
    )


class _PartWeight(torch.Tensor):
    """Rows of a fused weight, as ``q_proj.weight`` returns them.

    A view already shares the fused tensor's memory, so in-place updates through it
    (``q_proj.weight.data += delta``, as PEFT's merge does) reach the fused layer. Assigning
    ``.data`` would only rebind the view; here it writes into the rows instead, so PEFT's
    ``safe_merge`` and DoRA's merges update the fused layer as they update a plain one.
    """

    # Results of operations on it are plain tensors: only this object writes through.
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]  # torch's stubs differ

    @property
    def data(self) -> torch.Tensor:
        # The stubs type `TensorBase.data` as a tensor; on the class it is the C getter (a descriptor).
        getter = cast(Any, torch._C.TensorBase.data)
        plain: torch.Tensor = getter.__get__(self)
        return plain

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        if not isinstance(value, torch.Tensor) or (value.shape, value.dtype, value.device) != (
            self.shape,
            self.dtype,
            self.device,
        ):
            got = (
                (tuple(value.shape), value.dtype, value.device)
                if isinstance(value, torch.Tensor)
                else type(value).__name__
            )
            raise FusionError(
                "Cannot assign `.data` of a fused part: it is rows of the fused layer's weight and keeps "
                f"their shape, dtype and device {(tuple(self.shape), self.dtype, self.device)}; received "
                f"{got}."
            )
        with torch.no_grad():
            torch.Tensor.copy_(self, value)


def _part_view(tensor: torch.Tensor, span: slice) -> torch.Tensor:
    """Rows ``span`` of a fused tensor, carrying its "loaded" flag: a family's weight init that
    reaches a part through ``self.q_proj.weight`` (CLIP's does) must skip loaded weights, as it
    skips the fused tensor itself, instead of re-initialising them through the view."""
    part = tensor[span]
    if type(tensor) in (torch.Tensor, nn.Parameter) and not torch.compiler.is_compiling():
        part = part.as_subclass(_PartWeight)
    if getattr(tensor, "_is_hf_initialized", False):
        part._is_hf_initialized = True  # type: ignore[attr-defined]
    return part


def _same_rows(value: object, current: torch.Tensor | None) -> bool:
    # What PEFT's unload assigns back (`module.weight = wrapper.weight`) is this very view.
    return (
        isinstance(value, torch.Tensor)
        and current is not None
        and value.data_ptr() == current.data_ptr()
        and value.shape == current.shape
        and value.stride() == current.stride()
        and value.dtype == current.dtype
    )


class FusedSlice(nn.Linear):
    """Stands in for one of the fused ``nn.Linear`` layers; returns its slice of the fused output.

    It has no parameters of its own. ``weight`` and ``bias`` are views into the fused layer, for
    code that inspects them (``self.q_proj.weight.dtype``) and for adapters that update them in
    place. It is an ``nn.Linear`` (of ``in_features`` to ``out_features``) so that tools which
    wrap linear layers, PEFT's LoRA first, wrap it as they wrap the plain model's layer: the
    wrapper calls it for the base output and adds its own, exactly as on the plain model.
    """

    # transformers' weight init skips modules flagged as initialised: the fused layer is
    # initialised (or loaded) itself, and drawing numbers again for its rows would change them.
    _is_hf_initialized = True

    def __init__(self, group: _FusionGroup, index: int, in_features: int, out_features: int) -> None:
        nn.Module.__init__(self)  # nn.Linear's own __init__ would allocate a weight
        self._group = group
        self._index = index
        self.in_features = in_features
        self.out_features = out_features
        group.__dict__.setdefault("_parts", {})[index] = self

    def _span(self) -> slice:
        start = sum(self._group.sizes[: self._index])
        return slice(start, start + self._group.sizes[self._index])

    @property
    def weight(self) -> torch.Tensor:
        return _part_view(cast(torch.Tensor, self._group.fused().weight), self._span())

    @weight.setter
    def weight(self, value: torch.Tensor) -> None:
        self._refuse_assignment("weight", value, self.weight)

    @property  # type: ignore[override]  # a part's bias is a view of the fused bias, not a Parameter
    def bias(self) -> torch.Tensor | None:
        bias = getattr(self._group.fused(), "bias", None)
        return None if bias is None else _part_view(bias, self._span())

    @bias.setter
    def bias(self, value: torch.Tensor | None) -> None:
        self._refuse_assignment("bias", value, self.bias)

    def _refuse_assignment(self, name: str, value: object, current: torch.Tensor | None) -> None:
        if value is current or _same_rows(value, current) or (value is None and current is None):
            return
        raise FusionError(
            f"Cannot assign `{name}` of the fused part `{self._part_name()}`: it is rows of `{self._group.fused_name}.{name}`. Update it in place "
            f"(`part.{name}.data.copy_(...)`) or assign `{self._group.fused_name}.{name}`."
        )

    def _part_name(self) -> str:
        names = self._group.names
        return names[self._index] if names else str(self._index)

    def reset_parameters(self) -> None:
        """Nothing to reset: the rows belong to the fused layer, which initialises itself."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._group.part(x, self._index)

    def __deepcopy__(self, memo: dict[int, object]) -> FusedSlice:
        # Copied together with its owner (deepcopy of the model or the attention) it stays a slice
        # of the copied fused layer. Copied alone, as PEFT's `modules_to_save` copies a layer to
        # train, the copy would compute from a fused layer that is no parameter of the model.
        if id(self._group.owner) not in memo:
            name = self._part_name()
            raise FusionError(
                f"`{type(self._group.owner).__name__}.{name}` is a slice of the fused "
                f"`{self._group.fused_name}` and cannot be copied on its own (PEFT's `modules_to_save` "
                f"copies the layers it trains): a copy would no longer read the model's "
                f'`{self._group.fused_name}`. Train it with an adapter (`target_modules=["{name}"]`), '
                "or load the model without the graft."
            )
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def extra_repr(self) -> str:
        span = self._span()
        return f"{self._group.fused_name}[{span.start}:{span.stop}], in_features={self.in_features}"


def can_fuse_linears(module: nn.Module, names: tuple[str, ...]) -> bool:
    """Whether :func:`fuse_linears` accepts ``names`` of ``module``: plain ``nn.Linear`` children
    reading inputs of one width, all with a bias or none.

    Example:
        >>> block = nn.Module()
        >>> block.a, block.b, block.c = nn.Linear(4, 3), nn.Linear(4, 2), nn.Linear(4, 2, bias=False)
        >>> can_fuse_linears(block, ("a", "b")), can_fuse_linears(block, ("a", "c"))
        (True, False)
    """
    found = [getattr(module, name, None) for name in names]
    layers = [layer for layer in found if type(layer) is nn.Linear]
    if len(layers) != len(found):
        return False
    with_bias = {layer.bias is not None for layer in layers}
    return len({layer.in_features for layer in layers}) == 1 and len(with_bias) == 1


def fuse_linears(module: nn.Module, names: tuple[str, ...], fused_name: str) -> nn.Linear:
    """Replace the ``nn.Linear`` children ``names`` of ``module`` by one fused layer.

    The fused layer's weight (and bias) is the concatenation, along the output dimension, of the
    original ones, so the module computes exactly what it computed before. It is registered as
    ``module.<fused_name>``; each original name now holds a :class:`FusedSlice`.

    Args:
        module: the module that owns the layers (an attention or an MLP).
        names: the child names to fuse, in the order of the fused output.
        fused_name: the attribute name of the fused layer (``"qkv_proj"``).

    Returns:
        The fused ``nn.Linear``.

    Raises:
        FusionError: a child is missing or not an ``nn.Linear``, the layers take inputs of
            different widths, or some have a bias and others not.
    """
    owner = type(module).__name__
    layers = []
    for name in names:
        layer = getattr(module, name, None)
        if type(layer) is not nn.Linear:
            raise FusionError(
                f"`{owner}.{name}` must be an `nn.Linear` to be fused into `{fused_name}`; "
                f"found `{type(layer).__name__}`. Fuse only modules built from plain linear layers."
            )
        layers.append(layer)
    widths = {layer.in_features for layer in layers}
    if len(widths) != 1:
        raise FusionError(
            f"`{owner}`: {', '.join(f'`{n}`' for n in names)} take inputs of different widths "
            f"{sorted(widths)}; expected one width (they must all read the same hidden states)."
        )
    with_bias = [layer.bias is not None for layer in layers]
    if any(with_bias) and not all(with_bias):
        raise FusionError(
            f"`{owner}`: only some of {', '.join(f'`{n}`' for n in names)} have a bias "
            f"({with_bias}); expected all or none, so that `{fused_name}` has one bias or none."
        )
    sizes = tuple(layer.out_features for layer in layers)
    first = layers[0]
    fused = nn.Linear(first.in_features, sum(sizes), bias=False, device="meta")
    # Reuse the already-initialised weights: the fused module computes what the original did,
    # and no extra random numbers are drawn (or allocated on meta, where from_pretrained builds).
    fused.weight = nn.Parameter(torch.cat([layer.weight.detach() for layer in layers]))
    if all(with_bias):
        fused.bias = nn.Parameter(torch.cat([layer.bias.detach() for layer in layers]))
    fused.weight.requires_grad_(first.weight.requires_grad)
    _peft.ensure_installed()  # PEFT's "all-linear" must pick the parts, not the fused layer too
    group = _FusionGroup(module, fused_name, sizes, tuple(names))
    for index, (name, layer) in enumerate(zip(names, layers)):
        setattr(module, name, FusedSlice(group, index, layer.in_features, layer.out_features))
    setattr(module, fused_name, fused)
    return fused


_SUBCLASSES: dict[tuple[type, tuple[str, ...], str], type] = {}
_SUBCLASSES_LOCK = ForkSafeLock()


def fused_subclass(
    base: type[nn.Module], names: tuple[str, ...], fused_name: str, prefix: str
) -> type[nn.Module]:
    """Return (and cache) a subclass of ``base`` whose ``__init__`` fuses ``names`` into one layer.

    Args:
        base: the original class (``LlamaAttention``).
        names: the child layers to fuse.
        fused_name: the name of the fused layer.
        prefix: prepended to the class name (``"FusedQKV"`` gives ``FusedQKVLlamaAttention``).

    Returns:
        The subclass; the same object on every call with the same arguments.
    """
    key = (base, names, fused_name)
    with _SUBCLASSES_LOCK:
        found = _SUBCLASSES.get(key)
        if found is not None:
            return found

        def __init__(self: nn.Module, *args: object, **kwargs: object) -> None:
            base.__init__(self, *args, **kwargs)
            fuse_linears(self, names, fused_name)

        name = f"{prefix}{base.__name__}"
        cls = cast(
            "type[nn.Module]",
            GraftedClass(
                name,
                (base,),
                {
                    "__init__": __init__,
                    "__doc__": f"`{base.__name__}` with {', '.join(names)} fused into one `{fused_name}`.",
                    "__qualname__": name,
                    "_modelgraft_original": base,
                    "_modelgraft_fused": (names, fused_name),
                    RECIPE_ATTR: (fused_subclass, (base, names, fused_name, prefix)),
                },
            ),
        )
        _SUBCLASSES[key] = cls
        return cls
