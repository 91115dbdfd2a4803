"""What :func:`modelgraft.graft_model` carries from a module into its replacement, or refuses.

A module grafted in place must come out as a load-time graft would, and keep what the user did
to the original since: per parameter its ``requires_grad``, dtype, device, gradient and tensor
hooks; per submodule its train/eval mode; its module hooks. Everything here is checked while the
replacement is built (:func:`place_tensors`, :func:`plan_hooks`), and nothing of the model
changes until :func:`move_hooks` runs at swap time, which cannot fail.

* A weight that comes across unchanged (same key, same tensor) *is* the original parameter
  object, so all of its state travels with it (and an optimizer still holds it).
* A weight built by a conversion from several originals takes their ``requires_grad``, dtype,
  device and attributes; originals that disagree (``q_proj`` frozen, ``k_proj`` trainable) are
  refused, as are gradients and tensor hooks, which have no exact place in a fused tensor.
* Per submodule: train/eval mode, transformers' "initialised" flag and gradient checkpointing.
* Hooks on the replaced module, and on children the replacement keeps (same path, same class), are
  carried over, and the caller's handles still remove them; state-dict hooks only where the keys
  they see do not change. Hooks elsewhere, accelerate hooks and a ``forward`` replaced on the
  instance are refused, naming the module and the hook.

Example:
    >>> import torch
    >>> from modelgraft._inplace_state import raw_state
    >>> sorted(raw_state(torch.nn.Linear(2, 2)))
    ['bias', 'weight']
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from modelgraft.errors import GraftStateError

__all__ = [
    "HookMove",
    "copy_modes",
    "move_hooks",
    "place_tensors",
    "plan_hooks",
    "raw_state",
    "refuse_wrapped",
]

_UNCHANGED = "The model was left unchanged."
_UNSET = object()

# Module hook tables, what they are called in messages, and the side tables a handle also cleans.
_CALL_HOOKS: dict[str, tuple[str, tuple[str, ...]]] = {
    "_forward_pre_hooks": ("forward pre-hook", ("_forward_pre_hooks_with_kwargs",)),
    "_forward_hooks": ("forward hook", ("_forward_hooks_with_kwargs", "_forward_hooks_always_called")),
    "_backward_pre_hooks": ("backward pre-hook", ()),
    "_backward_hooks": ("backward hook", ()),
}
_STATE_HOOKS: dict[str, tuple[str, tuple[str, ...]]] = {
    "_state_dict_pre_hooks": ("state-dict pre-hook", ()),
    "_state_dict_hooks": ("state-dict hook", ()),
    "_load_state_dict_pre_hooks": ("load-state-dict pre-hook", ()),
    "_load_state_dict_post_hooks": ("load-state-dict post-hook", ()),
}


def raw_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by state-dict key, without running any state-dict hook."""
    out: dict[str, torch.Tensor] = {}
    for path, sub in module.named_modules(remove_duplicate=False):
        prefix = f"{path}." if path else ""
        for name, param in sub._parameters.items():
            if param is not None:
                out[prefix + name] = param
        for name, buf in sub._buffers.items():
            if buf is not None and name not in sub._non_persistent_buffers_set:
                out[prefix + name] = buf
    return out


def _join(path: str, rel: str) -> str:
    return f"{path}.{rel}" if path and rel else path or rel


def _name(hook: Any) -> str:
    inner = getattr(hook, "hook", hook)  # torch wraps some state-dict hooks in `_WrappedHook`
    return getattr(inner, "__qualname__", None) or type(inner).__qualname__


def refuse_wrapped(path: str, module: nn.Module) -> None:
    """Refuse a module whose subtree was wrapped in ways a rebuilt module cannot inherit."""
    for rel, sub in module.named_modules(remove_duplicate=False):
        where = _join(path, rel)
        hook = sub.__dict__.get("_hf_hook")
        if hook is not None:
            raise GraftStateError(
                f"Cannot graft `{path}`: `{where}` has an accelerate hook `{type(hook).__name__}` (device "
                "placement or offloading), which a rebuilt module would not have. Graft the model before "
                "dispatching it (`device_map`, `dispatch_model`), or load it with the patch registered. "
                + _UNCHANGED
            )
        if "forward" in sub.__dict__:
            raise GraftStateError(
                f"Cannot graft `{path}`: `{where}` has its `forward` replaced on the instance "
                f"(`{_name(sub.__dict__['forward'])}`), which the replacement would silently lose. Graft before "
                "wrapping it, or restore `del module.forward`. " + _UNCHANGED
            )
        for name, tensor in [*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)]:
            if getattr(tensor, "placements", None) is not None:  # a DTensor: only its shard is here
                raise GraftStateError(
                    f"Cannot graft `{path}`: `{_join(where, name)}` is a DTensor (sharded by tensor parallelism or "
                    "FSDP2), which a rebuilt module cannot take over exactly. Graft before sharding "
                    "(`fully_shard`), or at load time (`patched(...)` around `from_pretrained(..., tp_plan=...)`). "
                    + _UNCHANGED
                )
        cls = type(sub)
        if (
            cls.get_extra_state is not nn.Module.get_extra_state
            or cls._save_to_state_dict is not nn.Module._save_to_state_dict
        ):
            raise GraftStateError(
                f"Cannot graft `{path}`: `{where}` (`{cls.__qualname__}`) writes state of its own to the state "
                "dict (`get_extra_state` or `_save_to_state_dict`, as quantized layers do), which graft_model "
                "cannot carry into a replacement exactly. Graft before quantizing, or load the model with the "
                "patch registered. " + _UNCHANGED
            )


# ---- parameters and buffers -----------------------------------------------------------------------
def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if a.device.type == "meta":
        return True  # no data to compare: same key, same shape and dtype
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride()


def agreed(path: str, key: str, what: str, values: Mapping[str, Any], fix: str) -> Any:
    """The one value of ``what`` that all the originals of ``key`` share; refuse when they differ."""
    distinct = list(dict.fromkeys(values.values()))
    if len(distinct) > 1:
        listed = ", ".join(f"`{k}`: {v}" for k, v in values.items())
        raise GraftStateError(
            f"Cannot graft `{path}`: its replacement's `{key}` is built from {listed}, which differ in "
            f"`{what}`; expected one value for all of them. {fix} " + _UNCHANGED
        )
    return distinct[0]


def _attributes(path: str, key: str, sources: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Attributes set on the original tensors (``_is_hf_initialized``...), where all of them agree."""
    out: dict[str, Any] = {}
    for name in sorted({n for t in sources.values() for n in vars(t)}):
        values = {k: vars(t).get(name, _UNSET) for k, t in sources.items()}
        if name == "_is_hf_initialized":  # transformers' "loaded" flag: loaded only if every part was
            out[name] = all(v is True for v in values.values())
            continue
        first = next(iter(values.values()))
        try:
            same = all(v is first or (v is not _UNSET and bool(v == first)) for v in values.values())
        except Exception:  # values that cannot be compared: refuse rather than pick one
            same = False
        if not same:
            listed = ", ".join(f"`{k}`: {'unset' if v is _UNSET else repr(v)}" for k, v in values.items())
            raise GraftStateError(
                f"Cannot graft `{path}`: its replacement's `{key}` is built from {listed}, which differ in the "
                f"attribute `{name}`; expected one value for all of them. " + _UNCHANGED
            )
        if first is not _UNSET:
            out[name] = first
    return out


def same_dtype_and_device(
    path: str, key: str, sources: Mapping[str, torch.Tensor]
) -> tuple[torch.dtype, torch.device]:
    """The dtype and device shared by the originals of ``key`` (relative keys); refuse when they differ."""
    dtype = agreed(
        path,
        key,
        "dtype",
        {k: t.dtype for k, t in sources.items()},
        "Cast them to one dtype before grafting.",
    )
    device = agreed(
        path,
        key,
        "device",
        {k: t.device for k, t in sources.items()},
        "Move them to one device before grafting.",
    )
    return dtype, device


def _check_movable(path: str, key: str, rel: str, tensor: torch.Tensor) -> None:
    if type(tensor) not in (nn.Parameter, torch.Tensor):
        raise GraftStateError(
            f"Cannot graft `{path}`: `{rel}` is a `{type(tensor).__qualname__}` (a quantized or otherwise "
            f"special tensor), which a conversion into the replacement's `{key}` cannot carry exactly. "
            "Graft before quantizing, or load the model with the patch registered. " + _UNCHANGED
        )
    if isinstance(tensor, nn.Parameter) and tensor.grad is not None:
        raise GraftStateError(
            f"Cannot graft `{path}`: `{rel}` has a `.grad`, which has no exact place in the replacement's "
            f"`{key}` built from it. Call `model.zero_grad(set_to_none=True)` before grafting. " + _UNCHANGED
        )
    hooks = {**(tensor._backward_hooks or {}), **(getattr(tensor, "_post_accumulate_grad_hooks", None) or {})}
    if hooks:
        raise GraftStateError(
            f"Cannot graft `{path}`: `{rel}` has a tensor hook `{_name(next(iter(hooks.values())))}`, which cannot "
            f"be carried into the replacement's `{key}` built from it. Remove the hook (its handle's "
            "`remove()`) before grafting and register it on the new parameter after. " + _UNCHANGED
        )


def place_tensors(
    path: str,
    original: nn.Module,
    built: nn.Module,
    values: Mapping[str, torch.Tensor],
    sources: Mapping[str, tuple[str, ...]],
) -> set[str]:
    """Put ``values`` (by key relative to ``path``) into ``built`` with the originals' state.

    ``sources[key]`` are the original keys each value was made from. Returns the keys that came
    across unchanged (the original parameter or buffer object itself).

    Raises:
        GraftStateError: originals that disagree, or state that cannot be carried.
    """
    old = raw_state(original)
    # Storages already in use: a converted tensor sharing one would look like a tied weight on save.
    taken = {t.untyped_storage().data_ptr() for t in old.values() if t.device.type != "meta"}
    unchanged: set[str] = set()
    owners = dict(built.named_modules(remove_duplicate=False))
    for key, value in values.items():
        owner_path, _, leaf = key.rpartition(".")
        owner = owners[owner_path]
        is_param = leaf in owner._parameters
        src = {k: old[k] for k in sources[key]}
        if (
            list(src) == [key]
            and _same_tensor(value, old[key])
            and isinstance(old[key], nn.Parameter) == is_param
        ):
            new: torch.Tensor = old[key]
            unchanged.add(key)
        else:
            new = _carried(path, key, value, src, (owner, leaf) if is_param else None, taken)
        (owner._parameters if is_param else owner._buffers)[leaf] = new
    _carry_non_persistent(original, built)
    return unchanged


def _carried(
    path: str,
    key: str,
    value: torch.Tensor,
    src: Mapping[str, torch.Tensor],
    param_of: tuple[Any, str] | None,  # (owner module, parameter name)
    taken: set[int],
) -> torch.Tensor:
    """``value`` as the replacement's ``key``, with the state its originals ``src`` agree on: dtype,
    device, ``requires_grad`` and attributes; copied where it would share a storage in ``taken``
    (which it then joins). A parameter where ``param_of`` (owner, name) names the built one (it
    gives ``requires_grad`` when no original is a parameter), else a buffer."""
    for rel, tensor in src.items():
        _check_movable(path, key, rel, tensor)
    dtype, device = same_dtype_and_device(path, key, src)
    params = {k: t for k, t in src.items() if isinstance(t, nn.Parameter)}
    trainable = (
        agreed(
            path,
            key,
            "requires_grad",
            {k: t.requires_grad for k, t in params.items()},
            "Freeze or unfreeze them together before grafting.",
        )
        if params
        else None
    )
    data = value.detach().to(device=device, dtype=dtype)
    if data.device.type != "meta":
        if value._base is not None or data.untyped_storage().data_ptr() in taken:
            data = data.clone()
        data = data.contiguous()
        taken.add(data.untyped_storage().data_ptr())
    new = data
    if param_of is not None:
        owner, leaf = param_of
        new = nn.Parameter(
            data, requires_grad=owner._parameters[leaf].requires_grad if trainable is None else trainable
        )
    for name, attr in _attributes(path, key, src).items():
        setattr(new, name, attr)
    return new


def _carry_non_persistent(original: nn.Module, built: nn.Module) -> None:
    """Non-persistent buffers (rotary frequencies...) the replacement has under the same name and shape
    are the original's: they may have been cast, moved or updated since construction."""
    old = dict(original.named_modules(remove_duplicate=False))
    for rel, sub in built.named_modules(remove_duplicate=False):
        twin = old.get(rel)
        if twin is None:
            continue
        for name in sub._non_persistent_buffers_set:
            mine, theirs = sub._buffers.get(name), twin._buffers.get(name)
            if mine is not None and theirs is not None and mine.shape == theirs.shape:
                sub._buffers[name] = theirs


# ---- modes ----------------------------------------------------------------------------------------
# Set on built modules by transformers at run time: `gradient_checkpointing_enable()`.
_RUNTIME_FLAGS = ("gradient_checkpointing", "_gradient_checkpointing_func")


def copy_modes(original: nn.Module, built: nn.Module) -> None:
    """Per submodule: train/eval mode and transformers' "initialised" flag from the module at the
    same path in the original, else from the nearest enclosing one; gradient checkpointing where
    the module at the same path has it."""
    old = dict(original.named_modules(remove_duplicate=False))
    for rel, sub in built.named_modules(remove_duplicate=False):
        probe = rel
        while probe not in old:
            probe = probe.rpartition(".")[0]
        twin = old[probe]
        sub.training = twin.training
        if "_is_hf_initialized" in twin.__dict__:
            sub._is_hf_initialized = twin._is_hf_initialized
        if probe == rel and hasattr(sub, "gradient_checkpointing"):
            for name in _RUNTIME_FLAGS:
                if name in twin.__dict__:
                    setattr(sub, name, twin.__dict__[name])


# ---- module hooks ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class HookMove:
    """One hook table of an original (sub)module to hand to its counterpart in the replacement."""

    source: nn.Module
    target: nn.Module
    table: str
    keep: tuple[int, ...]  # ids of the user's hooks (not the ones the module's class registered)


def _user_hooks(module: nn.Module, table: str) -> dict[int, Any]:
    # A bound method of the module itself was registered by its class (`self._register_..._hook(
    # self.load_hook)`): the replacement's constructor registers its own, as at load time.
    return {
        hid: hook
        for hid, hook in getattr(module, table).items()
        if getattr(getattr(hook, "hook", hook), "__self__", None) is not module
    }


def plan_hooks(path: str, original: nn.Module, built: nn.Module, unchanged: Iterable[str]) -> list[HookMove]:
    """The hook tables to move at swap time; refuse hooks that cannot be carried exactly.

    ``unchanged`` are the keys (relative to ``path``) that came across as the original tensors.
    """
    unchanged = set(unchanged)
    old_keys = raw_state(original)
    new_keys = raw_state(built)
    counterparts = dict(built.named_modules(remove_duplicate=False))
    moves: list[HookMove] = []
    for rel, sub in original.named_modules():  # each module once: its hook tables move once
        where = _join(path, rel)
        twin = counterparts.get(rel)
        if twin is not None and rel and type(twin) is not type(sub):
            twin = None  # another kind of module at that place: hooks written for this one do not fit
        prefix = f"{rel}." if rel else ""
        mine = {k for k in old_keys if k.startswith(prefix)}
        same_keys = mine == {k for k in new_keys if k.startswith(prefix)} and mine <= unchanged
        for table, (kind, _extra) in {**_CALL_HOOKS, **_STATE_HOOKS}.items():
            hooks = _user_hooks(sub, table)
            if not hooks:
                continue
            first = _name(next(iter(hooks.values())))
            if twin is None:
                raise GraftStateError(
                    f"Cannot graft `{path}`: `{where}` has a {kind} `{first}`, and the replacement has no "
                    f"`{type(sub).__name__}` at that place to carry it to. Remove it (its handle's `remove()`) "
                    "before grafting, or register it on the replacement after. " + _UNCHANGED
                )
            if table in _STATE_HOOKS and not same_keys:
                raise GraftStateError(
                    f"Cannot graft `{path}`: `{where}` has a {kind} `{first}`, written for the original layout, "
                    "and the replacement changes the layout of the keys it sees. Remove it before grafting. "
                    + _UNCHANGED
                )
            moves.append(HookMove(sub, twin, table, tuple(hooks)))
    return moves


def move_hooks(moves: Iterable[HookMove]) -> None:
    """Hand the hook tables over (at swap time; cannot fail).

    The table object itself moves to the replacement, so the handles the caller holds still remove
    the hooks; the original module keeps a copy of what it had.
    """
    for move in moves:
        extras = dict({**_CALL_HOOKS, **_STATE_HOOKS})[move.table][1]
        for table in (move.table, *extras):
            theirs: OrderedDict[int, Any] = getattr(move.source, table)
            own = list(getattr(move.target, table).items())
            object.__setattr__(move.source, table, OrderedDict(theirs))
            user = [(hid, theirs[hid]) for hid in move.keep if hid in theirs]
            theirs.clear()
            theirs.update(own + user)
            object.__setattr__(move.target, table, theirs)
        if move.table == "_backward_hooks" and move.source._is_full_backward_hook is not None:
            move.target._is_full_backward_hook = move.source._is_full_backward_hook
