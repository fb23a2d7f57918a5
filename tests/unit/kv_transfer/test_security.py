"""Security defaults (reliability matrix S1, S4, S10): loopback listeners, CURVE and HMAC auth,
payloads authenticated under HMAC, the shm path a peer names, the torch_dist store sealed."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
import torch.distributed as dist
import zmq

from cluster.config import TransferConfig
from cluster.kv_transfer import KVPool, KVReceiver
from cluster.kv_transfer.pool import MEMFD_NAME, MappedPool
from cluster.kv_transfer.protocol import Hello, KVTransferError, Reason, TransferState, encode
from cluster.kv_transfer.security import (
    MAC_FRAME_BYTES,
    MessageSigner,
    StoreSealer,
    check_auth_config,
    generate_curve_keypair,
    rendezvous_secret,
)
from cluster.kv_transfer.transports.dist_pair import DistPair
from cluster.kv_transfer.transports.rendezvous import RendezvousStore, SealedStore
from tests.harness.kv_faults import FaultRule, FaultyTransport
from tests.serve_fixtures import wait_until
from tests.unit.kv_transfer.conftest import SenderHandle
from tests.unit.kv_transfer.helpers import (
    SMALL,
    assert_landed,
    assert_untouched,
    crcs,
    transfer_config,
)

pytestmark = pytest.mark.timeout(60)
SECRET = "a-test-secret-of-32-characters!!"
BPB = SMALL.bytes_per_block


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


# -- S10: payload authentication under hmac ----------------------------------------------------

HMAC_CFG = transfer_config(transports=("zmq",), auth="hmac", hmac_secret=SECRET)
SRC = list(range(0, 32, 2))  # 16 scattered 8 KiB blocks: two 64 KiB frames
DST = list(range(32, 48))


def _lands_exactly(h: SenderHandle, receiver: KVReceiver, rid: str) -> None:
    before = crcs(receiver.pool)
    params = h.sender.register(rid, SRC, num_tokens=16 * 16)
    assert receiver.pull(params, DST).num_blocks == len(SRC)
    assert_landed(receiver.pool, SRC, DST, before)


@pytest.mark.parametrize("frame_bytes", [1 << 16, 8 << 20], ids=["chunk_per_frame", "grouped"])
def test_hmac_transfers_land_exactly(
    make_sender: Callable[..., SenderHandle],
    make_receiver: Callable[..., KVReceiver],
    frame_bytes: int,
) -> None:
    """S10 control: signed payloads, one frame a message or two, land bit-identical."""
    cfg = dataclasses.replace(HMAC_CFG, frame_bytes=frame_bytes)
    h = make_sender(cfg)
    receiver = make_receiver(cfg)
    for i in range(3):
        _lands_exactly(h, receiver, f"genuine-{i}")
    assert receiver.stats().get("rejected_total", 0) == 0


@pytest.mark.parametrize(
    "rule",
    [
        FaultRule("flip", frame=0, bit=8 * 4096 + 3),
        FaultRule("flip", frame=1, bit=5),  # the second frame of a grouped message
        FaultRule("truncate", frame=1, nbytes=100),
        FaultRule("drop_frame", frame=1),
        FaultRule("extra_frame", nbytes=8),
    ],
    ids=["flip_first", "flip_second", "truncate", "drop_frame", "extra_frame"],
)
def test_hmac_refuses_an_altered_payload_and_fails_the_pull_at_once(
    make_sender: Callable[..., SenderHandle],
    make_receiver: Callable[..., KVReceiver],
    rule: FaultRule,
) -> None:
    """S10: payload frames altered on the wire after signing (no checksums) are refused as
    bad_auth before any write; the pull fails at once, the lease is freed, the next lands."""
    grouped = dataclasses.replace(HMAC_CFG, frame_bytes=8 << 20)  # both frames in one chunk
    faults = FaultyTransport([rule])
    h = make_sender(grouped, faults=faults)
    receiver = make_receiver(grouped)
    before = crcs(receiver.pool)
    params = h.sender.register("altered", SRC, num_tokens=16 * 16)
    t0 = time.monotonic()
    with pytest.raises(KVTransferError) as e:
        receiver.pull(params, DST)
    assert e.value.reason == Reason.BAD_AUTH and "payload MAC" in str(e.value), e.value
    assert time.monotonic() - t0 < grouped.transfer_timeout_s / 2  # not a timeout
    assert faults.injected[rule.action] == 1
    assert receiver.state(params.transfer_id) is TransferState.FAILED
    assert_untouched(receiver.pool, before)
    assert dict(h.wait_released(1))["altered"] == "peer_aborted"
    assert receiver.stats()["rejected"] == {Reason.BAD_AUTH: 1}
    _lands_exactly(h, receiver, "next")


def test_the_mac_binds_header_frames_and_their_boundaries() -> None:
    signer = MessageSigner(SECRET)
    header = b"header"
    frames = [b"ab", b"c"]
    mac = signer.sign(header, frames)
    assert len(mac) == MAC_FRAME_BYTES
    # The same bytes through every buffer type a frame may be: numpy, memoryview, bytes.
    assert signer.check(mac, header, [np.frombuffer(b"ab", np.uint8), memoryview(b"c")]) == ""
    assert signer.check(mac, header, [b"a", b"bc"]) == "payload"  # boundary moved
    assert signer.check(mac, header, [b"abc"]) == "payload"
    assert signer.check(mac, header, [b"ab", b"c", b""]) == "payload"
    assert signer.check(mac, header, [b"ab", b"d"]) == "payload"
    assert signer.check(mac, b"headex", frames) == "header"
    assert signer.check(mac[:32], header, frames) == "header"  # a header-only MAC (older peer)
    assert MessageSigner("another-secret-of-32-characters!").check(mac, header, frames) == "header"


# -- S10: the shm path a peer names ------------------------------------------------------------


def _proc_path(fd: int) -> str:
    return f"/proc/{os.getpid()}/fd/{fd}"


def _map_within(path: str, nbytes: int, *, seconds: float = 2.0) -> BaseException | MappedPool:
    """``MappedPool`` on a thread: its result, or a failure if it blocks past ``seconds``."""
    out: list[BaseException | MappedPool] = []

    def run() -> None:
        try:
            out.append(MappedPool(path, nbytes // BPB, BPB, os.getpid()))
        except (OSError, ValueError) as e:
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"opening {path} blocked the caller"
    return out[0]


@pytest.fixture
def memfd() -> Iterator[Callable[[str, int], int]]:
    fds: list[int] = []

    def make(name: str, nbytes: int) -> int:
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        os.ftruncate(fd, nbytes)
        fds.append(fd)
        return fd

    yield make
    for fd in fds:
        os.close(fd)


def test_the_senders_shared_pool_still_maps() -> None:
    pool = KVPool.allocate(SMALL, 8, shared=True)
    assert pool.bytes is not None
    pool.bytes[3] = 7
    mapped = MappedPool(pool.shm_path, 8, BPB, os.getpid())
    assert mapped.bytes is not None and np.array_equal(mapped.bytes, pool.bytes)
    mapped.close()
    pool.close()


def test_shm_names_outside_the_senders_memfds_are_refused(
    memfd: Callable[[str, int], int], tmp_path: Path
) -> None:
    """S10: only /proc/<sender pid>/fd/<n> naming a pdserve pool memfd of the right size."""
    nbytes = 8 * BPB
    fd = memfd(MEMFD_NAME, nbytes)
    pid = os.getpid()
    names = [
        "/etc/passwd",
        MEMFD_NAME,
        f"/dev/shm/{MEMFD_NAME}",
        f"/proc/self/fd/{fd}",
        f"/proc/{pid}/fd/../fd/{fd}",
        f"/proc/{pid}/fd/{fd}/",
        f"/proc/{pid}/fd/{fd}\0",
        f"/proc/{pid}/fd/0{fd}/../{fd}",
    ]
    for name in names:
        with pytest.raises(ValueError, match=r"is not /proc/\d+/fd/<n>"):
            MappedPool(name, 8, BPB, pid)
    with pytest.raises(ValueError, match=r"is not /proc/\d+/fd/<n>"):
        MappedPool(_proc_path(fd), 8, BPB, pid + 1)  # another process's descriptor
    # Right place, wrong object: a plain file or another memfd of exactly the right size.
    plain = tmp_path / "pool"
    plain.write_bytes(bytes(nbytes))
    with open(plain, "rb") as f, pytest.raises(ValueError, match="not a pdserve KV pool memfd"):
        MappedPool(_proc_path(f.fileno()), 8, BPB, pid)
    with pytest.raises(ValueError, match="is not a pdserve KV pool memfd"):
        MappedPool(_proc_path(memfd("not-a-pool", nbytes)), 8, BPB, pid)
    # Right object, too small for the blocks the peer claims.
    small = memfd(MEMFD_NAME, nbytes - 1)
    with pytest.raises(ValueError, match=rf"{nbytes - 1} bytes, expected {nbytes}"):
        MappedPool(_proc_path(small), 8, BPB, pid)
    assert MappedPool(_proc_path(fd), 8, BPB, pid).bytes is not None  # the control


def test_a_fifo_named_as_the_pool_is_refused_without_blocking(tmp_path: Path) -> None:
    """S10: a FIFO with no writer (an open of it would block) behind the sender's fd path or
    under /dev/shm with the pool's name: refused at once, never opened."""
    shm_dir = Path("/dev/shm") if os.path.isdir("/dev/shm") else tmp_path
    fifo = shm_dir / f"{MEMFD_NAME}-{uuid.uuid4().hex}"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # no writer: a blocking open would wait
    try:
        for path in (_proc_path(reader), str(fifo)):
            t0 = time.monotonic()
            result = _map_within(path, 8 * BPB)
            assert isinstance(result, ValueError), result
            assert time.monotonic() - t0 < 0.5
    finally:
        with contextlib.suppress(OSError):  # release an open that did block (the unfixed case)
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        os.close(reader)
        fifo.unlink()


# -- S10: the torch_dist rendezvous store ------------------------------------------------------


def _store_client(store: RendezvousStore) -> Any:
    return dist.TCPStore(
        "127.0.0.1", store.port, None, False, timeout=datetime.timedelta(seconds=2)
    )


def test_the_rendezvous_store_refuses_values_written_without_the_secret() -> None:
    cfg = transfer_config(transports=("torch_dist",), auth="hmac", hmac_secret=SECRET)
    store = RendezvousStore(cfg)
    sealer = StoreSealer(rendezvous_secret(cfg))
    assert sealer.enabled and sealer.namespace.startswith("pdserve-kv/")
    assert SECRET not in sealer.namespace
    assert sealer.namespace != StoreSealer(b"another-secret-of-32-characters!").namespace
    prefix = f"{sealer.namespace}receiver/1/"
    sealed = SealedStore(_store_client(store), prefix, sealer)
    raw = _store_client(store)
    sealed.set("rank0", b"10.0.0.1:1234")
    assert sealed.get("rank0") == b"10.0.0.1:1234"
    assert raw.get(f"{prefix}/rank0") != b"10.0.0.1:1234"  # what the wire holds is sealed
    forgeries = {
        "planted": b"10.6.6.6:1234",  # a client that found the key but lacks the secret
        "moved": raw.get(f"{prefix}/rank0"),  # a genuine value copied to another key
        "short": b"x",
    }
    for key, value in forgeries.items():
        raw.set(f"{prefix}/{key}", value)
        with pytest.raises(KVTransferError, match="fails its MAC") as e:
            sealed.get(key)
        assert e.value.reason == Reason.BAD_AUTH
    other = SealedStore(_store_client(store), prefix, StoreSealer(b"another-secret-of-32-chars!!"))
    with pytest.raises(KVTransferError, match="fails its MAC"):
        other.get("rank0")  # another secret cannot read (or forge) ours either
    store.close()


def test_a_pair_fails_cleanly_when_its_peer_writes_without_the_secret() -> None:
    """gloo's own rendezvous through the sealed store: the honest rank refuses the values a
    rank without the secret wrote under the very keys (the worst case: it learned them)."""
    cfg = transfer_config(transports=("torch_dist",), auth="hmac", hmac_secret=SECRET)
    store = RendezvousStore(cfg)
    sealer = StoreSealer(rendezvous_secret(cfg))
    prefix = f"{sealer.namespace}receiver/1/"
    cpu = torch.device("cpu")
    pairs = [  # rank 0 writes plain values
        DistPair(lambda: _store_client(store), rank, prefix, 2.0, "127.0.0.1", cpu, s)
        for rank, s in ((0, None), (1, sealer))
    ]
    try:
        assert wait_until(lambda: pairs[1].failed, timeout=10, interval=0.02)
        assert "bad_auth" in pairs[1].failed and "fails its MAC" in pairs[1].failed
        done = pairs[1].submit(lambda pg: None)
        assert done.done() and not done.ok
    finally:
        for pair in pairs:
            pair.close("test over")
        store.close()


def test_torch_dist_under_hmac_rendezvous_in_the_sealed_namespace(
    make_sender: Callable[..., SenderHandle], make_receiver: Callable[..., KVReceiver]
) -> None:
    """A genuine torch_dist pull under hmac lands exactly; every rendezvous key is in the
    secret's namespace and every value there is sealed."""
    cfg = transfer_config(
        transports=("torch_dist",), auth="hmac", hmac_secret=SECRET, transfer_timeout_s=5.0
    )
    h = make_sender(cfg)
    receiver = make_receiver(cfg)
    before = crcs(receiver.pool)
    params = h.sender.register("dist", [1, 2, 5], num_tokens=48)
    assert receiver.pull(params, [7, 8, 9]).transport == "torch_dist"
    assert_landed(receiver.pool, [1, 2, 5], [7, 8, 9], before)
    master = h.sender._ctx.dist_store.store
    keys = master.list_keys()
    sealer = StoreSealer(rendezvous_secret(cfg))
    assert keys and all(k.startswith(sealer.namespace) for k in keys), keys
    for key in keys:
        sealer.open(key, master.get(key))  # raises if any value is not sealed
