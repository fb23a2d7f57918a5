"""KV-transfer wire messages: typed frozen dataclasses and their one codec (torch-free).

A message on a pdserve transfer socket is ``[mac?] header *frames``: the header is a msgpack map
``{"t": tag, "v": PROTOCOL_VERSION, **fields}``; KV bytes travel as separate raw frames that the
header declares (count and byte length), never inside the map and never pickled.

Conversation (decode side D = DEALER, prefill side P = ROUTER; D always speaks first):

    D: Hello            P: HelloReply           layout, version and transports checked here
    D: DistSetup        (torch_dist only: both build a fresh pair group of this generation)
    D: PullRequest      P: Chunk* (zmq) | Ready (shm, loopback, torch_dist) | PullError
    D: Ack              P: AckReply             (only transports where D reads P's memory)
    D: Heartbeat        P: HeartbeatReply       renews the leases D is still waiting on
    D: Abort                                    D gave up: P frees the lease now
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack

from cluster.common.kv_wire import (
    MAX_LIST_LEN,
    MAX_STR_LEN,
    PROTOCOL_VERSION,
    KVTransferError,
    Reason,
    from_plain,
    to_plain,
)

# Headers are small (a pull of 512 scattered blocks is ~5 KB); the limit fits under the smallest
# transfer.max_message_bytes, so zmq's MAXMSGSIZE can be that setting on every socket.
MAX_HEADER_BYTES = 1 << 16
MAX_HEARTBEAT_IDS = 1024  # transfer ids per Heartbeat message (~35 KB)

# A frame plan: per frame, the (first source block id, number of blocks) segments it carries.
Segment = tuple[int, int]


@dataclass(frozen=True, slots=True)
class Hello:
    TAG: ClassVar[str] = "hello"
    instance_id: str
    host_id: str
    pid: int
    layout: dict[str, str | int]
    transports: tuple[str, ...]  # what this receiver can use, in preference order


@dataclass(frozen=True, slots=True)
class HelloReply:
    TAG: ClassVar[str] = "hello_reply"
    ok: bool
    reason: str  # "" when ok
    message: str
    instance_id: str
    epoch: int
    host_id: str
    pid: int
    layout: dict[str, str | int]
    transports: tuple[str, ...]  # what this sender offers
    num_blocks: int
    shm_name: str  # the sender pool's shared segment ("" when not shared)
    dist_store: str  # host:port of the torch_dist rendezvous store ("" when not offered)
    max_frame_bytes: int


@dataclass(frozen=True, slots=True)
class DistSetup:
    TAG: ClassVar[str] = "dist_setup"
    generation: int


@dataclass(frozen=True, slots=True)
class PullRequest:
    TAG: ClassVar[str] = "pull"
    pull_id: int  # chosen by D, unique on its connection
    transfer_id: str
    request_id: str
    epoch: int
    transport: str
    frames: tuple[tuple[Segment, ...], ...]
    checksum: bool
    dist_generation: int  # 0 unless transport is torch_dist


@dataclass(frozen=True, slots=True)
class Chunk:
    TAG: ClassVar[str] = "chunk"
    pull_id: int
    first_frame: int  # index in the pull's frame plan of this message's first frame
    nbytes: tuple[int, ...]  # per raw frame that follows the header
    crcs: tuple[int, ...]  # crc32 per frame when the pull asked for checksums, else empty


@dataclass(frozen=True, slots=True)
class Ready:
    TAG: ClassVar[str] = "ready"
    pull_id: int
    crcs: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PullError:
    TAG: ClassVar[str] = "pull_error"
    pull_id: int
    transfer_id: str
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class Ack:
    TAG: ClassVar[str] = "ack"
    pull_id: int
    transfer_id: str


@dataclass(frozen=True, slots=True)
class AckReply:
    TAG: ClassVar[str] = "ack_reply"
    pull_id: int
    ok: bool  # False: the lease ended before the ack, what D read may be stale
    reason: str


@dataclass(frozen=True, slots=True)
class Heartbeat:
    TAG: ClassVar[str] = "heartbeat"
    transfer_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class HeartbeatReply:
    TAG: ClassVar[str] = "heartbeat_reply"
    unknown: tuple[str, ...]  # leases P no longer holds (expired, aborted, never known)


@dataclass(frozen=True, slots=True)
class Abort:
    TAG: ClassVar[str] = "abort"
    transfer_id: str
    pull_id: int  # 0 when no pull was running
    reason: str


Message = (
    Hello
    | HelloReply
    | DistSetup
    | PullRequest
    | Chunk
    | Ready
    | PullError
    | Ack
    | AckReply
    | Heartbeat
    | HeartbeatReply
    | Abort
)

MESSAGE_TYPES: dict[str, type[Any]] = {
    cls.TAG: cls
    for cls in (
        Hello,
        HelloReply,
        DistSetup,
        PullRequest,
        Chunk,
        Ready,
        PullError,
        Ack,
        AckReply,
        Heartbeat,
        HeartbeatReply,
        Abort,
    )
}


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError("msgpack ext types are not part of the protocol")


def encode(msg: Message) -> bytes:
    body = to_plain(msg)
    body["t"] = msg.TAG
    body["v"] = PROTOCOL_VERSION
    packed: bytes = msgpack.packb(body, use_bin_type=True)
    return packed


def decode(data: bytes | memoryview) -> Message:
    """Header bytes -> message; ``KVTransferError`` (malformed, bad_version, oversized) if not."""
    if len(data) > MAX_HEADER_BYTES:
        raise KVTransferError(Reason.OVERSIZED, f"header of {len(data)} bytes")
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            ext_hook=_no_ext,
            max_str_len=MAX_STR_LEN,
            max_bin_len=0,
            max_array_len=MAX_LIST_LEN,
            max_map_len=64,
            max_ext_len=0,
        )
    except Exception as e:  # msgpack raises a zoo of types (StackError, ExtraData, ...)
        raise KVTransferError(
            Reason.MALFORMED, f"undecodable header ({type(e).__name__})"
        ) from None
    if not isinstance(obj, dict):
        raise KVTransferError(Reason.MALFORMED, "header is not a map")
    version = obj.get("v")
    if version != PROTOCOL_VERSION:
        raise KVTransferError(
            Reason.BAD_VERSION, f"protocol version {version!r}, expected {PROTOCOL_VERSION}"
        )
    tag = obj.get("t")
    cls = MESSAGE_TYPES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise KVTransferError(Reason.MALFORMED, f"unknown message tag {str(tag)[:32]!r}")
    msg: Message = from_plain(cls, obj, skip=("t", "v"))
    return msg
