"""One Ray Serve autoscaling policy per pool, over the signals its replicas report.

Two layers:

* Pure decisions (``prefill_decision``, ``decode_decision``, ``decide``) over per-replica metric
  snapshots (``serving.signals`` keys): no Ray, no clock, unit-tested directly.
* Ray adapters (``PrefillPolicy``, ``DecodePolicy``): callable classes that Ray Serve's
  controller instantiates once per deployment with ``policy_kwargs`` (the pool's
  ``autoscaling`` config section) and calls every control-loop tick with an
  ``AutoscalingContext``. They are classes because Ray forwards ``policy_kwargs`` only to a
  class; a plain policy function never receives them.

Each signal becomes a utilization, 1.0 meaning "at its target":

* additive load (KV use, sequences over ``max_num_seqs``, queued prefill tokens): the pool's
  total divided by ``running replicas x per-replica target``; a replica that has not reported
  yet counts as empty, which is what a fresh replica is;
* latency (TTFT, TPOT): the mean over the replicas with recent samples divided by the SLO.

Rules: scale up when any utilization exceeds 1 (to ``ceil(running x utilization)``, as Ray's
default policy does with ongoing requests); hold while the largest one is between
``scale_down_ratio`` and 1 (hysteresis); scale down only when every one is below
``scale_down_ratio`` (to ``ceil(running x utilization)``, so the remaining replicas stay at or
below the target). The result lies in ``[min_replicas, max_replicas]``, never shrinks under
pressure nor grows while calm.

What Ray does with the result (checked in ray 2.60, ``ray.serve.autoscaling_policy``): it wraps
every custom policy with ``_apply_autoscaling_config``, which applies ``upscaling_factor`` /
``downscaling_factor``, the ``upscale_delay_s`` / ``downscale_delay_s`` timers (the recommendation
must point the same way for the whole delay, wall-clock), and the min/max bounds. So the delays
and smoothing of the pool's config are mapped onto those Ray fields
(``serving.options``) rather than re-implemented here.

Draining: Ray stops a replica gracefully (no new requests, open calls finish, up to
``graceful_shutdown_timeout_s``). A prefill replica's stream stays open while its KV is leased,
so a draining prefill replica keeps its leases until they are pulled or expire; the config
enforces ``graceful_shutdown_timeout_s > transfer.lease_s``. Leases are reported for
visibility, not used as a scaling signal.

Visibility: the policy state (``POLICY_STATE_KEY``) holds the last recommendation, its reason,
the utilizations, counts of the scale decisions Ray applied (seen as changes of the target
between ticks) and the last few of them with their reasons; each applied decision is logged on
the Serve controller and counted in ``pdserve_autoscaling_decisions`` (exported
``ray_pdserve_autoscaling_decisions_total``).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cluster.config import PoolScalingConfig
from cluster.serving import signals as keys

logger = logging.getLogger("ray.serve")

POLICY_STATE_KEY = "pdserve"
HISTORY = 8  # applied decisions kept in the policy state
_EPS = 1e-9  # 5 x (0.98 / 0.7) is 7.000000000000001 in floats: 7 replicas, not 8


@dataclass(frozen=True)
class Decision:
    """A recommendation: ``desired`` replicas, which way, why, and the signals behind it."""

    desired: int
    action: str  # "up" | "down" | "hold"
    reason: str
    utilization: dict[str, float] = field(default_factory=dict)


def decide(
    utilization: Mapping[str, float],
    *,
    num_running: int,
    current_target: int,
    min_replicas: int,
    max_replicas: int,
    scale_down_ratio: float,
) -> Decision:
    """Desired replicas from utilizations (1.0 = at target) of ``num_running`` replicas."""
    util = {k: round(v, 4) for k, v in utilization.items()}

    def bounded(n: int) -> int:
        return max(min_replicas, min(max_replicas, n))

    if num_running <= 0 or not utilization:
        # Nothing running (Ray's cold start handles 0 -> 1) or nothing reported yet.
        why = "no replica running" if num_running <= 0 else "no metrics reported yet"
        return Decision(bounded(current_target), "hold", why, util)
    name, peak = max(utilization.items(), key=lambda kv: kv[1])
    proportional = math.ceil(num_running * peak - _EPS)
    if peak > 1.0:
        desired = bounded(max(current_target, proportional))
        action = "up" if desired > current_target else "hold"
        reason = f"{name} at {peak:.2f}x target"
        if action == "hold":
            reason += " (at max_replicas)" if desired >= max_replicas else " (scale-up under way)"
        return Decision(desired, action, reason, util)
    if peak < scale_down_ratio:
        desired = bounded(min(current_target, proportional))
        action = "down" if desired < current_target else "hold"
        reason = f"every signal below {scale_down_ratio:g}x target (max {name} {peak:.2f}x)"
        if action == "hold":
            reason += " (at min_replicas)" if desired <= min_replicas else ""
        return Decision(desired, action, reason, util)
    return Decision(
        bounded(current_target), "hold", f"{name} at {peak:.2f}x target: within band", util
    )


def _additive(reports: Sequence[Mapping[str, float]], key: str) -> float:
    return sum(r.get(key, 0.0) for r in reports)


def _mean_present(reports: Sequence[Mapping[str, float]], key: str) -> float | None:
    values = [r[key] for r in reports if key in r]
    return sum(values) / len(values) if values else None


def prefill_utilization(
    reports: Sequence[Mapping[str, float]], num_running: int, cfg: PoolScalingConfig
) -> dict[str, float]:
    """Queued prefill tokens per replica vs its target; recent TTFT vs the SLO."""
    if not reports or num_running <= 0:
        return {}
    n = max(num_running, len(reports))
    util = {
        "queued_prefill_tokens": _additive(reports, keys.QUEUED_PREFILL_TOKENS)
        / (n * cfg.target_queued_prefill_tokens)
    }
    ttft = _mean_present(reports, keys.TTFT_MS)
    if ttft is not None:
        util["ttft"] = ttft / cfg.ttft_slo_ms
    return util


def decode_utilization(
    reports: Sequence[Mapping[str, float]], num_running: int, cfg: PoolScalingConfig
) -> dict[str, float]:
    """KV use vs ``target_kv_usage``; sequences (running + waiting) over ``max_num_seqs`` vs
    ``target_running_fraction``; recent TPOT vs the SLO."""
    if not reports or num_running <= 0:
        return {}
    n = max(num_running, len(reports))
    seqs = sum(
        (r.get(keys.RUNNING, 0.0) + r.get(keys.WAITING, 0.0)) / r[keys.MAX_NUM_SEQS]
        for r in reports
        if r.get(keys.MAX_NUM_SEQS, 0.0) > 0
    )
    util = {
        "kv_usage": _additive(reports, keys.KV_USAGE) / (n * cfg.target_kv_usage),
        "running_fraction": seqs / (n * cfg.target_running_fraction),
    }
    tpot = _mean_present(reports, keys.TPOT_MS)
    if tpot is not None:
        util["tpot"] = tpot / cfg.tpot_slo_ms
    return util


Utilization = Callable[[Sequence[Mapping[str, float]], int, PoolScalingConfig], dict[str, float]]


def _pool_decision(
    utilization: Utilization,
    reports: Sequence[Mapping[str, float]],
    *,
    num_running: int,
    current_target: int,
    cfg: PoolScalingConfig,
    min_replicas: int | None = None,
    max_replicas: int | None = None,
) -> Decision:
    return decide(
        utilization(reports, num_running, cfg),
        num_running=num_running,
        current_target=current_target,
        min_replicas=cfg.min_replicas if min_replicas is None else min_replicas,
        max_replicas=cfg.max_replicas if max_replicas is None else max_replicas,
        scale_down_ratio=cfg.scale_down_ratio,
    )


# (reports, *, num_running, current_target, cfg, min_replicas=None, max_replicas=None) -> Decision
prefill_decision = functools.partial(_pool_decision, prefill_utilization)
decode_decision = functools.partial(_pool_decision, decode_utilization)


def replica_reports(
    aggregated: Mapping[str, Mapping[Any, float]] | None, running: Iterable[Any] | None = None
) -> list[dict[str, float]]:
    """``{metric: {replica: value}}`` (Ray's ``aggregated_metrics``) -> one dict per replica,
    pdserve's keys only, restricted to ``running`` replicas when given."""
    allowed = set(running) if running is not None else None
    per_replica: dict[Any, dict[str, float]] = {}
    for name, by_replica in (aggregated or {}).items():
        if not name.startswith("pd_"):
            continue  # Ray's own series (running_requests) share the report
        for replica, value in by_replica.items():
            if allowed is not None and replica not in allowed:
                continue
            if value is not None and math.isfinite(value):
                per_replica.setdefault(replica, {})[name] = float(value)
    return list(per_replica.values())


# -- the Ray adapters ------------------------------------------------------------------------


class _PoolPolicy:
    pool = ""

    def __init__(self, **section: Any) -> None:
        # policy_kwargs are the pool's `autoscaling` section (JSON values), validated again here.
        self.cfg = PoolScalingConfig(**section)
        self.cfg._validate(self.pool)
        self._counter: Any = None
        try:
            from ray.util import metrics as rm

            self._counter = rm.Counter(
                "pdserve_autoscaling_decisions",
                "Scale decisions applied by Ray Serve under pdserve's policy, by direction.",
                ("pool", "direction"),
            )
        except Exception:  # metrics must never break autoscaling
            logger.debug("pdserve autoscaling: no decision counter", exc_info=True)

    def decide(self, reports: list[dict[str, float]], ctx: Any) -> Decision:
        decision = prefill_decision if self.pool == "prefill" else decode_decision
        return decision(
            reports,
            num_running=ctx.current_num_replicas,
            current_target=ctx.target_num_replicas,
            cfg=self.cfg,
            min_replicas=ctx.capacity_adjusted_min_replicas,
            max_replicas=ctx.capacity_adjusted_max_replicas,
        )

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        try:
            reports = replica_reports(ctx.aggregated_metrics, ctx.running_replicas)
            decision = self.decide(reports, ctx)
        except Exception as e:  # a broken tick holds the pool where it is
            logger.exception("pdserve %s autoscaling policy failed; holding", self.pool)
            decision = Decision(ctx.target_num_replicas, "hold", f"policy error: {e}")
        return decision.desired, {POLICY_STATE_KEY: self._track(ctx, decision)}

    def _track(self, ctx: Any, decision: Decision) -> dict[str, Any]:
        prev = dict((ctx.policy_state or {}).get(POLICY_STATE_KEY) or {})
        state: dict[str, Any] = {
            "pool": self.pool,
            "scale_ups": prev.get("scale_ups", 0),
            "scale_downs": prev.get("scale_downs", 0),
            "last_decision": prev.get("last_decision"),
            "history": list(prev.get("history") or []),
        }
        last_target = prev.get("target")
        if last_target is not None and ctx.target_num_replicas != last_target:
            direction = "up" if ctx.target_num_replicas > last_target else "down"
            state["scale_ups" if direction == "up" else "scale_downs"] += 1
            state["last_decision"] = {
                "direction": direction,
                "from": last_target,
                "to": ctx.target_num_replicas,
                "time": ctx.current_time,
                "reason": prev.get("reason", ""),
            }
            state["history"] = [*state["history"], state["last_decision"]][-HISTORY:]
            logger.info(
                "pdserve autoscaling: %s pool %s %d -> %d (%s)",
                self.pool,
                direction,
                last_target,
                ctx.target_num_replicas,
                prev.get("reason", ""),
            )
            if self._counter is not None:
                try:
                    self._counter.inc(1, {"pool": self.pool, "direction": direction})
                except Exception:
                    logger.debug("pdserve autoscaling: counting failed", exc_info=True)
        if decision.action != prev.get("action") and decision.action != "hold":
            logger.info(
                "pdserve autoscaling: %s pool recommends %d (target %d, %d running): %s",
                self.pool,
                decision.desired,
                ctx.target_num_replicas,
                ctx.current_num_replicas,
                decision.reason,
            )
        state.update(
            target=ctx.target_num_replicas,
            running=ctx.current_num_replicas,
            desired=decision.desired,
            action=decision.action,
            reason=decision.reason,
            utilization=decision.utilization,
        )
        return state


class PrefillPolicy(_PoolPolicy):
    """``cluster.serving.autoscaling:PrefillPolicy``: queued prefill tokens and TTFT."""

    pool = "prefill"


class DecodePolicy(_PoolPolicy):
    """``cluster.serving.autoscaling:DecodePolicy``: KV use, sequences and TPOT."""

    pool = "decode"
