"""The Router: the Ray Serve ingress for OpenAI-compatible HTTP (port 8000, through Serve's HTTP
proxy) and gRPC (port 9000, on each router replica's own server: ``grpc_server``), both on
``router.host`` only; public listeners without API keys are refused unless
``router.allow_unauthenticated`` (``auth.check_exposure``).

Torch-free (a test imports it in a fresh interpreter and checks). Each request:
  1. is authenticated (API keys, when configured: every route and method but health);
  2. is validated and tokenized here, its block hashes computed: a bad request gets
     INVALID_ARGUMENT / HTTP 400 naming the field before any worker is touched;
  3. is streamed from a decode replica (``DecodeRelay``: retries only before the first token);
  4. ends with usage (tokens, cached tokens, local vs remote prefill, per-phase times) and
     metrics. Errors carry a code and a message, never a stack trace.
The request id travels through every pool and appears in every log line about it.
"""

# No ``from __future__ import annotations`` here: FastAPI must see real annotation objects
# (``Request``) on the methods Ray Serve's ingress wraps, or it takes them for query parameters.
# The gRPC methods' protobuf annotations stay strings: Serve pickles the app, and protobuf
# descriptors do not pickle.
import asyncio
import collections
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from cluster.common.errors import PDServeError, internal_error
from cluster.common.faults import FaultPoints
from cluster.common.protocol import StreamChunk
from cluster.common.tokenizer import load_tokenizer
from cluster.config import config_from_dict
from cluster.config.model import declared_formats
from cluster.config.model_paths import model_limits, model_name
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.router.admission import Admission
from cluster.router.auth import ApiKeyAuth, check_exposure
from cluster.router.grpc_server import GrpcListener, deadline_within
from cluster.router.readiness import Readiness
from cluster.router.relay import DecodeRelay
from cluster.router.requests import ParsedRequest, RequestParser, json_object, read_body
from cluster.router.responses import (
    ChatStream,
    CompletionStream,
    aggregate_chat,
    aggregate_completion,
    error_event,
    error_response,
    grpc_chunk,
)
from cluster.serving.heap import freeze_startup_heap, heap_stats
from cluster.serving.metrics import RouterMetrics
from cluster.serving.options import router_admission_limit
from cluster.serving.routers import recent_ranking_ms

logger = logging.getLogger(__name__)


T = TypeVar("T")
INLINE_PARSE_BYTES = 64 << 10  # bigger requests are parsed and tokenized off the event loop


app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)


@serve.deployment(name="Router")
@serve.ingress(app)
class Router:
    async def __init__(self, config: dict[str, Any], decode_handle: Any) -> None:  # type: ignore[misc]
        self.config = config_from_dict(config)
        r = self.config.router
        warning = check_exposure(r)  # ValueError: public listeners without API keys
        if warning:
            logger.warning(warning)
        self.model = r.model_name or model_name(self.config)
        self.limits = model_limits(self.config)
        self.parser = RequestParser(
            load_tokenizer(self.config),
            self.limits,
            self.model,
            self.config.cache.block_size,
            r,
        )
        self.auth = ApiKeyAuth(r)
        self.relay = DecodeRelay(decode_handle, r)
        self.decode_handle = decode_handle
        self.metrics = RouterMetrics()
        self.faults = FaultPoints.from_config(self.config.testing)  # inert outside test mode
        # requests, errors, and the tokens of finished requests' usage (what clients were told)
        self.counts = {"requests": 0, "errors": 0, "prompt_tokens": 0, "completion_tokens": 0}
        # Milliseconds from receipt to a parsed, tokenized, hashed request, per API (latest).
        self.parse_ms: dict[str, collections.deque[float]] = collections.defaultdict(
            lambda: collections.deque(maxlen=4096)
        )
        # One thread: big requests are parsed one at a time, the event loop keeps a core.
        self._parse_pool = ThreadPoolExecutor(1, thread_name_prefix="router-parse")
        self.readiness = Readiness(
            self._pools_ready,
            period_s=r.readiness_period_s,
            timeout_s=max(2.0, 4 * r.readiness_period_s),
        )
        self.admission = Admission(
            router_admission_limit(self.config), ttft_slo_s=r.ttft_slo_ms / 1000
        )
        self.grpc = GrpcListener(
            r,
            generate=self._grpc_generate,
            model_info=self._model_info,
            ready=lambda: self.readiness.ready,
            admit=self.admission.check,
            # admitted generations + health watches + room for checks and reflection
            max_calls=self.admission.limit + r.max_health_watches + 64,
        )
        await self.grpc.start()
        self.readiness.start()
        freeze_startup_heap("router")  # last: the tokenizer and the listeners are up

    async def __del__(self) -> None:
        # Graceful shutdown (Serve calls it): open gRPC streams get the grace period.
        readiness = getattr(self, "readiness", None)
        if readiness is not None:
            readiness.stop()
        listener = getattr(self, "grpc", None)
        if listener is not None:
            await listener.stop(self.config.router.graceful_shutdown_timeout_s)
            self._parse_pool.shutdown(wait=False)

    # -- the shared path ----------------------------------------------------------------------

    async def _run(self, parsed: ParsedRequest, route: str) -> AsyncGenerator[StreamChunk, None]:
        """Stream one validated request; records metrics; raises PDServeError."""
        t0 = time.monotonic()
        first: float | None = None
        status = "ok"
        usage = None
        self.counts["requests"] += 1
        logger.info(
            "request %s: %s, %d prompt tokens",
            parsed.call_id,
            route,
            len(parsed.prompt_token_ids),
        )
        try:
            with self.admission.admitted(
                parsed.request_id, parsed.num_samples, len(parsed.prompt_token_ids)
            ) as ticket:
                async with contextlib.aclosing(self._relay(parsed, t0)) as relayed:
                    async for chunk in relayed:
                        if chunk.token_ids or chunk.text:
                            self.readiness.saw_progress()
                            if first is None:
                                first = time.monotonic()
                                self.admission.first_token(ticket)
                        if chunk.usage is not None:
                            usage = chunk.usage
                        yield chunk
        except PDServeError as e:
            status = e.code.value.lower()
            self.counts["errors"] += 1
            logger.warning("request %s: %s", parsed.call_id, e)
            e.request_id = parsed.request_id
            raise
        except Exception:
            # A bug: the details go to the log, the client gets a code and the request id.
            status = "internal"
            self.counts["errors"] += 1
            logger.exception("request %s failed", parsed.call_id)
            raise internal_error(parsed.request_id) from None
        except BaseException:
            status = "cancelled"
            raise
        finally:
            if usage is not None:
                self.counts["prompt_tokens"] += usage.prompt_tokens
                self.counts["completion_tokens"] += usage.completion_tokens
            self.metrics.observe_finished(
                route,
                status,
                None if first is None else first - t0,
                time.monotonic() - t0,
                usage.completion_tokens if usage else 0,
                usage.prompt_tokens if usage else 0,
                usage.phases if usage else None,
            )

    async def _relay(self, parsed: ParsedRequest, t0: float) -> AsyncGenerator[StreamChunk, None]:
        await self.faults.hit_async("router.before_relay")
        stream = self.relay.stream(parsed.to_call((time.monotonic() - t0) * 1000))
        try:
            async for chunk in stream:
                # the client's id, not the cluster's
                yield dataclasses.replace(chunk, request_id=parsed.request_id)
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    # -- gRPC (the replica's own server: router/grpc_server.py) ------------------------------

    async def _grpc_generate(
        self, request: "pb.GenerateRequest", metadata: Mapping[str, str], remaining_s: float | None
    ) -> "AsyncIterator[pb.GenerateResponse]":
        t0 = time.perf_counter()
        self.auth.check(metadata.get("authorization"))
        parsed = await self._parse(lambda: self.parser.from_grpc(request), request.ByteSize())
        self.parse_ms["grpc"].append((time.perf_counter() - t0) * 1000)
        parsed.deadline = deadline_within(parsed.deadline, remaining_s)
        async with contextlib.aclosing(self._run(parsed, "grpc")) as chunks:
            async for chunk in chunks:
                yield grpc_chunk(chunk)

    def _model_info(self, metadata: Mapping[str, str]) -> "pb.ModelInfo":
        self.auth.check(metadata.get("authorization"))
        return pb.ModelInfo(
            model=self.model,
            max_model_len=self.limits.max_model_len,
            vocab_size=self.limits.vocab_size,
            block_size=self.config.cache.block_size,
        )

    # -- OpenAI-compatible HTTP ---------------------------------------------------------------

    async def _body(self, request: Request) -> bytes:
        self.auth.check(request.headers.get("authorization"))
        return await read_body(
            request.stream(),
            request.headers.get("content-length"),
            self.config.router.max_request_bytes,
        )

    async def _parse(self, parse: Callable[[], T], size: int) -> T:
        """Validate and tokenize: a small request here, a big one on the parse thread, so that
        a few MiB of text never stall this event loop (health, other requests: B10)."""
        if size <= INLINE_PARSE_BYTES:
            return parse()
        return await asyncio.get_running_loop().run_in_executor(self._parse_pool, parse)

    async def _http(self, request: Request, kind: str) -> Response:
        try:
            self.admission.check()  # before reading anything: overload costs nothing
            t0 = time.perf_counter()
            raw = await self._body(request)
            from_body = self.parser.from_chat if kind == "chat" else self.parser.from_completion
            parsed = await self._parse(lambda: from_body(json_object(raw)), len(raw))
            self.parse_ms[kind].append((time.perf_counter() - t0) * 1000)
            # Before a stream's headers go out: a refusal is a 429, not an error event.
            self.admission.check(
                parsed.request_id, parsed.num_samples, len(parsed.prompt_token_ids)
            )
        except PDServeError as e:
            return error_response(e)
        except Exception:
            logger.exception("HTTP %s request failed before it was parsed", kind)
            return error_response(internal_error(""))
        route = "chat" if kind == "chat" else "completions"
        if parsed.stream:
            stream_cls = ChatStream if kind == "chat" else CompletionStream
            fmt = stream_cls(parsed, self.model, self.parser.tokenizer)
            return StreamingResponse(
                self._sse(parsed, route, fmt),
                media_type="text/event-stream",
                headers={"x-request-id": parsed.request_id},
            )
        chunks: list[StreamChunk] = []
        try:
            async with contextlib.aclosing(self._run(parsed, route)) as stream:
                async for chunk in stream:
                    chunks.append(chunk)
        except PDServeError as e:
            return error_response(e)
        aggregate = aggregate_chat if kind == "chat" else aggregate_completion
        return JSONResponse(
            aggregate(parsed, self.model, chunks, self.parser.tokenizer),
            headers={"x-request-id": parsed.request_id},
        )

    async def _sse(self, parsed: ParsedRequest, route: str, fmt: Any) -> AsyncIterator[str]:
        try:
            async with contextlib.aclosing(self._run(parsed, route)) as chunks:
                async for chunk in chunks:
                    for event in fmt.events(chunk):
                        yield event
            for event in fmt.finish():
                yield event
        except PDServeError as e:
            # Headers are gone: the error travels as a final SSE event (never a silent cut).
            yield error_event(e)
        except Exception:
            logger.exception("request %s: rendering the stream failed", parsed.request_id)
            yield error_event(internal_error(parsed.request_id))

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._http(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._http(request, "chat")

    @app.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        """The token ids of a prompt (``prompt``) or of chat messages (``messages``)."""
        return await self._utility(request, self.parser.tokenize)

    @app.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        """The text of token ids (``tokens``)."""
        return await self._utility(request, self.parser.detokenize)

    async def _utility(
        self, request: Request, handle: Callable[[dict[str, Any]], dict[str, Any]]
    ) -> Response:
        try:
            raw = await self._body(request)
            return JSONResponse(await self._parse(lambda: handle(json_object(raw)), len(raw)))
        except PDServeError as e:
            return error_response(e)

    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        try:
            self.auth.check(request.headers.get("authorization"))
        except PDServeError as e:
            return error_response(e)
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model,
                        "object": "model",
                        "created": 0,
                        "owned_by": "pdserve",
                        "max_model_len": self.limits.max_model_len,
                        **declared_formats(self.config.model, self.config.cache),
                    }
                ],
            }
        )

    @app.get("/health")
    async def health(self) -> Response:
        """Readiness (no key needed): 200 once both pools can take a request, else 503."""
        if self.readiness.ready:
            return JSONResponse({"status": "ok"})
        return JSONResponse(
            {"status": "unavailable", "reason": self.readiness.reason}, status_code=503
        )

    async def _pools_ready(self) -> bool:
        return bool(await self.decode_handle.ready.remote())

    # -- introspection (tests, operators) -----------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return {
            **self.counts,
            "retries": self.relay.num_retries,
            "migrations": dict(self.relay.migrations),
            "parse_ms": {k: list(v) for k, v in self.parse_ms.items()},
            "ranking_ms": recent_ranking_ms(),  # the decode pool's routing, in this process
            "paused_faults": self.faults.paused(),
            "in_flight": self.admission.num_inflight,
            "rejected": self.admission.num_rejected,
            "rejected_slo": self.admission.num_rejected_slo,
            "ttft_model": self.admission.model.state(),
            "ready": self.readiness.ready,
            "heap": heap_stats(),
        }

    def pid(self) -> int:
        return os.getpid()

    def arm_fault(self, spec: str) -> str:
        """Test mode only (``testing.enabled``): arm a router fault point (``common.faults``)."""
        self.faults.arm(spec)
        return "ok"

    def release_fault(self, name: str) -> str:
        self.faults.release(name)
        return "ok"
