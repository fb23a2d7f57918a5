"""Security defaults (reliability matrix S1, S4): loopback listeners, CURVE and HMAC auth."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import psutil
import pytest
import zmq

from cluster.config import TransferConfig
from cluster.kv_transfer import KVReceiver
from cluster.kv_transfer.protocol import Hello, KVTransferError, Reason, encode
from cluster.kv_transfer.security import check_auth_config, generate_curve_keypair
from tests.unit.kv_transfer.conftest import SenderHandle
from tests.unit.kv_transfer.helpers import SMALL, transfer_config

pytestmark = pytest.mark.timeout(60)
SECRET = "a-test-secret-of-32-characters!!"


def test_every_listener_is_on_loopback_by_default(
    make_sender: Callable[..., SenderHandle],
) -> None:
    """S1: the zmq socket and the torch_dist rendezvous store listen on 127.0.0.1 only."""
    before = {c.laddr for c in psutil.Process().net_connections() if c.status == "LISTEN"}
    make_sender(transfer_config(transports=("zmq", "torch_dist")))
    listening = [
        c.laddr
        for c in psutil.Process().net_connections()
        if c.status == "LISTEN" and c.laddr not in before
    ]
    assert len(listening) >= 2
    assert all(addr.ip == "127.0.0.1" for addr in listening), listening


def test_auth_settings_are_checked_with_the_field_named() -> None:
    with pytest.raises(ValueError, match=r"transfer\.hmac_secret"):
        check_auth_config(TransferConfig(auth="hmac", hmac_secret="short"))
    with pytest.raises(ValueError, match=r"transfer\.curve_public_key"):
        check_auth_config(TransferConfig(auth="curve"))
    public, secret = generate_curve_keypair()
    assert len(public) == len(secret) == 40 and public != secret
    check_auth_config(
        TransferConfig(auth="curve", curve_public_key=public, curve_secret_key=secret)
    )


def test_secrets_from_the_environment_are_read_and_checked_at_start(
    monkeypatch: pytest.MonkeyPatch,
    make_sender: Callable[..., SenderHandle],
    make_receiver: Callable[..., KVReceiver],
) -> None:
    """The config never holds them: the sender and receiver read and check them at start."""
    for env in ("PDSERVE_TRANSFER_SECRET", "PDSERVE_CURVE_SECRET_KEY", "PDSERVE_CURVE_PUBLIC_KEY"):
        monkeypatch.delenv(env, raising=False)
    hmac_cfg = transfer_config(transports=("zmq",), auth="hmac")
    with pytest.raises(ValueError, match=r"^transfer\.hmac_secret: .*PDSERVE_TRANSFER_SECRET"):
        make_receiver(hmac_cfg)
    with pytest.raises(ValueError, match=r"^transfer\.curve_public_key: .*PDSERVE_CURVE_PUBLIC"):
        check_auth_config(TransferConfig(auth="curve"))
    public, secret = generate_curve_keypair()
    monkeypatch.setenv("PDSERVE_CURVE_PUBLIC_KEY", public)
    monkeypatch.setenv("PDSERVE_CURVE_SECRET_KEY", secret)
    check_auth_config(TransferConfig(auth="curve"))
    monkeypatch.setenv("PDSERVE_TRANSFER_SECRET", SECRET)
    h = make_sender(hmac_cfg)
    _pull_ok(h, make_receiver(hmac_cfg), "from-env")
    # The config's own secret wins over the environment's: this receiver signs with another.
    wrong = dataclasses.replace(hmac_cfg, hmac_secret="another-secret-of-32-characters!")
    assert _pull_refused(h, make_receiver(wrong), "wrong") == Reason.TIMEOUT


def _pull_ok(h: SenderHandle, receiver: KVReceiver, rid: str) -> None:
    params = h.sender.register(rid, [1, 2], num_tokens=32)
    assert receiver.pull(params, [5, 6]).num_blocks == 2


def _pull_refused(h: SenderHandle, receiver: KVReceiver, rid: str) -> str:
    params = h.sender.register(rid, [1, 2], num_tokens=32)
    with pytest.raises(KVTransferError) as e:
        receiver.pull(params, [5, 6])
    h.sender.abort(rid)
    return e.value.reason


def test_hmac_admits_only_the_shared_secret(
    make_sender: Callable[..., SenderHandle], make_receiver: Callable[..., KVReceiver]
) -> None:
    cfg = transfer_config(transports=("zmq",), auth="hmac", hmac_secret=SECRET)
    h = make_sender(cfg)
    _pull_ok(h, make_receiver(cfg), "good")
    wrong = dataclasses.replace(cfg, hmac_secret="another-secret-of-32-characters!")
    assert _pull_refused(h, make_receiver(wrong), "wrong") == Reason.TIMEOUT
    plain = dataclasses.replace(cfg, auth="none", hmac_secret="")
    assert _pull_refused(h, make_receiver(plain), "plain") == Reason.TIMEOUT
    rejected = h.sender.stats()["rejected"]
    assert rejected[Reason.BAD_AUTH] >= 2 and h.sender.stats()["handshakes"] == 1


def _raw_client(endpoint: str, keys: dict[str, bytes] | None) -> tuple[Any, Any]:
    ctx: Any = zmq.Context()
    ctx.linger = 0
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in (keys or {}).items():
        setattr(sock, name, value)
    sock.connect(endpoint)
    return ctx, sock


def test_curve_admits_only_the_cluster_keypair(
    make_sender: Callable[..., SenderHandle], make_receiver: Callable[..., KVReceiver]
) -> None:
    """S4: no message from a client without keys, or with the server key but its own pair."""
    public, secret = generate_curve_keypair()
    cfg = transfer_config(
        transports=("zmq",), auth="curve", curve_public_key=public, curve_secret_key=secret
    )
    h = make_sender(cfg)
    _pull_ok(h, make_receiver(cfg), "good")
    other_pub, other_sec = generate_curve_keypair()
    intruders = [
        None,  # plain zmq, no CURVE at all
        {  # knows the server's public key, presents its own keypair: ZAP says no
            "curve_serverkey": public.encode(),
            "curve_publickey": other_pub.encode(),
            "curve_secretkey": other_sec.encode(),
        },
    ]
    hello = encode(Hello("intruder", "x", 1, SMALL, ("zmq",)))
    for keys in intruders:
        ctx, sock = _raw_client(h.sender.endpoint, keys)
        sock.send(hello)
        assert sock.poll(1000) == 0  # nothing comes back
        sock.close(linger=0)
        ctx.term()
    wrong_server = dataclasses.replace(cfg, curve_public_key=other_pub, curve_secret_key=other_sec)
    t0 = time.monotonic()
    reason = _pull_refused(h, make_receiver(wrong_server), "wrong")
    assert reason in (Reason.BAD_AUTH, Reason.TIMEOUT)
    assert time.monotonic() - t0 <= cfg.transfer_timeout_s + 0.5
    assert h.sender.stats()["handshakes"] == 1  # only the authorized receiver got through
