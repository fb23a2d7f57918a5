"""Where models live on disk (torch-free, so the router finds the tokenizer without the engine)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.config.model import DEFAULT_MODEL_NAME, is_gguf_source
from cluster.config.tree import ClusterConfig

COMPLETE_MARKER = ".pdserve-complete"


def default_model_dir(config: ClusterConfig) -> Path:
    return config.paths.resolved_cache_dir / "models" / DEFAULT_MODEL_NAME


def gguf_model_dir(config: ClusterConfig, gguf: Path) -> Path:
    """Where a ``.gguf`` model.path is converted once (config, tokenizer, de-quantized weights)."""
    tag = hashlib.sha256(str(gguf.expanduser().resolve()).encode()).hexdigest()[:8]
    return config.paths.resolved_cache_dir / "models" / f"{gguf.stem}-{tag}"


def model_dir(config: ClusterConfig) -> Path:
    """The model directory the config names (the default model's converted cache when unset,
    a ``.gguf`` file's converted cache)."""
    if config.model.path is None:
        return default_model_dir(config)
    path = Path(config.model.path).expanduser()
    return gguf_model_dir(config, path) if is_gguf_source(config.model.path) else path


def model_name(config: ClusterConfig) -> str:
    """The public model name (OpenAI ``model`` field, metrics label)."""
    if config.model.path is None:
        return DEFAULT_MODEL_NAME
    path = Path(config.model.path).expanduser().resolve()
    return path.stem if is_gguf_source(config.model.path) else path.name


def require_model_dir(config: ClusterConfig) -> Path:
    """The model directory, or a clear error saying how to get it."""
    path = model_dir(config)
    if config.model.path is None:
        if not (path / COMPLETE_MARKER).is_file():
            raise FileNotFoundError(
                f"the default model is not converted yet at {path}; run `pdserve model fetch` "
                "(or `make model`) once"
            )
    elif is_gguf_source(config.model.path):
        if not (path / COMPLETE_MARKER).is_file():
            raise FileNotFoundError(
                f"model.path: {config.model.path!r} is not converted yet (at {path}); run "
                f"`pdserve model fetch --model {config.model.path}` once"
            )
    elif not path.is_dir():
        raise FileNotFoundError(f"model.path: {str(path)!r} is not a directory")
    elif not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model.path: {str(path)!r} has no config.json; pdserve loads transformers "
            "checkpoint directories (config.json, *.safetensors, tokenizer.json)"
        )
    return path


MAX_DEFAULT_MODEL_LEN = 8192


@dataclass(frozen=True, slots=True)
class ModelLimits:
    max_model_len: int
    vocab_size: int


def resolve_max_model_len(model_config: dict[str, Any], requested: int | None) -> int:
    """The context length to serve: the model's limit (capped by default), or the config's.

    A sliding window caps it too: full attention equals sliding-window attention only inside it.
    So does a LongRoPE scaling's original context: its short factors (the ones pdserve's static
    RoPE uses) are the model's own only up to there; beyond it the model switches factors.
    """
    limit = int(model_config.get("max_position_embeddings") or MAX_DEFAULT_MODEL_LEN)
    window = model_config.get("sliding_window")
    if window is not None and model_config.get("use_sliding_window", True):
        limit = min(limit, int(window))
    rope = model_config.get("rope_scaling") or model_config.get("rope_parameters") or {}
    if (rope.get("rope_type") or rope.get("type")) == "longrope":
        original = model_config.get("original_max_position_embeddings") or rope.get(
            "original_max_position_embeddings"
        )
        if original:
            limit = min(limit, int(original))
    if requested is None:
        return min(limit, MAX_DEFAULT_MODEL_LEN)
    if requested > limit:
        raise ValueError(
            f"model.max_model_len: {requested} exceeds the model's limit of {limit} tokens"
        )
    return requested


def model_limits(config: ClusterConfig) -> ModelLimits:
    """What the router validates against, read from config.json without loading the model."""
    if config.model.runner == "fake":
        fm = config.testing.fake_model
        return ModelLimits(config.model.max_model_len or 4096, fm.vocab_size)
    path = require_model_dir(config)
    with (path / "config.json").open() as f:
        raw = json.load(f)
    return ModelLimits(
        resolve_max_model_len(raw, config.model.max_model_len), int(raw["vocab_size"])
    )
