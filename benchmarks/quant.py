"""P11 ``quant``: quantized weights and KV (docs/benchmarks/index.md, P11).

How:
  1. Arms, one process, the same threads: ours on the GGUF file's own blocks (native kernels)
     in each ``model.numerics`` mode, ``gguf_exact`` and ``gguf_fast``, ``fp32`` (the same
     model de-quantized, dense), ``gguf_int8kv`` (GGUF weights, default numerics, int8 KV;
     reported, no key), and
     llama.cpp on the same GGUF file with ``n_threads`` = ours (optional:
     ``pip install -e './benchmarks[llamacpp]'``): ``llamacpp`` drives llama-cpp-python's
     low-level batch API (``llama_batch_init``, ``llama_decode``, a context per batch size with
     ``n_seq_max`` = the batch, each sequence its own ``seq_id``, greedy argmax over each
     sequence's logits in numpy), ``llamacpp_generate`` its ``Llama.generate`` (bs1 only,
     reported, no key).
  2. Cells, every arm greedy with EOS ignored. ``b1``: the same short prompt; decode tok/s =
     1 / the median gap between consecutive tokens after the first. ``b8`` / ``b32``: 8 / 32
     requests of 64 random prompt tokens (the same ids for every arm of a repetition), all sent
     at once; decode tok/s = batch / the median time of the steps in which every sequence
     decodes one token. ``prefill``: one random 512-token prompt; tok/s = 512 / the time to its
     first token, ours as the engine schedules it by default (``scheduler.chunk_size``, 256:
     two chunks in two steps), llama.cpp one ``llama_decode`` of the 512 tokens (``n_ubatch``
     512). Each repetition runs every cell with its arms in a shuffled order
     (``interleaved_order``), a cell in which an arm got < 93% of its cores again on fresh
     prompts (at most twice); ratios per repetition, medians reported.
  3. KV: bytes per token of the int8 and fp32 layouts (scales included), and the tokens each
     fits into the same pool bytes (``cache.memory_bytes``), as the runner sizes its pool.

Keys: ``b1_vs_llamacpp``, ``b8_vs_llamacpp``, ``b32_vs_llamacpp``, ``prefill_vs_llamacpp_512``
(ours in the numerics mode ``auto`` resolves to / llama.cpp), the same decode ratios per mode
(``b1_fast_vs_llamacpp``, ``b1_exact_vs_llamacpp``, ...), ``fast_vs_exact_b32``, ``b1_vs_fp32``,
``b32_vs_fp32`` (the auto mode over dense fp32), ``kv_bytes_ratio`` (int8 / fp32),
``kv_capacity_ratio`` (int8 tokens / fp32 tokens in the same bytes). The llama.cpp keys are
``nan`` without llama-cpp-python (the run says how to install it) and in ``--smoke``, which runs
the tiny random model written as a GGUF file.
"""

from __future__ import annotations

import atexit
import ctypes
import itertools
import math
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness import BenchContext, BenchReport, interleaved_order
from benchmarks.workloads import (
    MIN_CPU_UTIL,
    CpuMeter,
    bench_threads,
    exact_tokens,
    max_pair_retries,
    pin_threads,
    random_prompt,
)
from cluster.common.kv_layout import SCHEMES, KVLayout
from cluster.config import ClusterConfig
from cluster.config.model import is_gguf_source
from cluster.config.model_paths import COMPLETE_MARKER, gguf_model_dir
from cluster.engine.engine import EngineRequest, LLMEngine
from cluster.engine.runner import num_kv_blocks
from cluster.engine.torch_runner import numerics_for
from cluster.planner.measure.engine import tiny_model_dir

PROMPT = "The capital of France is"
INSTALL_LLAMACPP = (
    "pip install -e './benchmarks[llamacpp]' (llama-cpp-python; it builds llama.cpp from source, "
    "about 5 minutes on 2 cores; CMAKE_ARGS=-DGGML_NATIVE=ON for this CPU, see docs/benchmarks "
    "where the CPU reports AMX the VM does not enable)"
)
MODES = ("exact", "fast")  # model.numerics of our GGUF arms (auto resolves to one of them)
LLAMA = "llamacpp"
PROMPT_TOKENS = 64  # per request of the b8 / b32 cells
CELLS = ("b1", "prefill", "b8", "b32")
TARGETS = {
    "b1_vs_llamacpp": ">= 1.1",
    "b8_vs_llamacpp": ">= 1.5",
    "b32_vs_llamacpp": ">= 2.0",
    "prefill_vs_llamacpp_512": ">= 1.5",
    "fast_vs_exact_b32": "reported",
    "b1_vs_fp32": ">= 4 (docs/benchmarks/index.md: >= 2.5)",
    "b32_vs_fp32": ">= 1.0",
    "kv_bytes_ratio": "<= 0.27",
    "kv_capacity_ratio": ">= 3.6",
}
_ids = itertools.count()


def smoke_gguf_config(ctx: BenchContext) -> ClusterConfig:
    """The tiny model as a GGUF file with its converted checkpoint (a copy: figures are
    meaningless in smoke mode, only the harness is checked); P9 and ``structured`` use it too."""
    from cluster.engine.models.tiny import write_tiny_gguf

    tmp = Path(tempfile.mkdtemp(prefix="pdserve-bench-gguf-"))
    atexit.register(shutil.rmtree, tmp, True)
    gguf = write_tiny_gguf(tiny_model_dir(), tmp / "tiny.gguf")
    config = ctx.config.replace({"model.path": str(gguf), "paths.cache_dir": str(tmp)})
    target = gguf_model_dir(config, gguf)
    shutil.copytree(tiny_model_dir(), target)
    (target / COMPLETE_MARKER).write_text("bench smoke\n")
    return config


def gguf_arms(**extra: Any) -> dict[str, dict[str, Any]]:
    """Our GGUF arms and their overrides: ``gguf_exact`` and ``gguf_fast``."""
    return {f"gguf_{m}": {"model.weights": "gguf", "model.numerics": m, **extra} for m in MODES}


def _engine(config: ClusterConfig, threads: int, num_blocks: int, **overrides: Any) -> LLMEngine:
    dotted = {"model.num_threads": threads, "cache.num_blocks": num_blocks, **overrides}
    return LLMEngine(config.replace(dotted))


# --- our arms: each takes the repetition's prompts and output length, returns tok/s ---------


def _b1_ours(engine: LLMEngine, prompts: list[list[int]], num_tokens: int) -> float:
    engine.add(EngineRequest(f"b1-{next(_ids)}", prompts[0], exact_tokens(num_tokens)))
    times: list[float] = []
    while engine.has_unfinished_requests():
        if engine.step():
            times.append(time.perf_counter())
    gaps = [b - a for a, b in itertools.pairwise(times)]  # decode steps after the first token
    return 1.0 / statistics.median(gaps)


def _batch_ours(engine: LLMEngine, prompts: list[list[int]], num_tokens: int) -> float:
    rids = [f"batch-{next(_ids)}" for _ in prompts]
    for rid, prompt in zip(rids, prompts):
        engine.add(EngineRequest(rid, prompt, exact_tokens(num_tokens)))
    steps: list[float] = []
    while engine.has_unfinished_requests():
        reqs = [engine.requests.get(rid) for rid in rids]
        decoding = all(r is not None and r.num_output_tokens >= 1 for r in reqs)
        t0 = time.perf_counter()
        outs = engine.step()
        if decoding and len(outs) == len(rids):  # every request decoded one token in this step
            steps.append(time.perf_counter() - t0)
    return len(rids) / statistics.median(steps)


def _prefill_ours(engine: LLMEngine, prompts: list[list[int]], _num_tokens: int) -> float:
    """Prompt tokens / time to the first token, as the engine schedules the prompt."""
    t0 = time.perf_counter()
    engine.add(EngineRequest(f"prefill-{next(_ids)}", prompts[0], exact_tokens(1)))
    ttft = math.inf
    while engine.has_unfinished_requests():
        if any(o.new_token_ids for o in engine.step()) and ttft == math.inf:
            ttft = time.perf_counter() - t0
    return len(prompts[0]) / ttft


# --- llama.cpp ------------------------------------------------------------------------------


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


def _b1_generate(llm: Any, prompts: list[list[int]], num_tokens: int) -> float:
    """bs1 through ``Llama.generate`` (top-k 1: greedy), timed as ours."""
    llm.reset()
    times: list[float] = []
    for i, _tok in enumerate(llm.generate(prompts[0], top_k=1, temp=0.0, reset=True)):
        times.append(time.perf_counter())
        if i + 1 >= num_tokens:
            break
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return 1.0 / statistics.median(gaps)


_QUIET: list[Any] = []  # the no-op log callback, kept alive while llama.cpp may call it


class LlamaCppBatch:
    """llama.cpp through llama-cpp-python's low-level API: one model, a context per batch size
    (``n_seq_max`` = the batch, ``n_ctx`` = the batch x ``ctx_per_seq``, ``n_ubatch`` 512,
    ``n_batch`` as large as the batch's prompts, llama.cpp's defaults otherwise), one
    ``llama_decode`` for all prompts and then one per step, a token per sequence, each sequence
    its own ``seq_id``; greedy: numpy argmax over each sequence's logits row."""

    def __init__(self, path: Path, threads: int) -> None:
        import llama_cpp as lc

        self.lc, self.threads = lc, threads
        if not _QUIET:
            _QUIET.append(lc.llama_log_callback(lambda _level, _text, _user: None))
            lc.llama_log_set(_QUIET[0], ctypes.c_void_p())
        lc.llama_backend_init()
        params = lc.llama_model_default_params()
        params.n_gpu_layers = 0
        self.model = lc.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.contexts: dict[int, tuple[Any, Any, int]] = {}  # n_seq -> (context, batch, n_batch)
        atexit.register(self.close)

    def context(self, n_seq: int, ctx_per_seq: int, max_tokens: int) -> None:
        """Create the context for batches of ``n_seq`` (before anything is timed)."""
        lc = self.lc
        params = lc.llama_context_default_params()
        params.n_ctx = n_seq * ctx_per_seq
        params.n_batch = max(512, max_tokens)
        params.n_ubatch = 512
        params.n_seq_max = n_seq
        params.n_threads = params.n_threads_batch = self.threads
        ctx = lc.llama_init_from_model(self.model, params)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not create a context for {n_seq} sequences")
        batch = lc.llama_batch_init(params.n_batch, 0, n_seq)
        self.contexts[n_seq] = (ctx, batch, params.n_batch)

    def _decode(self, n_seq: int, items: Sequence[tuple[int, int, int, bool]]) -> Any:
        """One ``llama_decode`` of (token, position, seq_id, wants logits) items; the argmax of
        each output row, in the items' order."""
        import numpy as np

        lc = self.lc
        ctx, batch, _ = self.contexts[n_seq]
        for i, (tok, pos, seq, out) in enumerate(items):
            batch.token[i] = tok
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = out
        batch.n_tokens = len(items)
        rc = lc.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        n_out = sum(1 for item in items if item[3])
        logits = np.ctypeslib.as_array(lc.llama_get_logits(ctx), shape=(n_out, self.n_vocab))
        return logits.argmax(axis=1)

    def _prompts(self, prompts: list[list[int]]) -> Any:
        """Empty the context's KV, then decode every prompt (its own seq_id) in one batch."""
        ctx = self.contexts[len(prompts)][0]
        self.lc.llama_memory_clear(self.lc.llama_get_memory(ctx), True)
        items = [
            (tok, pos, seq, pos == len(p) - 1)
            for seq, p in enumerate(prompts)
            for pos, tok in enumerate(p)
        ]
        return self._decode(len(prompts), items)

    def decode_tok_s(self, prompts: list[list[int]], num_tokens: int) -> float:
        """Batch / the median step time, ``num_tokens`` per sequence (the first from the
        prompts' decode, untimed)."""
        n = len(prompts)
        nxt = self._prompts(prompts)
        steps: list[float] = []
        for k in range(num_tokens - 1):
            t0 = time.perf_counter()
            items = [(int(nxt[s]), len(prompts[s]) + k, s, True) for s in range(n)]
            nxt = self._decode(n, items)
            steps.append(time.perf_counter() - t0)
        return n / statistics.median(steps)

    def prefill_tok_s(self, prompts: list[list[int]], _num_tokens: int) -> float:
        """Prompt tokens / the time of its one ``llama_decode`` and the first token's argmax."""
        t0 = time.perf_counter()
        self._prompts(prompts)
        return len(prompts[0]) / (time.perf_counter() - t0)

    def close(self) -> None:
        for ctx, batch, _ in self.contexts.values():
            self.lc.llama_batch_free(batch)
            self.lc.llama_free(ctx)
        self.contexts.clear()
        if self.model:
            self.lc.llama_model_free(self.model)
            self.model = None


# --- the run --------------------------------------------------------------------------------


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
        return smoke_gguf_config(ctx)
    if is_gguf_source(ctx.config.model.path):
        return ctx.config
    raise ValueError(
        "bench quant compares a GGUF file's own blocks: use the default model or a .gguf --model"
    )


Arm = Callable[[list[list[int]], int], float]


@dataclass
class _Sizes:
    num_reps: int
    b1_tokens: int  # output tokens of the b1 cell
    batch_tokens: int  # output tokens per request of the b8 / b32 cells
    prefill_len: int
    batches: dict[str, int]  # cell -> requests (b8 -> 8, b32 -> 32; smaller in --smoke)

    @classmethod
    def of(cls, ctx: BenchContext) -> _Sizes:
        return cls(
            num_reps=ctx.pick(5, 3, 1),
            b1_tokens=ctx.pick(128, 64, 8),
            batch_tokens=ctx.pick(24, 12, 4),
            prefill_len=ctx.pick(512, 512, 64),
            batches={"b8": ctx.pick(8, 8, 2), "b32": ctx.pick(32, 32, 4)},
        )

    def tokens(self, cell: str) -> int:
        return {"b1": self.b1_tokens, "prefill": 1}.get(cell, self.batch_tokens)

    def prompts(self, cell: str, rng: random.Random, vocab: int, b1: list[int]) -> list[list[int]]:
        if cell == "b1":
            return [b1]
        if cell == "prefill":
            return [random_prompt(rng, self.prefill_len, vocab)]
        return [random_prompt(rng, PROMPT_TOKENS, vocab) for _ in range(self.batches[cell])]


@dataclass
class _Arms:
    """Our engines by arm, the GGUF ones among them, llama.cpp (None: not installed, or
    --smoke) and each cell's timed arms."""

    engines: dict[str, LLMEngine]
    gguf: list[str]
    llama: LlamaCppBatch | None
    cells: dict[str, dict[str, Arm]] = field(default_factory=dict)


def _llama_arms(
    ctx: BenchContext, gguf_path: Path, threads: int, sizes: _Sizes
) -> tuple[LlamaCppBatch | None, dict[str, dict[str, Arm]]]:
    """llama.cpp's arm in every cell (its contexts created here; ``llamacpp_generate`` beside
    it at bs1), or none: in --smoke, or without llama-cpp-python (the run says how to get it)."""
    if ctx.smoke:
        return None, {}
    try:
        llama = LlamaCppBatch(gguf_path, threads)
    except ImportError:
        ctx.progress(f"llama-cpp-python not installed: llama.cpp keys nan; {INSTALL_LLAMACPP}")
        return None, {}
    llama.context(1, max(1024, sizes.prefill_len + 256), sizes.prefill_len)
    for n in sizes.batches.values():
        llama.context(n, 256, n * PROMPT_TOKENS)
    generate = load_llamacpp(gguf_path, threads)
    cells: dict[str, dict[str, Arm]] = {
        "b1": {
            LLAMA: llama.decode_tok_s,
            f"{LLAMA}_generate": lambda prompts, n: _b1_generate(generate, prompts, n),
        },
        "prefill": {LLAMA: llama.prefill_tok_s},
        **{cell: {LLAMA: llama.decode_tok_s} for cell in sizes.batches},
    }
    return llama, cells


def _load_arms(
    ctx: BenchContext, config: ClusterConfig, gguf_path: Path, threads: int, sizes: _Sizes
) -> _Arms:
    blocks = sizes.batches["b32"] * -(
        -(PROMPT_TOKENS + sizes.batch_tokens + 8) // config.cache.block_size
    )
    blocks += -(-sizes.prefill_len // config.cache.block_size) + 64
    ctx.progress(f"loading arms ({threads} threads, {blocks} KV blocks each)")
    gguf = gguf_arms()
    overrides = {
        **gguf,
        "fp32": {"model.weights": "dense"},
        "gguf_int8kv": {"model.weights": "gguf", "cache.kv_dtype": "int8"},
    }
    engines = {name: _engine(config, threads, blocks, **o) for name, o in overrides.items()}
    llama, llama_cells = _llama_arms(ctx, gguf_path, threads, sizes)
    cells: dict[str, dict[str, Arm]] = {
        "b1": {name: _bind(_b1_ours, e) for name, e in engines.items()},
        "prefill": {name: _bind(_prefill_ours, engines[name]) for name in gguf},
        "b8": {name: _bind(_batch_ours, engines[name]) for name in gguf},
        "b32": {name: _bind(_batch_ours, e) for name, e in engines.items()},
    }
    for cell, arms in llama_cells.items():
        cells[cell].update(arms)
    return _Arms(engines, list(gguf), llama, cells)


def _bind(fn: Callable[[LLMEngine, list[list[int]], int], float], engine: LLMEngine) -> Arm:
    return lambda prompts, num_tokens: fn(engine, prompts, num_tokens)


Results = dict[str, dict[str, list[float]]]  # cell -> arm -> tok/s per repetition


@dataclass
class _Run:
    """What ``_measure`` keeps: tok/s per cell, arm and repetition; each arm's share of its
    cores (``CpuMeter``) per repetition; the cells run again because other work took cores."""

    results: Results
    cpu_util: dict[str, dict[str, list[float]]]
    disturbed: list[dict[str, Any]] = field(default_factory=list)


def _run_cell(
    ctx: BenchContext, arms: dict[str, Arm], prompts: list[list[int]], tokens: int, seed: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Every arm of a cell once, in the order ``interleaved_order`` draws for ``seed``: tok/s
    and the share of its cores each arm got."""
    tok_s, utils = {}, {}
    for name in interleaved_order(list(arms), seed):
        pin_threads(ctx)
        meter = CpuMeter(bench_threads(ctx))
        tok_s[name] = arms[name](prompts, tokens)
        utils[name] = meter.utilisation()
    return tok_s, utils


def _measure(ctx: BenchContext, arms: _Arms, sizes: _Sizes) -> _Run:
    """Warm-up (each arm of each cell once, short), then every repetition runs every cell with
    its arms in a shuffled order, all arms of a cell on the same prompts; a cell in which an arm
    got < 93% of its cores is run again on fresh prompts (at most twice), as P9's pairs are."""
    engine = next(iter(arms.engines.values()))
    vocab, b1_prompt = engine.vocab_size, engine.tokenizer.encode(PROMPT)
    rng = random.Random(0)
    for cell, cell_arms in arms.cells.items():  # first-call allocations, kernel compiles
        prompts = sizes.prompts(cell, rng, vocab, b1_prompt)
        for fn in cell_arms.values():
            fn(prompts, min(3, sizes.tokens(cell)))
    run = _Run(
        {cell: {name: [] for name in arms.cells[cell]} for cell in CELLS},
        {cell: {name: [] for name in arms.cells[cell]} for cell in CELLS},
    )
    for rep in range(sizes.num_reps):
        for i, cell in enumerate(CELLS):
            for attempt in range(max_pair_retries(ctx) + 1):
                prompts = sizes.prompts(cell, rng, vocab, b1_prompt)  # fresh: no prefix hits
                seed = rep * len(CELLS) + i
                tok_s, utils = _run_cell(ctx, arms.cells[cell], prompts, sizes.tokens(cell), seed)
                shown = ", ".join(f"{n} {v:.1f}" for n, v in tok_s.items())
                ctx.progress(f"rep {rep + 1}/{sizes.num_reps} {cell} tok/s: {shown}")
                if min(utils.values()) >= MIN_CPU_UTIL or attempt == max_pair_retries(ctx):
                    break
                run.disturbed.append({"rep": rep, "cell": cell, "cpu_util": utils})
                ctx.progress(f"{cell} disturbed by other work (cpu util {utils}): again")
            for name, value in tok_s.items():
                run.results[cell][name].append(value)
                run.cpu_util[cell][name].append(utils[name])
    for e in arms.engines.values():
        e.check_integrity()
    return run


def _ratios(results: Results, cell: str, num: str, den: str) -> list[float]:
    a, b = results[cell].get(num), results[cell].get(den)
    return [x / y for x, y in zip(a, b)] if a and b else []


def _ratio(results: Results, cell: str, num: str, den: str) -> float:
    ratios = _ratios(results, cell, num, den)
    return statistics.median(ratios) if ratios else float("nan")


def _interval(ratios: list[float], num_resamples: int = 2000) -> list[float] | None:
    """The 90% bootstrap interval of the median of per-repetition ratios (None under 3)."""
    if len(ratios) < 3:
        return None
    rng = random.Random(0)
    medians = sorted(
        statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(num_resamples)
    )
    return [medians[int(0.05 * num_resamples)], medians[int(0.95 * num_resamples) - 1]]


def auto_mode(config: ClusterConfig) -> tuple[str, str]:
    """The GGUF arm of the numerics ``auto`` resolves to on this host, and why."""
    mode = numerics_for(config.replace({"model.weights": "gguf"}), True, "cpu float32")
    return f"gguf_{mode}", "model.numerics auto on this host (torch_runner.numerics_for)"


def _keys(results: Results, auto: str, kv: dict[str, float]) -> dict[str, float]:
    keys = {
        "b1_vs_llamacpp": _ratio(results, "b1", auto, LLAMA),
        "b8_vs_llamacpp": _ratio(results, "b8", auto, LLAMA),
        "b32_vs_llamacpp": _ratio(results, "b32", auto, LLAMA),
        "prefill_vs_llamacpp_512": _ratio(results, "prefill", auto, LLAMA),
    }
    for cell in ("b1", "b8", "b32"):
        for mode in MODES:
            keys[f"{cell}_{mode}_vs_llamacpp"] = _ratio(results, cell, f"gguf_{mode}", LLAMA)
    keys.update(
        {
            "fast_vs_exact_b32": _ratio(results, "b32", "gguf_fast", "gguf_exact"),
            "b1_vs_fp32": _ratio(results, "b1", auto, "fp32"),
            "b32_vs_fp32": _ratio(results, "b32", auto, "fp32"),
            "kv_bytes_ratio": kv["int8_bytes_per_token"] / kv["fp32_bytes_per_token"],
            "kv_capacity_ratio": kv["int8_tokens"] / kv["fp32_tokens"],
        }
    )
    return keys


def _table(engines: dict[str, LLMEngine], results: Results, auto: str) -> list[dict[str, Any]]:
    table: list[dict[str, Any]] = []
    for name in results["b1"]:
        runner: Any = engines[name].runner if name in engines else None
        numerics = name.removeprefix("gguf_") if name.startswith("gguf_") else ""
        row: dict[str, Any] = {
            "arm": name + (" (auto)" if name == auto else ""),
            "weights": runner.formats["weights"] if runner else "llama.cpp (same file)",
            "numerics": numerics if numerics in MODES else "",
            "kv": runner.layout.dtype if runner else "f16 (llama.cpp)",
        }
        for cell in CELLS:
            runs = results[cell].get(name)
            row[f"{cell}_tok_s"] = statistics.median(runs) if runs else ""
        row["weight_MiB"] = runner.model.weight_bytes() / 2**20 if runner else ""
        table.append(row)
    return table


def run(ctx: BenchContext) -> BenchReport:
    config = _source(ctx)
    from cluster.engine.models.default_model import gguf_source

    gguf_path = gguf_source(config)
    assert gguf_path is not None
    sizes = _Sizes.of(ctx)
    threads = pin_threads(ctx)
    arms = _load_arms(ctx, config, gguf_path, threads, sizes)
    measured = _measure(ctx, arms, sizes)
    results = measured.results
    auto, why = auto_mode(config)
    kv = _kv(config, arms.engines["fp32"].runner.layout)
    gguf_runner: Any = arms.engines[auto].runner
    per_rep = {
        f"{cell}_{num}_vs_{den}": _ratios(results, cell, num, den)
        for cell in CELLS
        for num in arms.gguf
        for den in (LLAMA, "fp32", f"{LLAMA}_generate", "gguf_exact")
        if num != den
    }
    return BenchReport(
        keys=_keys(results, auto, kv),
        table=_table(arms.engines, results, auto),
        targets=TARGETS,
        details={
            "threads": threads,
            "num_reps": sizes.num_reps,
            "bs1_tokens": sizes.b1_tokens,
            "batch_tokens": sizes.batch_tokens,
            "batches": sizes.batches,
            "prompt_tokens": PROMPT_TOKENS,
            "prefill_tokens": sizes.prefill_len,
            "prefill_chunk_size": config.scheduler.chunk_size,
            "auto_numerics": {"arm": auto, "how": why},
            "tok_s_per_rep": results,
            "cpu_util_per_rep": measured.cpu_util,
            "disturbed_cells": measured.disturbed,
            "ratios_per_rep": {k: v for k, v in per_rep.items() if v},
            "intervals_90": {k: _interval(v) for k, v in per_rep.items() if len(v) >= 3},
            "b1_vs_llamacpp_generate": _ratio(results, "b1", auto, f"{LLAMA}_generate"),
            "kv": kv,
            "gguf": str(gguf_path),
            "llamacpp": "llama-cpp-python low-level batch API"
            if arms.llama
            else ("not in --smoke" if ctx.smoke else f"unavailable: {INSTALL_LLAMACPP}"),
            "kernel_isa": getattr(getattr(gguf_runner.model.ops, "kernels", None), "isa", "none"),
            # the most activation rows the native kernel takes before tiles + BLAS (packed.py rule)
            "kernel_max_rows": getattr(
                getattr(gguf_runner.model.ops, "packed", None), "kernel_max_rows", None
            ),
        },
    )
