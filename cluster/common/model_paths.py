"""Where models live on disk (torch-free, so the router finds the tokenizer without the engine)."""

from __future__ import annotations

from pathlib import Path

from cluster.config import DEFAULT_MODEL_NAME, ClusterConfig

COMPLETE_MARKER = ".pdserve-complete"


def default_model_dir(config: ClusterConfig) -> Path:
    return config.paths.resolved_cache_dir / "models" / DEFAULT_MODEL_NAME


def model_dir(config: ClusterConfig) -> Path:
    """The model directory the config names (the default model's converted cache when unset)."""
    if config.model.path is None:
        return default_model_dir(config)
    return Path(config.model.path).expanduser()


def model_name(config: ClusterConfig) -> str:
    """The public model name (OpenAI ``model`` field, metrics label)."""
    if config.model.path is None:
        return DEFAULT_MODEL_NAME
    return Path(config.model.path).expanduser().resolve().name


def require_model_dir(config: ClusterConfig) -> Path:
    """The model directory, or a clear error saying how to get it."""
    path = model_dir(config)
    if config.model.path is None:
        if not (path / COMPLETE_MARKER).is_file():
            raise FileNotFoundError(
                f"the default model is not converted yet at {path}; run `pdserve model fetch` "
                "(or `make model`) once"
            )
    elif not path.is_dir():
        raise FileNotFoundError(f"model.path: {str(path)!r} is not a directory")
    elif not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model.path: {str(path)!r} has no config.json; pdserve loads transformers "
            "checkpoint directories (config.json, *.safetensors, tokenizer.json)"
        )
    return path
