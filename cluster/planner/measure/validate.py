"""``pdserve plan --validate``: the planner's predictions against what the serving arms measure.

For 3 workload mixes (``mixed-long``, ``chat-heavy``, ``long-heavy``: the same two request classes
in other shares) at one rate each, and the arms that fit on this machine (``bench serve``'s
``disagg`` 1P1D, ``colocated``, ``colocated_chunked``, with the same configs, deployed side by
side once: ``cluster.planner.measure.arms``), the same seeded requests are
  * simulated (``cluster.planner``) on this machine's profile (measured first with ``pdserve
    profile --quick`` unless ``--profile`` names one), its serving section re-calibrated per arm
    from this deployment's own unloaded requests and bursts (``BURST`` short ones at once, a
    long prompt while they decode; every arm deployed, as it is measured): some of each before
    every mix, each time other prompts, and every calibrated figure a median over all of them,
    and
  * sent to the arms over gRPC (``bench serve``'s load generator and interleaving),
and the predicted p50/p90 TTFT, p50/p90 TPOT and goodput are compared with the measured ones
(goodput against the per-class SLOs ``bench serve`` sets from the measured unloaded runs, the
same bounds for both). The check passes when every figure is within 25%.

Each row also has ``sampling_%``: the half-width of the measured figure's 90% bootstrap
interval (its run's requests resampled), as a % of it. A figure whose interval is wider than
the tolerance can miss it with a perfect model; ``resolvable_25pct`` is the share that could not.
``exact_model_pass_p`` goes one step further: the chance that a model predicting every figure's
true value exactly still passes the whole check, given how far each run's own requests let its
measured figures stray (per run, the share of its bootstrap resamples in which all five figures
stay within the tolerance of the run's figures; the runs multiplied, as independent draws). Far
below 1, the check cannot tell a good model from a bad one at this many requests.

Per mix and arm the JSON also has ``loaded_prefill_scale``: the median, over the loaded run's
requests of at least ``LONG_PROMPT`` tokens (none cached), of the prefill compute their engine
reported over the bare engine's time for the prompt alone; beside it the arm's calibrated
``prefill_scale``, which comes from unloaded requests. A loaded replica whose prompts prefill
faster than the calibration says shows up here (each step of theirs also holds the batch's
decodes, so a figure below the calibrated one is the stronger for it).

Each mix draws its own requests (``mix_seed``). With one seed for all three,
``chat-heavy``'s first 16 prompts were ``mixed-long``'s, already in the arms' prefix caches
from the run before, while the simulation started cold.

Last line: ``RESULT plan-check within_25pct=<share of figures> max_error=<largest |error|>
resolvable_25pct=<share> exact_model_pass_p=<probability> passed=<0|1>``; the JSON
(``bench/results/plan-check.json``) has every figure and each run's ``exact_pass``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from cluster.config import ClusterConfig
from cluster.planner.calibration import (
    BURST,
    burst_samples,
    calibrate,
    predicted_prefill,
    prefill_costs,
    serving_samples,
)
from cluster.planner.cli import print_table
from cluster.planner.measure.arms import ARMS, ArmRecords, arm_config, class_slos, measure
from cluster.planner.measure.deploy import local_apps
from cluster.planner.measure.engine import model_dir
from cluster.planner.measure.load import compute_metrics
from cluster.planner.measure.machine import StealMeter
from cluster.planner.measure.profiler import run_profile
from cluster.planner.metrics import slo_metrics
from cluster.planner.plan import simulate
from cluster.planner.profile import Profile, ServingCost, StepCosts
from cluster.planner.simulator import ArmSpec
from cluster.planner.workload import WORKLOADS, SLOs, percentile

MIXES = {"mixed-long": 0.5, "chat-heavy": 0.75, "long-heavy": 0.3}
FIGURES = (
    ("ttft_p50", "ttft_s", "p50"),
    ("ttft_p90", "ttft_s", "p90"),
    ("tpot_p50", "tpot_s", "p50"),
    ("tpot_p90", "tpot_s", "p90"),
    ("goodput", "goodput", ""),
)
TOLERANCE = 0.25
LONG_PROMPT = 512  # prompts this long spend far more on their prefill than on the decodes beside it
BOOTSTRAP = 200  # resamples behind each measured figure's sampling interval
_MODES = {"full": 0, "quick": 1, "smoke": 2}


def mix_seed(index: int) -> int:
    """The seed of the ``index``-th mix's requests: each mix its own prompts, none of them in
    the prefix cache another mix's run filled."""
    return 100 + 1000 * index


def _figure(m: dict[str, Any], key: str, sub: str) -> float:
    return float(m[key][sub] if sub else m[key])


def relative_error(predicted: float, measured: float) -> float:
    """``predicted / measured - 1``; 0 where both are 0, inf where only ``measured`` is."""
    if measured:
        return predicted / measured - 1
    return 0.0 if predicted == measured else math.inf


def loaded_prefill_scale(records: list[Any], costs: StepCosts, chunk: int | None) -> float | None:
    """Median over ``records`` (served, ``LONG_PROMPT`` tokens or more, none from a prefix cache)
    of the prefill compute the engine reported over ``predicted_prefill`` for the prompt alone;
    None without such a request."""
    ratios = [
        r.phases["prefill_ms"] / 1000 / predicted_prefill(costs, r.prompt_len, chunk)
        for r in records
        if r.ok
        and r.prompt_len >= LONG_PROMPT
        and not r.cached_tokens
        and r.phases.get("prefill_ms", 0) > 0
    ]
    return statistics.median(ratios) if ratios else None


@dataclasses.dataclass(frozen=True)
class Sampling:
    """What a run's own requests leave open about its measured figures (``_sampling``)."""

    spread_pct: dict[str, float]  # per figure: half-width of its 90% interval, % of it
    exact_pass: float  # share of resamples in which an exact model passes all figures


class _Check:
    """One ``--validate`` run: its mode's sizes, and progress lines on stderr."""

    def __init__(self, mode: str) -> None:
        if mode not in _MODES:
            raise ValueError(f"mode: unknown {mode!r}; valid: {', '.join(_MODES)}")
        self.mode = mode
        self.started = time.monotonic()

    def pick(self, full: Any, quick: Any, smoke: Any) -> Any:
        return (full, quick, smoke)[_MODES[self.mode]]

    def progress(self, message: str) -> None:
        elapsed = time.monotonic() - self.started
        print(f"[plan-check {elapsed:7.1f}s] {message}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class _Measured:
    """The arms' runs of every mix, and the calibration samples pooled over the mixes."""

    mixes: list[tuple[str, float, int, ArmRecords]] = dataclasses.field(default_factory=list)
    unloaded: dict[str, list[Any]] = dataclasses.field(default_factory=dict)
    bursts: dict[str, list[list[Any]]] = dataclasses.field(default_factory=dict)
    steal: list[float] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class _Setup:
    """What every mix shares: the arms' configs and specs, and the requests' shape."""

    configs: dict[str, Any]
    specs: dict[str, ArmSpec]
    vocab: int
    per_rate: int
    scale: float


def _profile(
    check: _Check, config: ClusterConfig, profile_path: Path | None, out: Path
) -> tuple[Profile, Path, float | None]:
    """The profile (measured first into ``out`` unless given) and the hypervisor's share of
    the cores while it was measured (None: measured elsewhere, or unknown)."""
    if profile_path is not None:
        return Profile.load(profile_path), profile_path, None  # measured elsewhere, another time
    profile_path = out / "profile.json"
    check.progress(f"measuring this machine's profile into {profile_path}")
    meter = StealMeter()
    mode = "quick" if check.mode != "smoke" else "smoke"
    run_profile(config, mode, profile_path, progress=check.progress)
    steal = meter.share()
    if steal is not None:
        check.progress(f"profile: the hypervisor took {100 * steal:.1f}% of core time")
    return Profile.load(profile_path), profile_path, steal


def _setup(check: _Check, config: ClusterConfig, profile: Profile, model: str) -> _Setup:
    from cluster.config.model_paths import model_limits

    total = check.pick(1400, 1400, 256)
    configs = {arm: arm_config(config, arm, total, model) for arm in ARMS}
    transport = next(t for t in configs["disagg"].transfer.transports if t in profile.transfer)
    specs = {
        arm: ArmSpec(
            arm, ARMS[arm]["prefill.num_replicas"], ARMS[arm]["decode.num_replicas"], cfg, transport
        )
        for arm, cfg in configs.items()
    }
    return _Setup(
        configs,
        specs,
        model_limits(configs["disagg"]).vocab_size,
        check.pick(40, 24, 6),
        check.pick(1.0, 1.0, 0.05),
    )


def _measure_mixes(check: _Check, setup: _Setup) -> _Measured:
    """Every mix sent to the arms, deployed side by side once; calibration samples pooled."""
    # --smoke checks the harness on the tiny model (its figures mean nothing): its six requests
    # arrive at four times the mix's rate, within seconds.
    rate_x = check.pick(1.0, 1.0, 4.0)
    mixes = list(MIXES.items()) if check.mode != "smoke" else list(MIXES.items())[:1]
    got = _Measured(unloaded={arm: [] for arm in setup.specs}, bursts={a: [] for a in setup.specs})
    with local_apps() as put:
        for i, (name, mix_rate) in enumerate(mixes):
            rate = mix_rate * rate_x
            runs = measure(
                put,
                setup.configs,
                WORKLOADS[name],
                [rate],
                setup.per_rate,
                # Unloaded requests and a burst before every mix, each its own prompts: the
                # calibration and the SLOs take medians over all of them: one mix's few
                # samples per class, taken at one moment, moved an arm's calibration
                # several-fold between runs.
                per_class=check.pick(4, 3, 1),
                vocab=setup.vocab,
                scale=setup.scale,
                progress=check.progress,
                deploy=i == 0,
                seed=mix_seed(i),
                burst=check.pick(BURST, BURST, 2),
                sample_seed=2 * i,
            )
            for arm in setup.specs:
                got.unloaded[arm] += runs.unloaded[arm]
                if arm in runs.burst:
                    got.bursts[arm].append(runs.burst[arm])
            if runs.baseline_steal is not None:
                got.steal.append(runs.baseline_steal)
            got.mixes.append((name, rate, mix_seed(i), runs))
    return got


@dataclasses.dataclass
class _Comparison:
    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    exact_pass: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    loaded_prefill: dict[str, dict[str, float | None]] = dataclasses.field(default_factory=dict)


def _compare_arm(
    check: _Check,
    setup: _Setup,
    profile: Profile,
    calibrated: tuple[Profile, ServingCost],
    run: tuple[str, float, int, ArmRecords, str],
    slos: SLOs,
    rng: random.Random,
    cmp: _Comparison,
) -> None:
    """One mix on one arm: the simulation on the calibrated profile against the loaded run."""
    name, rate, seed, runs, arm = run
    arm_profile, serving = calibrated
    spec = setup.specs[arm]
    recs, dur = runs.loaded[arm][rate]
    measured = compute_metrics(recs, dur, slos=slos)
    sampling = _sampling(recs, dur, slos, measured, rng)
    cmp.exact_pass.setdefault(name, {})[arm] = sampling.exact_pass
    kind = "local" if spec.colocated else "remote"
    loaded = loaded_prefill_scale(recs, *prefill_costs(kind, profile.steps, spec.config))
    cmp.loaded_prefill.setdefault(name, {})[arm] = loaded
    sim, sim_dur = simulate(
        spec, arm_profile, WORKLOADS[name], rate, setup.per_rate, seed, setup.vocab, setup.scale
    )
    predicted = slo_metrics(sim, sim_dur, slos)
    stolen = runs.steal.get(arm, {}).get(rate)  # the hypervisor's share, that run
    for label, key, sub in FIGURES:
        p, m = _figure(predicted, key, sub), _figure(measured, key, sub)
        cmp.rows.append(
            {
                "mix": name,
                "rate": rate,
                "arm": arm,
                "figure": label,
                "predicted": p,
                "measured": m,
                "error_%": 100 * relative_error(p, m),
                "sampling_%": sampling.spread_pct[label],
                "steal_%": None if stolen is None else 100 * stolen,
            }
        )
    check.progress(
        f"{name} {arm}: "
        + ", ".join(f"{r['figure']} {r['error_%']:+.0f}%" for r in cmp.rows[-len(FIGURES) :])
        + (
            f"; long prompts prefilled at {loaded:.2f}x the bare engine under load "
            f"(calibrated: {serving.prefill_scale:.2f}x)"
            if loaded is not None
            else ""
        )
    )


def _write(out: Path, payload: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan-check.json").write_text(json.dumps(payload, indent=2))
    print(f"wrote {out / 'plan-check.json'}", file=sys.stderr)


def run_check(config: ClusterConfig, mode: str, profile_path: Path | None, out: Path) -> int:
    """The check (``mode``: full, quick or smoke); 0 when it passed (always in smoke)."""
    check = _Check(mode)
    model = str(model_dir(config, mode))
    config = config.replace({"model.path": model})
    profile, profile_path, profile_steal = _profile(check, config, profile_path, out)
    setup = _setup(check, config, profile, model)
    got = _measure_mixes(check, setup)
    baseline_steal = statistics.mean(got.steal) if got.steal else None
    if baseline_steal is not None:
        check.progress(f"calibration: the hypervisor took {100 * baseline_steal:.1f}%")
    slos = class_slos(got.unloaded)
    arm_profiles, serving, calibration = _calibrated(profile, setup.specs, got.unloaded, got.bursts)
    for arm, cost in serving.items():
        check.progress(f"serving {arm} (this deployment): {cost}")
    rng = random.Random(0)
    cmp = _Comparison()
    for name, rate, seed, runs in got.mixes:
        for arm in setup.specs:
            calibrated = (arm_profiles[arm], serving[arm])
            run = (name, rate, seed, runs, arm)
            _compare_arm(check, setup, profile, calibrated, run, slos, rng, cmp)
    rows = cmp.rows
    print_table(rows)
    errors = [abs(r["error_%"]) / 100 for r in rows]
    within = sum(1 for e in errors if e <= TOLERANCE) / len(errors)
    passed = within == 1.0
    # How many figures this run could pin down to the tolerance at all: a figure whose own
    # sampling interval is wider than +-25% can miss with a perfect model.
    resolvable = sum(1 for r in rows if r["sampling_%"] <= 100 * TOLERANCE) / len(rows)
    exact_p = math.prod(p for by_arm in cmp.exact_pass.values() for p in by_arm.values())
    _write(
        out,
        {
            "mode": mode,
            "profile": str(profile_path),
            "tolerance": TOLERANCE,
            "slos": slos.to_dict() if slos else {},
            "serving": {arm: vars(cost) for arm, cost in serving.items()},
            "calibration": calibration,  # the samples behind each arm's serving section
            # The hypervisor's share of the cores' time while the profile and the calibration
            # were measured (each row has its own run's): a figure from a stretch with much of
            # it moves.
            "steal_%": {
                "profile": None if profile_steal is None else 100 * profile_steal,
                "calibration": None if baseline_steal is None else 100 * baseline_steal,
            },
            "profile_serving": {kind: vars(cost) for kind, cost in profile.serving.items()},
            "rows": rows,
            "within_25pct": within,
            "resolvable_25pct": resolvable,
            "exact_pass": cmp.exact_pass,  # per mix and arm (see the module's docstring)
            "exact_model_pass_p": exact_p,
            # per mix and arm, beside each arm's calibrated prefill_scale (module docstring)
            "loaded_prefill_scale": cmp.loaded_prefill,
            "max_error": max(errors),
            "passed": passed,
        },
    )
    print(
        f"RESULT plan-check within_25pct={within:.3g} max_error={max(errors):.3g} "
        f"resolvable_25pct={resolvable:.3g} exact_model_pass_p={exact_p:.3g} "
        f"passed={int(passed)}",
        flush=True,
    )
    return 0 if passed or mode == "smoke" else 1


def _sampling(
    records: list[Any],
    duration_s: float,
    slos: SLOs,
    measured: dict[str, Any],
    rng: random.Random,
) -> Sampling:
    """The run's requests resampled with replacement, ``BOOTSTRAP`` times, each resample's
    figures computed as the run's were. Per figure, the half-width of the 90% interval of the
    resampled values, as a % of the measured value: how far the same run with other draws of
    its own requests could have landed. And the share of resamples in which a model that
    predicts the run's figures exactly would be within ``TOLERANCE`` of every resampled figure
    (the bootstrap's stand-in for an exact model against one run). Both hold sampling only, not
    the machine's drift between runs."""
    draws: list[dict[str, float]] = []
    for _ in range(BOOTSTRAP):
        sample = rng.choices(records, k=len(records))
        m = compute_metrics(sample, duration_s, slos=slos)
        draws.append({label: _figure(m, key, sub) for label, key, sub in FIGURES})
    truth = {label: _figure(measured, key, sub) for label, key, sub in FIGURES}
    spread = {}
    for label, value in truth.items():
        xs = sorted(x for d in draws if not math.isnan(x := d[label]))
        if not xs or not value or math.isnan(value):
            spread[label] = math.inf
            continue
        lo, hi = percentile(xs, 5), percentile(xs, 95)
        spread[label] = 100 * (hi - lo) / 2 / abs(value)
    # A NaN on either side (no request with two tokens) is not a pass: the check fails on it.
    passes = sum(
        all(abs(relative_error(truth[label], d[label])) <= TOLERANCE for label in truth)
        for d in draws
    )
    return Sampling(spread, passes / len(draws) if draws else 0.0)


def _calibrated(
    profile: Profile,
    specs: dict[str, ArmSpec],
    unloaded: dict[str, list[Any]],
    bursts: dict[str, list[list[Any]]],
) -> tuple[dict[str, Profile], dict[str, ServingCost], dict[str, Any]]:
    """Per arm, the profile with its serving section calibrated on this deployment's unloaded
    requests and burst (all arms deployed side by side, as they are measured), not on the separate
    two-arm deployment ``pdserve profile`` measures: the stack's cost around the engine depends
    on what else is deployed on the machine. Step and transfer costs stay the profile's."""
    profiles, costs, raws = {}, {}, {}
    for arm, spec in specs.items():
        kind = "local" if spec.colocated else "remote"
        transfer = None if spec.colocated else profile.transfer_cost(spec.transport)
        costs[arm], raws[arm] = calibrate(
            kind,
            serving_samples(unloaded[arm]),
            profile.steps,
            spec.config,
            transfer,
            profile.bytes_per_block,
            [burst_samples(b) for b in bursts.get(arm, [])],
        )
        profiles[arm] = dataclasses.replace(profile, serving={kind: costs[arm]})
    return profiles, costs, raws
