"""Transfer-socket security: loopback by default, CURVE or HMAC when exposed, host identity.

* ``auth: none`` is only accepted with a loopback ``bind_host`` (the config refuses otherwise).
* ``auth: curve``: zmq CURVE (encrypts and authenticates every frame). The cluster shares one
  keypair (``curve_public_key`` / ``curve_secret_key``, or ``$PDSERVE_CURVE_PUBLIC_KEY`` /
  ``$PDSERVE_CURVE_SECRET_KEY``); the sender runs a ZAP handler that
  admits only clients presenting that public key, so knowing the server key is not enough.
* ``auth: hmac``: an HMAC-SHA256 of each header (``hmac_secret`` or
  ``$PDSERVE_TRANSFER_SECRET``) travels as the message's
  first frame and is compared in constant time. Payload frames are covered through the header
  only when checksums are on; use CURVE where an active attacker sits on the network.

Secrets are read here, where they are used (``cluster.config.environment``), never from a config
tree that had them written in, so they never travel in what a process hands to its replicas.

``python -m cluster.kv_transfer.security`` prints a fresh CURVE keypair for the config.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

from cluster.config import TransferConfig, curve_keys, transfer_hmac_secret

MAC_BYTES = 32
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


class HeaderSigner:
    """HMAC-SHA256 over a header; ``None`` secret means no MAC frame at all."""

    def __init__(self, secret: str | None) -> None:
        self._key = secret.encode("utf-8") if secret else None

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def sign(self, header: bytes) -> bytes:
        assert self._key is not None
        return hmac.new(self._key, header, hashlib.sha256).digest()

    def verify(self, mac: bytes, header: bytes) -> bool:
        return self._key is not None and hmac.compare_digest(mac, self.sign(header))

    @classmethod
    def from_config(cls, config: TransferConfig) -> HeaderSigner:
        return cls(transfer_hmac_secret(config) if config.auth == "hmac" else None)


if __name__ == "__main__":
    pub, sec = generate_curve_keypair()
    print(f"transfer:\n  auth: curve\n  curve_public_key: {pub!r}\n  curve_secret_key: {sec!r}")
