"""Load on Ray Serve, fake model (docs/reliability/matrix.md L1, F9, L4, B8; issue 12.7).

  * L1: 200 concurrent streams against a pool that holds a few dozen, with a TTFT SLO: the
    router admits what its model of the queue says can start within the SLO and refuses the
    rest with a retry delay (never a DEADLINE_EXCEEDED after queueing), the admitted ones are
    oracle-identical, the router's memory stays bounded. A second client in a process of its
    own (tests/serve/l1_probe.py) calls one at a time during each burst: what a caller arriving
    in the overload sees, without the burst client's own 200-call send loop in its figures.
  * B8: one connection opening more calls than ``router.max_streams_per_connection``: the
    excess gets RESOURCE_EXHAUSTED, other connections and health are unaffected.
  * F9: 500 streams in flight cancelled at once; the next 100 requests all succeed and every
    pool is idle-clean within 2 s.
  * L4: 300 HTTP clients close their sockets mid-stream: 0 blocks or leases left after 2 s.

The numbers each test measures are printed (-s); the bounds asserted are generous, for 2 shared
cores (the L1 targets, admitted TTFT p99 within the SLO and refusals within max(50 ms, 2x the
refusing-only floor), are reported against, not asserted: see docs/reliability/coverage.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.engine.engine import EngineRequest, LLMEngine
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc
from cluster.serving.options import router_admission_limit
from tests.health_poller import HealthPoller
from tests.helpers import fake_config, greedy, run_until_done
from tests.serve.cluster_helpers import App, delta, outcome_counters
from tests.serve_fixtures import ServeCluster, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]

BASE = {
    "cache.num_blocks": 2048,
    "prefill.num_replicas": 1,
    "prefill.num_cpus": 0.5,
    "decode.num_cpus": 0.5,
    "transfer.transports": ["shm", "zmq"],
    "transfer.lease_s": 2.0,
    "transfer.heartbeat_s": 0.2,
    "prefill.graceful_shutdown_timeout_s": 5.0,
    "decode.graceful_shutdown_timeout_s": 5.0,
    "decode.local_prefill_threshold": 16,
    "testing.fake_model.decode_delay_s": 0.002,
}
# L1 and B8: a small pool (16 sequences a step, 32 requests a replica, 32 queued at the router).
L1_SLO_MS = 500.0
SMALL = {
    **BASE,
    "scheduler.max_num_seqs": 16,
    "decode.max_queued_requests": 32,
    "router.max_streams_per_connection": 16,
    "router.ttft_slo_ms": L1_SLO_MS,
    # A router replica per core, sharing the gRPC port (SO_REUSEPORT): one replica's event loop
    # took the 200 arrivals one at a time (refusals p99 0.5-0.9 s against 0.2-0.25 s with two).
    "router.num_replicas": 2,
    "router.num_cpus": 0.1,
}
# F9 and L4: room for every stream in flight at once, and a decode batch that holds L4's 100
# (with 64, the last 36 waited ~35 s for the first 64 to finish their 400 tokens).
BIG = {
    **BASE,
    # F9's 500 streams of 1,000 tokens, 128 decoding at a time, never short of blocks (4 KiB
    # each for the fake model)
    "cache.num_blocks": 16384,
    "scheduler.max_num_seqs": 128,
    "scheduler.max_num_batched_tokens": 1024,
    "decode.max_ongoing_requests": 640,
    "router.max_ongoing_requests": 640,
    "router.max_streams_per_connection": 640,
}


def prompt(i: int, n: int = 24) -> list[int]:
    return [1 + (i * 37 + j * 11) % 500 for j in range(n)]


def greedy_req(p: list[int], max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=p),
        sampling=pb.SamplingParameters(
            max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0, ignore_eos=True
        ),
    )


def reference(config: Any, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    engine = LLMEngine(config)
    for rid, p in prompts.items():
        engine.add(EngineRequest(rid, p, greedy(max_tokens)))
    return run_until_done(engine)


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[int(0.99 * (len(ordered) - 1))]


class Outcome:
    def __init__(self) -> None:
        self.code = "OK"
        self.ttft: float | None = None
        self.latency = 0.0
        self.tokens: list[int] = []
        self.details = ""
        self.pushback_ms: int | None = None  # a refusal's retry delay (grpc-retry-pushback-ms)


async def one(stub: Any, req: pb.GenerateRequest, timeout: float = 60) -> Outcome:
    out = Outcome()
    t0 = time.perf_counter()
    try:
        async for msg in stub.Generate(req, timeout=timeout):
            if msg.token_ids and out.ttft is None:
                out.ttft = time.perf_counter() - t0
            out.tokens.extend(msg.token_ids)
    except grpc.aio.AioRpcError as e:
        out.code = e.code().name
        out.details = e.details() or ""
        pushback = dict(e.trailing_metadata() or ()).get("grpc-retry-pushback-ms")
        out.pushback_ms = None if pushback is None else int(pushback)
    out.latency = time.perf_counter() - t0
    return out


async def burst(target: str, reqs: list[pb.GenerateRequest], channels: int) -> list[Outcome]:
    # Each channel its own TCP connection (grpc shares one between equal channels otherwise).
    private = [("grpc.use_local_subchannel_pool", 1)]
    chans = [grpc.aio.insecure_channel(target, options=private) for _ in range(channels)]
    try:
        stubs = [pb_grpc.GenerationStub(c) for c in chans]
        for c in chans:
            await c.channel_ready()
        return list(
            await asyncio.gather(*(one(stubs[i % channels], r) for i, r in enumerate(reqs)))
        )
    finally:
        for c in chans:
            await c.close()


class Apps:
    """One app at a time on the session's Serve (both take the route prefix /)."""

    def __init__(self, cluster: ServeCluster) -> None:
        self.cluster = cluster
        self.current: App | None = None

    def get(self, name: str, overrides: dict[str, Any]) -> App:
        if self.current is None or self.current.name != name:
            self.close()
            self.current = App(self.cluster, fake_config(**overrides), name)
        return self.current

    def close(self) -> None:
        if self.current is not None:
            self.current.close()
            self.current = None


@pytest.fixture(scope="module")
def apps(serve_cluster: ServeCluster) -> Iterator[Apps]:
    held = Apps(serve_cluster)
    try:
        yield held
    finally:
        held.close()


@pytest.fixture
def small(apps: Apps) -> App:
    return apps.get("pdserve-load-small", SMALL)


@pytest.fixture
def big(apps: Apps) -> App:
    return apps.get("pdserve-load-big", BIG)


def worker_calls(app: App) -> int:
    return sum(s["local_prefills"] + s["remote_prefills"] for s in app.stats("decode").values())


def test_l1_overload_admits_what_meets_the_ttft_slo_and_refuses_the_rest_at_once(
    small: App,
) -> None:
    """L1: 200-call bursts at several times capacity. The router admits what its model of the
    queue says can start within ``router.ttft_slo_ms`` (and what the places allow) and refuses
    the rest at once, each refusal with a retry delay (``grpc-retry-pushback-ms``); never a
    deadline after queueing, never a 5xx; admitted outputs exact; refused requests reach no
    pool; the router's memory bounded. Printed against the targets: the admitted TTFT p99 (the
    SLO) and the refusals' p99 (max(50 ms, 2x the refusing-only floor of the same run))."""
    limit = router_admission_limit(small.config)
    router = psutil.Process(small.router.pid.remote().result(timeout_s=30))
    prompts = {f"r{i}": prompt(i) for i in range(200)}
    expected = reference(small.config, prompts, 16)
    reqs = [greedy_req(p, 16) for p in prompts.values()]
    unloaded = [asyncio.run(burst(small.grpc_target, [reqs[i]], 1))[0] for i in range(10)]
    assert all(o.code == "OK" for o in unloaded)
    unloaded_ttft = statistics.median(o.ttft or 0.0 for o in unloaded)
    floor = floor_reject_p99(reqs)
    bound = max(0.05, 2 * max(floor))
    print(
        "L1 floor (the router's gRPC listener alone, refusing all 200 of each burst): reject "
        f"p99 {', '.join(f'{x * 1000:.0f}' for x in floor)} ms; refusal target "
        f"{bound * 1000:.0f} ms; TTFT SLO {L1_SLO_MS:.0f} ms; unloaded TTFT "
        f"{unloaded_ttft * 1000:.1f} ms"
    )
    asyncio.run(burst(small.grpc_target, reqs, channels=20))  # the model learns the queue
    model = small.router.stats.remote().result(timeout_s=30)["ttft_model"]
    print(f"L1 router's TTFT model after a warm-up burst: {model}")
    rss_before = router.memory_info().rss
    num_rejected = 0
    for _ in range(3):
        before = worker_calls(small)
        probe = start_probe(small.grpc_target)
        try:
            outcomes = asyncio.run(burst(small.grpc_target, reqs, channels=20))
        finally:
            probed = finish_probe(probe)
        odd = [(o.code, o.details) for o in outcomes if o.code not in ("OK", "RESOURCE_EXHAUSTED")]
        odd += [(code, "probe") for code, _ in probed if code not in ("OK", "RESOURCE_EXHAUSTED")]
        assert not odd, odd[:3]  # never a deadline after queueing, never UNAVAILABLE, INTERNAL
        ok = [(rid, o) for rid, o in zip(prompts, outcomes) if o.code == "OK"]
        rejected = [o for o in outcomes if o.code == "RESOURCE_EXHAUSTED"]
        assert all(o.tokens == expected[rid] for rid, o in ok)
        assert all(o.pushback_ms is not None and o.pushback_ms > 0 for o in rejected)
        # Refused before any work: no pool saw a refused request (the probe's admitted calls
        # reached one: each read its first token).
        probe_ok = [t for code, t in probed if code == "OK"]
        probe_rejected = [t for code, t in probed if code == "RESOURCE_EXHAUSTED"]
        assert worker_calls(small) - before == len(ok) + len(probe_ok)
        num_rejected += len(rejected)
        reject_p99 = p99([o.latency for o in rejected]) if rejected else 0.0
        admitted_p99 = p99([o.ttft or 0.0 for _, o in ok])
        by_slo = sum("ttft_slo_ms" in o.details for o in rejected)
        print(
            f"L1: {len(ok)} served, {len(rejected)} refused ({by_slo} by the SLO, the rest for "
            f"want of a place of {limit}); admitted TTFT p99 {admitted_p99 * 1000:.0f} ms "
            f"(SLO {L1_SLO_MS:.0f}); refused p99 {reject_p99 * 1000:.0f} ms (target "
            f"{bound * 1000:.0f}); retry delays "
            f"{figures([(o.pushback_ms or 0) / 1000 for o in rejected], 'refusals')}"
        )
        print(
            f"L1 probe (own process, one call at a time): {figures(probe_rejected, 'refused')}; "
            f"{figures(probe_ok, 'admitted, first token')}"
        )
        assert reject_p99 < 5.0  # generous (2 shared cores); the printed figure is what counts
        assert probed and all(t < 5.0 for t in probe_rejected)  # as generous
    assert num_rejected > 0  # the excess was refused, not queued
    grown = (router.memory_info().rss - rss_before) / 2**20
    print(f"L1: router RSS +{grown:.1f} MiB")
    assert grown < 50
    small.assert_clean()


def floor_reject_p99(reqs: list[pb.GenerateRequest], bursts: int = 3) -> list[float]:
    """The same bursts against ``tests/serve/l1_floor.py``: what refusing costs with no cluster
    work at all (no Ray, no pools, nothing admitted) on this machine; p99 per burst."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = start_helper("tests.serve.l1_floor", str(port))
    try:
        out = []
        for _ in range(bursts):
            outcomes = asyncio.run(burst(f"127.0.0.1:{port}", reqs, channels=20))
            assert all(o.code == "RESOURCE_EXHAUSTED" for o in outcomes)
            out.append(p99([o.latency for o in outcomes]))
        return out
    finally:
        proc.communicate("", timeout=30)


def start_helper(module: str, *args: str) -> subprocess.Popen[str]:
    """``python -m module args`` from the repo root, once it printed READY (it ends when its
    stdin closes)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "READY"
    return proc


def start_probe(target: str) -> subprocess.Popen[str]:
    """L1's second client, in a process of its own (tests/serve/l1_probe.py), connected."""
    return start_helper("tests.serve.l1_probe", target)


def finish_probe(proc: subprocess.Popen[str]) -> list[tuple[str, float]]:
    out, _ = proc.communicate("", timeout=60)
    assert proc.returncode == 0
    return [(str(code), float(t)) for code, t in json.loads(out.strip().splitlines()[-1])]


def figures(values: list[float], what: str) -> str:
    if not values:
        return f"0 {what}"
    ms = sorted(v * 1000 for v in values)
    return f"{len(ms)} {what}, p50 {statistics.median(ms):.0f} ms, max {ms[-1]:.0f} ms"


def test_b8_one_connection_cannot_take_more_than_its_streams(small: App) -> None:
    per_conn = small.config.router.max_streams_per_connection
    p = prompt(7, 20)
    expected = reference(small.config, {"x": p}, 40)["x"]
    health = health_pb2_grpc.HealthStub(small.channel)
    latencies: list[float] = []
    done = threading.Event()

    def poll() -> None:  # health from another connection, all the while
        while not done.is_set():
            t0 = time.perf_counter()
            health.Check(health_pb2.HealthCheckRequest(), timeout=10)
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.01)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        outcomes = asyncio.run(burst(small.grpc_target, [greedy_req(p, 40)] * (3 * per_conn), 1))
    finally:
        done.set()
        poller.join(30)
    ok = [o for o in outcomes if o.code == "OK"]
    refused = [o for o in outcomes if o.code == "RESOURCE_EXHAUSTED"]
    assert len(ok) + len(refused) == len(outcomes)
    assert refused and 0 < len(ok) <= per_conn + 4, (len(ok), len(refused))
    assert all(o.tokens == expected for o in ok)
    print(
        f"B8: {len(ok)} served, {len(refused)} refused; health p99 {p99(latencies) * 1000:.0f} ms"
    )
    assert p99(latencies) < 0.5
    small.assert_clean()


# Long enough that no stream can finish while the 500 are still being admitted (at 200 a CI run
# peaked at 346 in flight: the first ones had finished), and that ignored cancels would hold
# blocks far past assert_clean's window.
F9_TOKENS = 1000


def test_f9_an_abort_storm_leaves_nothing_behind(big: App) -> None:
    prompts = {f"s{i}": prompt(i, 24 + i % 40) for i in range(500)}  # local and remote
    normal = {f"n{i}": prompt(1000 + i, 30) for i in range(100)}
    expected = reference(big.config, normal, 8)

    def in_flight() -> int:  # admitted at the router, streaming from the pools
        return int(big.router.stats.remote().result(timeout_s=30)["in_flight"])

    async def storm() -> int:
        private = [("grpc.use_local_subchannel_pool", 1)]
        chans = [grpc.aio.insecure_channel(big.grpc_target, options=private) for _ in range(10)]
        stubs = [pb_grpc.GenerationStub(c) for c in chans]
        calls = [
            stubs[i % 10].Generate(greedy_req(p, F9_TOKENS)) for i, p in enumerate(prompts.values())
        ]
        firsts = [asyncio.ensure_future(c.read()) for c in calls]  # drive every call
        deadline = time.monotonic() + 60
        most = 0
        while time.monotonic() < deadline and most < 450:
            await asyncio.sleep(0.2)
            most = max(most, await asyncio.to_thread(in_flight))
        t0 = time.perf_counter()
        for c in calls:
            c.cancel()
        # All cancelled at once: within 1 s of this client's loop (a busy 2-core box can pause it
        # for a tenth of that), while each stream still has most of its tokens to go.
        assert time.perf_counter() - t0 < 1.0
        await asyncio.wait(firsts, timeout=30)
        for c in chans:
            await c.close()
        return most

    before = outcome_counters(big)
    started = asyncio.run(storm())
    print(f"F9: {started} of 500 requests in flight when all were cancelled")
    assert started >= 450
    t0 = time.monotonic()
    big.assert_clean(timeout=15.0)  # the target is 2 s: generous here, the figure printed
    print(f"F9: every pool clean {time.monotonic() - t0:.2f} s after the storm")
    # Ignored cancels would free the blocks too, once the 1,000 tokens were done (tens of
    # seconds at 128 a step): the decode pool must have aborted the streams it had (345-347 of
    # ~465 on a quiet box, 224 of 450 in a CI run beside the other worker: the rest were still
    # on their way to it) and completed at most a few that finished first (0 in every run).
    ended = delta(before, outcome_counters(big))
    print(f"F9: {ended}")
    assert ended["decode.aborted"] >= started // 4, ended
    assert ended["decode.completed"] <= 50, ended
    assert ended["lease.expired"] == 0, ended
    outcomes = asyncio.run(burst(big.grpc_target, [greedy_req(p, 8) for p in normal.values()], 4))
    assert [o.code for o in outcomes] == ["OK"] * 100
    assert {rid: o.tokens for rid, o in zip(normal, outcomes)} == expected
    big.assert_clean()


async def cancel_flood(target: str, n: int) -> dict[str, int]:
    """B8's flood: ``n`` streams over 8 connections, 64 open at a time, three in four cancelled
    1-3 ms after they were opened, the rest after their first token; their codes counted."""
    private = [("grpc.use_local_subchannel_pool", 1)]
    chans = [grpc.aio.insecure_channel(target, options=private) for _ in range(8)]
    stubs = [pb_grpc.GenerationStub(c) for c in chans]
    room = asyncio.Semaphore(64)
    codes: dict[str, int] = {}

    async def open_and_cancel(i: int) -> None:
        async with room:
            call = stubs[i % 8].Generate(greedy_req(prompt(i, 20 + i % 30), 200))
            if i % 4:
                await asyncio.sleep((i % 4) / 1000)
            else:  # a quarter mid-stream: after their first token
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await call.read()
            call.cancel()
            code = (await call.code()).name
            codes[code] = codes.get(code, 0) + 1

    await asyncio.gather(*(open_and_cancel(i) for i in range(n)))
    for c in chans:
        await c.close()
    return codes


# B8's full flood (10,000 streams) runs nightly; CI opens and cancels 2,000.
@pytest.mark.parametrize("n", [2000, pytest.param(10_000, marks=pytest.mark.nightly)])
def test_b8_a_flood_of_opened_and_cancelled_streams_leaves_nothing(big: App, n: int) -> None:
    """B8 cancel flood (``cancel_flood``): health from another process answers fast all the
    while (below); afterwards no call is held
    at the router, every pool is clean, the router's memory grew < 50 MiB (no leaked call
    contexts), and the next requests are served exactly."""
    router = psutil.Process(big.router.pid.remote().result(timeout_s=30))
    rss_before = router.memory_info().rss
    normal = {f"n{i}": prompt(2000 + i, 30) for i in range(20)}
    expected = reference(big.config, normal, 8)

    def router_requests() -> int:
        return int(big.router.stats.remote().result(timeout_s=30)["requests"])

    reached_before = router_requests()
    t0 = time.monotonic()
    with HealthPoller(big.cluster.http_url, big.grpc_target, ("grpc",)) as poller:
        codes = asyncio.run(cancel_flood(big.grpc_target, n))
    took = time.monotonic() - t0
    health = poller.latencies["grpc"]
    reached = router_requests() - reached_before
    health_p99 = p99(health)
    print(
        f"B8 flood: {n} streams in {took:.1f} s, {codes}, {reached} reached the router's "
        f"admission; health {len(health)} checks, p99 {health_p99 * 1000:.0f} ms, "
        f"max {max(health) * 1000:.0f} ms"
    )
    assert sum(codes.values()) == n and set(codes) <= {"CANCELLED", "OK", "RESOURCE_EXHAUSTED"}
    assert codes.get("CANCELLED", 0) >= n // 2, codes
    assert reached >= n // 4, reached  # the mid-stream quarter at least: a flood of real calls
    # The target is p99 < 100 ms; it is printed, not asserted. Here the flood's client takes
    # one of the 2 cores and the router's event loop the other, and a check waits behind up to
    # 64 call starts (~1.8 ms each): p99 120-186 ms for 1,000-2,000 streams, 219-338 ms for 10,000
    # (2026-12-07). Asserted: p95 < 500 ms and no check over 2 s (the router stays responsive;
    # a stalled loop fails both). Not p99: over ~50 checks that is the second-worst, and a CI run
    # beside the other pytest worker read 0.50 and 0.54 s for its two worst (p95 0.33 s).
    health_p95 = sorted(health)[int(0.95 * (len(health) - 1))]
    assert len(health) >= 10 and health_p95 < 0.5 and max(health) < 2.0, sorted(health)[-5:]

    def router_idle() -> bool:
        return big.router.stats.remote().result(timeout_s=30)["in_flight"] == 0

    assert wait_until(router_idle, 15, 0.2), "calls still held at the router"
    big.assert_clean(timeout=15.0)
    grew = router.memory_info().rss - rss_before
    print(f"B8 flood: router RSS {grew / (1 << 20):+.1f} MiB")
    assert grew < 50 << 20, grew
    outcomes = asyncio.run(burst(big.grpc_target, [greedy_req(p, 8) for p in normal.values()], 4))
    assert [o.code for o in outcomes] == ["OK"] * len(normal)
    assert {rid: o.tokens for rid, o in zip(normal, outcomes, strict=True)} == expected
    big.assert_clean()


# L4's full count (300 clients) runs nightly; CI drops 100 at once (3 minutes -> about one).
@pytest.mark.parametrize("n", [100, pytest.param(300, marks=pytest.mark.nightly)])
def test_l4_clients_that_drop_mid_stream_leave_nothing_behind(big: App, n: int) -> None:
    body = {"max_tokens": 400, "min_tokens": 400, "ignore_eos": True, "stream": True}
    before = outcome_counters(big)
    socks: list[socket.socket] = []
    try:
        for i in range(n):
            s = socket.create_connection(("127.0.0.1", big.cluster.http_port), timeout=60)
            data = json.dumps({**body, "prompt": prompt(i, 20 + i % 30)}).encode()
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(data)}\r\n\r\n".encode()
                + data
            )
            socks.append(s)
        streaming = 0
        for s in socks:  # each got its headers and a first token: mid-stream
            got = b""
            while b"data: " not in got:
                more = s.recv(4096)
                if not more:
                    break
                got += more
            streaming += b" 200 " in got.split(b"\r\n", 1)[0] and b"data: " in got
        assert streaming == n, streaming
    finally:
        for s in socks:
            s.close()  # the client goes away
    t0 = time.monotonic()
    # 0 blocks, 0 leases: the target is 2 s; generous here (2 shared cores), the figure printed
    big.assert_clean(timeout=15.0)
    ended = delta(before, outcome_counters(big))
    print(f"L4: {n} dropped streams, every pool clean {time.monotonic() - t0:.2f} s later: {ended}")
    # each dropped client's request aborted, not left to finish its 400 tokens (100 of 100 in
    # every run so far; a tenth of slack for a loaded box)
    assert ended["decode.aborted"] >= n - n // 10 and ended["decode.completed"] <= n // 10, ended
    assert ended["lease.expired"] == 0, ended
    with urllib.request.urlopen(big.cluster.http_url + "/health", timeout=10) as r:
        assert r.status == 200
