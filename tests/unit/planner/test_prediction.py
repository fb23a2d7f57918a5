"""The planner's prediction against real pool workers: the CI-sized version of the check
(``pdserve plan --validate`` runs the full one against the cluster).

Ray-free prefill and decode workers in this process on the fake runner (its steps sleep 2 ms
per prefill token, 20 ms per step with decodes, plus whatever this machine adds). The profile is
measured as ``pdserve profile`` measures one (``measure.engine.measure_steps`` on the engine,
the serving calibration from a few unloaded requests on the workers), then the same seeded requests
are simulated and sent in real time to a colocated worker and to a 1P1D pair; predicted p50/p90
TTFT, p50/p90 TPOT and goodput must be within 25% of the measured ones. What is tested is the
simulator's scheduling, queueing and batching under Poisson load and the remote hand-off.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from cluster.common.hashing import hash_block_tokens
from cluster.common.protocol import GenerateCall
from cluster.decode_worker.worker import DecodeWorker
from cluster.engine.engine import LLMEngine
from cluster.planner.calibration import ServingSample, calibrate
from cluster.planner.measure.engine import measure_steps, step_costs
from cluster.planner.metrics import slo_metrics, unloaded_baseline
from cluster.planner.plan import simulate, simulate_unloaded
from cluster.planner.profile import Profile, StepCosts, TransferCost
from cluster.planner.simulator import ArmSpec, SimRecord
from cluster.planner.workload import RequestClass, SLOs, WorkloadMix, poisson_offsets
from cluster.prefill_worker.worker import PrefillWorker
from tests.helpers import fake_config, greedy
from tests.unit.servers.test_pd_cores import InProcessPrefill

pytestmark = pytest.mark.timeout(400)

PREFILL_S, DECODE_S = 0.002, 0.02
WORK = WorkloadMix(
    "fake-mixed",
    (RequestClass("chat", 0.8, (40, 80), 16), RequestClass("long", 0.2, (240, 320), 8)),
)
RATE, NUM, SEED = 2.0, 40, 100
FIGURES = (("ttft_s", "p50"), ("ttft_s", "p90"), ("tpot_s", "p50"), ("tpot_s", "p90"))


def _steps(cfg: Any) -> StepCosts:
    grid = {
        "prefill": (1, 16, 64, 256),
        "offsets": (0, 128),
        "chunk": 64,
        "batch": (1, 4, 16),
        "context": (32, 256),
        "reps": 1,
        "steps": 3,
    }
    engine = LLMEngine(
        cfg.replace(
            {
                "scheduler.chunk_size": None,
                "cache.num_blocks": 512,
                "scheduler.max_num_batched_tokens": 1024,
            }
        ),
        role="decode",
    )
    return step_costs(measure_steps(engine, grid, lambda msg: None), grid)


def _unloaded(decode: DecodeWorker, items: list[Any]) -> list[ServingSample]:
    async def main() -> list[ServingSample]:
        out = []
        for i, item in enumerate(items):
            call = GenerateCall(
                f"u{i}",
                item.token_ids,
                hash_block_tokens(item.token_ids, 16),
                greedy(item.max_tokens),
            )
            t0 = time.perf_counter()
            times: list[float] = []
            usage = None
            async for chunk in decode.generate(call):
                times.extend([time.perf_counter() - t0] * len(chunk.token_ids))
                usage = chunk.usage or usage
            assert usage is not None
            out.append(
                ServingSample(
                    len(item.token_ids), item.max_tokens, times, usage.phases["prefill_ms"] / 1000
                )
            )
        return out

    return asyncio.run(main())


def _config() -> Any:
    return fake_config(
        **{
            "testing.fake_model.prefill_delay_per_token_s": PREFILL_S,
            "testing.fake_model.decode_delay_s": DECODE_S,
            "scheduler.chunk_size": 64,
            "scheduler.max_num_batched_tokens": 256,
            "scheduler.max_num_seqs": 16,
            "cache.num_blocks": 512,
            "transfer.transports": ["loopback"],
            "transfer.stream_min_tokens": 0,
            "decode.local_prefill_threshold": 0,
        }
    )


def _measure(decode: DecodeWorker) -> tuple[list[SimRecord], float]:
    items = WORK.items(NUM, 500, seed=SEED)
    offsets = poisson_offsets(NUM, RATE, seed=SEED + 100)

    async def one(i: int, start: float) -> SimRecord:
        item = items[i]
        await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
        rec = SimRecord(item.cls, len(item.token_ids), item.max_tokens, time.perf_counter())
        call = GenerateCall(
            f"m{i}", item.token_ids, hash_block_tokens(item.token_ids, 16), greedy(item.max_tokens)
        )
        async for chunk in decode.generate(call):
            rec.token_times.extend([time.perf_counter()] * len(chunk.token_ids))
        return rec

    async def main() -> tuple[list[SimRecord], float]:
        start = time.perf_counter()
        recs = await asyncio.gather(*(one(i, start) for i in range(NUM)))
        return list(recs), time.perf_counter() - start

    return asyncio.run(main())


def test_predictions_are_within_25_percent_of_real_workers() -> None:
    """Measured twice at most: on a shared machine another job can take the cores between the
    profile and the run (the profile then describes another machine); both runs are shown."""
    runs = []
    for _ in range(2):
        bad, shown = _check()
        runs.append(shown)
        if not bad:
            return
    raise AssertionError(f"predictions off by more than 25%: {bad} (every attempt: {runs})")


def _check() -> tuple[dict[str, float], dict[str, float]]:
    cfg = _config()
    steps = {"1": _steps(cfg)}
    transfer = TransferCost(0.0005, 1e9)
    arms = {
        "colocated": ArmSpec("colocated", 0, 1, cfg, "loopback"),
        "1P1D": ArmSpec("1P1D", 1, 1, cfg, "loopback"),
    }
    probe = WORK.items(12, 500, seed=1)
    measured: dict[str, Any] = {}
    serving = {}
    for name, arm in arms.items():
        prefill = PrefillWorker(cfg).start() if arm.prefill else None
        decode = DecodeWorker(cfg, InProcessPrefill(prefill) if prefill else None).start()
        try:
            kind = "remote" if prefill else "local"
            serving[kind], _ = calibrate(
                kind, _unloaded(decode, probe[:6]), steps, cfg, transfer, 4096
            )
            measured[name] = _measure(decode)
            decode.engine.check_integrity()
        finally:
            decode.close()
            if prefill is not None:
                prefill.close()
    profile = Profile(
        device={"kind": "fake"},
        model={"block_size": 16, "bytes_per_block": 4096},
        steps=steps,
        transfer={"loopback": transfer},
        serving=serving,
    )
    base = {a: unloaded_baseline(simulate_unloaded(s, profile, probe)) for a, s in arms.items()}
    slos = SLOs.from_unloaded(
        {c: tuple(max(b[c][i] for b in base.values()) for i in range(2)) for c in ("chat", "long")},
        3.0,
        2.0,
    )
    errors: dict[str, float] = {}
    for name, arm in arms.items():
        sim_recs, sim_dur = simulate(arm, profile, WORK, RATE, NUM, SEED, 500)
        got = slo_metrics(*measured[name], slos)
        predicted = slo_metrics(sim_recs, sim_dur, slos)
        assert got["completed"] == predicted["completed"] == NUM
        for key, q in FIGURES:
            errors[f"{name} {key} {q}"] = predicted[key][q] / got[key][q] - 1
        errors[f"{name} goodput"] = predicted["goodput"] / got["goodput"] - 1
        for cls in ("chat", "long"):  # shown when the assertion fails
            for key in ("ttft_s", "tpot_s"):
                errors[f"({name} {cls} {key} p50 {got['by_class'][cls][key]['p50']:.3f})"] = (
                    predicted["by_class"][cls][key]["p50"] / got["by_class"][cls][key]["p50"] - 1
                )
    bad = {k: round(v, 3) for k, v in errors.items() if abs(v) > 0.25 and k[0] != "("}
    return bad, {k: round(v, 3) for k, v in errors.items()}
