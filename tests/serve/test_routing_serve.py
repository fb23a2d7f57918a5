"""Cache-aware routing on Ray Serve (fake model, 2 prefill replicas, remote prefill forced):
requests of one prefix group land on the same prefill replica, and a burst whose cache win is
small spreads over both instead of piling onto the replica that holds it."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from cluster.pb.pdserve.v1 import generation_pb2 as pb
from tests.helpers import fake_config
from tests.serve.cluster_helpers import App
from tests.serve_fixtures import ServeCluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

CFG = {
    "cache.num_blocks": 512,
    "transfer.transports": ["shm", "zmq"],
    "transfer.lease_s": 2.0,
    "transfer.heartbeat_s": 0.2,
    "decode.local_prefill_threshold": 0,  # every prefill goes to the prefill pool
    "prefill.num_replicas": 2,
    "prefill.num_cpus": 0.5,
    "decode.num_cpus": 0.5,
    "prefill.graceful_shutdown_timeout_s": 5.0,
    "decode.graceful_shutdown_timeout_s": 5.0,
    "prefill.routing.stats_period_s": 0.2,
    "testing.fake_model.prefill_delay_per_token_s": 0.0005,
}


@pytest.fixture(scope="module")
def app(serve_cluster: ServeCluster) -> Iterator[App]:
    cfg = {k: v for k, v in CFG.items() if v is not None}
    deployed = App(serve_cluster, fake_config(**cfg), "pdserve-routing")
    try:
        yield deployed
    finally:
        deployed.close()


def ids(group: int, n: int, tail: int) -> list[int]:
    shared = [1 + (group * 89 + j * 11) % 500 for j in range(n)]
    return shared + [1 + (tail * 37 + k * 3) % 500 for k in range(24)]


def request(rid: str, prompt: list[int]) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParameters(max_tokens=2, temperature=0.0),
    )


def where(app: App) -> dict[str, str]:
    placed = {}
    for rid, s in app.stats("prefill").items():
        for req in s["recent_requests"]:
            placed[req.partition("@")[0]] = rid  # the pools' id: the client's label + "@" suffix
    return placed


def test_a_prefix_group_sticks_to_one_prefill_replica(app: App) -> None:
    groups = {g: [f"g{g}-{i}" for i in range(4)] for g in range(4)}
    for i in range(4):  # interleaved, one at a time (a low rate)
        for g, rids in groups.items():
            assert app.generate(request(rids[i], ids(g, 256, 100 * g + i)))
    placed = where(app)
    for g, rids in groups.items():
        assert len({placed[r] for r in rids}) == 1, (g, {r: placed[r] for r in rids})
    app.assert_clean()


def test_a_hot_replica_sheds_a_burst_with_a_small_cache_win(app: App) -> None:
    # Warm one replica with a 16-token prefix, then send a burst sharing only that prefix.
    assert app.generate(request("warm", ids(9, 16, 0)))
    burst = [f"burst-{i}" for i in range(8)]
    threads = [
        threading.Thread(target=app.generate, args=(request(rid, ids(9, 16, 1000 + i) * 8),))
        for i, rid in enumerate(burst)
    ]
    for t in threads:
        # 30 ms apart (a prefill here takes ~160 ms): each routing decision sees the ones before
        # it. Decisions made at the same instant cannot: the caller counts a request where it
        # went only once Serve has assigned it (a known limit, in the closing note of stop 16).
        t.start()
        time.sleep(0.03)
    for t in threads:
        t.join(60)
    placed = where(app)
    spread = Counter(placed[r] for r in burst)
    assert len(spread) == 2 and min(spread.values()) >= 2, spread
    app.assert_clean()
