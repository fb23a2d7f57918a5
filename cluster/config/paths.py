"""``paths``: where pdserve keeps what it converts and caches."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PathsConfig:
    cache_dir: str = ""  # converted models and other caches; "" -> $PDSERVE_CACHE_DIR or XDG

    @property
    def resolved_cache_dir(self) -> Path:
        return Path(self.cache_dir).expanduser()
