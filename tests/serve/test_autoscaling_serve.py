"""The decode pool scales on KV use under Ray Serve, with pdserve's policy (fake model).

Two long-context streams fill most of one decode replica's KV cache while only two requests are
ongoing: Ray's default policy (``target_ongoing_requests`` = 2) would not scale on that, pdserve's
``DecodePolicy`` does (KV use above ``target_kv_usage``). When the streams end, a trickle of
short requests keeps flowing while the pool goes back to one replica: the stopped replica drains
its streams (graceful shutdown), so no request fails. Periods and delays are ~1 s here.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import pytest
import ray
from ray import serve

from cluster.common.hashing import hash_block_tokens
from cluster.common.protocol import Accepted, GenerateCall
from cluster.decode_worker.deployment import DecodeServer
from cluster.serving.autoscaling import POLICY_STATE_KEY
from cluster.serving.calls import Keepalive
from cluster.serving.options import deployment_options
from tests.helpers import fake_config, greedy
from tests.serve_fixtures import ServeCluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

APP = "autoscale"
LONG_PROMPT, LONG_TOKENS = 480, 400  # 30 blocks of prompt each, ~20 s of decoding
SHORT_TOKENS = 60  # ~3 s each: streams are in flight on both replicas when one is stopped
CFG = {
    "cache.num_blocks": 128,
    "testing.fake_model.decode_delay_s": 0.05,
    "transfer.lease_s": 2.0,
    "transfer.heartbeat_s": 0.2,
    "decode.graceful_shutdown_timeout_s": 10.0,
    # This test calls the decode pool itself (no router to follow a move) and checks the drain
    # in place: the path of decode.migrate_on_drain: false (live migration: test_replicas F23).
    "decode.migrate_on_drain": False,
    "decode.num_cpus": 0.5,
    "decode.autoscaling.enabled": True,
    "decode.autoscaling.min_replicas": 1,
    "decode.autoscaling.max_replicas": 2,
    "decode.autoscaling.metrics_interval_s": 0.5,
    "decode.autoscaling.look_back_period_s": 1.0,
    "decode.autoscaling.upscale_delay_s": 1.0,
    "decode.autoscaling.downscale_delay_s": 2.0,
    "decode.autoscaling.downscale_smoothing_factor": 1.0,
    "decode.autoscaling.target_kv_usage": 0.4,  # two long streams: ~0.5-0.85 of one replica
    "decode.autoscaling.scale_down_ratio": 0.5,
    "decode.autoscaling.tpot_slo_ms": 5000.0,  # this test is about KV, not latency
}


def _prompt(n: int, seed: int) -> list[int]:
    return [1 + (seed * 131 + i * 17) % 500 for i in range(n)]


@dataclass
class Outcome:
    replica: str = ""
    tokens: int = 0
    finish: str | None = None
    error: str | None = None
    start: float = 0.0  # wall clock (time.time), comparable with the policy's decision times
    end: float = 0.0


async def _stream(
    handle: Any, rid: str, prompt: list[int], max_tokens: int, avoid: tuple[str, ...] = ()
) -> Outcome:
    out = Outcome(start=time.time())
    call = GenerateCall(
        rid, prompt, hash_block_tokens(prompt, 16), greedy(max_tokens), exclude_replicas=avoid
    )
    try:
        async for item in handle.options(stream=True).generate.remote(call):
            if isinstance(item, Accepted):
                out.replica = item.replica_id
            elif not isinstance(item, Keepalive):
                out.tokens += len(item.token_ids)
                out.finish = item.finish_reason or out.finish
    except Exception as e:
        out.error = f"{type(e).__name__}: {e}"
    out.end = time.time()
    return out


def _replica_states() -> dict[str, int]:
    app = serve.status().applications.get(APP)
    if app is None or "DecodeServer" not in app.deployments:
        return {}
    return {
        str(getattr(k, "value", k)): v
        for k, v in app.deployments["DecodeServer"].replica_states.items()
    }


async def _wait_states(pred: Any, timeout: float, what: str) -> float:
    deadline = time.monotonic() + timeout
    while True:
        states = await asyncio.to_thread(_replica_states)
        if pred(states):
            return time.monotonic()
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; replica states {states}")
        await asyncio.sleep(0.25)


def _policy_state() -> dict[str, Any] | None:
    """The decode policy's state as Ray's controller keeps it (ray 2.60 internals: test only)."""
    from ray.serve._private.common import DeploymentID
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    def read(controller: Any) -> Any:
        try:
            app = controller.autoscaling_state_manager._app_autoscaling_states[APP]
            dep = app._deployment_autoscaling_states[DeploymentID("DecodeServer", APP)]
            return dict(dep._policy_state or {})
        except (AttributeError, KeyError) as e:
            return {"error": repr(e)}

    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    return ray.get(controller.__ray_call__.remote(read), timeout=30)


async def _scale_up_then_down(
    handle: Any, timeline: dict[str, float]
) -> tuple[list[Outcome], list[Outcome]]:
    """Two long streams take the pool to two replicas; then short ones trickle on while it
    scales back to one. Returns (the long streams, the short ones)."""
    start = time.monotonic()
    longs = [
        asyncio.create_task(_stream(handle, f"long{i}", _prompt(LONG_PROMPT, i), LONG_TOKENS))
        for i in range(2)
    ]
    await _wait_states(lambda s: s.get("RUNNING", 0) == 2, 60, "a second decode replica")
    timeline["scaled_up"] = time.monotonic() - start
    long_out = await asyncio.gather(*longs)
    timeline["long_streams_done"] = time.monotonic() - start
    trickle = await _trickle_through_scale_down(handle, {o.replica for o in long_out})
    timeline["scaled_down"] = time.monotonic() - start
    return long_out, trickle


async def _trickle_through_scale_down(handle: Any, first: set[str]) -> list[Outcome]:
    """Short streams from four workers until the pool is down to one replica (and a second
    more). Ray stops the newest replica first: two workers steer to it (the pools' router
    honours exclude_replicas while another replica is left, here the ``first`` replicas), so
    streams are in flight on it when it is stopped; the other two go wherever the router sends
    them."""
    stop = asyncio.Event()
    trickle: list[Outcome] = []

    async def worker(w: int) -> None:
        i = 0
        avoid = tuple(first) if w < 2 else ()
        while not stop.is_set():
            prompt = _prompt(12, 100 + w * 50 + i)
            trickle.append(await _stream(handle, f"t{w}-{i}", prompt, SHORT_TOKENS, avoid))
            i += 1

    workers = [asyncio.create_task(worker(w)) for w in range(4)]
    await _wait_states(
        lambda s: s.get("RUNNING", 0) == 1 and len(s) == 1, 60, "the scale-down to 1"
    )
    await asyncio.sleep(1.0)  # requests keep flowing to the remaining replica
    stop.set()
    await asyncio.gather(*workers)
    return trickle


def _check_the_policy_decided_on_kv_use() -> dict[str, Any]:
    """The decisions are visible in the policy state Ray keeps for the deployment: up on KV
    use (not the request count), then down. Returns the last (down) decision."""
    state = _policy_state()
    assert state is not None and POLICY_STATE_KEY in state, state
    mine = state[POLICY_STATE_KEY]
    print("policy state:", mine)
    assert mine["scale_ups"] >= 1 and mine["scale_downs"] >= 1, mine
    ups = [d for d in mine["history"] if d["direction"] == "up"]
    assert ups and "kv_usage" in ups[0]["reason"], mine  # not the request count
    down = mine["last_decision"]
    assert down["direction"] == "down", mine
    return down


def _check_the_removed_replica_drained(
    handle: Any, trickle: list[Outcome], down: dict[str, Any]
) -> None:
    """Streams in flight on the removed replica when the pool shrank finished (drained)."""
    remaining = handle.stats.remote().result()["replica_id"]
    removed = {o.replica for o in trickle} - {remaining}
    drained = [o for o in trickle if o.replica in removed and o.start < down["time"] < o.end]
    per = {r: sum(o.replica == r for o in trickle) for r in {o.replica for o in trickle}}
    print(f"{len(trickle)} short requests {per}, {len(drained)} drained by {removed}")
    assert len(removed) == 1 and drained, (removed, down, trickle)


def test_decode_pool_scales_on_kv_use_and_drains_on_scale_down(
    serve_cluster: ServeCluster,
) -> None:
    cfg = fake_config(**CFG)
    opts = deployment_options(cfg)["DecodeServer"]
    assert "num_replicas" not in opts and opts["autoscaling_config"]["max_replicas"] == 2
    t0 = time.monotonic()
    handle = serve.run(
        DecodeServer.options(**opts).bind(cfg.to_dict(), None), name=APP, route_prefix=None
    )
    timeline: dict[str, float] = {"deployed": time.monotonic() - t0}
    try:
        long_out, trickle = asyncio.run(_scale_up_then_down(handle, timeline))
        print("timeline (s):", {k: round(v, 1) for k, v in timeline.items()})
        for o in long_out:
            assert o.error is None and o.finish == "length" and o.tokens == LONG_TOKENS, o
        failed = [o for o in trickle if o.error is not None or o.tokens != SHORT_TOKENS]
        assert not failed, failed[:3]
        down = _check_the_policy_decided_on_kv_use()
        _check_the_removed_replica_drained(handle, trickle, down)

        # The remaining replica's KV blocks are intact and all free again.
        assert handle.check_integrity.remote().result() == "ok"
        deadline = time.monotonic() + 10
        while handle.stats.remote().result()["kv_used_blocks"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert handle.stats.remote().result()["kv_used_blocks"] == 0
    finally:
        serve.delete(APP)
