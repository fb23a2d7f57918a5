"""Speculative decoding through the cluster on Ray Serve (the fake model, prompt lookup on).

The decode pool drafts (``--set decode.speculative.method=ngram``); greedy outputs through gRPC
and HTTP, remote- and locally-prefilled, equal a reference engine without speculation; usage
and the replicas' stats report drafted and accepted tokens. Cancelling a stream and killing the
decode replica mid-stream while drafts are verified leave no block held anywhere.

A 16-token fake vocabulary makes the fake model's output quote its prompt often enough for
prompt lookup to draft (and sometimes be right) every few steps.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from cluster.engine.engine import EngineRequest, LLMEngine
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from tests.helpers import fake_config, greedy, run_until_done
from tests.serve.cluster_helpers import App, wait_replicas_ready
from tests.serve_fixtures import ServeCluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

APP = "pdserve-spec"
THRESHOLD = 16  # prompts longer than this are prefilled remotely
CFG = {
    "cache.num_blocks": 256,
    "transfer.transports": ["shm", "zmq"],
    "transfer.lease_s": 2.0,
    "transfer.heartbeat_s": 0.2,
    "decode.local_prefill_threshold": THRESHOLD,
    "prefill.graceful_shutdown_timeout_s": 5.0,
    "decode.graceful_shutdown_timeout_s": 5.0,
    "prefill.num_cpus": 0.5,
    "decode.num_cpus": 0.5,
    "router.assignment_timeout_s": 20.0,
    "testing.fake_model.vocab_size": 16,
    "testing.fake_model.decode_delay_s": 0.002,
}
# A fixed draft row cost: with the measured one (the default) how many tokens are drafted depends
# on the replica's step timings, and this test compares the drafts of two runs of one prompt.
SPEC = {
    "decode.speculative.method": "ngram",
    "decode.speculative.num_speculative_tokens": 4,
    "decode.speculative.measure_row_cost": False,
}


@pytest.fixture(scope="module")
def app(serve_cluster: ServeCluster) -> Iterator[App]:
    deployed = App(serve_cluster, fake_config(**CFG, **SPEC), APP)
    try:
        yield deployed
    finally:
        deployed.close()


def prompt(i: int, n: int) -> list[int]:
    return [1 + (i * 5 + j * 3) % 15 for j in range(n)]


def reference(prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    """The same fake model without speculation, in this process."""
    engine = LLMEngine(fake_config(**CFG))
    for rid, p in prompts.items():
        engine.add(EngineRequest(rid, p, greedy(max_tokens)))
    return run_until_done(engine)


def greedy_req(p: list[int], max_tokens: int, rid: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        token_ids=pb.TokenIds(ids=p),
        sampling=pb.SamplingParameters(
            max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0, ignore_eos=True
        ),
    )


def tokens(msgs: list[pb.GenerateResponse]) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


def spec_stats(app: App) -> dict[str, int]:
    return {
        k: sum(s["engine"]["spec"][k] for s in app.stats("decode").values())
        for k in ("num_draft_tokens", "num_accepted_tokens")
    }


def test_greedy_through_the_cluster_equals_no_speculation(app: App) -> None:
    prompts = {f"g{i}": prompt(i, n) for i, n in enumerate([6, 12, 30, 45, 60, 80, 9, 100])}
    expected = reference(prompts, 40)
    before = spec_stats(app)
    results: dict[str, list[pb.GenerateResponse]] = {}

    def run(rid: str) -> None:
        results[rid] = app.generate(greedy_req(prompts[rid], 40, rid))

    threads = [threading.Thread(target=run, args=(rid,)) for rid in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    modes = set()
    drafted = accepted = 0
    for rid, msgs in results.items():
        assert tokens(msgs) == expected[rid], rid
        usage = msgs[-1].usage
        modes.add(usage.prefill_mode)
        drafted += usage.draft_tokens
        accepted += usage.accepted_draft_tokens
    assert len(results) == len(prompts) and modes == {"local", "remote"}
    assert drafted > accepted > 0
    after = spec_stats(app)
    assert after["num_draft_tokens"] - before["num_draft_tokens"] == drafted
    assert after["num_accepted_tokens"] - before["num_accepted_tokens"] == accepted
    # HTTP: the same tokens, and the usage extra reports the drafts.
    with urllib.request.urlopen(app.cluster.http_url + "/v1/models", timeout=30) as r:
        model = json.loads(r.read())["data"][0]["id"]
    body = {
        "model": model,
        "prompt": prompts["g5"],
        "max_tokens": 40,
        "min_tokens": 40,
        "temperature": 0,
        "ignore_eos": True,
    }
    req = urllib.request.Request(
        app.cluster.http_url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    before = spec_stats(app)
    with urllib.request.urlopen(req, timeout=60) as r:
        reply = json.loads(r.read())
    after = spec_stats(app)
    assert reply["usage"]["completion_tokens"] == 40
    spec = reply["usage"]["pdserve"]["speculative"]
    assert spec["draft_tokens"] >= spec["accepted_draft_tokens"] >= 0
    # What this request drafted: the engine's counters moved by exactly that. (Not the gRPC
    # run's count: what a request drafts depends on its batch and on the acceptance of the
    # drafts before it, engine-wide.)
    assert spec["draft_tokens"] == after["num_draft_tokens"] - before["num_draft_tokens"]
    assert spec["accepted_draft_tokens"] == (
        after["num_accepted_tokens"] - before["num_accepted_tokens"]
    )
    app.assert_clean()


def _start(app: App, req: pb.GenerateRequest) -> tuple[Any, list[Any], threading.Thread]:
    call = app.stub.Generate(req, metadata=app.metadata)
    got: list[Any] = []

    def consume() -> None:
        try:
            for m in call:
                got.append(m)
        except grpc.RpcError as e:
            got.append(e)

    t = threading.Thread(target=consume)
    t.start()
    return call, got, t


def _wait_drafting(app: App, before: int) -> None:
    from tests.serve_fixtures import wait_until

    assert wait_until(lambda: spec_stats(app)["num_draft_tokens"] > before, 30, 0.1)


def test_cancel_while_drafts_are_verified_frees_every_block(app: App) -> None:
    before = spec_stats(app)["num_draft_tokens"]
    call, got, t = _start(app, greedy_req(prompt(3, 40), 400, "spec-cancel"))
    _wait_drafting(app, before)
    call.cancel()
    t.join(30)
    assert got and isinstance(got[-1], grpc.RpcError)
    assert got[-1].code() == grpc.StatusCode.CANCELLED
    app.assert_clean()
    p = prompt(4, 40)
    assert tokens(app.generate(greedy_req(p, 12))) == reference({"x": p}, 12)["x"]
    app.assert_clean()


def test_decode_killed_mid_stream_while_drafting(app: App) -> None:
    before = spec_stats(app)["num_draft_tokens"]
    _call, got, t = _start(app, greedy_req(prompt(5, 40), 400, "spec-kill"))
    _wait_drafting(app, before)
    (victim,) = app.stats("decode").values()
    os.kill(victim["pid"], signal.SIGKILL)
    t.join(60)
    assert not t.is_alive()
    assert any(isinstance(m, pb.GenerateResponse) and m.token_ids for m in got)
    err = got[-1]
    assert isinstance(err, grpc.RpcError), "the stream ended without an error status"
    assert err.code() in (grpc.StatusCode.ABORTED, grpc.StatusCode.UNAVAILABLE), err
    wait_replicas_ready(app, "decode", victim["pid"])
    p = prompt(6, 40)
    assert tokens(app.generate(greedy_req(p, 12))) == reference({"x": p}, 12)["x"]
    app.assert_clean()
