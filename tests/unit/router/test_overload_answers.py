"""How the router answers overload and oversize (issue 40, item 3; matrix L1, B7, B8): a 429 /
RESOURCE_EXHAUSTED carries a retry delay read off the queue (HTTP ``Retry-After``, gRPC
``grpc-retry-pushback-ms``), a body over the limit is a 413 the OpenAI SDKs do not retry, a
request with n samples holds n places, and health ``Watch`` streams are bounded per connection
and in total and share one poll. Real sockets against ``GrpcListener``; fake clocks for the
admission's arithmetic."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.common.errors import ErrorCode, PDServeError
from cluster.config import RouterConfig
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc
from cluster.router.admission import MAX_RETRY_AFTER_S, Admission
from cluster.router.grpc_server import RETRY_PUSHBACK, WATCHES_PER_CONNECTION, GrpcListener
from cluster.router.requests import read_body
from cluster.router.responses import error_response, grpc_status, openai_error
from cluster.router.ttft_model import TtftModel

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


# -- admission: places, weights, retry delays ---------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_refusal_carries_a_retry_delay_read_off_the_queue() -> None:
    clock = FakeClock()
    adm = Admission(4, clock)
    for _ in range(10):  # requests that took 2 s each: a place frees every 0.5 s
        with adm.admitted("r"):
            clock.t += 2.0
    held = [adm.admitted(f"h{i}") for i in range(4)]
    for h in held:
        h.__enter__()
    delays = []
    for _ in range(3):
        with pytest.raises(PDServeError) as e:
            adm.check("late")
        assert e.value.code == ErrorCode.RESOURCE_EXHAUSTED
        assert e.value.retry_after_s is not None
        delays.append(e.value.retry_after_s)
    per_place = adm.mean_duration_s / 4
    assert 0.4 < per_place < 0.55, per_place  # the mean moved from its 1 s prior towards 2 s
    # each refused client is told to come after the ones refused before it
    assert delays == pytest.approx([per_place, 2 * per_place, 3 * per_place])
    held[0].__exit__(None, None, None)  # a place frees: the line starts again
    held[0] = adm.admitted("next")
    held[0].__enter__()
    with pytest.raises(PDServeError) as e:
        adm.check("later")
    assert e.value.retry_after_s == pytest.approx(adm.mean_duration_s / 4)
    for h in held:
        h.__exit__(None, None, None)
    assert adm.num_inflight == 0 and adm.num_rejected == 4


def test_the_retry_delay_is_bounded() -> None:
    clock = FakeClock()
    adm = Admission(1, clock)
    with adm.admitted("slow"):
        clock.t += 10_000.0
    with adm.admitted("holder"), pytest.raises(PDServeError) as e:
        adm.check()
    assert e.value.retry_after_s == MAX_RETRY_AFTER_S


def test_a_request_with_n_samples_holds_n_places() -> None:
    adm = Admission(8)
    with adm.admitted("a", 5):
        assert adm.num_inflight == 5
        with pytest.raises(PDServeError), adm.admitted("b", 4):  # 5 + 4 > 8
            pass
        with adm.admitted("c", 3):
            assert adm.num_inflight == 8
    assert adm.num_inflight == 0
    with adm.admitted("wide", 16):  # wider than the limit: runs alone, never starves
        assert adm.num_inflight == 16
        with pytest.raises(PDServeError):
            adm.check("d")


# -- the TTFT SLO: a model of the queue learnt from the router's own first tokens ---------------


def true_ttft(tokens: int, requests: int, i: int) -> float:
    """A made-up system: 20 ms fixed, 0.5 ms a prompt token, 10 ms a request, +-4 ms noise."""
    return 0.02 + 0.0005 * tokens + 0.01 * requests + 0.004 * ((i * 7919 % 11) / 5 - 1)


def trained(n: int = 300) -> TtftModel:
    model = TtftModel()
    for i in range(n):
        tokens, requests = 50 + (i * 37) % 2000, 1 + (i * 13) % 40
        model.observe(tokens, requests, true_ttft(tokens, requests, i))
    return model


def test_the_ttft_model_learns_what_the_queue_costs() -> None:
    model = TtftModel()
    for _ in range(15):
        model.observe(100, 1, 0.07)
        assert model.predict(100, 1) is None  # not before min_samples first tokens
    state = trained().state()
    assert state["per_token_s"] == pytest.approx(0.0005, rel=0.05), state
    assert state["per_request_s"] == pytest.approx(0.01, rel=0.1), state
    assert state["fixed_s"] == pytest.approx(0.02, abs=0.005), state
    assert 0.0 < state["spread_s"] < 0.006, state
    # a p99 estimate: above the mean by about 2.33 residual spreads
    predicted = trained().predict(1000, 10)
    assert predicted is not None
    assert 0.62 < predicted < 0.62 + 3 * 0.006, predicted


def test_the_slo_refuses_what_would_start_late_and_says_when_to_retry() -> None:
    clock = FakeClock()
    adm = Admission(100, clock, ttft_slo_s=0.5, model=trained())
    with contextlib.ExitStack() as stack:
        tickets = []
        predicted = adm.predicted_ttft_s(400)
        while predicted is not None and predicted <= 0.5:  # 400-token prompts, no first token
            tickets.append(stack.enter_context(adm.admitted(f"a{len(tickets)}", 1, 400)))
            predicted = adm.predicted_ttft_s(400)
        assert predicted is not None and 2 <= len(tickets) <= 10, (predicted, tickets)
        # one more 400-token prompt would start after 0.5 s: refused, before any work
        with pytest.raises(PDServeError) as e:
            adm.check("late", 1, 400)
        assert e.value.code == ErrorCode.RESOURCE_EXHAUSTED
        assert "router.ttft_slo_ms=500" in e.value.message
        assert e.value.retry_after_s == pytest.approx(predicted - 0.5)
        assert adm.num_rejected_slo == 1 and adm.num_inflight == len(tickets)
        adm.check("short", 1, 10)  # a short prompt still fits
        # a first token: the model learns its TTFT, its prompt leaves the queue
        samples = adm.model.num_samples
        clock.t += true_ttft(tickets[0].tokens, tickets[0].requests, 0)  # as the model expects
        adm.first_token(tickets[0])
        adm.first_token(tickets[0])  # once only
        assert adm.model.num_samples == samples + 1
        assert adm.waiting_tokens == 400 * (len(tickets) - 1)
        adm.check("now-fits", 1, 400)
    # the rest ended without a first token: out of the queue, nothing learnt from them
    assert adm.waiting_tokens == 0 and adm.waiting_requests == 0 and adm.num_inflight == 0
    assert adm.model.num_samples == samples + 1


def test_the_slo_never_refuses_into_an_idle_router_and_is_off_at_0() -> None:
    alone = Admission(100, ttft_slo_s=0.05, model=trained())
    assert (alone.predicted_ttft_s(5000) or 0) > 0.05
    with alone.admitted("huge", 1, 5000):  # nothing waits: as fast as it gets, admitted
        pass
    off = Admission(100, ttft_slo_s=0.0, model=trained())
    with off.admitted("a", 1, 5000), off.admitted("b", 1, 5000):
        off.check("c", 1, 5000)
    assert off.num_rejected == 0


# -- HTTP: 413 for oversize, Retry-After on 429 -------------------------------------------------


async def _parts(*chunks: bytes) -> AsyncIterator[bytes]:
    for c in chunks:
        yield c


def test_a_body_over_the_limit_is_a_413_naming_the_limit() -> None:
    for declared, parts in (("2048", (b"x",)), (None, (b"x" * 600, b"x" * 600))):
        with pytest.raises(PDServeError) as e:
            asyncio.run(read_body(_parts(*parts), declared, 1024))
        err = e.value
        assert err.code == ErrorCode.PAYLOAD_TOO_LARGE and err.retry_after_s is None
        assert "1024" in err.message and "router.max_request_bytes" in err.message
        status, body = openai_error(err)
        # 413, not 429: the OpenAI SDKs retry a 429 (resending the body), never a 413
        assert status == 413 and body["error"]["type"] == "invalid_request_error"
        assert grpc_status(err) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "retry-after" not in error_response(err).headers
    assert asyncio.run(read_body(_parts(b"a" * 512, b"b" * 512), "1024", 1024)) == (
        b"a" * 512 + b"b" * 512
    )


def test_an_overload_429_carries_retry_after_in_whole_seconds() -> None:
    for delay, header in ((0.05, "1"), (1.0, "1"), (2.3, "3")):
        err = PDServeError(ErrorCode.RESOURCE_EXHAUSTED, "full", "r", retry_after_s=delay)
        response = error_response(err)
        assert response.status_code == 429 and response.headers["retry-after"] == header


def test_the_retry_delay_survives_serialization_between_replicas() -> None:
    import pickle

    err = PDServeError(ErrorCode.RESOURCE_EXHAUSTED, "full", "r", retry_after_s=2.5)
    back = pickle.loads(pickle.dumps(err))
    assert (back.code, back.message, back.request_id, back.retry_after_s) == (
        err.code,
        "full",
        "r",
        2.5,
    )


# -- gRPC: pushback on refusal, bounded health watches -------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Listener:
    """A ``GrpcListener`` on its own event loop thread, ready() and admission under the test's
    control."""

    def __init__(self, max_watches: int) -> None:
        self.serving = True
        self.admission = Admission(1)
        config = RouterConfig(grpc_port=_free_port(), max_health_watches=max_watches)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def generate(*args: Any) -> AsyncIterator[Any]:
            raise AssertionError("refused before this")
            yield  # pragma: no cover

        async def start() -> tuple[GrpcListener, int]:
            server = GrpcListener(
                config,
                generate=generate,
                model_info=lambda md: pb.ModelInfo(),
                ready=lambda: self.serving,
                admit=self.admission.check,
            )
            return server, await server.start()

        self.server, self.port = asyncio.run_coroutine_threadsafe(start(), self.loop).result(30)

    def channel(self) -> grpc.Channel:
        # one channel per connection: grpc would otherwise share a subchannel between them
        return grpc.insecure_channel(
            f"127.0.0.1:{self.port}", options=[("grpc.use_local_subchannel_pool", 1)]
        )

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    server = Listener(max_watches=6)
    try:
        yield server
    finally:
        server.close()


def test_a_grpc_refusal_carries_the_retry_delay_as_pushback(listener: Listener) -> None:
    with listener.admission.admitted("holder"), listener.channel() as channel:
        told = listener.admission.retry_after_s()  # one place, nobody refused before
        stub = pb_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(prompt="x"), timeout=10))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    trailers = dict(e.value.trailing_metadata())
    assert int(trailers[RETRY_PUSHBACK]) == round(told * 1000)


def _open_watch(channel: grpc.Channel) -> Any:
    call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=30)
    return call, next(call).status  # the first message: the status now


def test_health_watches_are_bounded_per_connection_and_in_total(listener: Listener) -> None:
    first, second = listener.channel(), listener.channel()
    calls = []
    try:
        for _ in range(WATCHES_PER_CONNECTION):
            call, status = _open_watch(first)
            calls.append(call)
            assert status == SERVING
        with pytest.raises(grpc.RpcError) as e:
            _open_watch(first)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "per connection" in e.value.details()
        for _ in range(6 - WATCHES_PER_CONNECTION):  # the total limit, from another connection
            calls.append(_open_watch(second)[0])
        with pytest.raises(grpc.RpcError) as e:
            _open_watch(second)
        assert "router.max_health_watches=6" in e.value.details()
        # a Check is not a watch: still answered
        assert health_pb2_grpc.HealthStub(second).Check(health_pb2.HealthCheckRequest()).status
        # every open watch hears a change, from the one shared poll
        listener.serving = False
        assert all(next(call).status == NOT_SERVING for call in calls)
        # a closed watch gives its place back
        calls.pop().cancel()
        deadline = time.monotonic() + 10
        while listener.server._health.num_open > 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        calls.append(_open_watch(second)[0])
        assert listener.server._health.num_open == 6
    finally:
        for call in calls:
            call.cancel()
        first.close()
        second.close()
    deadline = time.monotonic() + 10
    while listener.server._health.num_open and time.monotonic() < deadline:
        time.sleep(0.02)
    assert listener.server._health.num_open == 0  # nothing left holding a place


def test_health_watches_wake_only_on_a_change(listener: Listener) -> None:
    """An open watch costs no wake-up while the status holds: the shared poll reads ready()
    four times a second whatever the number of watches, and the watches sleep on one event."""
    reads = 0
    serving = listener.serving

    def ready() -> bool:
        nonlocal reads
        reads += 1
        return serving

    listener.server._health._ready = ready
    with listener.channel() as channel:
        calls = [_open_watch(channel)[0] for _ in range(WATCHES_PER_CONNECTION)]
        before, t0 = reads, time.monotonic()
        time.sleep(1.0)
        polls = reads - before
        elapsed = time.monotonic() - t0
        for call in calls:
            call.cancel()
    # one poll per period (a per-watch poll would read 4x as often); generous for a slow box
    assert polls <= elapsed / 0.25 + 2, (polls, elapsed)
