"""``transfer``: how KV blocks move from a prefill pool to a decode pool."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from cluster.config.validation import check, check_choices

_TRANSPORTS = ("loopback", "shm", "zmq", "torch_dist", "cuda_ipc")


@dataclass(frozen=True)
class TransferConfig:
    """kv_transfer: how KV blocks move from a prefill pool to a decode pool.

    The secrets and the advertise address may instead come from the environment; they are read
    where they are used (``cluster.config.environment``), never written back into this tree.
    """

    CHOICES: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "transports": _TRANSPORTS,
        "on_failure": ("recompute", "fail"),
        "auth": ("none", "hmac", "curve"),
    }

    transports: tuple[str, ...] = ("shm", "zmq")
    """Preference list (registry ``cluster.kv_transfer.transports.TRANSPORTS``), chosen per peer
    pair: the first that both ends support (shm needs one host)."""
    bind_host: str = "127.0.0.1"
    """The address the KV sockets bind; loopback unless a multi-node config says otherwise."""
    advertise_host: str | None = None
    """The address peers dial; null: ``$PDSERVE_ADVERTISE_HOST``, else ``bind_host``."""
    lease_s: float = 30.0
    """The prefill side holds a request's blocks this long without a heartbeat or pull."""
    heartbeat_s: float = 5.0
    """The decode side renews its leases this often while the request waits."""
    transfer_timeout_s: float = 60.0
    """The decode side gives up a pull after this long."""
    max_message_bytes: int = 64 << 20
    """Larger messages are refused before allocation (zmq ``MAXMSGSIZE`` on the receiver)."""
    frame_bytes: int = 8 << 20
    """KV bytes per data frame (capped by ``max_message_bytes``): >= 64 KiB so pyzmq sends it
    zero-copy, small enough that the receiver copies one frame while the next is in flight."""
    ipc: bool = True
    """zmq over ipc:// (not tcp) when both ends share a host."""
    checksum: bool = False
    """crc32 of every frame in its header (debugging; costs a pass over the data)."""
    on_failure: str = "recompute"
    """What a failed pull does: recompute prefills the prompt locally; fail ends the request."""
    stream_min_tokens: int = 1024
    """Prompts of at least this many tokens stream their KV: each finished chunk's full blocks
    are leased and pulled while later chunks compute. 0: never (one bulk pull after the last
    chunk). Needs chunked prefill on the prefill pool."""
    auth: str = "none"
    """KV socket authentication: hmac signs each message (header and KV frames), curve encrypts
    and authenticates every frame; either also seals the torch_dist rendezvous store; required
    when ``bind_host`` is not loopback."""
    hmac_secret: str = ""
    """The shared HMAC secret (>= 16 characters); "": ``$PDSERVE_TRANSFER_SECRET``."""
    curve_secret_key: str = ""
    """The cluster's CURVE secret key (z85); "": ``$PDSERVE_CURVE_SECRET_KEY``."""
    curve_public_key: str = ""
    """The cluster's CURVE public key (z85); "": ``$PDSERVE_CURVE_PUBLIC_KEY``."""

    def __post_init__(self) -> None:
        check(bool(self.transports), "transfer.transports", "must name at least one transport")
        check_choices(self, "transfer")
        for name in ("lease_s", "heartbeat_s", "transfer_timeout_s"):
            check(getattr(self, name) > 0, f"transfer.{name}", "must be > 0")
        check(
            self.heartbeat_s < self.lease_s,
            "transfer.heartbeat_s",
            f"must be < transfer.lease_s ({self.lease_s}) or leases expire between heartbeats",
        )
        check(self.max_message_bytes >= 1 << 16, "transfer.max_message_bytes", "must be >= 64 KiB")
        check(self.frame_bytes >= 1 << 16, "transfer.frame_bytes", "must be >= 64 KiB")
        check(self.stream_min_tokens >= 0, "transfer.stream_min_tokens", "must be >= 0 (0: off)")
        check(
            self.auth != "none" or self.is_loopback_bind,
            "transfer.auth",
            f"transfer.bind_host {self.bind_host!r} is not a loopback address: set transfer.auth "
            "to hmac or curve (with its secret) before exposing the KV transfer socket",
        )

    @property
    def max_frame_bytes(self) -> int:
        """KV bytes per data frame: ``frame_bytes``, capped by ``max_message_bytes``."""
        return min(self.frame_bytes, self.max_message_bytes)

    @property
    def is_loopback_bind(self) -> bool:
        if self.bind_host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.bind_host).is_loopback
        except ValueError:
            return False
