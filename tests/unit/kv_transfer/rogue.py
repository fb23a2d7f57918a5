"""Hand-driven peers for forged-message tests: a rogue receiver (DEALER) and a rogue sender
(ROUTER) that speak raw frames, so tests can send what the real classes never would."""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from cluster.common.kv_layout import KVLayout
from cluster.kv_transfer.protocol import (
    Hello,
    HelloReply,
    KVTransferParams,
    Message,
    decode,
    encode,
)


class RogueClient:
    """A DEALER connected to a sender; ``send`` takes raw parts or a message."""

    def __init__(self, endpoint: str) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.ctx.linger = 0
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, msg: Message | None = None, parts: Sequence[bytes] = ()) -> None:
        self.sock.send_multipart([encode(msg)] if msg is not None else list(parts))

    def recv(self, timeout_ms: int = 3000) -> Message | None:
        if not self.sock.poll(timeout_ms):
            return None
        parts = self.sock.recv_multipart()
        return decode(parts[0])

    def handshake(self, layout: KVLayout) -> HelloReply:
        self.send(Hello("rogue", "rogue-host", os.getpid(), layout, ("zmq",)))
        reply = self.recv()
        assert isinstance(reply, HelloReply), reply
        return reply

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


class RogueSender:
    """A ROUTER that handshakes like a sender and answers each pull with ``respond``.

    ``respond(pull_request) -> list of raw multipart messages`` (headers already encoded);
    ``reply_fields`` overrides fields of its ``HelloReply`` (e.g. offer shm with a hostile path).
    """

    def __init__(
        self,
        layout: KVLayout,
        respond: Callable[[Any], list[list[bytes]]],
        *,
        num_blocks: int = 64,
        hello_layout: KVLayout | None = None,
        reply_fields: dict[str, Any] | None = None,
    ) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.ctx.linger = 0
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:0")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.layout = layout
        self.hello_layout = hello_layout or layout
        self.respond = respond
        self.num_blocks = num_blocks
        self.reply_fields = reply_fields or {}
        self.seen: list[Message] = []
        self.identities: list[bytes] = []  # receivers that connected, in order
        self._outbox: queue.SimpleQueue[list[bytes]] = queue.SimpleQueue()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def params(self, block_ids: Sequence[int], request_id: str = "rogue-req") -> KVTransferParams:
        return KVTransferParams(
            request_id=request_id,
            transfer_id=f"t-{request_id}",
            endpoint=self.endpoint,
            ipc_endpoint="",
            instance_id="rogue",
            epoch=1,
            host_id="elsewhere",
            block_ids=tuple(block_ids),
            block_hashes=(),
            num_tokens=len(block_ids) * self.layout.block_size,
            layout=self.layout,
        )

    def push(self, parts: list[bytes]) -> None:
        """Queue raw parts (identity first) for the rogue's own thread to send."""
        self._outbox.put(parts)

    def _run(self) -> None:
        while not self._stop:
            while not self._outbox.empty():
                self.sock.send_multipart(self._outbox.get())
            if not self.sock.poll(5):
                continue
            identity, *parts = self.sock.recv_multipart()
            if identity not in self.identities:
                self.identities.append(identity)
            msg = decode(parts[0])
            self.seen.append(msg)
            if isinstance(msg, Hello):
                reply = HelloReply(
                    True, "", "", "rogue", 1, "elsewhere", 1,
                    self.hello_layout,
                    ("zmq",), self.num_blocks, "", "", 1 << 20,
                )  # fmt: skip
                reply = dataclasses.replace(reply, **self.reply_fields)
                self.sock.send_multipart([identity, encode(reply)])
            elif msg.TAG == "pull":
                for out in self.respond(msg):
                    self.sock.send_multipart([identity, *out])

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=5)
        self.sock.close(linger=0)
        self.ctx.term()
