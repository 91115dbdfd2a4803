"""Conversion rules (:class:`WeightConverter`, :class:`WeightRenaming`) and their registry.

A pattern is a dotted run of key segments; ``*`` stands for one index segment (an expert
number). ``q_proj`` matches ``model.layers.0.self_attn.q_proj.weight`` (and ``.bias``): the part
before the run is the *prefix*, the part after it the *suffix*, and the converter writes
``prefix + target_pattern + suffix``. The pattern syntax and the matching live in
:mod:`modelgraft.conversion.keys`.

Lookup, for a model and each of its sub-models: the entry registered under the class name wins
over the one under ``model_type``, and the chosen entry is the whole mapping for that (sub)model.
The entries live in :mod:`modelgraft.registry`, next to the replacement classes: one snapshot
carries both, a ``patched(conversions=...)`` block layers entries for its thread or task only,
and a load reads only the snapshot it took when it started.

Example:
    >>> from modelgraft import registry
    >>> from modelgraft.conversion import Concatenate, WeightConverter
    >>> fuse = WeightConverter(["q_proj", "k_proj", "v_proj"], ["qkv_proj"], [Concatenate(dim=0)])
    >>> with registry.scoped(conversions=validate_conversions({"MyModel": [fuse]})):
    ...     registry.current().lookup_conversions("MyModel", "llama")[0]
    'MyModel'
    >>> registry.current().lookup_conversions("MyModel", "llama") is None
    True
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from modelgraft import _compat, registry
from modelgraft.conversion.keys import Pattern, as_patterns
from modelgraft.conversion.ops import ConversionOperation
from modelgraft.errors import ConversionError

if TYPE_CHECKING:  # imported where used at run time: _hf_patterns builds on this module's patterns
    from modelgraft.conversion._hf_patterns import HFPattern, HFTargetPattern, TransformMatcher

__all__ = [
    "WeightConverter",
    "WeightRenaming",
    "get_checkpoint_conversion_mapping",
    "register_checkpoint_conversion_mapping",
    "unknown_conversions",
    "unregister_checkpoint_conversion_mapping",
    "validate_conversions",
]


class WeightConverter:
    """Turn the checkpoint tensors matched by ``source_patterns`` into ``target_patterns``.

    Args:
        source_patterns: checkpoint-side patterns, in the order the operations receive them.
        target_patterns: model-side patterns, in the order the operations produce them.
        operations: :class:`~modelgraft.conversion.ops.ConversionOperation` instances run in
            order on load and reversed (in reverse order) on save; or operations written for
            transformers (``convert(input_dict, source_patterns=..., target_patterns=..., **kwargs)``
            returning a dict, with ``reverse_op``), which run as transformers runs them.

    Patterns that are not all plain dotted segment runs (``.block_sparse_moe.gate``, ``^w``,
    regexes) and converters with a ``scope_prefix`` match as transformers 5 matches them (see
    :mod:`modelgraft.conversion._hf_patterns` and docs/porting.md). ``scope_prefix`` and
    ``base_model_prefix`` may be set after construction, before the converter is registered.

    Example:
        >>> from modelgraft.conversion import Concatenate
        >>> WeightConverter(["q_proj", "k_proj", "v_proj"], "qkv_proj", [Concatenate(dim=0)])
        WeightConverter(['q_proj', 'k_proj', 'v_proj'] -> ['qkv_proj'], [Concatenate(dim=0)])
        >>> WeightConverter(".block_sparse_moe.gate", ".mlp.gate").uses_transformers_semantics
        True
    """

    #: Subclasses that exist only in transformers' API (``PrefixChange``, ``GroupWeightRename``) match as it does.
    always_transformers_semantics = False

    __slots__ = (
        "_hf",
        "_matcher",
        "_source_patterns",
        "_sources",
        "_target_patterns",
        "_targets",
        "base_model_prefix",
        "operations",
        "scope_prefix",
    )

    _source_patterns: tuple[str, ...]
    _target_patterns: tuple[str, ...]
    operations: tuple[ConversionOperation, ...]
    scope_prefix: str | None
    base_model_prefix: str | None
    # Segment patterns, or (with transformers' semantics, ``_hf``) the matcher's compiled patterns.
    _hf: bool
    _matcher: TransformMatcher | None
    _sources: tuple[Pattern | HFPattern, ...]
    _targets: tuple[Pattern | HFTargetPattern, ...]

    def __init__(
        self,
        source_patterns: str | Sequence[str],
        target_patterns: str | Sequence[str],
        operations: Sequence[ConversionOperation] = (),
    ) -> None:
        sources = as_patterns(source_patterns, "source_patterns")
        targets = as_patterns(target_patterns, "target_patterns")
        from modelgraft.conversion._hf_ops import adapt_operations

        ops = adapt_operations(tuple(operations), sources, targets)
        for op in ops:
            if not isinstance(op, ConversionOperation):
                raise ConversionError(
                    f"Operation {op!r} of a converter for `{sources}` is neither a modelgraft "
                    "`ConversionOperation` nor an operation written for transformers (a `convert(input_dict, "
                    "source_patterns=..., target_patterns=..., **kwargs)` method). Use `modelgraft.Concatenate`, "
                    "`Chunk`, ... or subclass `modelgraft.ConversionOperation`."
                )
        object.__setattr__(self, "_source_patterns", sources)
        object.__setattr__(self, "_target_patterns", targets)
        object.__setattr__(self, "operations", ops)
        object.__setattr__(self, "scope_prefix", None)
        object.__setattr__(self, "base_model_prefix", None)
        self._compile()

    @property
    def source_patterns(self) -> Sequence[str]:
        """The checkpoint-side patterns, in the order the operations receive them."""
        return self._source_patterns

    @property
    def target_patterns(self) -> Sequence[str]:
        """The model-side patterns, in the order the operations produce them."""
        return self._target_patterns

    def _compile(self) -> None:
        from modelgraft.conversion._hf_patterns import TransformMatcher, is_plain_pattern

        sources, targets, ops = self._source_patterns, self._target_patterns, self.operations
        many_to_first = not ops and len(targets) == 1 and len(sources) > 1
        hf = (
            type(self).always_transformers_semantics
            or self.scope_prefix is not None
            or many_to_first
            or not all(is_plain_pattern(p) for p in (*sources, *targets))
        )
        if not ops and not hf and len(sources) != len(targets):
            raise ConversionError(
                f"A converter without operations renames one to one, but `{list(sources)}` -> "
                f"`{list(targets)}` differ in length. Add operations (e.g. `Concatenate(dim=0)`)."
            )
        matcher: TransformMatcher | None
        compiled: tuple[tuple[Pattern | HFPattern, ...], tuple[Pattern | HFTargetPattern, ...]]
        if hf:
            matcher = TransformMatcher(sources, targets, self.scope_prefix, self.base_model_prefix)
            compiled = (matcher.sources, matcher.targets)
        else:
            matcher = None
            compiled = (tuple(Pattern(p) for p in sources), tuple(Pattern(p) for p in targets))
        object.__setattr__(self, "_hf", hf)
        object.__setattr__(self, "_matcher", matcher)
        object.__setattr__(self, "_sources", compiled[0])
        object.__setattr__(self, "_targets", compiled[1])

    def __setattr__(self, name: str, value: object) -> None:
        if name in ("scope_prefix", "base_model_prefix"):
            if value is not None and not isinstance(value, str):
                raise ConversionError(f"`{name}` must be a string or None; received {value!r}.")
            object.__setattr__(self, name, value)
            self._compile()
            return
        raise AttributeError(
            f"`{type(self).__name__}` is immutable (only `scope_prefix` and `base_model_prefix` can be set); "
            "build a new one instead."
        )

    @property
    def uses_transformers_semantics(self) -> bool:
        """Whether this converter matches keys as transformers 5 does (see the class docstring)."""
        return self._hf

    def __repr__(self) -> str:
        ops = f", {list(self.operations)}" if self.operations else ""
        scope = f", scope_prefix={self.scope_prefix!r}" if self.scope_prefix is not None else ""
        return (
            f"{type(self).__name__}({list(self.source_patterns)} -> {list(self.target_patterns)}{ops}{scope})"
        )

    # Immutable, so copies may share it; pickling rebuilds it through __init__ (which validates).
    def __copy__(self) -> WeightConverter:
        return self

    def __deepcopy__(self, memo: dict[Any, Any]) -> WeightConverter:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _rebuild_converter,
            (type(self), self._source_patterns, self._target_patterns, self.operations, self._scope()),
        )

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, WeightConverter) and type(other) is type(self) and self._key() == other._key()
        )

    def __hash__(self) -> int:
        return hash(self._key())

    def _scope(self) -> tuple[str | None, str | None]:
        return (self.scope_prefix, self.base_model_prefix)

    def _key(self) -> tuple[Any, ...]:
        return (self._source_patterns, self._target_patterns, self.operations, self._scope())

    @property
    def is_reversible(self) -> bool:
        """Whether every operation has a reverse (needed to save the original layout)."""
        return all(op.is_reversible for op in self.operations)


class WeightRenaming(WeightConverter):
    """Rename keys one to one: the ``i``-th source pattern becomes the ``i``-th target pattern.

    Example:
        >>> WeightRenaming("wq", "q_proj")
        WeightRenaming(['wq'] -> ['q_proj'])
    """

    __slots__ = ()

    def __init__(self, source_patterns: str | Sequence[str], target_patterns: str | Sequence[str]) -> None:
        super().__init__(source_patterns, target_patterns, ())


def _rebuild_converter(
    cls: type[WeightConverter],
    sources: tuple[str, ...],
    targets: tuple[str, ...],
    operations: tuple[Any, ...],
    scope: tuple[str | None, str | None] = (None, None),
) -> WeightConverter:
    converter = object.__new__(cls)
    WeightConverter.__init__(converter, sources, targets, operations)
    if scope != (None, None):
        object.__setattr__(converter, "scope_prefix", scope[0])
        object.__setattr__(converter, "base_model_prefix", scope[1])
        converter._compile()
    return converter


Conversions = tuple[WeightConverter, ...]


def _validate_entry(key: object, mapping: object) -> Conversions:
    if not isinstance(key, str) or not key:
        raise ConversionError(
            f"A conversion key must be a non-empty model_type or class name; received {key!r}."
        )
    if isinstance(mapping, (str, bytes, WeightConverter)) or not isinstance(mapping, Iterable):
        raise ConversionError(
            f"The conversion mapping for `{key}` must be a list of `WeightConverter`/`WeightRenaming`; "
            f"received {type(mapping).__name__}."
        )
    items = tuple(mapping)
    for item in items:
        if not isinstance(item, WeightConverter):
            raise ConversionError(
                f"Entry {item!r} in the conversion mapping for `{key}` is a `{type(item).__module__}."
                f"{type(item).__name__}`, not a modelgraft `WeightConverter`/`WeightRenaming`. Import them "
                "from `modelgraft` instead of `transformers`."
            )
    return items


def validate_conversions(
    conversions: Mapping[str, Sequence[WeightConverter]] | None,
) -> dict[str, Conversions]:
    """Check a ``{model_type_or_class_name: [WeightConverter, ...]}`` mapping; return it with tuples.

    Raises:
        ConversionError: a key or an entry is invalid (names which one).
    """
    if conversions is not None and not isinstance(conversions, Mapping):
        raise ConversionError(
            f"`conversions` must be a dict of model_type or class name to a list of converters; received "
            f"`{type(conversions).__name__}`."
        )
    return {k: _validate_entry(k, v) for k, v in (conversions or {}).items()}


def register_checkpoint_conversion_mapping(
    model_type_or_class_name: str, mapping: Sequence[WeightConverter], overwrite: bool = False
) -> None:
    """Register the conversions used when loading (and saving) models of a type or class.

    The key is a class name (``"Qwen2MoeForCausalLM"``) or a ``model_type`` (``"qwen2_moe"``); a
    class-name entry wins. A key already registered, or one the installed transformers converts
    itself, needs ``overwrite=True``; the entry then replaces that conversion entirely. A load
    already in progress keeps the conversions it started with.

    Raises:
        ConversionError: invalid entry, or a duplicate without ``overwrite=True`` (nothing changes).

    Example:
        >>> from modelgraft.conversion import WeightRenaming
        >>> register_checkpoint_conversion_mapping("my_type", [WeightRenaming("wq", "q_proj")])
        >>> get_checkpoint_conversion_mapping("my_type")
        [WeightRenaming(['wq'] -> ['q_proj'])]
        >>> unregister_checkpoint_conversion_mapping("my_type")
    """
    items = _validate_entry(model_type_or_class_name, mapping)
    key = model_type_or_class_name
    if not overwrite and _compat.builtin_conversion_exists(key) and key not in registry.global_conversions():
        raise _exists(key, "the installed transformers")

    def duplicate(key: str, _existing: Conversions) -> ConversionError:
        return _exists(key, "modelgraft")

    registry.add_conversions({key: items}, overwrite=overwrite, duplicate=duplicate)


def _exists(key: str, where: str) -> ConversionError:
    return ConversionError(
        f"A conversion mapping for `{key}` already exists in {where}. Pass "
        "`overwrite=True` to replace it (your entry then becomes the whole mapping for that model)."
    )


def unregister_checkpoint_conversion_mapping(keys: str | Sequence[str]) -> None:
    """Remove registered entries (all or none: an unknown key changes nothing).

    Raises:
        ConversionError: a key that is not registered.
    """
    names = [keys] if isinstance(keys, str) else list(keys)
    registry.remove_conversions(names, unknown=unknown_conversions)


def unknown_conversions(missing: list[str], registered: list[str]) -> ConversionError:
    """The error for unregistering conversion keys that are not registered."""
    return ConversionError(
        f"Cannot unregister conversion mapping(s) {', '.join(f'`{k}`' for k in missing)}: not registered. "
        f"Registered: {registered}."
    )


def get_checkpoint_conversion_mapping(model_type_or_class_name: str) -> list[WeightConverter] | None:
    """Return the entry visible here (scoped blocks first, then global) as a new list, or ``None``."""
    found = registry.snapshot().conversions.get(model_type_or_class_name)
    return None if found is None else list(found)
