"""A small test-only RPC between processes: msgpack over a zmq ROUTER/DEALER pair (loopback).

Methods are async generators (streams) or coroutines on a server object; a call carries an id,
the reply stream ends with ``end`` or ``error``; the client cancels a call by sending ``cancel``.
The messages between pools travel as tagged maps, nested ones too (a reply's ``KVTransferParams``
and its ``KVLayout``), tuples tagged as such, so each side reads back the very types it was
sent; no pickle.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import itertools
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from cluster.common.errors import ErrorCode, PDServeError
from cluster.common.kv_layout import KVLayout
from cluster.common.kv_params import KVTransferParams
from cluster.common.protocol import (
    FirstToken,
    GenerateCall,
    PrefillCall,
    PrefillProgress,
    PrefillReply,
    StreamChunk,
    Usage,
)
from cluster.common.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_TYPES: dict[str, Any] = {
    c.__name__: c
    for c in (
        GenerateCall,
        PrefillCall,
        PrefillProgress,
        PrefillReply,
        FirstToken,
        StreamChunk,
        Usage,
        KVTransferParams,
        KVLayout,
    )
}


def _enc(obj: Any) -> Any:
    if isinstance(obj, SamplingParams):
        return {"__t": "SamplingParams", "v": _enc(obj.to_dict())}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        if type(obj).__name__ not in _TYPES:
            raise TypeError(f"the test RPC does not carry {type(obj).__name__}")
        return {
            "__t": type(obj).__name__,
            "v": {f.name: _enc(getattr(obj, f.name)) for f in dataclasses.fields(obj)},
        }
    if isinstance(obj, tuple):
        return {"__tuple": [_enc(x) for x in obj]}
    if isinstance(obj, list):
        return [_enc(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _enc(v) for k, v in obj.items()}
    return obj


def _dec(obj: Any) -> Any:
    if isinstance(obj, list):
        return [_dec(x) for x in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tuple" in obj:
        return tuple(_dec(x) for x in obj["__tuple"])
    tag = obj.get("__t")
    if tag == "SamplingParams":
        return SamplingParams.from_dict(_dec(obj["v"]))
    if tag in _TYPES:
        return _TYPES[tag](**{k: _dec(v) for k, v in obj["v"].items()})
    return {k: _dec(v) for k, v in obj.items()}


def pack(obj: Any) -> bytes:
    return msgpack.packb(_enc(obj), use_bin_type=True)


def unpack(data: bytes) -> Any:
    return _dec(msgpack.unpackb(data, raw=False, strict_map_key=False))


class RpcServer:
    def __init__(self, target: Any, host: str = "127.0.0.1", port: int = 0) -> None:
        self.target = target
        self.ctx = zmq.asyncio.Context()
        self.ctx.linger = 0  # never block interpreter exit or GC on queued messages
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if port:
            self.sock.bind(f"tcp://{host}:{port}")
        else:
            port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self._tasks: dict[tuple[bytes, int], asyncio.Task[None]] = {}

    async def serve_forever(self) -> None:
        while True:
            ident, data = await self.sock.recv_multipart()
            msg = unpack(data)
            key = (ident, msg["id"])
            if msg.get("cancel"):
                task = self._tasks.pop(key, None)
                if task is not None:
                    task.cancel()
                continue
            self._tasks[key] = asyncio.create_task(self._run(ident, msg))

    async def _send(self, ident: bytes, cid: int, kind: str, value: Any = None) -> None:
        await self.sock.send_multipart([ident, pack({"id": cid, "kind": kind, "value": value})])

    async def _run(self, ident: bytes, msg: dict[str, Any]) -> None:
        cid = msg["id"]
        logger.debug("rpc %s #%s start", msg["method"], cid)
        try:
            fn = getattr(self.target, msg["method"])
            result = fn(*msg.get("args", []))
            if inspect.isasyncgen(result):
                async for item in result:
                    await self._send(ident, cid, "item", item)
            else:
                if inspect.isawaitable(result):
                    result = await result
                await self._send(ident, cid, "item", result)
            await self._send(ident, cid, "end")
        except asyncio.CancelledError:
            pass
        except PDServeError as e:
            await self._send(ident, cid, "error", {"code": e.code.value, "message": e.message})
        except Exception as e:  # reported to the caller; the server keeps serving
            await self._send(
                ident, cid, "error", {"code": "INTERNAL", "message": f"{type(e).__name__}: {e}"}
            )
        finally:
            logger.debug("rpc %s #%s end", msg["method"], cid)
            self._tasks.pop((ident, cid), None)


class RpcClient:
    """One DEALER connection; calls may run concurrently from one event loop."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.ctx = zmq.asyncio.Context()
        self.ctx.linger = 0  # never block interpreter exit or GC on queued messages
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # A killed peer must fail its calls, not leave them waiting forever.
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, 200)
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 1000)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.sock.connect(endpoint)
        self._ids = itertools.count(1)
        self._queues: dict[int, asyncio.Queue[dict[str, Any]]] = {}
        self._reader: asyncio.Task[None] | None = None

    async def _read(self) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        while True:
            events = dict(await poller.poll())
            if self.monitor in events:
                await self.monitor.recv_multipart()
                gone = {"code": "UNAVAILABLE", "message": f"peer {self.endpoint} disconnected"}
                for q in self._queues.values():
                    q.put_nowait({"kind": "error", "value": gone})
            if self.sock in events:
                (data,) = await self.sock.recv_multipart()
                msg = unpack(data)
                q = self._queues.get(msg["id"])
                if q is not None:
                    q.put_nowait(msg)

    async def stream(self, method: str, *args: Any) -> AsyncIterator[Any]:
        if self._reader is None:
            self._reader = asyncio.create_task(self._read())
        cid = next(self._ids)
        q: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._queues[cid] = q
        done = False
        try:
            await self.sock.send_multipart(
                [pack({"id": cid, "method": method, "args": list(args)})]
            )
            while True:
                msg = await q.get()
                if msg["kind"] == "item":
                    yield msg["value"]
                elif msg["kind"] == "end":
                    done = True
                    return
                else:
                    done = True
                    err = msg["value"]
                    raise PDServeError(ErrorCode(err["code"]), err["message"])
        finally:
            self._queues.pop(cid, None)
            if not done:
                await self.sock.send_multipart([pack({"id": cid, "cancel": True})])

    async def call(self, method: str, *args: Any) -> Any:
        async for item in self.stream(method, *args):
            result = item
        return result

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)
        self.ctx.term()
