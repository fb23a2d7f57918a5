"""Loading: YAML + dotted overrides -> the validated frozen tree.

Values are checked against the dataclasses' type hints (gently coerced: int -> float,
list -> tuple); unknown keys are a ``ValueError`` listing the valid names.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cluster.config.environment import config_path, default_cache_dir
from cluster.config.paths import PathsConfig
from cluster.config.schema import apply_dotted, build_dataclass
from cluster.config.tree import ClusterConfig


def config_from_dict(data: Mapping[str, Any] | None) -> ClusterConfig:
    """Validate a plain mapping (parsed YAML) into the frozen config tree."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ValueError(f"config: the top level must be a mapping, got {type(data).__name__}")
    cfg: ClusterConfig = build_dataclass(ClusterConfig, data, "")
    if not cfg.paths.cache_dir:
        cache_dir = str(default_cache_dir())
        cfg = dataclasses.replace(cfg, paths=PathsConfig(cache_dir=cache_dir))
    return cfg


def parse_override(text: str) -> tuple[str, Any]:
    """``section.key=value``, the value parsed as YAML (``16``, ``null``, ``[a, b]``)."""
    import yaml

    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"override {text!r}: expected section.key=value")
    return key.strip(), yaml.safe_load(raw) if raw.strip() else ""


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> ClusterConfig:
    """The config from a YAML file (or ``$PDSERVE_CONFIG``), with dotted-key overrides on top."""
    import yaml

    path = path if path is not None else config_path()
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"config file {str(p)!r} does not exist")
        with p.open() as f:
            loaded = yaml.safe_load(f)
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"config file {str(p)!r}: the top level must be a mapping")
        data = loaded or {}
    if overrides:
        full = ClusterConfig().to_dict()
        _deep_merge(full, data)
        apply_dotted(full, overrides)
        data = full
    return config_from_dict(data)


def _deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> None:
    for k, v in top.items():
        if isinstance(v, Mapping) and isinstance(base.get(k), dict):
            _deep_merge(base[k], v)
        else:
            base[k] = v


_POOL_SECTIONS = ("router", "prefill", "decode")


def flat_key_index() -> dict[str, str]:
    """Leaf name -> dotted path for every leaf whose name is unique in the tree.

    Lets the offline API take ``LLM(block_size=16, max_num_seqs=8)``. The cluster sections
    (``router``, ``prefill``, ``decode``) only matter to a cluster and are left out.
    """
    seen: dict[str, list[str]] = {}

    def walk(cls: Any, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            dotted = f"{prefix}.{f.name}" if prefix else f.name
            if dotted in _POOL_SECTIONS:
                continue
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], dotted)
            else:
                seen.setdefault(f.name, []).append(dotted)

    walk(ClusterConfig, "")
    return {name: paths[0] for name, paths in seen.items() if len(paths) == 1}
