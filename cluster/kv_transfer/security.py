"""Transfer-socket security: loopback by default, CURVE or HMAC when exposed, host identity.

* ``auth: none`` is only accepted with a loopback ``bind_host`` (the config refuses otherwise).
* ``auth: curve``: zmq CURVE (encrypts and authenticates every frame). The cluster shares one
  keypair (``curve_public_key`` / ``curve_secret_key``, or ``$PDSERVE_CURVE_PUBLIC_KEY`` /
  ``$PDSERVE_CURVE_SECRET_KEY``); the sender runs a ZAP handler that
  admits only clients presenting that public key, so knowing the server key is not enough.
* ``auth: hmac``: HMAC-SHA256 with ``hmac_secret`` (or ``$PDSERVE_TRANSFER_SECRET``) over the
  header and every payload frame of each message, each length-prefixed so frame boundaries
  cannot shift, travels as its first frame and is compared in constant time: an altered KV byte
  is refused (``bad_auth``) before anything is written. It authenticates, it does not encrypt:
  use CURVE where the KV must stay confidential.
* The torch_dist rendezvous store (``transports/rendezvous.py``) has no authentication of its
  own: with hmac or curve its keys live under a namespace derived from the secret and every
  value carries a MAC over its key (``StoreSealer``), so a client without the secret cannot
  plant or alter a value a pair accepts (it can still list keys: the MACs are the guard).

Secrets are read here, where they are used (``cluster.config.environment``), never from a config
tree that had them written in, so they never travel in what a process hands to its replicas.

``python -m cluster.kv_transfer.security`` prints a fresh CURVE keypair for the config.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
from collections.abc import Sequence
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

from cluster.config import TransferConfig, curve_keys, transfer_hmac_secret
from cluster.kv_transfer.protocol import KVTransferError, Reason

MAC_BYTES = 32  # one HMAC-SHA256 digest
MAC_FRAME_BYTES = 2 * MAC_BYTES  # the header's digest, then the whole message's
MIN_HMAC_SECRET = 16


def generate_curve_keypair() -> tuple[str, str]:
    """(public, secret) z85 strings for ``transfer.curve_public_key`` / ``curve_secret_key``."""
    public, secret = zmq.curve_keypair()
    return public.decode("ascii"), secret.decode("ascii")


def host_id() -> str:
    """Equal on two processes that can share memory: same hostname (pod) and same boot."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{socket.gethostname()}/{boot}"


def check_auth_config(config: TransferConfig) -> None:
    """Raise ``ValueError`` naming the field when the chosen auth mode lacks its secret (in the
    config or the environment). The KV sender and receiver call it before they start."""
    if config.auth == "hmac" and len(transfer_hmac_secret(config)) < MIN_HMAC_SECRET:
        raise ValueError(
            f"transfer.hmac_secret: auth is hmac but the secret is missing or shorter than "
            f"{MIN_HMAC_SECRET} characters (set it in the config or $PDSERVE_TRANSFER_SECRET)"
        )
    if config.auth == "curve":
        secret, public = curve_keys(config)
        for name, key, env in (
            ("curve_public_key", public, "PDSERVE_CURVE_PUBLIC_KEY"),
            ("curve_secret_key", secret, "PDSERVE_CURVE_SECRET_KEY"),
        ):
            if len(key) != 40:
                raise ValueError(
                    f"transfer.{name}: auth is curve but the key is missing or not 40 z85 "
                    f"characters (set it in the config or ${env}; "
                    "python -m cluster.kv_transfer.security prints a keypair)"
                )
        if not zmq.has("curve"):
            raise ValueError("transfer.auth: curve requested but libzmq was built without CURVE")


class _OnlyClusterKey:
    """ZAP credentials provider: admit a CURVE client only if it holds the cluster keypair."""

    def __init__(self, public_key: str) -> None:
        self._key = public_key.encode("ascii")

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self._key)


def start_server_auth(ctx: zmq.Context[Any], config: TransferConfig) -> ThreadAuthenticator | None:
    """Start the context's ZAP handler when CURVE is on (one per context: its own inproc)."""
    if config.auth != "curve":
        return None
    auth = ThreadAuthenticator(ctx)
    auth.start()
    _secret, public = curve_keys(config)
    auth.configure_curve_callback("*", credentials_provider=_OnlyClusterKey(public))
    return auth


def secure_server_socket(sock: zmq.Socket[Any], config: TransferConfig) -> None:
    if config.auth == "curve":
        secret, public = curve_keys(config)
        sock.curve_secretkey = secret.encode("ascii")
        sock.curve_publickey = public.encode("ascii")
        sock.curve_server = True


def secure_client_socket(sock: zmq.Socket[Any], config: TransferConfig) -> None:
    if config.auth == "curve":
        secret, public = curve_keys(config)
        sock.curve_serverkey = public.encode("ascii")
        sock.curve_publickey = public.encode("ascii")
        sock.curve_secretkey = secret.encode("ascii")


def _u64(n: int) -> bytes:
    return n.to_bytes(8, "little")


class MessageSigner:
    """HMAC-SHA256 over a message's header and payload frames; ``None`` secret: no MAC frame.

    The MAC frame is two digests of one running HMAC: over the header alone, then over the
    header and every payload frame. The first lets the receiver trust the header (so it knows
    which pull an altered payload belongs to and fails that pull at once instead of timing out);
    the second covers the KV bytes. Lengths and the frame count are bound in, so bytes cannot
    move between frames. Frames are hashed in place (memoryviews: no copy).
    """

    def __init__(self, secret: str | None) -> None:
        # The keyed state, copied per message (saves the key schedule on every one).
        self._base = hmac.new(secret.encode("utf-8"), digestmod=hashlib.sha256) if secret else None

    @property
    def enabled(self) -> bool:
        return self._base is not None

    def sign(self, header: bytes, frames: Sequence[Any] = ()) -> bytes:
        """The MAC frame: ``MAC_BYTES`` of header digest, then ``MAC_BYTES`` over everything."""
        mac, header_digest = self._header(header)
        return header_digest + self._payload(mac, frames)

    def check(self, mac: bytes, header: bytes, frames: Sequence[Any]) -> str:
        """What fails to verify: ``""`` (nothing), ``"header"`` (the header, or the MAC frame
        itself: nothing in the message can be trusted) or ``"payload"`` (an authentic header
        whose payload frames were altered, added or dropped). Constant-time compares; the
        payload is hashed only under an authentic header, so a forgery costs little."""
        if self._base is None or len(mac) != MAC_FRAME_BYTES:
            return "header"
        running, header_digest = self._header(header)
        if not hmac.compare_digest(mac[:MAC_BYTES], header_digest):
            return "header"
        payload_digest = self._payload(running, frames)
        return "" if hmac.compare_digest(mac[MAC_BYTES:], payload_digest) else "payload"

    def _header(self, header: bytes) -> tuple[Any, bytes]:
        assert self._base is not None
        mac = self._base.copy()
        mac.update(_u64(len(header)))
        mac.update(header)
        return mac, mac.copy().digest()

    @staticmethod
    def _payload(mac: Any, frames: Sequence[Any]) -> bytes:
        mac.update(_u64(len(frames)))
        for frame in frames:
            view = memoryview(frame)
            mac.update(_u64(view.nbytes))
            mac.update(view)
        return bytes(mac.digest())

    @classmethod
    def from_config(cls, config: TransferConfig) -> MessageSigner:
        return cls(transfer_hmac_secret(config) if config.auth == "hmac" else None)


def rendezvous_secret(config: TransferConfig) -> bytes | None:
    """The secret the torch_dist store is sealed with: the HMAC secret, or the cluster's CURVE
    secret key (every process holds it); ``None`` with ``auth: none`` (loopback only)."""
    if config.auth == "hmac":
        return transfer_hmac_secret(config).encode("utf-8")
    if config.auth == "curve":
        return curve_keys(config)[0].encode("ascii")
    return None


class StoreSealer:
    """Keys and MAC'd values for the torch_dist rendezvous store.

    ``TCPStore`` lets any client that reaches its port read, list and write any key. Sealed, the
    keys live under a tag only secret holders can compute (nobody can pre-plant values under
    them), and each value carries an HMAC over its full key and itself, so a value planted,
    altered or moved from another key by anyone else is refused on read.
    """

    def __init__(self, secret: bytes | None) -> None:
        self._key = b""
        self.namespace = "pdserve-kv/"
        if secret:
            self._key = hmac.new(secret, b"pdserve-kv/store-values", hashlib.sha256).digest()
            tag = hmac.new(secret, b"pdserve-kv/store-keys", hashlib.sha256).hexdigest()
            self.namespace = f"pdserve-kv/{tag[:32]}/"

    @property
    def enabled(self) -> bool:
        return bool(self._key)

    def _mac(self, key: str, value: bytes) -> bytes:
        assert self._key
        k = key.encode("utf-8")
        return hmac.new(self._key, _u64(len(k)) + k + value, hashlib.sha256).digest()

    def seal(self, key: str, value: bytes) -> bytes:
        return value + self._mac(key, value) if self._key else value

    def open(self, key: str, sealed: bytes) -> bytes:
        """The value written under ``key``, or ``KVTransferError(bad_auth)`` if forged."""
        if not self._key:
            return sealed
        value, mac = sealed[:-MAC_BYTES], sealed[-MAC_BYTES:]
        if len(sealed) < MAC_BYTES or not hmac.compare_digest(mac, self._mac(key, value)):
            raise KVTransferError(
                Reason.BAD_AUTH,
                f"torch_dist rendezvous: the value at {key!r} fails its MAC (written by a "
                "client without the transfer secret, or altered)",
            )
        return value


if __name__ == "__main__":
    pub, sec = generate_curve_keypair()
    print(f"transfer:\n  auth: curve\n  curve_public_key: {pub!r}\n  curve_secret_key: {sec!r}")
