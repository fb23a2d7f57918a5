"""The router replica's own gRPC server: ``pdserve.v1.Generation`` and ``grpc.health.v1.Health``.

Served here, not through Ray Serve's gRPC proxy: that proxy binds every interface (``[::]``)
whatever ``router.host`` says, and takes no per-connection limit, no TLS and no parse errors of
ours. This server:

  * listens on ``router.host:router.grpc_port`` only (SO_REUSEPORT: the router replicas of one
    node share the port, the kernel spreads connections over them);
  * speaks TLS when ``router.tls_cert_file`` / ``tls_key_file`` are set, and requires client
    certificates signed by ``router.tls_client_ca_file`` when that is set (mTLS);
  * refuses a message over ``router.max_request_bytes`` (RESOURCE_EXHAUSTED, before parsing),
    more than ``router.max_streams_per_connection`` concurrent calls on one connection and,
    through the router's admission control (``admit``), more than it lets in at once
    (RESOURCE_EXHAUSTED at once, before parsing, nothing queued, with the retry delay as
    ``grpc-retry-pushback-ms``), and more than ``max_calls`` calls of any kind at once;
  * parses each request itself, so bytes that are not a valid message (invalid UTF-8 in a
    string field, a truncated field) are INVALID_ARGUMENT, not INTERNAL;
  * ends every failed call with a code and a short message naming the request id, never an
    exception's text (the details go to the log).
The health service reports what ``ready()`` says (SERVING only once both pools can take a
request), for the whole server (``""``) and for ``pdserve.v1.Generation``; its ``Watch`` streams
are bounded and share one poll (``HealthWatches``). Server reflection is on (grpcurl).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection

from cluster.common.errors import ErrorCode, PDServeError, internal_error
from cluster.config import RouterConfig
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.router.responses import grpc_status

logger = logging.getLogger(__name__)

GENERATION = "pdserve.v1.Generation"
HEALTH = "grpc.health.v1.Health"
WATCH_PERIOD_S = 0.25
WATCHES_PER_CONNECTION = 4
RETRY_PUSHBACK = "grpc-retry-pushback-ms"

Metadata = Mapping[str, str]
# (request, metadata, seconds the client's deadline leaves or None) -> response messages
GenerateFn = Callable[[pb.GenerateRequest, Metadata, "float | None"], AsyncIterator[Any]]
ModelInfoFn = Callable[[Metadata], pb.ModelInfo]


def server_credentials(config: RouterConfig) -> grpc.ServerCredentials | None:
    """TLS (and mTLS) credentials from ``router.tls_*``; None: plaintext."""
    if not config.tls_cert_file:
        return None

    def read(field: str) -> bytes:
        path = getattr(config, field)
        try:
            return Path(path).expanduser().read_bytes()
        except OSError as e:
            raise ValueError(f"router.{field}: cannot read {path!r}: {e.strerror}") from None

    client_ca = read("tls_client_ca_file") if config.tls_client_ca_file else None
    return grpc.ssl_server_credentials(
        [(read("tls_key_file"), read("tls_cert_file"))],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


def _parse(cls: type[Message], data: bytes, what: str) -> Any:
    try:
        return cls.FromString(data)
    except DecodeError:
        raise PDServeError(
            ErrorCode.INVALID_ARGUMENT,
            f"request: not a valid {what} message (a string field must be valid UTF-8)",
        ) from None


def _status_details(e: PDServeError) -> str:
    return f"{e.message} (request {e.request_id})" if e.request_id else e.message


async def _abort(context: grpc.aio.ServicerContext, e: PDServeError) -> None:
    """End a call with the error's status; an overload refusal carries its retry delay as
    gRPC's server pushback (``grpc-retry-pushback-ms``), which a client's retry policy obeys."""
    if e.retry_after_s is not None:
        pushback = str(max(1, round(e.retry_after_s * 1000)))
        context.set_trailing_metadata(((RETRY_PUSHBACK, pushback),))
    await context.abort(grpc_status(e), _status_details(e))


class HealthWatches:
    """The open health ``Watch`` streams: bounded (``router.max_health_watches`` in all,
    ``WATCHES_PER_CONNECTION`` on one connection), and sharing one poll of ``ready()`` every
    ``WATCH_PERIOD_S`` while any is open; a watch wakes only when the status changes."""

    def __init__(self, ready: Callable[[], bool], limit: int) -> None:
        self._ready = ready
        self.limit = limit
        self.num_open = 0
        self.num_rejected = 0
        self._per_peer: collections.Counter[str] = collections.Counter()
        self._changed = asyncio.Event()
        self._serving: bool | None = None
        self._poller: asyncio.Task[None] | None = None

    def join(self, peer: str) -> None:
        if self.num_open >= self.limit or self._per_peer[peer] >= WATCHES_PER_CONNECTION:
            self.num_rejected += 1
            raise PDServeError(
                ErrorCode.RESOURCE_EXHAUSTED,
                f"too many health watches (router.max_health_watches={self.limit}, "
                f"{WATCHES_PER_CONNECTION} per connection)",
            )
        self.num_open += 1
        self._per_peer[peer] += 1
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll())

    def leave(self, peer: str) -> None:
        self.num_open -= 1
        self._per_peer[peer] -= 1
        if self._per_peer[peer] <= 0:
            del self._per_peer[peer]

    def next_change(self) -> asyncio.Event:
        """An event set at the next change of the serving status."""
        return self._changed

    async def _poll(self) -> None:
        try:
            while self.num_open:
                serving = self._ready()
                if serving != self._serving:
                    self._serving = serving
                    self._changed.set()  # wakes every watch once: each sends its status
                    self._changed = asyncio.Event()
                await asyncio.sleep(WATCH_PERIOD_S)
        finally:
            self._poller = None


class GrpcListener:
    def __init__(
        self,
        config: RouterConfig,
        *,
        generate: GenerateFn,
        model_info: ModelInfoFn,
        ready: Callable[[], bool],
        admit: Callable[[], None],
        max_calls: int | None = None,
    ) -> None:
        self.config = config
        self._generate_fn = generate
        self._model_info_fn = model_info
        self._ready = ready
        self._admit_fn = admit
        self._streams: collections.Counter[str] = collections.Counter()  # per connection
        self._health = HealthWatches(ready, config.max_health_watches)
        self.num_rejected = 0
        self.port = 0
        limit = config.max_request_bytes
        self._server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", max(limit, 4 << 20)),
                ("grpc.so_reuseport", 1),
                # HTTP/2's own cap, well above ours (calls between the two get our
                # RESOURCE_EXHAUSTED; beyond it the stream is refused, REFUSED_STREAM, which a
                # client sees as UNAVAILABLE): no client can open unbounded streams at all.
                ("grpc.max_concurrent_streams", 4 * config.max_streams_per_connection),
            ],
            # Calls of every kind at once (health checks, reflection included): beyond it gRPC
            # itself answers RESOURCE_EXHAUSTED, before any handler runs.
            maximum_concurrent_rpcs=max_calls,
        )
        self._server.add_generic_rpc_handlers((self._generation_handler(), self._health_handler()))
        # Server reflection (grpcurl, grpcui): the API's schema, public like the .proto.
        reflection.enable_server_reflection(
            (GENERATION, HEALTH, reflection.SERVICE_NAME), self._server
        )

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> int:
        address = f"{self.config.host}:{self.config.grpc_port}"
        if ":" in self.config.host:  # an IPv6 literal
            address = f"[{self.config.host}]:{self.config.grpc_port}"
        creds = server_credentials(self.config)
        try:
            if creds is None:
                self.port = self._server.add_insecure_port(address)
            else:
                self.port = self._server.add_secure_port(address, creds)
        except RuntimeError as e:
            raise ValueError(f"router.grpc_port: cannot listen on {address}: {e}") from None
        await self._server.start()
        logger.info("gRPC listening on %s (%s)", address, "TLS" if creds else "plaintext")
        return self.port

    async def stop(self, grace_s: float) -> None:
        await self._server.stop(grace_s)

    # -- handlers -----------------------------------------------------------------------------

    def _generation_handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            GENERATION,
            {
                "Generate": grpc.unary_stream_rpc_method_handler(
                    self._generate, response_serializer=pb.GenerateResponse.SerializeToString
                ),
                "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                    self._model_info, response_serializer=pb.ModelInfo.SerializeToString
                ),
            },
        )

    def _health_handler(self) -> grpc.GenericRpcHandler:
        reply = health_pb2.HealthCheckResponse.SerializeToString
        return grpc.method_handlers_generic_handler(
            HEALTH,
            {
                "Check": grpc.unary_unary_rpc_method_handler(
                    self._check, response_serializer=reply
                ),
                "Watch": grpc.unary_stream_rpc_method_handler(
                    self._watch, response_serializer=reply
                ),
            },
        )

    def _admit(self, peer: str) -> None:
        if self._streams[peer] >= self.config.max_streams_per_connection:
            self.num_rejected += 1
            raise PDServeError(
                ErrorCode.RESOURCE_EXHAUSTED,
                "too many concurrent calls on this connection "
                f"(router.max_streams_per_connection={self.config.max_streams_per_connection})",
            )
        self._admit_fn()  # the router's admission control: full raises RESOURCE_EXHAUSTED
        self._streams[peer] += 1

    def _leave(self, peer: str) -> None:
        self._streams[peer] -= 1
        if self._streams[peer] <= 0:
            del self._streams[peer]

    async def _generate(self, data: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        peer = context.peer()
        try:
            self._admit(peer)
        except PDServeError as e:
            await _abort(context, e)
        request_id = ""
        stream: AsyncIterator[Any] | None = None
        try:
            request = _parse(pb.GenerateRequest, data, "GenerateRequest")
            request_id = request.request_id
            metadata = dict(context.invocation_metadata() or ())
            stream = self._generate_fn(request, metadata, context.time_remaining())
            async for msg in stream:
                yield msg
        except PDServeError as e:
            await _abort(context, e)
        except Exception:
            logger.exception("gRPC Generate failed (request %s)", request_id or "-")
            details = _status_details(internal_error(request_id))
            await context.abort(grpc.StatusCode.INTERNAL, details)
        finally:
            self._leave(peer)
            if stream is not None:  # a cancelled call: the request ends in every pool
                await stream.aclose()  # type: ignore[attr-defined]

    async def _model_info(self, data: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            _parse(pb.ModelInfoRequest, data, "ModelInfoRequest")
            return self._model_info_fn(dict(context.invocation_metadata() or ()))
        except PDServeError as e:
            await _abort(context, e)

    def _status(self, service: str) -> int:
        if service not in ("", GENERATION):
            raise PDServeError(ErrorCode.NOT_FOUND, f"service {service!r}: unknown")
        serving = self._ready()
        return int(
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )

    async def _check(self, data: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            req = _parse(health_pb2.HealthCheckRequest, data, "HealthCheckRequest")
            return health_pb2.HealthCheckResponse(status=self._status(req.service))
        except PDServeError as e:
            await context.abort(grpc_status(e), e.message)

    async def _watch(self, data: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        peer = context.peer()
        try:
            req = _parse(health_pb2.HealthCheckRequest, data, "HealthCheckRequest")
            self._status(req.service)  # an unknown service: NOT_FOUND before taking a place
            self._health.join(peer)
        except PDServeError as e:
            await context.abort(grpc_status(e), e.message)
        try:
            last = None
            while True:
                changed = self._health.next_change()
                status = self._status(req.service)
                if status != last:
                    yield health_pb2.HealthCheckResponse(status=status)
                    last = status
                await changed.wait()
        finally:
            self._health.leave(peer)


def deadline_within(deadline: float | None, remaining_s: float | None) -> float | None:
    """A request's wall-clock deadline, no later than what the client's gRPC deadline leaves."""
    if remaining_s is None:
        return deadline
    bound = time.time() + remaining_s
    return bound if deadline is None else min(deadline, bound)
