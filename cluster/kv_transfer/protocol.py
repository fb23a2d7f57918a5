"""The KV-transfer protocol: the wire messages, their one codec, the errors.

A prefill replica hands a decode replica a ``KVTransferParams`` (``cluster.common.kv_params``,
inside ``PrefillReply`` over Ray, as the object itself); the decode replica pulls the blocks it
lacks over a transfer socket, after ``check_params``. A message on that socket is ``[mac?] header
*frames`` (framing: ``framing.py``): the header is a msgpack map ``{"t": tag, "v":
PROTOCOL_VERSION, **fields}``; KV bytes travel as separate raw frames that the header declares
(count and byte length), never inside the map and never pickled.

Conversation (decode side D = DEALER, prefill side P = ROUTER; D always speaks first):

    D: Hello            P: HelloReply           layout, version and transports checked here
    D: DistSetup        (torch_dist only: both build a fresh pair group of this generation)
    D: PullRequest      P: Chunk* (zmq) | Ready (shm, loopback, torch_dist) | PullError
    D: Ack              P: AckReply             (only transports where D reads P's memory)
                        a streamed lease (its block list grows while the prefill runs) is
                        pulled in parts: PullRequest(final=False) ... Ack, the lease stays;
                        the last PullRequest(final=True) ... Ack ends it as a bulk pull does
    D: Heartbeat        P: HeartbeatReply       renews the leases D is still waiting on
    D: Abort                                    D gave up: P frees the lease now

Schema rules (``decode``, and ``decode_params`` for a handle's plain form, through
``from_plain``): a field's type is declared once, on its frozen dataclass, and checked on the way
in:

  * exactly the dataclass's fields: a missing or an unknown key is ``malformed``;
  * ``bool``, ``int`` (not bool, within int64..uint64), ``float`` (an int is accepted), ``str``
    (at most ``MAX_STR_LEN``), ``tuple[X, ...]`` / fixed tuples (at most ``MAX_LIST_LEN``
    items), small ``dict`` (at most 64 keys), unions of those, and a nested frozen dataclass
    (``KVLayout``: a map of its own fields, by the same rules); nothing else decodes;
  * no msgpack ext types and no bin values; a header over ``MAX_HEADER_BYTES`` is ``oversized``
    before it is parsed, and every declared length is bounded, so nothing is allocated in
    proportion to what a peer claims;
  * the version is checked before the tag (``bad_version``); an unknown tag is ``malformed``.

Bump ``PROTOCOL_VERSION`` (``cluster.common.kv_params``) on any change to a message's fields or
meaning.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any, ClassVar, TypeVar

import msgpack

from cluster.common.kv_layout import KVLayout
from cluster.common.kv_params import PROTOCOL_VERSION, KVTransferParams

# Bounds every decoded value must respect: no allocation proportional to a declared size.
MAX_STR_LEN = 1024
MAX_LIST_LEN = 1 << 16
_MAX_MAP_LEN = 64
_INT_MIN, _UINT_MAX = -(1 << 63), (1 << 64) - 1

# Headers are small (a pull of 512 scattered blocks is ~5 KB); the limit fits under the smallest
# transfer.max_message_bytes, so zmq's MAXMSGSIZE can be that setting on every socket.
MAX_HEADER_BYTES = 1 << 16
MAX_HEARTBEAT_IDS = 1024  # transfer ids per Heartbeat message (~35 KB)

# A frame plan: per frame, the (first source block id, number of blocks) segments it carries.
Segment = tuple[int, int]


# ---------------------------------------------------------------------------------------------
# States and errors


class TransferState(enum.Enum):
    PENDING = "pending"  # registered / requested, no byte moved yet
    TRANSFERRING = "transferring"
    DONE = "done"  # every requested block landed and was verified; never set for partial data
    FAILED = "failed"


class Reason:
    """Machine-readable ``KVTransferError.reason`` codes (also the keys of counters by reason)."""

    MALFORMED = "malformed"  # undecodable header or schema violation
    BAD_VERSION = "bad_version"
    OVERSIZED = "oversized"
    BAD_FRAMES = "bad_frames"  # frame count or byte length differs from what the header declares
    CHECKSUM = "checksum_mismatch"
    BAD_AUTH = "bad_auth"
    LAYOUT_MISMATCH = "layout_mismatch"
    STALE_EPOCH = "stale_epoch"  # the peer restarted (other instance id or epoch)
    UNKNOWN_TRANSFER = "unknown_transfer"
    STALE_TRANSFER = "stale_transfer"  # a transfer that already finished (replay)
    DUPLICATE = "duplicate"  # a second pull of one lease or block, or a repeated frame
    STREAM_OPEN = "stream_open"  # a final pull of a streamed lease whose prefill still runs
    BAD_BLOCKS = "bad_blocks"  # source ids outside the pool or not in the lease
    BAD_DESTINATION = "bad_destination"  # destination ids outside the pool or owned elsewhere
    UNEXPECTED = "unexpected"  # a message with no matching pull, or out of order
    STALE_ACK = "stale_ack"
    NO_HANDSHAKE = "no_handshake"
    NO_TRANSPORT = "no_transport"
    TIMEOUT = "timeout"
    PEER_DISCONNECTED = "peer_disconnected"
    ABORTED = "aborted"
    LEASE_EXPIRED = "lease_expired"
    TRANSPORT_ERROR = "transport_error"
    CLOSED = "closed"


class KVTransferError(RuntimeError):
    """A transfer failed or a message was refused; ``reason`` is one of ``Reason``'s codes."""

    def __init__(self, reason: str, message: str = "") -> None:
        super().__init__(f"{reason}: {message}" if message else reason)
        self.reason = reason
        self.detail = message


# ---------------------------------------------------------------------------------------------
# Messages, in conversation order


@dataclass(frozen=True, slots=True)
class Hello:
    TAG: ClassVar[str] = "hello"
    instance_id: str
    host_id: str
    pid: int
    layout: KVLayout
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
    layout: KVLayout
    transports: tuple[str, ...]  # what this sender offers
    num_blocks: int
    shm_name: str  # the sender pool's shared segment ("" when not shared)
    dist_store: str  # host:port of the torch_dist rendezvous store ("" when not offered)
    max_frame_bytes: int
    cuda_ipc: str = ""  # the sender's device pool as a CUDA IPC handle ("" when not offered)


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
    # False: one part of a streamed lease (its blocks so far); the ack keeps the lease for the
    # rest. True: the last (or only) pull; its ack ends the lease.
    final: bool = True


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


# ---------------------------------------------------------------------------------------------
# The codec: message <-> header bytes


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
            max_map_len=_MAX_MAP_LEN,
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


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError("msgpack ext types are not part of the protocol")


# ---------------------------------------------------------------------------------------------
# The handle's plain form (the bench and test peers' pipes) and its version check


def check_params(params: object) -> KVTransferParams:
    """A handle that came through Ray (as the object itself): the right type, and of this
    protocol version; ``KVTransferError`` (malformed, bad_version) if not."""
    if not isinstance(params, KVTransferParams):
        raise KVTransferError(Reason.MALFORMED, "params must be a KVTransferParams")
    if params.protocol_version != PROTOCOL_VERSION:
        raise KVTransferError(
            Reason.BAD_VERSION,
            f"params protocol {params.protocol_version}, this side speaks {PROTOCOL_VERSION}",
        )
    return params


def decode_params(data: Any) -> KVTransferParams:
    """A handle from its plain form (``to_plain``), schema- and version-checked."""
    return check_params(from_plain(KVTransferParams, data))


# ---------------------------------------------------------------------------------------------
# Schema checking: plain (msgpack-decoded) data -> typed dataclass fields, and back

T = TypeVar("T")


def from_plain(cls: type[T], data: Any, *, skip: tuple[str, ...] = ()) -> T:
    """Build dataclass ``cls`` from a plain mapping holding exactly its fields (minus ``skip``)."""
    if not isinstance(data, Mapping):
        raise KVTransferError(Reason.MALFORMED, f"{cls.__name__}: expected a mapping")
    names, checks = _schema(typing.cast(type, cls), skip)
    keys = set(data)
    keys.difference_update(skip)
    if keys != names:
        missing = sorted(names - keys)
        extra = sorted(str(k) for k in keys - names)
        raise KVTransferError(
            Reason.MALFORMED, f"{cls.__name__}: missing fields {missing}, unknown {extra[:5]}"
        )
    kwargs = {n: check(data[n]) for n, check in checks}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise KVTransferError(Reason.MALFORMED, f"{cls.__name__}: {e}") from None


def to_plain(obj: Any) -> dict[str, Any]:
    """A message (or handle, or layout) as plain data: nested dataclasses as maps, tuples as
    lists."""
    names = _field_names(typing.cast(type, type(obj)))
    return {name: _plain_value(getattr(obj, name)) for name in names}


def _plain_value(v: Any) -> Any:
    if isinstance(v, tuple):
        return [_plain_value(x) for x in v]
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return to_plain(v)
    return v


@cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


Check = typing.Callable[[Any], Any]  # a plain value -> the field's value, or KVTransferError
Schema = tuple[frozenset[str], tuple[tuple[str, Check], ...]]


@cache
def _schema(cls: type, skip: tuple[str, ...]) -> Schema:
    """The field names of ``cls`` (minus ``skip``) and one compiled check per field: the type
    hints are read once per class, not on every message (a pull decodes several)."""
    assert dataclasses.is_dataclass(cls)
    hints = typing.get_type_hints(cls)
    names = [n for n in _field_names(cls) if n not in skip]
    return frozenset(names), tuple((n, _compile(hints[n], f"{cls.__name__}.{n}")) for n in names)


def _fail(name: str, what: str) -> KVTransferError:
    return KVTransferError(Reason.MALFORMED, f"{name}: {what}")


def _compile(tp: Any, name: str) -> Check:
    """The check of one schema type (the rules in this module's docstring)."""
    scalar = _SCALARS.get(tp)
    if scalar is not None:
        return scalar(name)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _check_nested(tp, name)
    generic = _GENERICS.get(typing.get_origin(tp))
    if generic is None:
        raise TypeError(f"{name}: unsupported schema type {tp!r}")  # a bug in a dataclass here
    return generic(tp, name)


def _check_bool(name: str) -> Check:
    def check(value: Any) -> Any:
        if not isinstance(value, bool):
            raise _fail(name, "expected bool")
        return value

    return check


def _check_int(name: str) -> Check:
    def check(value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(name, "expected int")
        if not _INT_MIN <= value <= _UINT_MAX:
            raise _fail(name, "int out of range")
        return value

    return check


def _check_float(name: str) -> Check:
    def check(value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _fail(name, "expected number")
        return float(value)

    return check


def _check_str(name: str) -> Check:
    def check(value: Any) -> Any:
        if not isinstance(value, str) or len(value) > MAX_STR_LEN:
            raise _fail(name, f"expected str <= {MAX_STR_LEN}")
        return value

    return check


def _check_nested(cls: type, name: str) -> Check:
    """A field that is a dataclass of its own (a ``KVLayout``): a map of its fields. A map that
    is no layout this side knows (another dtype, a field more or less) is a layout mismatch,
    which a handshake refuses at once, naming it; anything else is malformed."""

    def check(value: Any) -> Any:
        try:
            return from_plain(cls, value)
        except KVTransferError as e:
            if cls is KVLayout and isinstance(value, Mapping):
                raise KVTransferError(
                    Reason.LAYOUT_MISMATCH, f"{name}: unreadable layout ({e.detail})"
                ) from None
            raise _fail(name, e.detail) from None

    return check


def _check_tuple(tp: Any, name: str) -> Check:
    args = typing.get_args(tp)
    if len(args) == 2 and args[1] is Ellipsis:
        item = _compile(args[0], name)

        def check_list(value: Any) -> Any:
            if not isinstance(value, list | tuple) or len(value) > MAX_LIST_LEN:
                raise _fail(name, "expected a list")
            return tuple([item(v) for v in value])

        return check_list
    items = tuple(_compile(a, name) for a in args)

    def check_fixed(value: Any) -> Any:
        if not isinstance(value, list | tuple) or len(value) > MAX_LIST_LEN:
            raise _fail(name, "expected a list")
        if len(value) != len(items):
            raise _fail(name, f"expected {len(items)} items")
        return tuple([c(v) for v, c in zip(value, items)])

    return check_fixed


def _check_dict(tp: Any, name: str) -> Check:
    key_tp, val_tp = typing.get_args(tp)
    check_key, check_val = _compile(key_tp, name), _compile(val_tp, name)

    def check(value: Any) -> Any:
        if not isinstance(value, Mapping) or len(value) > _MAX_MAP_LEN:
            raise _fail(name, "expected a small mapping")
        out = {}
        for k, v in value.items():
            key = check_key(k)
            try:
                out[key] = check_val(v)
            except KVTransferError:
                _compile(val_tp, f"{name}.{k}")(v)  # the same error, naming the key
                raise
        return out

    return check


def _check_union(tp: Any, name: str) -> Check:
    options = tuple(_compile(a, name) for a in typing.get_args(tp))

    def check(value: Any) -> Any:
        for option in options:
            try:
                return option(value)
            except KVTransferError:
                continue
        raise _fail(name, "no matching type")

    return check


_SCALARS: dict[Any, typing.Callable[[str], Check]] = {
    bool: _check_bool,
    int: _check_int,
    float: _check_float,
    str: _check_str,
}
_GENERICS: dict[Any, typing.Callable[[Any, str], Check]] = {
    tuple: _check_tuple,
    dict: _check_dict,
    typing.Union: _check_union,
    types.UnionType: _check_union,
}
