"""``model.runner`` -> a model runner (config validates the names against this registry)."""

from __future__ import annotations

from collections.abc import Callable

from cluster.config import ClusterConfig
from cluster.engine.fake_runner import FakeModelRunner
from cluster.engine.runner import KVAllocator, ModelRunner, default_kv_allocator
from cluster.engine.torch_runner import TorchModelRunner

RUNNER_REGISTRY: dict[str, Callable[[ClusterConfig, KVAllocator], ModelRunner]] = {
    "torch": lambda config, alloc: TorchModelRunner(config, kv_allocator=alloc),
    "fake": lambda config, alloc: FakeModelRunner(config, kv_allocator=alloc),
}


def create_runner(
    config: ClusterConfig, kv_allocator: KVAllocator = default_kv_allocator
) -> ModelRunner:
    return RUNNER_REGISTRY[config.model.runner](config, kv_allocator)
