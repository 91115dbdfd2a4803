"""Turn what a user names on the command line or in ``verify`` into a config and a model class.

A target is a ``model_type`` known to the installed transformers (``"llama"``), a
:class:`~transformers.PretrainedConfig`, a local checkpoint folder, or a ``config.json`` file.
Shared by :mod:`modelgraft.verify` and :mod:`modelgraft.cli`.

Example:
    >>> from modelgraft._model_lookup import resolve_config, model_class_for
    >>> config, checkpoint = resolve_config("llama")
    >>> checkpoint is None, model_class_for(config).__name__
    (True, 'LlamaForCausalLM')
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import transformers
from transformers import CONFIG_MAPPING, AutoConfig, PretrainedConfig, PreTrainedModel

from modelgraft.errors import TargetError

__all__ = [
    "TargetError",
    "ensure_model_class",
    "import_object",
    "looks_like_path",
    "model_class_for",
    "resolve_config",
]


def resolve_config(target: str | Path | PretrainedConfig) -> tuple[PretrainedConfig, Path | None]:
    """Return ``(config, checkpoint_folder_or_None)`` for a model type, config, folder or json file.

    A model type gives the default (full-size) config of that architecture; a folder gives its
    ``config.json`` and the folder itself as the checkpoint (when it holds weights).
    """
    if isinstance(target, PretrainedConfig):
        return target, None
    path = Path(target).expanduser()
    if path.is_file():
        return _config_from_json(path), None
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise TargetError(
                f"`{path}` is a folder without a `config.json`; expected a checkpoint folder "
                "written by `save_pretrained` (or pass a model type such as `llama`)."
            )
        config = _read_config(path / "config.json", lambda: AutoConfig.from_pretrained(str(path)))
        has_weights = any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
        return config, path if has_weights else None
    name = str(target)
    if isinstance(target, Path) or looks_like_path(name):
        raise TargetError(
            f"`{name}` does not exist; expected a checkpoint folder, a `config.json` file, or a model "
            "type such as `llama` (only local paths are read)."
        )
    if name in CONFIG_MAPPING:
        return AutoConfig.for_model(name), None
    raise TargetError(
        f"`{name}` is neither a local path nor a model type known to transformers "
        f"{transformers.__version__}; expected a model type such as `llama` or `qwen2_moe`, "
        "a checkpoint folder, or a `config.json` file."
    )


def _config_from_json(path: Path) -> PretrainedConfig:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise TargetError(f"`{path}` is not a readable JSON config: {exc}.") from exc
    model_type = data.pop("model_type", None) if isinstance(data, dict) else None
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise TargetError(
            f"`{path}` has model_type `{model_type}`; expected one known to transformers "
            f"{transformers.__version__} (for example `llama`)."
        )
    return _read_config(path, lambda: AutoConfig.for_model(model_type, **data))


def _check_architectures(architectures: object) -> None:
    if architectures is not None and (
        not isinstance(architectures, list | tuple) or not all(isinstance(a, str) for a in architectures)
    ):
        raise TargetError(
            f"The config's `architectures` is `{architectures!r}`; expected a list of class names such "
            'as `["LlamaForCausalLM"]`.'
        )


def looks_like_path(name: str) -> bool:
    """True for a name no model type has: one with a path separator, a leading ``.``/``~``, or ``.json``.

    Example:
        >>> looks_like_path("./ckpt"), looks_like_path("xlm-roberta")
        (True, False)
    """
    return "/" in name or "\\" in name or name.startswith((".", "~")) or name.endswith(".json")


def _read_config(path: Path, read: Callable[[], PretrainedConfig]) -> PretrainedConfig:
    # transformers validates values as it builds the config (a strict dataclass on 5.x, the config's
    # __init__ on 4.57): what it raises for a bad value differs by line, so it is reported as ours.
    # `architectures` is checked before transformers sees it: some releases validate the field
    # themselves, others accept anything, and the error must not depend on the release.
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        raw = None
    if isinstance(raw, dict):
        _check_architectures(raw.get("architectures"))
    try:
        return read()
    except Exception as exc:
        raise TargetError(
            f"`{path}` is not a valid transformers config: {type(exc).__name__}: {str(exc).rstrip('.')}; "
            "fix the config's values (or pass a model type such as `llama`)."
        ) from exc


def model_class_for(config: PretrainedConfig) -> type[PreTrainedModel]:
    """Pick the model class to build: the config's ``architectures[0]``, else a model with an LM head.

    Encoders (``is_decoder=False``) get their masked-LM head, decoders their causal-LM head,
    vision-language models their image-text-to-text class, anything else the base model.

    Example:
        >>> from transformers import BertConfig
        >>> model_class_for(BertConfig()).__name__
        'BertForMaskedLM'
    """
    architectures = config.architectures
    _check_architectures(architectures)
    for name in architectures or ():
        found = getattr(transformers, name, None)
        if found is not None:  # a name this transformers lacks (remote code) falls back to the auto classes
            return ensure_model_class(found, f"`{name}` (named in the config's `architectures`)")
    autos = [
        transformers.AutoModelForCausalLM,
        transformers.AutoModelForImageTextToText,
        transformers.AutoModel,
    ]
    if getattr(config, "is_encoder_decoder", False):
        autos.insert(0, transformers.AutoModelForSeq2SeqLM)
    elif getattr(config, "is_decoder", None) is False:
        autos.insert(0, transformers.AutoModelForMaskedLM)
    for auto in autos:
        mapping: Any = auto._model_mapping  # set on each Auto class; None on their untyped base
        try:
            return cast("type[PreTrainedModel]", mapping[type(config)])
        except KeyError:
            continue
    raise TargetError(
        f"No model class of transformers {transformers.__version__} builds config "
        f"`{type(config).__name__}`; expected a config with `architectures` or one that "
        "`AutoModel` knows."
    )


def ensure_model_class(obj: object, what: str) -> type[PreTrainedModel]:
    """Return ``obj`` if it is a transformers model class, else refuse it: only models are ever built.

    Example:
        >>> ensure_model_class(transformers.LlamaForCausalLM, "it").__name__
        'LlamaForCausalLM'
        >>> ensure_model_class(transformers.Trainer, "`Trainer`")
        Traceback (most recent call last):
        ...
        modelgraft.errors.TargetError: `Trainer` is a class `Trainer`, not a transformers model class (a `PreTrainedModel` subclass); only model classes are built, such as `LlamaForCausalLM`.
    """
    if isinstance(obj, type) and issubclass(obj, PreTrainedModel):
        return obj
    kind = f"class `{obj.__name__}`" if isinstance(obj, type) else f"`{type(obj).__name__}`"
    raise TargetError(
        f"{what} is a {kind}, not a transformers model class (a `PreTrainedModel` subclass); only model "
        "classes are built, such as `LlamaForCausalLM`."
    )


def import_object(reference: str) -> object:
    """Import ``package.module:NAME`` (``NAME`` may be dotted) and return the object.

    Example:
        >>> import_object("collections:OrderedDict").__name__
        'OrderedDict'
    """
    import importlib

    module_name, sep, attr = reference.partition(":")
    if not sep or not module_name or not attr:
        raise TargetError(
            f"`{reference}` is not a `package.module:NAME` reference; expected for example "
            "`modelgraft.grafts:fused_qkv`."
        )
    try:
        obj: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise TargetError(f"Could not import module `{module_name}` of `{reference}`: {exc}.") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise TargetError(
                f"Module `{module_name}` has no attribute `{attr}` (from `{reference}`); check the name "
                "after the colon."
            )
        obj = getattr(obj, part)
    return obj
