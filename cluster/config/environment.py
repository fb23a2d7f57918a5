"""The only reader of environment variables in pdserve (and of the process's CPU affinity).

Secrets and per-pod facts are read here at the point of use, never written into the config tree:
the tree a process hands to its Ray replicas is exactly what the YAML and overrides said, and
each replica reads its own pod's environment (its IP, its Kubernetes Secrets). Each function
returns the config's value when it is set, else the environment's.

  * ``$PDSERVE_CONFIG``: the YAML file ``load_config()`` reads when given no path;
  * ``$PDSERVE_CACHE_DIR`` (else ``$XDG_CACHE_HOME/pdserve``): the default ``paths.cache_dir``;
  * ``$PDSERVE_TRANSFER_SECRET``: ``transfer.hmac_secret``;
  * ``$PDSERVE_CURVE_SECRET_KEY`` / ``$PDSERVE_CURVE_PUBLIC_KEY``: the transfer CURVE keypair;
  * ``$PDSERVE_API_KEYS`` (comma list): ``router.api_keys``;
  * ``$PDSERVE_ADVERTISE_HOST``: ``transfer.advertise_host`` (Kubernetes: the pod IP);
  * ``$RAY_AUTH_MODE``: whether Ray's own token authentication was turned off (S7);
  * ``$MALLOC_ARENA_MAX`` / ``$MALLOC_MMAP_THRESHOLD_``: glibc's allocator in the replicas
    (``replica_allocator_env``: pdserve's defaults per role unless the launching environment
    sets them).
"""

from __future__ import annotations

import os
from pathlib import Path

from cluster.config.router import RouterConfig
from cluster.config.transfer import TransferConfig

CONFIG_ENV = "PDSERVE_CONFIG"
CACHE_DIR_ENV = "PDSERVE_CACHE_DIR"
TRANSFER_SECRET_ENV = "PDSERVE_TRANSFER_SECRET"
CURVE_SECRET_KEY_ENV = "PDSERVE_CURVE_SECRET_KEY"
CURVE_PUBLIC_KEY_ENV = "PDSERVE_CURVE_PUBLIC_KEY"
API_KEYS_ENV = "PDSERVE_API_KEYS"
ADVERTISE_HOST_ENV = "PDSERVE_ADVERTISE_HOST"
RAY_AUTH_MODE_ENV = "RAY_AUTH_MODE"

MIN_API_KEY_LEN = 8


def config_path() -> str | None:
    """The config file named by ``$PDSERVE_CONFIG`` (None when unset or empty)."""
    return os.environ.get(CONFIG_ENV) or None


def default_cache_dir() -> Path:
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "pdserve"


def transfer_hmac_secret(config: TransferConfig) -> str:
    """``transfer.hmac_secret``, else ``$PDSERVE_TRANSFER_SECRET`` ("" when neither is set)."""
    return config.hmac_secret or os.environ.get(TRANSFER_SECRET_ENV, "")


def curve_keys(config: TransferConfig) -> tuple[str, str]:
    """(secret, public) z85 keys: each from the config, else its environment variable."""
    secret = config.curve_secret_key or os.environ.get(CURVE_SECRET_KEY_ENV, "")
    public = config.curve_public_key or os.environ.get(CURVE_PUBLIC_KEY_ENV, "")
    return secret, public


def advertise_host(config: TransferConfig) -> str:
    """The address KV peers dial: ``transfer.advertise_host``, else ``$PDSERVE_ADVERTISE_HOST``
    (this pod's IP), else ``bind_host`` (which may be a wildcard the caller resolves)."""
    return config.advertise_host or os.environ.get(ADVERTISE_HOST_ENV) or config.bind_host


def api_keys(config: RouterConfig) -> tuple[str, ...]:
    """The router's API keys, without duplicates; empty: authentication is off.

    ``router.api_keys``, else ``$PDSERVE_API_KEYS`` (comma list), plus the lines of
    ``router.api_keys_file``. Raises ``ValueError`` naming the field (and the variable).
    """
    keys = list(config.api_keys)
    if not keys:
        raw = os.environ.get(API_KEYS_ENV, "")
        keys = [k.strip() for k in raw.split(",") if k.strip()]
        for key in keys:
            if len(key) < MIN_API_KEY_LEN:
                raise ValueError(
                    f"router.api_keys: keys must be at least {MIN_API_KEY_LEN} characters "
                    f"(from ${API_KEYS_ENV})"
                )
    if config.api_keys_file:
        keys.extend(_read_keys_file(config.api_keys_file))
    return tuple(dict.fromkeys(keys))


def _read_keys_file(path: str) -> tuple[str, ...]:
    p = Path(path).expanduser()
    try:
        lines = p.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"router.api_keys_file: cannot read {str(p)!r}: {e.strerror}") from None
    keys = tuple(k.strip() for k in lines if k.strip() and not k.lstrip().startswith("#"))
    if not keys:
        raise ValueError(f"router.api_keys_file: {str(p)!r} holds no keys")
    for key in keys:
        if len(key) < MIN_API_KEY_LEN:
            raise ValueError(
                f"router.api_keys_file: keys must be at least {MIN_API_KEY_LEN} characters"
            )
    return keys


# glibc malloc in the long-lived replicas (tens of threads each: Ray, gRPC, KV receivers). With
# glibc's defaults (an arena per thread, a mmap threshold that rises after every large free) a
# router's heap grows while the bytes in use stay flat. Two arenas everywhere; the router also
# gets a fixed mmap threshold. The pools keep the rising one: fixed, every prefill activation is
# a fresh mmap, page-faulted inside the step. The docs' design decisions have the measurements.
# Only glibc reads these; an allocator preloaded instead ignores them.
POOL_ALLOCATOR_ENV = {"MALLOC_ARENA_MAX": "2"}
ROUTER_ALLOCATOR_ENV = {**POOL_ALLOCATOR_ENV, "MALLOC_MMAP_THRESHOLD_": "131072"}


def replica_allocator_env(role: str) -> dict[str, str]:
    """The allocator variables a Ray replica of ``role`` (``router``, ``prefill``, ``decode``)
    starts with: pdserve's defaults, except those the launching environment sets itself (its
    own value is passed on)."""
    defaults = ROUTER_ALLOCATOR_ENV if role == "router" else POOL_ALLOCATOR_ENV
    return {k: os.environ.get(k, v) for k, v in defaults.items()}


def cpu_count() -> int:
    """Cores this process may use (affinity-aware)."""
    return len(allowed_cores())


def allowed_cores() -> tuple[int, ...]:
    """The cores this thread may run on, ascending (all of them where affinity is unknown)."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return tuple(range(os.cpu_count() or 1))


def ray_auth_disabled() -> bool:
    """Ray's token authentication (on by default since Ray 2.52: GCS, raylets and the job API
    refuse callers without the cluster's token) turned off by ``$RAY_AUTH_MODE=disabled``."""
    return os.environ.get(RAY_AUTH_MODE_ENV, "").strip().lower() == "disabled"
