"""The two socket kinds of the data plane, with every option that matters and why.

Sender: one ROUTER (bound) serving all receivers. Receiver: one DEALER (connecting) per sender
incarnation. Both: no linger (a closing process never blocks on a dead peer), zmq heartbeats
(a silent peer is dropped, which also releases zero-copy frames queued towards it), MAXMSGSIZE
(a frame over the limit is refused by zmq before it is allocated), and the configured auth.
"""

from __future__ import annotations

from typing import Any

import zmq

from cluster.config import TransferConfig
from cluster.kv_transfer.protocol import MAX_HEADER_BYTES
from cluster.kv_transfer.security import secure_client_socket, secure_server_socket


def _common(sock: zmq.Socket[Any], config: TransferConfig) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    ivl = int(min(config.heartbeat_s, 5.0) * 1000)
    sock.setsockopt(zmq.HEARTBEAT_IVL, ivl)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * ivl)


def sender_socket(ctx: zmq.Context[Any], config: TransferConfig) -> zmq.Socket[Any]:
    sock = ctx.socket(zmq.ROUTER)
    _common(sock, config)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable replies raise, never vanish
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting receiver keeps its identity
    sock.setsockopt(zmq.SNDHWM, 0)  # zero-copy frames queue by reference, not by copy
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_HEADER_BYTES)  # receivers send headers only
    secure_server_socket(sock, config)
    return sock


def receiver_socket(
    ctx: zmq.Context[Any], config: TransferConfig, routing_id: bytes
) -> zmq.Socket[Any]:
    sock = ctx.socket(zmq.DEALER)
    _common(sock, config)
    sock.setsockopt(zmq.ROUTING_ID, routing_id)  # kept across zmq's own reconnects
    sock.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)  # >= MAX_HEADER_BYTES
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    secure_client_socket(sock, config)
    return sock
