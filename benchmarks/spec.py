"""P9 ``spec``: speculative decoding (prompt-lookup drafts) vs none.

How (docs/benchmarks/index.md, P9):
  1. One runner (the real model), two engines on it: speculation off, and
     ``decode.speculative.method: ngram`` with the config's other ``decode.speculative`` knobs
     (the defaults unless ``--set`` says otherwise). Same weights, same memory, same threads.
  2. Workloads (``spec_workloads``, shipped with the bench): ``copy`` (16 edits and summaries
     of a given passage, prose and code; quick 8) and ``no_copy`` (16 open questions; quick 8);
     chat template applied, greedy, each request's own EOS ends it, at most 128 new tokens
     (quick 64).
  3. Cells: (workload, batch) for batch 1 (requests one at a time) and 8 (the prompts in
     groups of 8 sent together). Each cell runs both arms as a pair, interleaved (off on, then
     on off in the next pair); a pair in which an arm got < 93% of its cores is run again, at
     most twice.
  4. Decode tok/s of an arm = its tokens after each request's first / the time after the first
     token (first to last token of each request at batch 1; of each group at batch 8): what
     speculation speeds up. End-to-end tok/s (all tokens / arrival to last token) is reported
     beside it. Greedy outputs are compared token for token between the arms.

  5. GGUF arms (where the model is a GGUF file, the default model; in ``--smoke`` the tiny
     model written as GGUF): every cell's pair also runs ``gguf_off`` / ``gguf_on``
     (speculation off / on on a second runner that keeps the file's own blocks,
     ``model.weights: gguf`` with the default ``model.numerics``), interleaved with the others.
     Where llama-cpp-python is installed (never in ``--smoke``), each copy-workload batch-1 pair
     also runs ``llamacpp`` (llama.cpp on the same file, the same threads, the same
     chat-templated token ids, greedy, ending at the same EOS ids or max tokens, timed the same
     way: first to last token of each request).

Keys: ``speedup_b1`` / ``speedup_b8`` (copy workload, decode tok/s on / off; median over pairs),
``no_copy_ratio`` (no-copy workload, on / off, the lower of batch 1 and 8), ``acceptance``
(accepted / drafted tokens, copy workload, batch 1), ``greedy_identical`` (1 when every request
produced the same tokens in both arms), the first three and the last again on the GGUF arms
(``speedup_b1_gguf``, ``speedup_b8_gguf``, ``no_copy_ratio_gguf``, ``greedy_identical_gguf``;
``nan`` where the model is not a GGUF file), ``b1_vs_llamacpp_copy`` (copy workload, batch 1,
decode tok/s of ``gguf_on`` / ``llamacpp``; ``nan`` with the reason in the details when the arm
cannot run).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks.harness import ArmRun, BenchContext, BenchReport
from benchmarks.quant import INSTALL_LLAMACPP, load_llamacpp, smoke_gguf_config
from benchmarks.spec_workloads import copy_heavy, no_copy
from benchmarks.workloads import (
    CpuMeter,
    bench_threads,
    make_engine,
    make_runner,
    run_groups,
    run_pair,
)
from cluster.common.sampling_params import SamplingParams
from cluster.config.model import is_gguf_source
from cluster.engine.engine import LLMEngine

ARMS = ("off", "on")
# The same two arms on a runner that keeps the GGUF file's blocks quantized (the default model's
# default), in every cell; and llama.cpp on that file (copy workload, batch 1).
GGUF_ARMS = ("gguf_off", "gguf_on")
LLAMA = "llamacpp"
BATCHES = (1, 8)


def run_llamacpp(
    llm: Any, prompts: dict[str, list[int]], max_tokens: int, eos: tuple[int, ...]
) -> ArmRun:
    """llama.cpp, one request at a time: greedy from the same token ids, timed as ours."""
    run = ArmRun("llamacpp")
    meter = CpuMeter(llm.n_threads)
    for rid, prompt in prompts.items():
        t0 = time.perf_counter()
        times: list[float] = []
        toks: list[int] = []
        for tok in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            times.append(time.perf_counter())
            toks.append(int(tok))
            if int(tok) in eos or len(toks) >= max_tokens:
                break
        run.tokens[rid] = toks
        run.total_tokens += len(toks)
        run.total_s += times[-1] - t0
        run.decode_tokens += len(toks) - 1
        run.decode_s += times[-1] - times[0]
    run.cpu_util = meter.utilisation()
    return run


def _gguf_overrides(ctx: BenchContext) -> tuple[dict[str, Any] | None, str]:
    """The overrides of a runner on the config's GGUF file, its own blocks (``--smoke``: the
    tiny model written as GGUF), or None and why not."""
    if ctx.smoke:
        config = smoke_gguf_config(ctx)
        path, cache = config.model.path, config.paths.cache_dir
        return {"model.path": path, "paths.cache_dir": cache, "model.weights": "gguf"}, "tiny"
    if not is_gguf_source(ctx.config.model.path):
        return None, "the model is not a GGUF file"
    return {"model.path": ctx.config.model.path, "model.weights": "gguf"}, "the config's file"


def _gguf_engines(ctx: BenchContext) -> tuple[dict[str, LLMEngine], Any | None, str]:
    """(``GGUF_ARMS``' engines on one runner that keeps the GGUF file's own blocks, llama.cpp
    on that file, a note); none of either where it cannot run: no GGUF model, llama-cpp-python
    not installed, or ``--smoke`` (llama.cpp runs the real file only)."""
    overrides, why = _gguf_overrides(ctx)
    if overrides is None:
        return {}, None, f"no gguf arms: {why}"
    runner = make_runner(ctx, overrides)
    engines = {
        arm: make_engine(ctx, {**overrides, "decode.speculative.method": m}, runner=runner)
        for arm, m in zip(GGUF_ARMS, ("none", "ngram"))
    }
    note = f"gguf arms: {getattr(runner, 'formats', {}).get('weights')} ({why})"
    if ctx.smoke:
        return engines, None, f"{note}; llama.cpp: not in --smoke"
    from cluster.engine.models.default_model import gguf_source

    path = gguf_source(ctx.config)
    assert path is not None
    llm = load_llamacpp(path, bench_threads(ctx), n_ctx=2048)
    if llm is None:
        return engines, None, f"{note}; llama-cpp-python not installed; {INSTALL_LLAMACPP}"
    return engines, llm, f"{note}; llama.cpp: llama-cpp-python on {path.name}"


@dataclass
class _Arms:
    """What every cell runs on: the engines by arm (the GGUF ones when they can run),
    llama.cpp (or None) and why, the workloads' prompts, the sampling and the EOS ids."""

    engines: dict[str, LLMEngine]
    llama: Any | None
    llama_note: str
    workloads: dict[str, dict[str, list[int]]]
    params: SamplingParams
    max_tokens: int
    eos: tuple[int, ...]

    def runner(
        self, ctx: BenchContext, prompts: dict[str, list[int]], batch: int, pair: int
    ) -> Callable[[str], ArmRun]:
        def run_one(arm: str) -> ArmRun:
            ids = {f"{rid}-{arm}-{pair}": p for rid, p in prompts.items()}
            if arm == LLAMA:
                return run_llamacpp(self.llama, ids, self.max_tokens, self.eos)
            return run_arm(ctx, self.engines[arm], ids, batch, self.params, arm)

        return run_one

    def names(self, workload: str, batch: int) -> tuple[str, ...]:
        names = (*ARMS, *GGUF_ARMS) if GGUF_ARMS[0] in self.engines else ARMS
        if self.llama is not None and (workload, batch) == ("copy", 1):
            return (*names, LLAMA)
        return names


def run_arm(
    ctx: BenchContext,
    engine: LLMEngine,
    prompts: dict[str, list[int]],
    batch: int,
    params: SamplingParams,
    arm: str = "",
) -> ArmRun:
    """One arm: ``prompts`` in groups of ``batch``, its prefix cache emptied first."""
    return run_groups(ctx, arm, engine, prompts, batch, params)


def _arms(ctx: BenchContext, num_prompts: int, max_tokens: int) -> _Arms:
    ctx.progress("loading the runner")
    runner = make_runner(ctx)
    engines = {
        "off": make_engine(ctx, {"decode.speculative.method": "none"}, runner=runner),
        "on": make_engine(ctx, {"decode.speculative.method": "ngram"}, runner=runner),
    }
    tok = engines["off"].tokenizer
    workloads = {
        "copy": {f"copy{i}": tok.encode_chat(c) for i, c in enumerate(copy_heavy()[:num_prompts])},
        "no_copy": {f"free{i}": tok.encode_chat(c) for i, c in enumerate(no_copy()[:num_prompts])},
    }
    gguf_engines, llama, llama_note = _gguf_engines(ctx)
    ctx.progress(llama_note)
    engines.update(gguf_engines)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return _Arms(
        engines, llama, llama_note, workloads, params, max_tokens, engines["off"].eos_token_ids
    )


def _describer(tag: str) -> Callable[[ArmRun], str]:
    def describe(r: ArmRun) -> str:
        return (
            f"{tag}: decode {r.decode_tok_s:.1f} tok/s, e2e {r.e2e_tok_s:.1f} tok/s, "
            f"accepted {r.accepted}/{r.drafted}, row cost {r.row_cost:.2f}, "
            f"cpu util {r.cpu_util:.2f}"
        )

    return describe


Cells = dict[tuple[str, int], list[dict[str, ArmRun]]]


def _run_cells(
    ctx: BenchContext, arms: _Arms, num_pairs: int, disturbed: list[dict[str, float]]
) -> Cells:
    """Every (workload, batch) cell's arms as a pair, ``num_pairs`` times."""
    for name, eng in arms.engines.items():  # first-call allocations and lazy inits off the clock
        run_arm(ctx, eng, {f"warm-{name}": arms.workloads["copy"]["copy0"]}, 1, arms.params)
    cells: Cells = {}
    for pair in range(num_pairs):
        for wl, prompts in arms.workloads.items():
            for batch in BATCHES:
                done = run_pair(
                    ctx,
                    pair,
                    num_pairs,
                    arms.names(wl, batch),
                    arms.runner(ctx, prompts, batch, pair),
                    _describer(f"{wl} b{batch}"),
                    disturbed,
                )
                cells.setdefault((wl, batch), []).append(done)
    return cells


def _ratios(
    cells: Cells, wl: str, batch: int, attr: str, on: str = "on", off: str = "off"
) -> list[float]:
    """Arm ``on`` over arm ``off`` per pair of the cell (none where the arms did not run)."""
    pairs = [d for d in cells[(wl, batch)] if on in d and off in d]
    return [getattr(d[on], attr) / getattr(d[off], attr) for d in pairs]


def _speedup(cells: Cells, wl: str, batch: int, on: str = "on", off: str = "off") -> float:
    ratios = _ratios(cells, wl, batch, "decode_tok_s", on, off)
    return statistics.median(ratios) if ratios else float("nan")


def _mismatches(cells: Cells, off: str = "off", on: str = "on") -> list[str]:
    """Requests whose greedy tokens differ between arms ``off`` and ``on``: each with the output
    index where they part and, where the other pairs agree, which arm left them."""
    found = []
    for (wl, batch), pairs in cells.items():
        runs = [d for d in pairs if off in d and on in d]
        for p, d in enumerate(runs):
            for rid, toks in d[off].tokens.items():
                base = rid.removesuffix(f"-{off}-{p}")
                other = d[on].tokens[f"{base}-{on}-{p}"]
                if other != toks:
                    at = next((i for i, (a, b) in enumerate(zip(toks, other)) if a != b), None)
                    odd = _odd_arm(runs, p, base, (off, on))
                    found.append(f"{wl} b{batch} {rid} from token {at}{odd}")
    return found


def _odd_arm(runs: list[dict[str, ArmRun]], p: int, base: str, arms: tuple[str, str]) -> str:
    """``; <arm> left the other pairs`` where the other pairs all gave request ``base`` the same
    tokens and one arm of pair ``p`` did not, else nothing."""
    others = [
        runs[q][a].tokens[f"{base}-{a}-{q}"] for q in range(len(runs)) if q != p for a in arms
    ]
    if not others or any(o != others[0] for o in others):
        return ""
    odd = [a for a in arms if runs[p][a].tokens[f"{base}-{a}-{p}"] != others[0]]
    return f"; {odd[0]} left the other pairs" if len(odd) == 1 else ""


def _keys(cells: Cells, arms: _Arms) -> dict[str, float]:
    copy_b1 = cells[("copy", 1)]
    drafted = sum(d["on"].drafted for d in copy_b1)
    has_gguf = GGUF_ARMS[0] in arms.engines
    return {
        "speedup_b1": _speedup(cells, "copy", 1),
        "speedup_b8": _speedup(cells, "copy", 8),
        "no_copy_ratio": min(_speedup(cells, "no_copy", 1), _speedup(cells, "no_copy", 8)),
        "acceptance": sum(d["on"].accepted for d in copy_b1) / drafted if drafted else 0.0,
        "greedy_identical": float(not _mismatches(cells)),
        # The same on the GGUF file's own blocks; nan where it is not a GGUF model.
        "speedup_b1_gguf": _speedup(cells, "copy", 1, *reversed(GGUF_ARMS)),
        "speedup_b8_gguf": _speedup(cells, "copy", 8, *reversed(GGUF_ARMS)),
        "no_copy_ratio_gguf": min(
            _speedup(cells, "no_copy", 1, *reversed(GGUF_ARMS)),
            _speedup(cells, "no_copy", 8, *reversed(GGUF_ARMS)),
        ),
        "greedy_identical_gguf": float(not _mismatches(cells, *GGUF_ARMS))
        if has_gguf
        else float("nan"),
        # nan without llama-cpp-python, and in --smoke (llama.cpp runs the real file only)
        "b1_vs_llamacpp_copy": _speedup(cells, "copy", 1, GGUF_ARMS[1], LLAMA),
    }


def _table(cells: Cells) -> list[dict[str, Any]]:
    table = []
    for (wl, batch), pairs in cells.items():
        for arm in pairs[0]:
            runs = [d[arm] for d in pairs]
            table.append(
                {
                    "workload": wl,
                    "batch": batch,
                    "arm": arm,
                    "decode_tok_s": statistics.median(r.decode_tok_s for r in runs),
                    "e2e_tok_s": statistics.median(r.e2e_tok_s for r in runs),
                    "tokens": runs[0].total_tokens,
                    "accepted/drafted": f"{runs[0].accepted}/{runs[0].drafted}",
                }
            )
    return table


def _speculative(ctx: BenchContext) -> dict[str, Any]:
    """The ``decode.speculative`` knobs the on arm ran with."""
    spec_cfg = ctx.config.decode.speculative
    return {
        "num_speculative_tokens": spec_cfg.num_speculative_tokens,
        "min_ngram": spec_cfg.min_ngram,
        "max_ngram": spec_cfg.max_ngram,
        "max_batch_size": spec_cfg.max_batch_size,
        "max_num_draft_tokens": spec_cfg.max_num_draft_tokens,
        "draft_row_cost": spec_cfg.draft_row_cost,
        "min_acceptance_rate": spec_cfg.min_acceptance_rate,
        "max_pause_steps": spec_cfg.max_pause_steps,
    }


TARGETS = {
    "speedup_b1": ">= 2.0",
    "speedup_b8": ">= 1.3",
    "no_copy_ratio": ">= 0.95",
    "greedy_identical": "== 1",
    "speedup_b1_gguf": ">= 1.8",
    "speedup_b8_gguf": "reported",
    "no_copy_ratio_gguf": ">= 0.95",
    "greedy_identical_gguf": "== 1",
    "b1_vs_llamacpp_copy": ">= 2.0 (goal)",
}


def run(ctx: BenchContext) -> BenchReport:
    num_prompts = ctx.pick(16, 8, 2)
    max_tokens = ctx.pick(128, 64, 8)
    num_pairs = ctx.pick(2, 1, 1)
    arms = _arms(ctx, num_prompts, max_tokens)
    disturbed: list[dict[str, float]] = []
    cells = _run_cells(ctx, arms, num_pairs, disturbed)
    ratio_arms = {"": ARMS[::-1], "_gguf": GGUF_ARMS[::-1]}
    return BenchReport(
        keys=_keys(cells, arms),
        table=_table(cells),
        targets=TARGETS,
        details={
            "threads": bench_threads(ctx),
            "gguf_and_llamacpp_arms": arms.llama_note,
            "num_prompts": num_prompts,
            "max_tokens": max_tokens,
            "speculative": _speculative(ctx),
            "decode_ratios_per_pair": {
                f"{wl}_b{b}{tag}": _ratios(cells, wl, b, "decode_tok_s", *pair)
                for (wl, b) in cells
                for tag, pair in ratio_arms.items()
            },
            "e2e_ratios_per_pair": {
                f"{wl}_b{b}{tag}": _ratios(cells, wl, b, "e2e_tok_s", *pair)
                for (wl, b) in cells
                for tag, pair in ratio_arms.items()
            },
            "mismatched_requests": _mismatches(cells),
            "mismatched_requests_gguf": _mismatches(cells, *GGUF_ARMS),
            "disturbed_pairs": disturbed,
        },
    )
