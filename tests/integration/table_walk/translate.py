"""transformers' conversion transforms re-expressed with :mod:`modelgraft.porting`'s classes.

Each transform and operation becomes the porting module's class of the same name, built from the
same constructor arguments, as a user porting code by changing its import line would build it.
A class the porting module lacks raises ``LookupError`` naming it.
"""

from __future__ import annotations

from typing import Any

from modelgraft import porting

#: The constructor arguments of each operation of the table, read from transformers' instance.
_OP_ARGS: dict[str, tuple[str, ...]] = {
    "Concatenate": ("dim",),
    "Chunk": ("dim",),
    "MergeModulelist": ("dim",),
    "SplitModulelist": ("dim",),
    "Transpose": ("dim0", "dim1", "check_dims"),
    "PermuteForRope": ("subconfig_key", "permute_layer_names", "inverse"),
    "Interleave": ("dim", "inverse"),
    "Split": ("dim",),
    "ErnieFuseAndSplitTextVisionExperts": ("stack_dim", "concat_dim"),
    "Conv3dToLinear": ("in_channels", "kernel_size"),
    "LinearToConv3d": ("in_channels", "kernel_size"),
    "Inkling2UnpadVocab": ("inverse",),
    "Inkling2LoopMergeMessageQueries": ("inverse",),
    "Inkling2LoopDequantizeExperts": (),
}


def _porting_class(name: str) -> Any:
    cls = getattr(porting, name, None)
    if cls is None:
        raise LookupError(f"modelgraft.porting has no `{name}`")
    return cls


def to_porting_op(op: Any) -> Any:
    name = type(op).__name__
    if name not in _OP_ARGS:
        raise LookupError(f"no constructor arguments known for transformers' operation `{name}`")
    kwargs = {arg: getattr(op, arg) for arg in _OP_ARGS[name] if hasattr(op, arg)}
    return _porting_class(name)(**kwargs)


def to_porting(transform: Any) -> Any:
    name = type(transform).__name__
    sources = list(transform._original_source_patterns)
    targets = list(transform._original_target_patterns)
    cls = _porting_class(name)
    if name == "PrefixChange":
        ours = cls(
            prefix_to_add=transform.prefix_to_add,
            prefix_to_remove=transform.prefix_to_remove,
            model_prefix=transform.model_prefix or None,
        )
    elif name == "Inkling2IndexOffsetWeightRename":
        ours = cls(sources, targets, offset=transform.offset)
    elif name == "LayerPairCollapse":
        ours = cls()
    elif hasattr(transform, "operations"):
        ours = cls(sources, targets, operations=[to_porting_op(op) for op in transform.operations])
    else:
        ours = cls(sources, targets)
    if transform.scope_prefix is not None:
        ours.scope_prefix = transform.scope_prefix
        ours.base_model_prefix = transform.base_model_prefix
    return ours


def to_porting_entry(entry: list[Any]) -> list[Any]:
    return [to_porting(t) for t in entry]
