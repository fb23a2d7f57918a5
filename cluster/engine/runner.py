"""The model-runner seam: ``execute(batch) -> RunnerOutput``. The runner never decides who runs.

Implementations (``runner_registry`` maps ``model.runner`` to one): ``torch`` (Llama-family
models with paged attention, ``torch_runner``) and ``fake`` (a deterministic tiny model for
orchestration and fault tests, ``fake_runner``). Each owns the KV cache tensor, whose layout
every transfer relies on:

    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, row_width]

(``row_width`` is ``head_dim``, or ``head_dim + 4`` bytes for int8 KV: see common/kv_layout.)
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from cluster.common import shared_regions
from cluster.common.kv_layout import KVLayout
from cluster.config import ClusterConfig, cpu_count
from cluster.engine.batch import ScheduledBatch
from cluster.engine.outputs import EmittedTokens

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# KVLayout.storage_dtype -> torch (int8 KV rows are raw bytes: int8 values, then an fp32 scale)
KV_STORAGE_DTYPES = {**DTYPES, "uint8": torch.uint8}


@dataclass(slots=True)
class RunnerOutput:
    # One entry per emitted token, in batch order: one for each scheduled request whose step
    # ended in a sampled token; a request verified with drafts has its accepted drafts, then
    # the correction or bonus token, in consecutive entries (``spec.verify``).
    request_ids: list[str]
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    # Requests asking for prompt logprobs: (first position scored, entries) (``prompt_logprobs``)
    prompt_logprobs: dict[str, tuple[int, list[Any]]] = field(default_factory=dict)

    def per_request(self) -> dict[str, EmittedTokens]:
        """The entries grouped by request, in order."""
        out: dict[str, EmittedTokens] = {}
        for i, rid in enumerate(self.request_ids):
            em = out.get(rid)
            if em is None:
                em = out[rid] = EmittedTokens([], [], [])
            em.token_ids.append(self.token_ids[i])
            em.logprobs.append(self.logprobs[i] if self.logprobs is not None else None)
            em.top_logprobs.append(self.top_logprobs[i] if self.top_logprobs is not None else None)
        return out


class ModelRunner(Protocol):
    kv_cache: torch.Tensor
    layout: KVLayout
    num_blocks: int
    vocab_size: int
    max_model_len: int
    tokenizer: Any  # Tokenizer-like: encode/decode/eos_token_ids

    def execute(self, batch: ScheduledBatch) -> RunnerOutput: ...


# (layout, num_blocks, device) -> a zeroed, contiguous KV tensor of that layout. Servers pass one
# to place the pool in shared memory (the shm transport); the default is plain torch.zeros.
KVAllocator = Callable[[KVLayout, int, torch.device], torch.Tensor]


def default_kv_allocator(layout: KVLayout, num_blocks: int, device: torch.device) -> torch.Tensor:
    # Zeros, not empty: padded attention rows multiply probabilities 0 by these values.
    dtype = KV_STORAGE_DTYPES[layout.storage_dtype]
    return torch.zeros((num_blocks, *layout.block_shape), dtype=dtype, device=device)


def shared_kv_allocator(layout: KVLayout, num_blocks: int, device: torch.device) -> torch.Tensor:
    """A zeroed KV tensor in a memfd other processes on this host may map (``map_shared_kv``,
    by ``shared_kv_path``): a tensor-parallel engine's ranks share one cache this way."""
    if device.type != "cpu":
        raise ValueError("a shared KV cache lives in host memory (model.device cpu)")
    region, fd, path = shared_regions.new_region("pdserve-kv", num_blocks * layout.bytes_per_block)
    tensor = _kv_over(region, layout, num_blocks)
    shared_regions.register(tensor.data_ptr(), path, fd)
    return tensor


def shared_kv_path(kv_cache: torch.Tensor) -> str | None:
    """Where another process on this host maps ``kv_cache``, if it lives in shared memory
    (``shared_kv_allocator``, or a server's shared KV pool)."""
    return shared_regions.path_of(kv_cache.data_ptr())


def map_shared_kv(path: str, layout: KVLayout, num_blocks: int) -> torch.Tensor:
    """Another process's shared KV cache (``shared_kv_path``), read-write."""
    return _kv_over(
        shared_regions.map_region(path, num_blocks * layout.bytes_per_block), layout, num_blocks
    )


def _kv_over(region: mmap.mmap, layout: KVLayout, num_blocks: int) -> torch.Tensor:
    dtype = KV_STORAGE_DTYPES[layout.storage_dtype]
    return torch.frombuffer(region, dtype=dtype).view(num_blocks, *layout.block_shape)


def resolve_device(config: ClusterConfig) -> torch.device:
    if config.model.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if config.model.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("model.device: cuda requested but no CUDA device is available")
    return torch.device(config.model.device)


def resolve_dtype(config: ClusterConfig, device: torch.device) -> torch.dtype:
    if config.model.dtype == "auto":
        # Most CPUs have no bf16 arithmetic (torch emulates it, several times slower): fp32
        # there, bf16 on GPUs.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[config.model.dtype]


def resolve_kv_dtype(config: ClusterConfig, model_dtype: torch.dtype) -> str:
    """cache.kv_dtype, ``auto`` meaning the model's dtype."""
    if config.cache.kv_dtype == "auto":
        return str(model_dtype).removeprefix("torch.")
    return config.cache.kv_dtype


def num_kv_blocks(config: ClusterConfig, bytes_per_block: int, device: torch.device) -> int:
    """How many blocks the budget allows: a measured fact, returned, never written to config."""
    cache = config.cache
    if cache.num_blocks is not None:
        return cache.num_blocks
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * cache.gpu_memory_fraction)
    else:
        budget = cache.memory_bytes
    n = budget // bytes_per_block
    if n < 1:
        raise ValueError(
            f"cache.memory_bytes: {budget} bytes hold no KV block ({bytes_per_block} bytes each)"
        )
    return n


def set_torch_threads(config: ClusterConfig) -> int:
    n = config.model.num_threads or cpu_count()
    torch.set_num_threads(n)
    return n
