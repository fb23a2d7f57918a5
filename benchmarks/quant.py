"""P11 ``quant``: quantized weights and KV (docs/benchmarks/index.md, P11).

How:
  1. Arms, one process, the same torch threads: ``gguf`` (the GGUF file's own blocks, native
     kernels), ``fp32`` (the same model de-quantized, dense), ``gguf_int8kv`` (gguf weights and
     an int8 KV cache, reported, no key) and ``llamacpp`` (llama-cpp-python on the same GGUF
     file with ``n_threads`` = ours; optional: ``pip install -e './benchmarks[llamacpp]'``).
  2. bs1: the same short prompt, greedy, EOS ignored; decode tok/s = 1 / the median gap between
     consecutive tokens after the first (prefill left out), llama.cpp's through its token
     generator. bs32: 32 requests of 64 random prompt tokens, decode tok/s = 32 / the median
     time of the steps in which all 32 decode. Arms interleave within every repetition (the
     order reversed each time) and ratios are taken per repetition, median reported.
  3. KV: bytes per token of the int8 and fp32 layouts (scales included), and the tokens each
     fits into the same pool bytes (``cache.memory_bytes``), as the runner sizes its pool.

Keys: ``b1_vs_llamacpp`` (ours gguf bs1 / llama.cpp bs1; ``nan`` when llama-cpp-python is not
installed, with a note how to install it), ``b1_vs_fp32``, ``b32_vs_fp32``, ``kv_bytes_ratio``
(int8 / fp32), ``kv_capacity_ratio`` (int8 tokens / fp32 tokens in the same bytes). ``--smoke``
runs the tiny random model written as a GGUF file and leaves llama.cpp out.
"""

from __future__ import annotations

import atexit
import itertools
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.harness import BenchContext, BenchReport
from benchmarks.workloads import exact_tokens, pin_threads, random_prompt
from cluster.common.kv_layout import SCHEMES, KVLayout
from cluster.config import ClusterConfig
from cluster.config.model import is_gguf_source
from cluster.config.model_paths import COMPLETE_MARKER, gguf_model_dir
from cluster.engine.engine import EngineRequest, LLMEngine
from cluster.engine.runner import num_kv_blocks
from cluster.planner.measure.engine import tiny_model_dir

PROMPT = "The capital of France is"
INSTALL_LLAMACPP = (
    "pip install -e './benchmarks[llamacpp]' (llama-cpp-python; it builds llama.cpp from source, "
    "about 5 minutes on 2 cores; CMAKE_ARGS=-DGGML_NATIVE=ON for this CPU, see docs/benchmarks "
    "where the CPU reports AMX the VM does not enable)"
)
TARGETS = {
    "b1_vs_llamacpp": ">= 1.0",
    "b1_vs_fp32": ">= 4 (docs/benchmarks/index.md: >= 2.5)",
    "b32_vs_fp32": ">= 1.0",
    "kv_bytes_ratio": "<= 0.27",
    "kv_capacity_ratio": ">= 3.6",
}


def _smoke_source(ctx: BenchContext) -> ClusterConfig:
    """The tiny model as a GGUF file with its converted checkpoint (a copy: figures are
    meaningless in smoke mode, only the harness is checked)."""
    from cluster.engine.models.tiny import write_tiny_gguf

    tmp = Path(tempfile.mkdtemp(prefix="pdserve-bench-quant-"))
    atexit.register(shutil.rmtree, tmp, True)
    gguf = write_tiny_gguf(tiny_model_dir(), tmp / "tiny.gguf")
    config = ctx.config.replace({"model.path": str(gguf), "paths.cache_dir": str(tmp)})
    target = gguf_model_dir(config, gguf)
    shutil.copytree(tiny_model_dir(), target)
    (target / COMPLETE_MARKER).write_text("bench smoke\n")
    return config


def _engine(config: ClusterConfig, threads: int, num_blocks: int, **overrides: Any) -> LLMEngine:
    dotted = {"model.num_threads": threads, "cache.num_blocks": num_blocks, **overrides}
    return LLMEngine(config.replace(dotted))


def _b1_ours(engine: LLMEngine, prompt: list[int], num_tokens: int) -> float:
    engine.add(EngineRequest("b1", prompt, exact_tokens(num_tokens)))
    times: list[float] = []
    while engine.has_unfinished_requests():
        if engine.step():
            times.append(time.perf_counter())
    gaps = [b - a for a, b in itertools.pairwise(times)]  # decode steps after the first token
    return 1.0 / statistics.median(gaps)


def _b32_ours(engine: LLMEngine, rng: random.Random, batch: int, num_tokens: int) -> float:
    rids = [f"b{batch}-{i}" for i in range(batch)]
    for rid in rids:
        engine.add(
            EngineRequest(rid, random_prompt(rng, 64, engine.vocab_size), exact_tokens(num_tokens))
        )
    steps: list[float] = []
    while engine.has_unfinished_requests():
        reqs = [engine.requests.get(rid) for rid in rids]
        decoding = all(r is not None and r.num_output_tokens >= 1 for r in reqs)
        t0 = time.perf_counter()
        outs = engine.step()
        if decoding and len(outs) == batch:  # every request decoded one token in this step
            steps.append(time.perf_counter() - t0)
    return batch / statistics.median(steps)


def load_llamacpp(path: Path, threads: int, n_ctx: int = 512) -> Any | None:
    """llama-cpp-python's ``Llama`` on ``path`` (None when it is not installed)."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    return Llama(
        model_path=str(path),
        n_threads=threads,
        n_threads_batch=threads,
        n_ctx=n_ctx,
        verbose=False,
        seed=0,
    )


def _b1_llamacpp(llm: Any, num_tokens: int) -> float:
    llm.reset()
    tokens = llm.tokenize(PROMPT.encode())
    times: list[float] = []
    for i, _tok in enumerate(llm.generate(tokens, top_k=1, temp=0.0, reset=True)):
        times.append(time.perf_counter())
        if i + 1 >= num_tokens:
            break
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return 1.0 / statistics.median(gaps)


def _kv(config: ClusterConfig, fp32: KVLayout) -> dict[str, float]:
    int8 = KVLayout(
        fp32.model,
        "int8",
        fp32.block_size,
        fp32.num_layers,
        fp32.num_kv_heads,
        fp32.head_dim,
        SCHEMES["int8"],
    )
    import torch

    budget = config.replace({"cache.num_blocks": None})
    tokens = {
        layout.dtype: num_kv_blocks(budget, layout.bytes_per_block, torch.device("cpu"))
        * layout.block_size
        for layout in (fp32, int8)
    }
    return {
        "fp32_bytes_per_token": fp32.bytes_per_token,
        "int8_bytes_per_token": int8.bytes_per_token,
        "fp32_tokens": tokens["float32"],
        "int8_tokens": tokens["int8"],
        "pool_bytes": config.cache.memory_bytes,
    }


def _source(ctx: BenchContext) -> ClusterConfig:
    """The config whose GGUF file every arm loads (smoke: a tiny one written for the run)."""
    if ctx.smoke:
        return _smoke_source(ctx)
    if is_gguf_source(ctx.config.model.path):
        return ctx.config
    raise ValueError(
        "bench quant compares a GGUF file's own blocks: use the default model or a .gguf --model"
    )


@dataclass
class _Arms:
    """Our engines on the file (its own blocks, de-quantized fp32, its blocks with int8 KV)
    and llama.cpp on it (None: not installed, or --smoke); ``b1``: one timed bs1 run of each."""

    engines: dict[str, LLMEngine]
    llama: Any | None
    b1: dict[str, Callable[[], float]]


def _load_arms(
    ctx: BenchContext, config: ClusterConfig, gguf_path: Path, threads: int, blocks: int
) -> _Arms:
    ctx.progress(f"loading arms ({threads} threads, {blocks} KV blocks each)")
    engines = {
        "gguf": _engine(config, threads, blocks, **{"model.weights": "gguf"}),
        "fp32": _engine(config, threads, blocks, **{"model.weights": "dense"}),
        "gguf_int8kv": _engine(
            config, threads, blocks, **{"model.weights": "gguf", "cache.kv_dtype": "int8"}
        ),
    }
    llama = None if ctx.smoke else load_llamacpp(gguf_path, threads)
    if llama is None and not ctx.smoke:
        ctx.progress(
            f"llama-cpp-python not installed: b1_vs_llamacpp unavailable; {INSTALL_LLAMACPP}"
        )
    prompt = engines["gguf"].tokenizer.encode(PROMPT)
    b1_tokens = ctx.pick(128, 64, 8)
    b1: dict[str, Callable[[], float]] = {
        name: partial(_b1_ours, e, prompt, b1_tokens) for name, e in engines.items()
    }
    if llama is not None:
        b1["llamacpp"] = partial(_b1_llamacpp, llama, b1_tokens)
    return _Arms(engines, llama, b1)


def _measure(
    ctx: BenchContext, arms: _Arms, batch: int, b32_tokens: int, num_reps: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each repetition: every arm at bs1, then ours at ``batch``, the order alternating; tok/s
    per arm and repetition."""
    rng = random.Random(0)
    engines = arms.engines
    b1: dict[str, list[float]] = {name: [] for name in [*engines, "llamacpp"]}
    b32: dict[str, list[float]] = {name: [] for name in engines}
    for fn in arms.b1.values():  # warm-up: first-call allocations, kernel compiles
        fn()
    for e in engines.values():
        _b32_ours(e, rng, batch, 3)
    order, names = list(arms.b1), list(engines)
    for rep in range(num_reps):
        for name in order if rep % 2 == 0 else order[::-1]:
            pin_threads(ctx)
            b1[name].append(arms.b1[name]())
            ctx.progress(f"rep {rep + 1}/{num_reps} bs1 {name}: {b1[name][-1]:.1f} tok/s")
        for name in names if rep % 2 == 0 else names[::-1]:
            pin_threads(ctx)
            b32[name].append(_b32_ours(engines[name], rng, batch, b32_tokens))
            ctx.progress(f"rep {rep + 1}/{num_reps} bs{batch} {name}: {b32[name][-1]:.1f} tok/s")
    for e in engines.values():
        e.check_integrity()
    return b1, b32


def _ratio(num: list[float], den: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(num, den))


def _table(
    engines: dict[str, LLMEngine],
    b1: dict[str, list[float]],
    b32: dict[str, list[float]],
    batch: int,
) -> list[dict[str, Any]]:
    table: list[dict[str, Any]] = []
    for name in b1:
        if not b1[name]:
            continue
        runner: Any = engines[name].runner if name in engines else None
        table.append(
            {
                "arm": name,
                "weights": runner.formats["weights"] if runner else "llama.cpp (same file)",
                "kv": runner.layout.dtype if runner else "f16 (llama.cpp)",
                "bs1_tok_s": statistics.median(b1[name]),
                f"bs{batch}_tok_s": statistics.median(b32[name]) if name in b32 else "",
                "weight_MiB": runner.model.weight_bytes() / 2**20 if runner else "",
            }
        )
    return table


def run(ctx: BenchContext) -> BenchReport:
    config = _source(ctx)
    from cluster.engine.models.default_model import gguf_source

    gguf_path = gguf_source(config)
    assert gguf_path is not None
    num_reps = ctx.pick(5, 3, 1)
    b32_tokens = ctx.pick(24, 12, 4)
    batch = ctx.pick(32, 32, 4)
    threads = pin_threads(ctx)
    blocks = batch * -(-(64 + b32_tokens + 8) // config.cache.block_size) + 64
    arms = _load_arms(ctx, config, gguf_path, threads, blocks)
    engines, llama = arms.engines, arms.llama
    b1, b32 = _measure(ctx, arms, batch, b32_tokens, num_reps)
    kv = _kv(config, engines["fp32"].runner.layout)
    gguf_runner: Any = engines["gguf"].runner
    keys: dict[str, float] = {}
    if not ctx.smoke:
        keys["b1_vs_llamacpp"] = _ratio(b1["gguf"], b1["llamacpp"]) if llama else float("nan")
    keys.update(
        {
            "b1_vs_fp32": _ratio(b1["gguf"], b1["fp32"]),
            "b32_vs_fp32": _ratio(b32["gguf"], b32["fp32"]),
            "kv_bytes_ratio": kv["int8_bytes_per_token"] / kv["fp32_bytes_per_token"],
            "kv_capacity_ratio": kv["int8_tokens"] / kv["fp32_tokens"],
        }
    )
    return BenchReport(
        keys=keys,
        table=_table(engines, b1, b32, batch),
        targets=TARGETS,
        details={
            "threads": threads,
            "num_reps": num_reps,
            "bs1_tokens": ctx.pick(128, 64, 8),
            "batch": batch,
            "bs1_tok_s_per_rep": b1,
            "bs_batch_tok_s_per_rep": b32,
            "kv": kv,
            "gguf": str(gguf_path),
            "llamacpp": "llama-cpp-python" if llama else f"unavailable: {INSTALL_LLAMACPP}",
            "kernel_isa": getattr(getattr(gguf_runner.model.ops, "kernels", None), "isa", "none"),
            # the most activation rows the native kernel takes before tiles + BLAS (packed.py rule)
            "kernel_max_rows": getattr(
                getattr(gguf_runner.model.ops, "packed", None), "kernel_max_rows", None
            ),
        },
    )
