"""``paths``: where pdserve keeps what it converts and caches."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PathsConfig:
    cache_dir: str = ""
    """Where converted models and other caches live; "": ``$PDSERVE_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/pdserve`` (``~/.cache/pdserve``)."""

    @property
    def resolved_cache_dir(self) -> Path:
        if not self.cache_dir:  # a config built in code, not loaded: never the working directory
            from cluster.config.environment import default_cache_dir

            return default_cache_dir()
        return Path(self.cache_dir).expanduser()
