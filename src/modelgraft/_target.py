"""Turn what a user names on the command line or in ``verify`` into a config and a model class.

A target is a ``model_type`` known to the installed transformers (``"llama"``), a
:class:`~transformers.PretrainedConfig`, a local checkpoint folder, or a ``config.json`` file.
Shared by :mod:`modelgraft.verify` and :mod:`modelgraft.cli`.

Example:
    >>> from modelgraft._target import resolve_config, model_class_for
    >>> config, checkpoint = resolve_config("llama")
    >>> checkpoint is None, model_class_for(config).__name__
    (True, 'LlamaForCausalLM')
"""

from __future__ import annotations

import json
from pathlib import Path

import transformers
from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from modelgraft.errors import GraftError

__all__ = ["TargetError", "import_object", "model_class_for", "resolve_config"]


class TargetError(GraftError, ValueError):
    """A model type, path or ``package.module:NAME`` reference could not be resolved."""


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
        config = AutoConfig.from_pretrained(str(path))
        has_weights = any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
        return config, path if has_weights else None
    name = str(target)
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
    if model_type not in CONFIG_MAPPING:
        raise TargetError(
            f"`{path}` has model_type `{model_type}`; expected one known to transformers "
            f"{transformers.__version__} (for example `llama`)."
        )
    return AutoConfig.for_model(model_type, **data)


def model_class_for(config: PretrainedConfig) -> type:
    """Pick the model class to build: the config's ``architectures[0]``, else a model with an LM head.

    Encoders (``is_decoder=False``) get their masked-LM head, decoders their causal-LM head,
    vision-language models their image-text-to-text class, anything else the base model.

    Example:
        >>> from transformers import BertConfig
        >>> model_class_for(BertConfig()).__name__
        'BertForMaskedLM'
    """
    for name in config.architectures or ():
        cls = getattr(transformers, name, None)
        if isinstance(cls, type):
            return cls
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
        try:
            return auto._model_mapping[type(config)]
        except KeyError:
            continue
    raise TargetError(
        f"No model class of transformers {transformers.__version__} builds config "
        f"`{type(config).__name__}`; expected a config with `architectures` or one that "
        "`AutoModel` knows."
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
            "`modelgraft.grafts:FUSED_QKV`."
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
