"""``retrying_stream``'s stall detection (F10), without Ray: a replica that keeps sending
keepalives is waited for however long it is quiet; one that falls silent is given up after
``stall_timeout_s`` (retried elsewhere before progress, raised after it)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from cluster.common.errors import ErrorCode, PDServeError
from cluster.common.protocol import Accepted
from cluster.serving.calls import KEEPALIVE, retrying_stream


class FakeResponse:
    """One replica's stream: ``script`` items, a float being a pause in seconds; ``None``
    hangs forever (a stopped process)."""

    def __init__(self, replica: str, script: list[Any]) -> None:
        self.script = [Accepted(replica), *script]
        self.cancelled = False

    def __aiter__(self) -> FakeResponse:
        return self

    async def __anext__(self) -> Any:
        while self.script:
            item = self.script.pop(0)
            if item is None:
                await asyncio.Event().wait()
            elif isinstance(item, float):
                await asyncio.sleep(item)
            else:
                return item
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True


def collect(
    responses: list[FakeResponse], stall_s: float, assign_s: float = 5.0
) -> tuple[list[Any], list[tuple]]:
    calls: list[tuple] = []

    def call(excluded: tuple[str, ...]) -> FakeResponse:
        calls.append(excluded)
        return responses[len(calls) - 1]

    async def main() -> list[Any]:
        out = []
        stream = retrying_stream(
            call, request_id="r", retries=2, assignment_timeout_s=assign_s, stall_timeout_s=stall_s
        )
        async for item in stream:
            out.append(item)
        return out

    return asyncio.run(main()), calls


def test_keepalives_carry_a_quiet_stream_past_the_stall_timeout() -> None:
    quiet = [0.1, KEEPALIVE] * 6  # 0.6 s of nothing but keepalives, stall timeout 0.3 s
    r = FakeResponse("a", ["t1", *quiet, "t2"])
    out, calls = collect([r], stall_s=0.3)
    assert out == ["t1", "t2"]  # keepalives are never yielded
    assert calls == [()]


def test_a_silent_replica_before_progress_is_retried_elsewhere() -> None:
    hung = FakeResponse("a", [None])
    good = FakeResponse("b", ["t1", "t2"])
    import ray.serve.exceptions  # noqa: F401  (imported by the error mapping: not timed here)

    t0 = time.monotonic()
    out, calls = collect([hung, good], stall_s=0.3)
    assert out == ["t1", "t2"]
    assert calls == [(), ("a",)]  # the hung replica excluded
    assert hung.cancelled
    assert time.monotonic() - t0 < 3.0  # generous: 0.3 s expected


def test_a_silent_replica_after_progress_is_unavailable_within_the_timeout() -> None:
    hung = FakeResponse("a", ["t1", None])
    import ray.serve.exceptions  # noqa: F401

    t0 = time.monotonic()
    with pytest.raises(PDServeError) as e:
        collect([hung, FakeResponse("b", ["x"])], stall_s=0.3)
    assert e.value.code == ErrorCode.UNAVAILABLE  # the router turns it into ABORTED
    assert "stopped responding" in str(e.value)
    assert hung.cancelled
    assert time.monotonic() - t0 < 3.0


class RefusedResponse(FakeResponse):
    """A call Serve refused before assigning it (its backpressure): the first item raises, and
    so does ``cancel``, as Ray's ``DeploymentResponseGenerator.cancel`` re-raises the refusal."""

    def __init__(self) -> None:
        super().__init__("", [])

    async def __anext__(self) -> Any:
        from ray.serve.exceptions import BackPressureError

        raise BackPressureError(num_queued_requests=32, max_queued_requests=32)

    def cancel(self) -> None:
        from ray.serve.exceptions import BackPressureError

        self.cancelled = True
        raise BackPressureError(num_queued_requests=32, max_queued_requests=32)


def test_a_call_refused_by_backpressure_stays_resource_exhausted() -> None:
    refused = RefusedResponse()
    with pytest.raises(PDServeError) as e:
        collect([refused], stall_s=0.3)
    assert e.value.code == ErrorCode.RESOURCE_EXHAUSTED  # not INTERNAL from the cancel
    assert refused.cancelled


def _rpc_error(code_name: str) -> Exception:
    import grpc

    code = getattr(grpc.StatusCode, code_name)
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="x")


class FailingResponse(FakeResponse):
    """Accepted, then the replica channel fails with ``error``."""

    def __init__(self, replica: str, error: Exception) -> None:
        super().__init__(replica, [])
        self.error = error

    async def __anext__(self) -> Any:
        if self.script:
            return self.script.pop(0)
        raise self.error


@pytest.mark.parametrize("code_name", ["UNAVAILABLE", "CANCELLED"])
def test_a_replica_channel_that_goes_away_before_progress_is_retried(code_name: str) -> None:
    """Serve's gRPC transport (router.pool_call_transport=grpc): a replica that dies or shuts
    down mid-call ends its stream UNAVAILABLE or CANCELLED from its side; both are retryable."""
    items, calls = collect(
        [FailingResponse("a", _rpc_error(code_name)), FakeResponse("b", ["t1"])], stall_s=5.0
    )
    assert items == ["t1"]
    assert calls == [(), ("a",)]


def test_another_replica_channel_error_is_internal_and_not_retried() -> None:
    failing = FailingResponse("a", _rpc_error("RESOURCE_EXHAUSTED"))
    with pytest.raises(PDServeError) as e:
        collect([failing, FakeResponse("b", ["t1"])], stall_s=5.0)
    assert e.value.code == ErrorCode.INTERNAL
    assert failing.cancelled


def test_the_transport_option_picks_serves_channel() -> None:
    from cluster.serving.calls import streaming_handle

    class Handle:
        def options(self, **kwargs: Any) -> dict[str, Any]:
            return kwargs

    assert streaming_handle(Handle(), "grpc") == {"stream": True, "_by_reference": False}
    assert streaming_handle(Handle(), "object_ref") == {"stream": True, "_by_reference": True}


class UnassignedResponse(FakeResponse):
    """A call no replica takes (an empty pool: Serve holds it, nothing ever arrives)."""

    def __init__(self) -> None:
        super().__init__("", [])
        self.script = [None]


def test_a_call_no_replica_accepts_is_unavailable_after_one_window() -> None:
    """Re-calling an empty pool would only wait the window again: 4 windows (20 s with the
    multi-node test's 5 s) before a request to a pool whose node died was refused."""
    import ray.serve.exceptions  # noqa: F401  (imported by the error mapping: not timed here)

    first, second = UnassignedResponse(), FakeResponse("b", ["t1"])
    t0 = time.monotonic()
    with pytest.raises(PDServeError) as e:
        collect([first, second], stall_s=5.0, assign_s=0.2)
    assert e.value.code == ErrorCode.UNAVAILABLE
    assert time.monotonic() - t0 < 2.0  # one window, generous for 2 shared cores
    assert first.cancelled and not second.cancelled  # called once
