"""The protocol (handle, messages, codec), fault-point specs and the transport registry."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import threading

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster import config as config_module
from cluster.common.faults import FaultInjected, FaultPoints, FaultSpec
from cluster.config import TransferConfig, load_config
from cluster.kv_transfer import TRANSPORTS, get_transport
from cluster.kv_transfer.protocol import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Ack,
    Chunk,
    Heartbeat,
    Hello,
    KVTransferError,
    KVTransferParams,
    PullRequest,
    Reason,
    check_params,
    decode,
    decode_params,
    encode,
    to_plain,
)
from tests.unit.kv_transfer.helpers import SMALL

# The live-endpoint fuzz (test_fuzz_endpoints) carries the K2 count; this one checks the codec.
CODEC_EXAMPLES = int(os.environ.get("PDSERVE_CODEC_FUZZ_EXAMPLES", "300"))


def make_params(**kw: object) -> KVTransferParams:
    base: dict = dict(
        request_id="r1",
        transfer_id="t1",
        endpoint="tcp://127.0.0.1:5555",
        ipc_endpoint="",
        instance_id="i1",
        epoch=3,
        host_id="h/b",
        block_ids=(4, 5, 9),
        block_hashes=(11, 2**64 - 1),
        num_tokens=40,
        layout=SMALL,
    )
    base.update(kw)
    return KVTransferParams(**base)


def test_params_round_trip_through_msgpack() -> None:
    params = make_params()
    wire = msgpack.unpackb(msgpack.packb(to_plain(params)), raw=False)
    assert wire["layout"] == dataclasses.asdict(SMALL)  # the layout nests as a map
    assert decode_params(wire) == params
    assert decode_params(wire).layout == SMALL
    assert params.peer_key == ("tcp://127.0.0.1:5555", "i1", 3)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.pop("transfer_id"),
        lambda d: d.update(extra=1),
        lambda d: d.update(block_ids=["1"]),
        lambda d: d.update(epoch=True),
        lambda d: d.update(num_tokens=0),
        lambda d: d.update(block_ids=[-1]),
        lambda d: d.update(layout="float32"),
    ],
)
def test_params_decode_rejects_bad_input(mutate: object) -> None:
    d = to_plain(make_params())
    mutate(d)  # type: ignore[operator]
    with pytest.raises(KVTransferError) as e:
        decode_params(d)
    assert e.value.reason == Reason.MALFORMED


@pytest.mark.parametrize(
    "mutate",
    [
        lambda layout: layout.update(dtype="float64"),
        lambda layout: layout.pop("head_dim"),
        lambda layout: layout.update(sliding_window=4),
    ],
)
def test_a_layout_this_side_cannot_read_is_a_layout_mismatch(mutate: object) -> None:
    """A map that is no layout this side knows (another dtype, a field more or less): the
    handshake refuses it as such, at once (not as a malformed message left unanswered)."""
    d = to_plain(make_params())
    mutate(d["layout"])  # type: ignore[operator]
    with pytest.raises(KVTransferError) as e:
        decode_params(d)
    assert e.value.reason == Reason.LAYOUT_MISMATCH and "unreadable layout" in str(e.value)
    hello = to_plain(Hello("i", "h", 1, SMALL, ("zmq",)))
    mutate(hello["layout"])  # type: ignore[operator]
    with pytest.raises(KVTransferError) as e:
        decode(msgpack.packb({"t": "hello", "v": PROTOCOL_VERSION, **hello}))
    assert e.value.reason == Reason.LAYOUT_MISMATCH


def test_params_from_another_protocol_version_are_refused() -> None:
    d = to_plain(make_params())
    d["protocol_version"] = PROTOCOL_VERSION + 1
    with pytest.raises(KVTransferError) as e:
        decode_params(d)
    assert e.value.reason == Reason.BAD_VERSION
    # The same handle as an object (through Ray), checked before any pull uses it.
    with pytest.raises(KVTransferError) as e:
        check_params(make_params(protocol_version=PROTOCOL_VERSION + 1))
    assert e.value.reason == Reason.BAD_VERSION
    with pytest.raises(KVTransferError) as e:
        check_params(d)
    assert e.value.reason == Reason.MALFORMED


def test_a_params_handle_takes_a_layout_not_its_dict() -> None:
    with pytest.raises(ValueError, match="layout: must be a KVLayout"):
        make_params(layout=dataclasses.asdict(SMALL))


def test_every_message_round_trips_with_its_tag() -> None:
    msgs = [
        Hello("i", "h", 1, SMALL, ("shm", "zmq")),
        PullRequest(7, "t", "r", 1, "zmq", (((1, 2), (5, 1)), ((9, 3),)), True, 0),
        Chunk(7, 0, (1024,), (123,)),
        Ack(7, "t"),
        Heartbeat(("a", "b")),
    ]
    for m in msgs:
        data = encode(m)
        assert msgpack.unpackb(data)["t"] == m.TAG
        assert decode(data) == m
    assert len(MESSAGE_TYPES) == 12


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"", Reason.MALFORMED),
        (b"\xc1", Reason.MALFORMED),  # never-used msgpack byte
        (msgpack.packb([1, 2]), Reason.MALFORMED),
        (msgpack.packb({"t": "ack", "v": PROTOCOL_VERSION + 1}), Reason.BAD_VERSION),
        (msgpack.packb({"t": "nope", "v": PROTOCOL_VERSION}), Reason.MALFORMED),
        (msgpack.packb({"t": "ack", "v": PROTOCOL_VERSION, "pull_id": 1}), Reason.MALFORMED),
        (
            msgpack.packb({"t": "ack", "v": PROTOCOL_VERSION, "pull_id": "1", "transfer_id": "x"}),
            Reason.MALFORMED,
        ),
        (b"\xdd\xff\xff\xff\xff", Reason.MALFORMED),  # array of 4 G items declared
        (b"\x91" * 5000 + b"\xc0", Reason.MALFORMED),  # nesting depth 5000
        (b"\xd4\x01\x02", Reason.MALFORMED),  # ext type
        (b"\xa2\xff\xfe", Reason.MALFORMED),  # invalid UTF-8
        (b"\x00" * (2 << 20), Reason.OVERSIZED),
    ],
)
def test_decode_refuses_malformed_headers(payload: bytes, reason: str) -> None:
    with pytest.raises(KVTransferError) as e:
        decode(payload)
    assert e.value.reason == reason


_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=20),
)
_values = st.recursive(
    _leaf,
    lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=8), c, max_size=5),
    max_leaves=20,
)


@settings(
    max_examples=CODEC_EXAMPLES,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    tag=st.sampled_from([*MESSAGE_TYPES, "x"]),
    fields=st.dictionaries(st.text(max_size=12), _values, max_size=8),
    raw=st.binary(max_size=64),
    use_raw=st.booleans(),
)
def test_fuzzed_headers_raise_only_transfer_errors(
    tag: str, fields: dict, raw: bytes, use_raw: bool
) -> None:
    """K2 at the codec: any input decodes to a message or raises KVTransferError, nothing else."""
    payload = raw if use_raw else msgpack.packb({"t": tag, "v": PROTOCOL_VERSION, **fields})
    with contextlib.suppress(KVTransferError):
        decode(payload)


def test_fault_specs_parse_and_refuse_nonsense() -> None:
    assert FaultSpec.parse("p.mid_send_frame_k") == FaultSpec("p.mid_send_frame_k", 1, "kill")
    assert FaultSpec.parse(" d.x:3=raise ") == FaultSpec("d.x", 3, "raise")
    for bad in ("", ":2", "a:0", "a:x", "a=explode"):
        with pytest.raises(ValueError, match=r"testing\.fault_points"):
            FaultSpec.parse(bad)


def test_fault_point_raises_on_the_nth_hit_only() -> None:
    fp = FaultPoints(["a:3=raise"])
    fp.hit("a")
    fp.hit("a")
    with pytest.raises(FaultInjected):
        fp.hit("a")
    fp.hit("a")  # acts once
    fp.hit("unarmed")
    assert fp.count("a") == 4 and fp.count("unarmed") == 0 and not fp.armed("unarmed")


def test_fault_point_pause_blocks_until_released() -> None:
    fp = FaultPoints(["p=pause"])
    done = threading.Event()
    t = threading.Thread(target=lambda: (fp.hit("p"), done.set()))
    t.start()
    assert fp.wait_paused("p", timeout=5)
    assert not done.wait(0.1)
    fp.release("p")
    assert done.wait(5)
    t.join()


def test_fault_point_kill_is_a_real_sigkill() -> None:
    code = (
        "from cluster.common.faults import FaultPoints\n"
        "fp = FaultPoints(['x:2'])\nfp.hit('x')\nprint('first', flush=True)\nfp.hit('x')\n"
        "print('survived')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == -9 and "first" in out.stdout and "survived" not in out.stdout


def test_transport_registry_is_the_config_list() -> None:
    assert set(config_module._TRANSPORTS) == set(TRANSPORTS)
    assert get_transport("zmq").name == "zmq"
    with pytest.raises(ValueError, match="valid: loopback, shm, zmq, torch_dist"):
        get_transport("rdma")
    with pytest.raises(ValueError, match=r"transfer\.transports"):
        load_config().replace({"transfer.transports": ["rdma"]})


def test_config_refuses_an_exposed_socket_without_auth() -> None:
    with pytest.raises(ValueError, match=r"transfer\.auth"):
        TransferConfig(bind_host="0.0.0.0")
    assert TransferConfig(bind_host="0.0.0.0", auth="hmac").auth == "hmac"
    assert TransferConfig(bind_host="::1").is_loopback_bind
    assert TransferConfig(bind_host="localhost").is_loopback_bind
