"""``structured``: grammar-constrained decoding (a JSON Schema through llguidance) vs none.

How (issue 11; docs/benchmarks/index.md describes it):
  1. One runner (the config's model; the tiny random one in ``--smoke``), engines on it that
     differ only in what the cell compares. Same weights, same memory, same threads; the arms of
     a cell run as a pair, interleaved (A B, then B A in the next pair), a pair in which an arm
     got < 93% of its cores run again (at most twice).
  2. ``mask_overhead_b8``: 8 requests decoded together, greedy, EOS ignored, exactly
     ``max_tokens`` new tokens (128; quick 64). Arm ``free``: unconstrained. Arm ``json``: each
     request constrained to ``RECORDS_SCHEMA`` (an array of 50 records: integers, fixed-length
     strings, a pattern, booleans: longer than ``max_tokens``, so both arms decode the same
     number of tokens), with the grammar's forced tokens *not* proposed as drafts and the
     budget closing off (``structured.close_at_budget: false``: the schema's shortest document
     is longer than ``max_tokens``, which admission would refuse; the cell times the masks).
     Key: the median decode-step time (steps in which all 8 decode) of ``json`` / ``free``.
     Target <= 1.10.
  3. ``forced_token_speedup``: ``FIXED_KEYS_SCHEMA`` (long fixed keys and constants), 8
     requests (quick 4) one at a time, greedy, each ended by its grammar. Arms ``drafts_off``
     (``decode.speculative.grammar_drafts: false``) and ``drafts_on`` (forced tokens proposed
     as drafts, verified). Key: decode tok/s (tokens after the first / time after the first
     token) of on / off, the median over pairs. Target >= 1.3. ``greedy_identical``: 1 when
     every request produced the same tokens in both arms (verification is exact).
  4. Where the model is a GGUF file (the default model; in ``--smoke`` the tiny model written
     as GGUF), both cells also run the same arms on a second runner that keeps the file's own
     blocks (``model.weights: gguf``, the default ``model.numerics``), named with ``_gguf``
     and interleaved in the same pairs: keys ``mask_overhead_b8_gguf``,
     ``forced_token_speedup_gguf``, ``greedy_identical_gguf`` (``nan`` for another model). The
     unsuffixed keys are the dense fp32 runner's (the benchmarks' checkpoint directory).
"""

from __future__ import annotations

import json
import statistics
from typing import Any

from benchmarks.harness import ArmRun, BenchContext, BenchReport
from benchmarks.quant import smoke_gguf_config
from benchmarks.workloads import bench_threads, make_engine, make_runner, run_groups, run_pair
from cluster.common.sampling_params import SamplingParams
from cluster.config.model import is_gguf_source
from cluster.engine.engine import LLMEngine

RECORD: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999999},
        "name": {"type": "string", "minLength": 24, "maxLength": 24},
        "email": {"type": "string", "pattern": "^[a-z]{4,12}@example\\.com$"},
        "active": {"type": "boolean"},
    },
    "required": ["id", "name", "email", "active"],
    "additionalProperties": False,
}
RECORDS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"records": {"type": "array", "items": RECORD, "minItems": 50, "maxItems": 50}},
    "required": ["records"],
    "additionalProperties": False,
}
FIXED_KEYS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "document_schema_version_identifier": {"const": "customer-profile/2024-06-01"},
        "customer_account_reference_number": {"type": "integer", "minimum": 0, "maximum": 9999},
        "is_subscription_currently_active_and_paid": {"type": "boolean"},
        "preferred_contact_channel_for_notifications": {"enum": ["email", "phone", "postal"]},
        "account_region_and_data_residency_zone": {"enum": ["eu-west", "us-east", "ap-south"]},
        "number_of_support_tickets_opened_this_year": {
            "type": "integer",
            "minimum": 0,
            "maximum": 99,
        },
    },
    "required": [
        "document_schema_version_identifier",
        "customer_account_reference_number",
        "is_subscription_currently_active_and_paid",
        "preferred_contact_channel_for_notifications",
        "account_region_and_data_residency_zone",
        "number_of_support_tickets_opened_this_year",
    ],
    "additionalProperties": False,
}
DRAFTS = ("drafts_off", "drafts_on")
TARGETS = {
    "mask_overhead_b8": "<= 1.10",
    "forced_token_speedup": ">= 1.3",
    "greedy_identical": "== 1",
    "mask_overhead_b8_gguf": "<= 1.10",
    "forced_token_speedup_gguf": ">= 1.3",
    "greedy_identical_gguf": "== 1",
}
PEOPLE = ["Ada", "Grace", "Alan", "Edsger", "Barbara", "Donald", "Frances", "Ken"]


def _arm(
    ctx: BenchContext,
    engine: LLMEngine,
    prompts: dict[str, list[int]],
    batch: int,
    params: SamplingParams,
    arm: str = "",
) -> ArmRun:
    """One arm: ``prompts`` in groups of ``batch`` (the arms share one KV pool: its prefix
    cache is emptied first); no grammar left active after it."""
    return run_groups(ctx, arm, engine, prompts, batch, params)


def _cell(
    ctx: BenchContext,
    arms: dict[str, tuple[LLMEngine, SamplingParams]],
    prompts: dict[str, list[int]],
    batch: int,
    num_pairs: int,
    disturbed: list[dict[str, float]],
) -> list[dict[str, ArmRun]]:
    pairs = []
    for pair in range(num_pairs):

        def one(arm: str, pair: int = pair) -> ArmRun:
            engine, params = arms[arm]
            ids = {f"{rid}-{arm}-{pair}": p for rid, p in prompts.items()}
            return _arm(ctx, engine, ids, batch, params, arm)

        def describe(r: ArmRun) -> str:
            return (
                f"step {r.step_ms:.2f} ms ({len(r.step_s)} full steps), decode "
                f"{r.decode_tok_s:.1f} tok/s, cpu util {r.cpu_util:.2f}"
            )

        pairs.append(run_pair(ctx, pair, num_pairs, list(arms), one, describe, disturbed))
    return pairs


def _engines(ctx: BenchContext, overrides: dict[str, Any], tag: str) -> dict[str, LLMEngine]:
    """The four engines of the two cells on one runner (``overrides`` picks its weights), each
    arm's name ending in ``tag``."""
    runner = make_runner(ctx, overrides)
    off = {**overrides, "decode.speculative.grammar_drafts": False}
    on = {**overrides, "decode.speculative.grammar_drafts": True}
    return {
        f"free{tag}": make_engine(ctx, off, runner=runner),
        # RECORDS_SCHEMA's shortest document (50 records) is longer than max_tokens: with the
        # budget closing on (structured.close_at_budget) admission would refuse it, so this
        # arm runs without it (the cell times the masks; the docs: what the closing costs).
        f"json{tag}": make_engine(ctx, {**off, "structured.close_at_budget": False}, runner=runner),
        f"drafts_off{tag}": make_engine(ctx, off, runner=runner),
        f"drafts_on{tag}": make_engine(ctx, on, runner=runner),
    }


def _gguf_overrides(ctx: BenchContext) -> dict[str, Any] | None:
    """A runner on the GGUF file's own blocks (``--smoke``: the tiny model written as GGUF), or
    None where the model is not a GGUF file."""
    if ctx.smoke:
        config = smoke_gguf_config(ctx)
        return {
            "model.path": config.model.path,
            "paths.cache_dir": config.paths.cache_dir,
            "model.weights": "gguf",
        }
    if not is_gguf_source(ctx.config.model.path):
        return None
    return {"model.path": ctx.config.model.path, "model.weights": "gguf"}


def _prompts(engine: LLMEngine, num_forced: int) -> tuple[dict[str, list[int]], ...]:
    tok = engine.tokenizer

    def chat(text: str) -> list[int]:
        return list(tok.encode_chat([{"role": "user", "content": text}]))

    records = {
        f"rec{i}": chat(f"List 50 customer records like {n}'s.") for i, n in enumerate(PEOPLE)
    }
    profiles = {
        f"prof{i}": chat(f"Write the customer profile of {n} as JSON.")
        for i, n in enumerate(PEOPLE[:num_forced])
    }
    return records, profiles


def _ratios(pairs: list[dict[str, ArmRun]], num: str, den: str, attr: str) -> list[float]:
    return [getattr(d[num], attr) / getattr(d[den], attr) for d in pairs if num in d]


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _mismatches(pairs: list[dict[str, ArmRun]], tag: str) -> list[str]:
    off, on = f"drafts_off{tag}", f"drafts_on{tag}"
    return [
        rid
        for d in pairs
        if off in d
        for rid, toks in d[off].tokens.items()
        if d[on].tokens[rid.replace(f"-{off}-", f"-{on}-")] != toks
    ]


def _table(cells: dict[str, list[dict[str, ArmRun]]]) -> list[dict[str, Any]]:
    table = []
    for cell, pairs in cells.items():
        for arm in pairs[0]:
            runs = [d[arm] for d in pairs]
            table.append(
                {
                    "cell": cell,
                    "arm": arm,
                    "step_ms": statistics.median(r.step_ms for r in runs),
                    "decode_tok_s": statistics.median(r.decode_tok_s for r in runs),
                    "tokens": sum(len(t) for t in runs[0].tokens.values()),
                }
            )
    return table


def _keys(mask: list[dict[str, ArmRun]], forced: list[dict[str, ArmRun]]) -> dict[str, float]:
    keys: dict[str, float] = {}
    for tag in ("", "_gguf"):
        ran = any(f"free{tag}" in d for d in mask)
        keys[f"mask_overhead_b8{tag}"] = _median(
            _ratios(mask, f"json{tag}", f"free{tag}", "step_ms")
        )
        keys[f"forced_token_speedup{tag}"] = _median(
            _ratios(forced, f"drafts_on{tag}", f"drafts_off{tag}", "decode_tok_s")
        )
        keys[f"greedy_identical{tag}"] = (
            float(not _mismatches(forced, tag)) if ran else float("nan")
        )
    return keys


def run(ctx: BenchContext) -> BenchReport:
    max_tokens = ctx.pick(128, 64, 12)
    num_forced = ctx.pick(8, 4, 2)
    num_pairs = ctx.pick(3, 2, 1)
    ctx.progress("loading the runners")
    engines = _engines(ctx, {}, "")
    gguf = _gguf_overrides(ctx)
    if gguf is not None:
        engines.update(_engines(ctx, gguf, "_gguf"))
    tags = ("", "_gguf") if gguf is not None else ("",)
    records, profiles = _prompts(engines["free"], num_forced)
    exact = {"temperature": 0.0, "max_tokens": max_tokens, "min_tokens": max_tokens}
    free = SamplingParams(**exact, ignore_eos=True)
    constrained = SamplingParams(**exact, ignore_eos=True, json_schema=json.dumps(RECORDS_SCHEMA))
    fixed = SamplingParams(
        temperature=0.0, max_tokens=256, json_schema=json.dumps(FIXED_KEYS_SCHEMA)
    )
    arms_mask = {
        f"{arm}{t}": (engines[f"{arm}{t}"], params)
        for t in tags
        for arm, params in (("free", free), ("json", constrained))
    }
    arms_forced = {f"{arm}{t}": (engines[f"{arm}{t}"], fixed) for t in tags for arm in DRAFTS}
    ctx.progress("warm-up (grammar compile, first-call allocations)")
    for arms in (arms_mask, arms_forced):
        for name, (eng, params) in arms.items():
            _arm(ctx, eng, {f"warm-{name}": records["rec0"]}, 1, params)
    disturbed: list[dict[str, float]] = []
    mask_pairs = _cell(ctx, arms_mask, records, 8, num_pairs, disturbed)
    forced_pairs = _cell(ctx, arms_forced, profiles, 1, num_pairs, disturbed)
    on = engines["drafts_on"].stats()
    return BenchReport(
        keys=_keys(mask_pairs, forced_pairs),
        table=_table({"mask b8": mask_pairs, "forced b1": forced_pairs}),
        targets=TARGETS,
        details={
            "threads": bench_threads(ctx),
            "max_tokens": max_tokens,
            "gguf_arms": "the model's GGUF file, its own blocks (model.weights: gguf)"
            if gguf is not None
            else "none: the model is not a GGUF file",
            **{
                f"step_ratios_per_pair{t}": _ratios(mask_pairs, f"json{t}", f"free{t}", "step_ms")
                for t in tags
            },
            **{
                f"speedups_per_pair{t}": _ratios(
                    forced_pairs, f"drafts_on{t}", f"drafts_off{t}", "decode_tok_s"
                )
                for t in tags
            },
            "forced_drafts": on["structured"]["num_forced_drafts"],
            "spec_acceptance_drafts_on": on["spec"]["acceptance_rate"],
            "mismatched_requests": {t or "dense": _mismatches(forced_pairs, t) for t in tags},
            "disturbed_pairs": disturbed,
        },
    )
