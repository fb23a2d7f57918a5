"""``model`` and ``cache``: which weights run where, and the KV pool they fill."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.config.validation import check, check_choice, fail

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DEVICES = ("auto", "cpu", "cuda")
_RUNNERS = ("torch", "fake")
_BACKENDS = ("auto", "native", "torch")
# auto: a GGUF source (the default model, a .gguf model.path) keeps its quantized blocks; a
# checkpoint directory runs dense. dense: model.dtype weights (GGUF de-quantized once). gguf:
# the GGUF file's own blocks (Q4_0, Q4_1, Q8_0), native kernels on CPU. int8: int8 weight-only
# in groups of 32 inputs, each with an fp16 scale and minimum, quantized at load from the dense
# weights (tied embedding/lm_head included); int8_rows: the same with one scale per output
# channel (smaller, less accurate).
WEIGHT_FORMATS = ("auto", "dense", "gguf", "int8", "int8_rows")
# auto: the model dtype. int8: int8 values and one fp32 scale per (token, KV head).
KV_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")


def is_gguf_source(path: str | None) -> bool:
    """The default model (a GGUF file in a package) or a ``.gguf`` file named by model.path."""
    return path is None or path.lower().endswith(".gguf")


@dataclass(frozen=True)
class ModelConfig:
    path: str | None = None  # None: the default model, converted once into cache_dir
    runner: str = "torch"  # model-runner registry key: torch | fake
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"
    max_model_len: int | None = None  # None: the model's own limit, capped at 8192
    num_threads: int | None = None  # torch intra-op threads of this process; None: all cores
    # CPU fp32 fast paths: native (a small C kernel for paged decode attention reading the cache
    # in place, and oneDNN linear layers at the batch sizes where a start-up probe finds them
    # faster than F.linear on this CPU), torch (plain torch ops, any device), or auto (native
    # where it applies; torch otherwise).
    kernels: str = "auto"
    weights: str = "auto"  # auto | dense | gguf | int8 | int8_rows (WEIGHT_FORMATS above)
    seed: int = 0  # seed for requests that bring none

    def __post_init__(self) -> None:
        check_choice(self.runner, "model.runner", _RUNNERS)
        check_choice(self.dtype, "model.dtype", _DTYPES)
        check_choice(self.device, "model.device", _DEVICES)
        check_choice(self.kernels, "model.kernels", _BACKENDS)
        check_choice(self.weights, "model.weights", WEIGHT_FORMATS)
        if self.weights == "gguf" and not is_gguf_source(self.path):
            fail(
                "model.weights",
                f"gguf needs a GGUF source (the default model or a .gguf model.path), not "
                f"{self.path!r}; use dense or int8 for checkpoint directories",
            )
        if self.max_model_len is not None:
            check(self.max_model_len >= 2, "model.max_model_len", "must be >= 2")
        if self.num_threads is not None:
            check(self.num_threads >= 1, "model.num_threads", "must be >= 1")

    @property
    def resolved_weights(self) -> str:
        """The weight format ``auto`` stands for: gguf for GGUF sources, dense otherwise."""
        if self.weights != "auto":
            return self.weights
        return "gguf" if is_gguf_source(self.path) else "dense"


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block, the same everywhere (router hashes too)
    memory_bytes: int = 1 << 30  # CPU: KV pool size in bytes
    gpu_memory_fraction: float = 0.85  # CUDA: share of the free device memory for the KV pool
    num_blocks: int | None = None  # explicit pool size, overriding the two budgets (tests)
    enable_prefix_caching: bool = True
    kv_dtype: str = "auto"  # auto (the model dtype) | float32 | bfloat16 | float16 | int8

    def __post_init__(self) -> None:
        check_choice(self.kv_dtype, "cache.kv_dtype", KV_DTYPES)
        check(
            self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
            "cache.block_size",
            f"must be a power of two >= 1, got {self.block_size}",
        )
        check(self.memory_bytes > 0, "cache.memory_bytes", "must be > 0")
        check(
            0.0 < self.gpu_memory_fraction <= 1.0,
            "cache.gpu_memory_fraction",
            "must be in (0, 1]",
        )
        if self.num_blocks is not None:
            check(self.num_blocks >= 1, "cache.num_blocks", "must be >= 1")


def declared_formats(model: ModelConfig, cache: CacheConfig) -> dict[str, str]:
    """The weight and KV formats a configuration asks for, without loading the model
    (``/v1/models``, the startup banner; each engine logs the exact ones, e.g. ``Q4_1 + Q8_0``).
    """
    weights = model.resolved_weights if model.runner != "fake" else "none (the fake runner)"
    dtype = model.dtype if model.dtype != "auto" else "model dtype"
    if weights == "dense":
        weights = f"dense ({dtype})"
    elif weights == "gguf":
        weights = "gguf (the file's own quantized blocks)"
    elif weights == "int8":
        weights = "int8 (groups of 32, fp16 scale and minimum)"
    elif weights == "int8_rows":
        weights = "int8 (per output channel)"
    kv = cache.kv_dtype
    if kv == "auto":
        kv = dtype if dtype != "model dtype" else "model dtype (float32 on CPU)"
    elif kv == "int8":
        kv = "int8 (one fp32 scale per token and KV head)"
    return {"weights": weights, "kv_cache": kv}
