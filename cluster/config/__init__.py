"""One frozen configuration tree for every pdserve process.

Loaded once from YAML (the same file the Kubernetes ConfigMap carries) plus overrides, validated
with a ``ValueError`` that names the field, unknown keys rejected with the valid names listed.
Facts measured at run time (how many KV blocks fit, the model's real context length) are return
values of the code that measures them, never written back here; nor are secrets or per-pod
values from the environment, which ``environment`` (the package's only reader of environment
variables) returns where they are used.

One module per section: ``model`` (model, cache), ``scheduler``, ``transfer``, ``pools``
(prefill, decode: routing, autoscaling), ``speculative`` (the decode pool's drafts), ``router``,
``structured`` (grammar-constrained decoding), ``paths``, ``testing``; ``tree`` joins them into
``ClusterConfig``; ``loading`` turns YAML and overrides into it; ``model_paths`` says where
models live on disk.
"""

from __future__ import annotations

from cluster.config.environment import (
    advertise_host,
    allowed_cores,
    api_keys,
    cpu_count,
    curve_keys,
    ray_auth_disabled,
    replica_allocator_env,
    transfer_hmac_secret,
)
from cluster.config.loading import config_from_dict, flat_key_index, load_config, parse_override
from cluster.config.model import DEFAULT_MODEL_NAME, CacheConfig, ModelConfig
from cluster.config.paths import PathsConfig
from cluster.config.pools import (
    DecodePoolConfig,
    PoolConfig,
    PoolScalingConfig,
    PrefillPoolConfig,
    RoutingConfig,
)
from cluster.config.router import RouterConfig
from cluster.config.scheduler import SchedulerConfig
from cluster.config.speculative import SPECULATIVE_METHODS, SpeculativeConfig
from cluster.config.structured import StructuredConfig
from cluster.config.testing import FakeModelConfig, TestingConfig
from cluster.config.transfer import _TRANSPORTS, TransferConfig
from cluster.config.tree import ClusterConfig

__all__ = [
    "DEFAULT_MODEL_NAME",
    "SPECULATIVE_METHODS",
    "_TRANSPORTS",
    "CacheConfig",
    "ClusterConfig",
    "DecodePoolConfig",
    "FakeModelConfig",
    "ModelConfig",
    "PathsConfig",
    "PoolConfig",
    "PoolScalingConfig",
    "PrefillPoolConfig",
    "RouterConfig",
    "RoutingConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "StructuredConfig",
    "TestingConfig",
    "TransferConfig",
    "advertise_host",
    "allowed_cores",
    "api_keys",
    "config_from_dict",
    "cpu_count",
    "curve_keys",
    "flat_key_index",
    "load_config",
    "parse_override",
    "ray_auth_disabled",
    "replica_allocator_env",
    "transfer_hmac_secret",
]
