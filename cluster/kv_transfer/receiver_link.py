"""The zmq plumbing of one receiver connection: a DEALER socket, its monitor, and a backlog.

A ``PeerLink`` is one socket's life; the connection opens a fresh link after the peer dropped.
Messages sent while no pipe is up (``zmq.Again``, e.g. during zmq's own reconnect) wait in the
backlog and go out in order before anything newer.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from cluster.config import TransferConfig
from cluster.kv_transfer.framing import Framer, Inbound
from cluster.kv_transfer.protocol import Message
from cluster.kv_transfer.sockets import receiver_socket

logger = logging.getLogger(__name__)

_MONITOR_EVENTS = (
    zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


class PeerLink:
    def __init__(
        self,
        zmq_ctx: zmq.Context[Any],
        config: TransferConfig,
        framer: Framer,
        routing_id: bytes,
        endpoint: str,
    ) -> None:
        self.framer = framer
        self.sock = receiver_socket(zmq_ctx, config, routing_id)
        self.monitor = self.sock.get_monitor_socket(_MONITOR_EVENTS)
        self.sock.connect(endpoint)
        self.backlog: list[Message] = []  # sent while no pipe was up (zmq.Again), in order

    def recv(self) -> list[Inbound]:
        """One message's batch; raises ``zmq.Again`` (none queued) or ``KVTransferError``."""
        return self.framer.recv(self.sock)

    def monitor_events(self) -> Iterator[int]:
        """The monitor's queued event kinds (``zmq.EVENT_*``), oldest first."""
        while True:
            try:
                event = recv_monitor_message(self.monitor, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            yield event["event"]

    def send(self, msg: Message) -> None:
        if self.backlog:
            self.backlog.append(msg)  # keep the order
            return
        try:
            self.framer.send(self.sock, msg)
        except zmq.Again:  # no live pipe right now (reconnecting): retry on the next tick
            self.backlog.append(msg)
        except zmq.ZMQError as e:
            logger.debug("kv-receiver: cannot send %s: %s", msg.TAG, e)

    def flush(self) -> None:
        """Send what the backlog holds, until the pipe is full again."""
        while self.backlog:
            try:
                self.framer.send(self.sock, self.backlog[0])
            except zmq.Again:
                return
            except zmq.ZMQError as e:
                logger.debug("kv-receiver: dropping %s: %s", self.backlog[0].TAG, e)
            self.backlog.pop(0)

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)
