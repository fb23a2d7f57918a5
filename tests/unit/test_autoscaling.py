"""Autoscaling policies: pure decisions over metric snapshots, the Ray adapters under Ray's own
wrapper (delays, factors, bounds), the config -> Ray ``AutoscalingConfig`` mapping, and the
replica-side signals."""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import pytest
from ray.serve.config import AutoscalingConfig as RayAutoscalingConfig
from ray.serve.config import AutoscalingContext

from cluster.config import PoolScalingConfig
from cluster.serving import signals as k
from cluster.serving.autoscaling import (
    POLICY_STATE_KEY,
    DecodePolicy,
    PrefillPolicy,
    decide,
    decode_decision,
    prefill_decision,
    replica_reports,
)
from cluster.serving.options import AUTOSCALING_POLICIES, deployment_options
from tests.helpers import make_config

CFG = PoolScalingConfig(
    enabled=True,
    min_replicas=1,
    max_replicas=4,
    scale_down_ratio=0.5,
    target_kv_usage=0.6,
    target_running_fraction=0.75,
    tpot_slo_ms=100.0,
    ttft_slo_ms=1000.0,
    target_queued_prefill_tokens=1000,
)


def dec(reports: list[dict[str, float]], running: int = 1, target: int | None = None) -> Any:
    return decode_decision(
        reports, num_running=running, current_target=running if target is None else target, cfg=CFG
    )


def pre(reports: list[dict[str, float]], running: int = 1, target: int | None = None) -> Any:
    return prefill_decision(
        reports, num_running=running, current_target=running if target is None else target, cfg=CFG
    )


def d_rep(kv: float = 0.0, running: int = 0, waiting: int = 0, **extra: float) -> dict[str, float]:
    return {k.KV_USAGE: kv, k.RUNNING: running, k.WAITING: waiting, k.MAX_NUM_SEQS: 8, **extra}


def p_rep(queued: float = 0.0, **extra: float) -> dict[str, float]:
    return {k.QUEUED_PREFILL_TOKENS: queued, k.RUNNING: 0, k.ACTIVE_LEASES: 0, **extra}


# -- pure decisions ----------------------------------------------------------------------------


def test_decode_scales_up_on_each_signal_alone() -> None:
    kv = dec([d_rep(kv=0.9)])  # 0.9 / 0.6 = 1.5x
    assert (kv.action, kv.desired) == ("up", 2) and "kv_usage" in kv.reason
    seqs = dec([d_rep(running=6, waiting=4)])  # 10/8 / 0.75 = 1.67x
    assert (seqs.action, seqs.desired) == ("up", 2) and "running_fraction" in seqs.reason
    tpot = dec([d_rep(**{k.TPOT_MS: 250.0})])  # 2.5x the SLO
    assert (tpot.action, tpot.desired) == ("up", 3) and "tpot" in tpot.reason


def test_prefill_scales_up_on_each_signal_alone() -> None:
    queued = pre([p_rep(queued=2500)], running=1)  # 2.5x the per-replica target
    assert (queued.action, queued.desired) == ("up", 3) and "queued" in queued.reason
    ttft = pre([p_rep(**{k.TTFT_MS: 1500.0})], running=1)
    assert (ttft.action, ttft.desired) == ("up", 2) and "ttft" in ttft.reason


def test_scale_up_is_proportional_over_the_pool() -> None:
    # Two replicas, 1.8 x 0.6 of KV in all: ceil(2 x 0.9/0.6) = 3.
    d = dec([d_rep(kv=0.9), d_rep(kv=0.9)], running=2)
    assert (d.action, d.desired) == ("up", 3)
    # A replica that has not reported yet counts as empty (a fresh one is): no overshoot.
    d = dec([d_rep(kv=0.9)], running=2)
    assert d.action == "hold" and d.desired == 2


def test_hold_inside_the_hysteresis_band() -> None:
    # 0.45 / 0.6 = 0.75x: above scale_down_ratio (0.5), below the target.
    d = dec([d_rep(kv=0.45), d_rep(kv=0.45)], running=2)
    assert (d.action, d.desired) == ("hold", 2) and "within band" in d.reason
    # One signal in the band holds even when the others are idle.
    d = dec([d_rep(kv=0.0, running=5), d_rep()], running=2)  # 5/16 / 0.75 = 0.42x ... below
    assert d.action == "down"
    d = dec([d_rep(kv=0.0, running=8), d_rep()], running=2)  # 8/16 / 0.75 = 0.67x: in band
    assert d.action == "hold"


def test_scale_down_only_when_every_signal_is_low_and_keeps_the_rest_under_target() -> None:
    d = dec([d_rep(kv=0.1), d_rep(kv=0.1), d_rep(kv=0.1)], running=3)  # 0.3/1.8 = 0.17x
    assert (d.action, d.desired) == ("down", 1)
    # 4 replicas at 0.25x: ceil(4 x 0.25) = 1 ... at 0.29x: ceil(1.17) = 2.
    d = dec([d_rep(kv=0.175)] * 4, running=4)
    assert (d.action, d.desired) == ("down", 2)
    # TPOT above the SLO blocks the scale-down even with idle KV.
    d = dec([d_rep(**{k.TPOT_MS: 60.0}), d_rep()], running=2)
    assert d.action == "hold"


def test_bounds_are_respected() -> None:
    d = dec([d_rep(kv=1.0, running=8, waiting=40)], running=3)
    assert d.desired == CFG.max_replicas and d.action == "up"
    at_max = dec([d_rep(kv=1.0)] * 4, running=4)
    assert (at_max.action, at_max.desired) == ("hold", 4) and "max_replicas" in at_max.reason
    idle = dec([d_rep(), d_rep()], running=2)
    assert (idle.action, idle.desired) == ("down", CFG.min_replicas)
    at_min = dec([d_rep()], running=1)
    assert (at_min.action, at_min.desired) == ("hold", 1)
    # Ray's capacity-adjusted bounds override the config's.
    d = decode_decision([d_rep(kv=1.0)], num_running=1, current_target=1, cfg=CFG, max_replicas=1)
    assert d.desired == 1
    zero = decode_decision([d_rep()], num_running=1, current_target=1, cfg=CFG, min_replicas=0)
    assert (zero.action, zero.desired) == ("down", 0)


def test_no_metrics_yet_or_nothing_running_holds() -> None:
    assert dec([], running=1).action == "hold"
    assert dec([], running=1).desired == 1
    d = dec([], running=0, target=1)
    assert (d.action, d.desired) == ("hold", 1) and "no replica" in d.reason
    assert pre([], running=2).desired == 2
    # No latency samples means no latency signal, not a latency of zero.
    assert "tpot" not in dec([d_rep()]).utilization
    # A scale-up under way (target above running) is not undone while the pressure lasts.
    d = dec([d_rep(kv=0.7)], running=1, target=3)
    assert (d.action, d.desired) == ("hold", 3)


def test_decide_rounding_at_exact_target() -> None:
    # 5 x (0.98 / 0.7) is 7.000000000000001 in floats: 7 replicas, not 8.
    d = decide(
        {"x": 0.98 / 0.7},
        num_running=5,
        current_target=5,
        min_replicas=1,
        max_replicas=16,
        scale_down_ratio=0.5,
    )
    assert (d.action, d.desired) == ("up", 7)


def test_replica_reports_keeps_pdserve_keys_of_running_replicas() -> None:
    agg = {
        "running_requests": {"a": 3.0, "b": 1.0},  # Ray's own series
        k.KV_USAGE: {"a": 0.5, "b": 0.1, "gone": 0.9},
        k.TPOT_MS: {"a": float("nan")},
    }
    reps = replica_reports(agg, running=["a", "b"])
    assert sorted(r[k.KV_USAGE] for r in reps) == [0.1, 0.5]
    assert all("running_requests" not in r and k.TPOT_MS not in r for r in reps)
    assert replica_reports(None) == [] and replica_reports({}) == []


# -- the Ray adapters under Ray's own wrapper -------------------------------------------------


def ray_config(**section: Any) -> RayAutoscalingConfig:
    cfg = make_config(**{f"decode.autoscaling.{key}": v for key, v in section.items()})
    return RayAutoscalingConfig(**deployment_options(cfg)["DecodeServer"]["autoscaling_config"])


class Driver:
    """Calls a policy the way Ray's controller does (ray 2.60): the class instantiated once with
    policy_kwargs, wrapped by ``_apply_autoscaling_config`` (factors, delays), then bounded; the
    target follows the decision, the policy state is carried between ticks."""

    def __init__(self, config: RayAutoscalingConfig, monkeypatch: pytest.MonkeyPatch) -> None:
        from ray.serve import autoscaling_policy
        from ray.serve._private.autoscaling_state import _resolve_policy_callable

        self.config = config
        self.now = 1000.0
        monkeypatch.setattr(autoscaling_policy, "time", types.SimpleNamespace(time=self.clock))
        self.instance = _resolve_policy_callable(config.policy)
        self.policy = autoscaling_policy._apply_autoscaling_config(self.instance)
        self.target = config.initial_replicas or config.min_replicas
        self.state: dict[str, Any] = {}

    def clock(self) -> float:
        return self.now

    def tick(self, at: float, kv: list[float], running: int | None = None) -> int:
        self.now = 1000.0 + at
        running = self.target if running is None else running
        names = [f"r{i}" for i in range(running)]
        agg = {k.KV_USAGE: dict(zip(names, kv)), k.MAX_NUM_SEQS: dict.fromkeys(names, 8.0)}
        ctx = AutoscalingContext(
            deployment_id=None,  # type: ignore[arg-type]
            deployment_name="DecodeServer",
            app_name="t",
            current_num_replicas=running,
            target_num_replicas=self.target,
            running_replicas=names,  # type: ignore[arg-type]
            total_num_requests=1.0,
            total_queued_requests=0.0,
            aggregated_metrics=agg,  # type: ignore[arg-type]
            raw_metrics={},
            capacity_adjusted_min_replicas=self.config.min_replicas,
            capacity_adjusted_max_replicas=self.config.max_replicas,
            policy_state=dict(self.state),
            last_scale_up_time=None,
            last_scale_down_time=None,
            current_time=self.now,
            config=self.config,
        )
        decision, self.state = self.policy(ctx)
        self.target = max(self.config.min_replicas, min(self.config.max_replicas, decision))
        return self.target

    @property
    def mine(self) -> dict[str, Any]:
        return dict(self.state[POLICY_STATE_KEY])


def test_ray_applies_the_upscale_delay_to_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    d = Driver(ray_config(enabled=True, upscale_delay_s=1.0, downscale_delay_s=2.0), monkeypatch)
    assert isinstance(d.instance, DecodePolicy) and d.instance.cfg.target_kv_usage == 0.75
    assert d.tick(0.0, [0.9]) == 1  # 1.2x the target: recommended 2, delay starts
    assert d.mine["action"] == "up" and d.mine["desired"] == 2
    assert d.tick(0.5, [0.9]) == 1
    assert d.tick(1.0, [0.9]) == 2  # pressure lasted upscale_delay_s
    d.tick(1.1, [0.9, 0.0])  # the policy sees the target move: one decision counted
    assert d.mine["scale_ups"] == 1 and d.mine["last_decision"]["to"] == 2
    assert "kv_usage" in d.mine["last_decision"]["reason"]
    assert d.mine["history"] == [d.mine["last_decision"]]


def test_ray_scales_down_only_after_the_downscale_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    d = Driver(
        ray_config(enabled=True, initial_replicas=2, upscale_delay_s=1.0, downscale_delay_s=2.0),
        monkeypatch,
    )
    assert d.tick(0.0, [0.0, 0.0]) == 2  # calm: recommended 1, delay starts
    assert d.mine["action"] == "down"
    assert d.tick(1.0, [0.0, 0.0]) == 2
    assert d.tick(1.9, [0.0, 0.0]) == 2  # not before the delay
    # A blip into the band resets the timer (Ray resets it when the recommendation holds).
    assert d.tick(1.95, [0.5, 0.5]) == 2
    assert d.tick(2.5, [0.0, 0.0]) == 2
    assert d.tick(4.4, [0.0, 0.0]) == 2
    assert d.tick(4.5, [0.0, 0.0]) == 1  # 2 s of calm since 2.5
    d.tick(4.6, [0.0], running=1)
    assert d.mine["scale_downs"] == 1 and d.mine["last_decision"]["direction"] == "down"


def test_ray_applies_the_smoothing_factors(monkeypatch: pytest.MonkeyPatch) -> None:
    d = Driver(
        ray_config(
            enabled=True,
            max_replicas=8,
            initial_replicas=8,
            upscale_delay_s=0.0,
            downscale_delay_s=0.0,
            downscale_smoothing_factor=0.5,
        ),
        monkeypatch,
    )
    assert d.tick(0.0, [0.0] * 8) == 5  # recommended 1: half the way (8 + 0.5 x -7 = 4.5 -> 5)
    assert d.tick(0.1, [0.0] * 5) == 3


def test_policy_failure_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    d = Driver(ray_config(enabled=True, initial_replicas=2), monkeypatch)
    monkeypatch.setattr(d.instance, "decide", lambda *a: 1 / 0)
    assert d.tick(0.0, [0.0, 0.0]) == 2
    assert "policy error" in d.mine["reason"]


def test_prefill_policy_reads_queued_tokens_and_ttft() -> None:
    policy = PrefillPolicy(**dataclasses.asdict(CFG))
    ctx = types.SimpleNamespace(
        aggregated_metrics={
            k.QUEUED_PREFILL_TOKENS: {"a": 500.0, "b": 2700.0},
            k.ACTIVE_LEASES: {"a": 3.0, "b": 0.0},
            k.TTFT_MS: {"b": 900.0},
        },
        running_replicas=["a", "b"],
        current_num_replicas=2,
        target_num_replicas=2,
        capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=4,
        policy_state={},
        current_time=0.0,
    )
    desired, state = policy(ctx)
    assert desired == 4  # 3200 tokens / 1000 per replica
    assert state[POLICY_STATE_KEY]["utilization"] == {"queued_prefill_tokens": 1.6, "ttft": 0.9}


def test_policy_rejects_unknown_kwargs() -> None:
    with pytest.raises(TypeError):
        DecodePolicy(target_kv=0.5)
    with pytest.raises(ValueError, match="decode.autoscaling.target_kv_usage"):
        DecodePolicy(target_kv_usage=1.5)


# -- config -> Ray AutoscalingConfig -------------------------------------------------------------


def test_mapping_onto_ray_autoscaling_config() -> None:
    cfg = make_config(
        **{
            "decode.autoscaling.enabled": True,
            "decode.autoscaling.min_replicas": 1,
            "decode.autoscaling.max_replicas": 3,
            "decode.autoscaling.initial_replicas": 2,
            "decode.autoscaling.metrics_interval_s": 2.0,
            "decode.autoscaling.look_back_period_s": 8.0,
            "decode.autoscaling.upscale_delay_s": 3.0,
            "decode.autoscaling.downscale_delay_s": 40.0,
            "decode.autoscaling.upscale_smoothing_factor": 0.8,
            "decode.autoscaling.downscale_smoothing_factor": 0.3,
            "decode.autoscaling.target_kv_usage": 0.7,
        }
    )
    opts = deployment_options(cfg)
    decode, prefill = opts["DecodeServer"], opts["PrefillServer"]
    assert "num_replicas" not in decode  # Ray rejects num_replicas with an autoscaling_config
    assert prefill["num_replicas"] == cfg.prefill.num_replicas
    assert "autoscaling_config" not in prefill
    ray_cfg = RayAutoscalingConfig(**decode["autoscaling_config"])  # Ray's pydantic model
    assert (ray_cfg.min_replicas, ray_cfg.max_replicas, ray_cfg.initial_replicas) == (1, 3, 2)
    assert (ray_cfg.metrics_interval_s, ray_cfg.look_back_period_s) == (2.0, 8.0)
    assert (ray_cfg.upscale_delay_s, ray_cfg.downscale_delay_s) == (3.0, 40.0)
    assert ray_cfg.get_upscaling_factor() == 0.8 and ray_cfg.get_downscaling_factor() == 0.3
    assert ray_cfg.policy.policy_function == AUTOSCALING_POLICIES["decode"]
    assert ray_cfg.policy.get_serialized_policy_def()  # importable and pickled for the controller
    assert ray_cfg.policy.policy_kwargs["target_kv_usage"] == 0.7
    policy = ray_cfg.policy.get_policy()(**ray_cfg.policy.policy_kwargs)
    assert policy.pool == "decode" and policy.cfg == cfg.decode.autoscaling
    # The whole options dict is accepted by Ray's deployment options.
    from ray import serve

    class Dummy:
        pass

    dep = serve.deployment(name="Dummy")(Dummy).options(**decode)
    assert dep._deployment_config.autoscaling_config.max_replicas == 3


def test_prefill_mapping_and_the_lease_drain_invariant() -> None:
    cfg = make_config(
        **{"prefill.autoscaling.enabled": True, "prefill.autoscaling.min_replicas": 0}
    )
    opts = deployment_options(cfg)["PrefillServer"]
    ray_cfg = RayAutoscalingConfig(**opts["autoscaling_config"])
    assert ray_cfg.policy.policy_function == AUTOSCALING_POLICIES["prefill"]
    assert ray_cfg.min_replicas == 0
    # A draining prefill replica keeps its leased KV until pulled or expired: the config refuses
    # a shutdown timeout that would cut the lease short.
    assert opts["graceful_shutdown_timeout_s"] > cfg.transfer.lease_s
    with pytest.raises(ValueError, match="prefill.graceful_shutdown_timeout_s"):
        make_config(**{"transfer.lease_s": 30.0, "prefill.graceful_shutdown_timeout_s": 20.0})


# -- replica-side signals -----------------------------------------------------------------------


def test_recent_window_median_and_expiry() -> None:
    w = k.RecentWindow(window_s=10.0)
    assert w.median(now=0.0) is None
    for t, v in ((0.0, 100.0), (1.0, 300.0), (2.0, 200.0)):
        w.add(v, now=t)
    assert w.median(now=5.0) == 200.0
    assert w.median(now=10.5) == 250.0  # the first sample left the window
    assert w.median(now=30.0) is None


def test_stats_builders() -> None:
    stats = {
        "engine": {
            "num_running": 2,
            "num_waiting": 1,
            "num_waiting_for_kv": 3,
            "num_queued_prefill_tokens": 700,
            "kv": {"usage": 0.25},
        },
        "num_active_leases": 4,
        "recent_ttft_ms": None,
        "recent_tpot_ms": 12.5,
    }
    p = k.prefill_autoscaling_stats(stats)
    assert p[k.QUEUED_PREFILL_TOKENS] == 700 and p[k.ACTIVE_LEASES] == 4
    assert k.TTFT_MS not in p  # no recent samples: no key
    d = k.decode_autoscaling_stats(stats, max_num_seqs=16)
    assert d == {
        k.KV_USAGE: 0.25,
        k.RUNNING: 2.0,
        k.WAITING: 4.0,
        k.MAX_NUM_SEQS: 16.0,
        k.TPOT_MS: 12.5,
    }
    assert all(key.startswith("pd_") for key in (*p, *d))
    assert all(isinstance(v, float) for v in (*p.values(), *d.values()))


def test_engine_reports_queued_prefill_tokens() -> None:
    from cluster.engine.engine import EngineRequest, LLMEngine
    from tests.helpers import fake_config, greedy

    engine = LLMEngine(fake_config(**{"scheduler.chunk_size": 16}))
    engine.add(EngineRequest("a", list(range(1, 41)), greedy(2)))
    engine.add(EngineRequest("b", list(range(1, 25)), greedy(2)))
    assert engine.stats()["num_queued_prefill_tokens"] == 64
    engine.step()  # 64-token budget: chunks of both prompts
    assert 0 <= engine.stats()["num_queued_prefill_tokens"] < 64
    for _ in range(20):
        engine.step()
    assert engine.stats()["num_queued_prefill_tokens"] == 0


def test_server_cores_keep_recent_ttft_and_tpot() -> None:
    import asyncio

    from tests.unit.servers.test_pd_cores import Pair, _call, _collect, _prompt

    pair = Pair()
    try:
        assert pair.prefill.stats()["recent_ttft_ms"] is None
        assert pair.decode.stats()["recent_tpot_ms"] is None
        asyncio.run(_collect(pair.decode, _call("r", _prompt(40, 1), 6)))
        p = k.prefill_autoscaling_stats(pair.prefill.stats())
        d = k.decode_autoscaling_stats(pair.decode.stats(), max_num_seqs=8)
        assert p[k.TTFT_MS] >= 0 and d[k.TPOT_MS] >= 0
        pair.wait_idle_clean()
    finally:
        pair.close()
