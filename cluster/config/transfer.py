"""``transfer``: how KV blocks move from a prefill pool to a decode pool."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from cluster.config.validation import check, check_choice

_TRANSPORTS = ("loopback", "shm", "zmq", "torch_dist", "cuda_ipc")


@dataclass(frozen=True)
class TransferConfig:
    """kv_transfer: how KV blocks move from a prefill pool to a decode pool.

    The secrets and the advertise address may instead come from the environment; they are read
    where they are used (``cluster.config.environment``), never written back into this tree.
    """

    # Preference list, chosen per peer pair: the first that both ends support (shm needs one host).
    transports: tuple[str, ...] = ("shm", "zmq")
    bind_host: str = "127.0.0.1"  # loopback unless a multi-node config says otherwise
    # The address peers dial; None: $PDSERVE_ADVERTISE_HOST, else bind_host (node IP multi-node).
    advertise_host: str | None = None
    lease_s: float = 30.0  # prefill side holds a request's blocks this long without a heartbeat
    heartbeat_s: float = 5.0  # decode side renews its leases this often while it waits
    transfer_timeout_s: float = 60.0  # decode side gives up a pull after this long
    max_message_bytes: int = 64 << 20  # larger frames are refused before allocation
    # KV bytes per data frame (capped by max_message_bytes): >= 64 KiB so pyzmq sends it
    # zero-copy, small enough that the receiver copies one frame while the next is in flight.
    frame_bytes: int = 8 << 20
    ipc: bool = True  # zmq over ipc:// (not tcp) when both ends share a host
    checksum: bool = False  # per-frame checksums (debugging; costs a pass over the data)
    on_failure: str = "recompute"  # recompute: prefill locally; fail: end the request
    # Prompts of at least this many tokens stream their KV: the prefill replica leases each
    # finished chunk's full blocks as it goes and the decode replica pulls them while later
    # chunks compute, so only the last chunk's blocks move after the first token. 0: never
    # (one bulk pull after the last chunk). Needs chunked prefill on the prefill pool.
    stream_min_tokens: int = 1024
    auth: str = "none"  # none | hmac | curve (required when bind_host is not loopback)
    hmac_secret: str = ""  # "": $PDSERVE_TRANSFER_SECRET
    curve_secret_key: str = ""  # z85; "": $PDSERVE_CURVE_SECRET_KEY
    curve_public_key: str = ""  # z85; "": $PDSERVE_CURVE_PUBLIC_KEY

    def __post_init__(self) -> None:
        check(bool(self.transports), "transfer.transports", "must name at least one transport")
        for t in self.transports:
            check_choice(t, "transfer.transports", _TRANSPORTS)
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
        check_choice(self.on_failure, "transfer.on_failure", ("recompute", "fail"))
        check_choice(self.auth, "transfer.auth", ("none", "hmac", "curve"))
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
