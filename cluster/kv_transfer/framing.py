"""Framing on a transfer socket: ``[identity] [mac] header *frames`` in, typed messages out.

Every inbound message is checked here before anyone acts on it: the part count, the header size
(before it is even copied out of zmq's buffer), the MAC in hmac mode (over the header and every
payload frame: ``security.MessageSigner``), then the header schema and protocol version
(``protocol.decode``). Raw frames stay zmq frames (zero-copy) until a transport has validated
their count and lengths against its plan.

A ``WireFaults`` injector (tests only: ``tests/harness/kv_faults.py``) may rewrite each message's
raw frames on the way out or in; production passes none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import zmq

from cluster.kv_transfer.protocol import (
    MAX_HEADER_BYTES,
    KVTransferError,
    Message,
    Reason,
    decode,
    encode,
)
from cluster.kv_transfer.security import MAC_BYTES, MAC_FRAME_BYTES, MessageSigner

Buffer = Any  # bytes, memoryview, numpy view or zmq.Frame: anything with the buffer protocol
# Send flags as plain ints (combining the IntFlag members costs more than the send of a header).
_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
_LAST = int(zmq.NOBLOCK)
Direction = Literal["send", "recv"]


class WireFaults(Protocol):
    def apply(self, direction: Direction, tag: str, frames: list[Buffer]) -> list[list[Buffer]]:
        """The raw frames of the messages to deliver instead of one (empty list: none)."""
        ...


class InboundError(KVTransferError):
    """A refused inbound message, with the routing id of who sent it (when known) and its
    header when that is authentic (an altered payload: the receiver fails the pull it names)."""

    def __init__(
        self, reason: str, message: str, identity: bytes, msg: Message | None = None
    ) -> None:
        super().__init__(reason, message)
        self.identity = identity
        self.msg = msg


@dataclass(slots=True)
class Inbound:
    identity: bytes  # the peer's routing id on a ROUTER socket, b"" on a DEALER
    msg: Message
    frames: list[Buffer]  # raw payload frames after the header


class Framer:
    def __init__(
        self, signer: MessageSigner, *, router: bool, faults: WireFaults | None = None
    ) -> None:
        self.signer = signer
        self.router = router
        self.faults = faults

    def send(
        self,
        sock: zmq.Socket[Any],
        msg: Message,
        frames: Sequence[Buffer] = (),
        *,
        identity: bytes = b"",
        track: bool = False,
    ) -> list[zmq.MessageTracker]:
        """Send one message (non-blocking; large frames zero-copy).

        With ``track``, returns one tracker per payload frame: the frame's memory may be
        reused only once every tracker is done (zmq has handed the bytes to the kernel).
        """
        header = encode(msg)
        prefix: list[bytes] = [identity] if self.router else []
        if self.signer.enabled:  # over what we mean to send: a fault injector alters it after
            prefix.append(self.signer.sign(header, frames))
        prefix.append(header)
        variants = [list(frames)]
        if self.faults is not None:
            variants = self.faults.apply("send", msg.TAG, variants[0])
        trackers: list[zmq.MessageTracker] = []
        for variant in variants:
            # The prefix parts are small: copied into zmq's message (no Frame, no tracker).
            more = bool(variant)
            last = len(prefix) - 1
            for i, part in enumerate(prefix):
                sock.send(part, _MORE if i < last or more else _LAST)
            last = len(variant) - 1
            for i, data in enumerate(variant):
                flags = _MORE if i < last else _LAST
                if track:
                    trackers.append(sock.send(data, flags, copy=False, track=True))
                else:
                    sock.send(data, flags, copy=False)
        return trackers

    def recv(self, sock: zmq.Socket[Any]) -> list[Inbound]:
        """One message off the socket (non-blocking), or ``KVTransferError`` with a reason.

        Usually one ``Inbound``; a fault injector may turn it into none or several.
        """
        parts: list[zmq.Frame] = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
        identity = b""
        if self.router:
            identity = parts[0].bytes
            parts = parts[1:]
        if self.signer.enabled:
            header, payload, altered = self._verified(parts)
        else:
            if not parts:
                raise KVTransferError(Reason.MALFORMED, "empty message")
            if len(parts[0]) > MAX_HEADER_BYTES:
                raise KVTransferError(Reason.OVERSIZED, f"header of {len(parts[0])} bytes")
            header, payload, altered = parts[0].bytes, parts[1:], False
        try:
            msg = decode(header)
        except KVTransferError as e:
            raise InboundError(e.reason, e.detail, identity) from None
        if altered:
            raise InboundError(
                Reason.BAD_AUTH,
                f"{msg.TAG}: payload MAC does not verify (frames altered, added or dropped on "
                "the wire)",
                identity,
                msg,
            )
        frames: list[Buffer] = list(payload)
        if self.faults is None:
            return [Inbound(identity, msg, frames)]
        return [Inbound(identity, msg, f) for f in self.faults.apply("recv", msg.TAG, frames)]

    def _verified(self, parts: list[zmq.Frame]) -> tuple[bytes, list[zmq.Frame], bool]:
        """(header, payload frames, payload altered) of an hmac message whose header is
        authentic; ``KVTransferError(bad_auth)`` when not even the header can be trusted."""
        if len(parts) < 2 or len(parts[1]) > MAX_HEADER_BYTES:
            raise KVTransferError(Reason.BAD_AUTH, "missing or malformed MAC frame")
        if len(parts[0]) != MAC_FRAME_BYTES:  # checked before copying it out of zmq's buffer
            older = " (the peer signs headers only: older pdserve?)" * (len(parts[0]) == MAC_BYTES)
            raise KVTransferError(
                Reason.BAD_AUTH, f"MAC frame of {len(parts[0])} bytes, not {MAC_FRAME_BYTES}{older}"
            )
        header = parts[1].bytes
        payload = parts[2:]
        failed = self.signer.check(parts[0].bytes, header, payload)
        if failed == "header":
            raise KVTransferError(Reason.BAD_AUTH, "header MAC does not verify")
        return header, payload, failed == "payload"
