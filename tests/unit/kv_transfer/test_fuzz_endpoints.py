"""K2: hypothesis-fuzzed messages against a live sender and a live receiver (derandomized).

0 uncaught exceptions (each side's thread alive, no internal errors), no allocation that follows
a declared size (the sender's RSS, measured in its own process, grows < 2 x max message size),
and honest traffic still served afterwards. CI runs 1000 cases
per side; the nightly marker runs 5000 per side.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.kv_sender_peer import SenderProcess
from cluster.kv_transfer import KVPool, KVReceiver
from cluster.kv_transfer.protocol import MESSAGE_TYPES, PROTOCOL_VERSION, Chunk, PullRequest, encode
from tests.unit.kv_transfer.helpers import SEED, SMALL, assert_landed, crcs, transfer_config
from tests.unit.kv_transfer.rogue import RogueClient, RogueSender

pytestmark = pytest.mark.timeout(300)
CFG = transfer_config(transports=("zmq",), max_message_bytes=1 << 20, transfer_timeout_s=600.0)

_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.text(max_size=12),
    st.binary(max_size=12),
)
_value = st.one_of(_scalar, st.lists(_scalar, max_size=4), st.lists(st.lists(_scalar, max_size=3)))
_frames = st.lists(st.binary(max_size=256), max_size=3)


@st.composite
def headers(draw: Any) -> bytes:
    """Random bytes, msgpack maps with a real tag and wrong fields, or hostile encodings."""
    kind = draw(st.sampled_from(["raw", "fields", "hostile", "valid_chunk", "valid_pull"]))
    if kind == "raw":
        return bytes(draw(st.binary(max_size=64)))
    if kind == "hostile":
        return bytes(
            draw(
                st.sampled_from(
                    [
                        b"\xdd\xff\xff\xff\xff",  # array of 4 G items
                        b"\xdf\xff\xff\xff\xff",  # map of 4 G items
                        b"\xdb\xff\xff\xff\xff",  # str of 4 GB
                        b"\xc6\xff\xff\xff\xff",  # bin of 4 GB
                        b"\x91" * 1000 + b"\xc0",  # nesting depth 1000
                        b"\xd4\x05\x01",  # ext type
                        b"\xa3\xed\xa0\x80",  # a lone surrogate, invalid UTF-8
                        msgpack.packb({"t": "hello", "v": PROTOCOL_VERSION + 1}),
                    ]
                )
            )
        )
    if kind == "valid_chunk":
        n = draw(st.integers(0, 3))
        return encode(Chunk(draw(st.integers(0, 3)), draw(st.integers(0, 3)), (1 << 16,) * n, ()))
    if kind == "valid_pull":
        frames = draw(st.lists(st.lists(st.tuples(st.integers(-2, 70), st.integers(-1, 9)))))
        msg = PullRequest(1, "t" * 32, "r", 0, "zmq", frames, False, 0)  # type: ignore[arg-type]
        return encode(msg)
    tag = draw(st.sampled_from(list(MESSAGE_TYPES)))
    fields = draw(st.dictionaries(st.text(max_size=10), _value, max_size=6))
    return bytes(msgpack.packb({"t": tag, "v": PROTOCOL_VERSION, **fields}))


@pytest.fixture(scope="module")
def live_sender() -> Iterator[SenderProcess]:
    """The sender in its own process, so its memory is measured apart from hypothesis's."""
    proc = SenderProcess(
        {
            "layout": dataclasses.asdict(SMALL),
            "num_blocks": 64,
            "seed": SEED,
            "transfer": {"transports": ["zmq"], "max_message_bytes": CFG.max_message_bytes},
        }
    )
    yield proc
    proc.close()


def _fuzz(examples: int, send: Callable[[bytes, list[bytes], bool], None]) -> None:
    @settings(
        max_examples=examples,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(header=headers(), frames=_frames, flag=st.booleans())
    def case(header: bytes, frames: list[bytes], flag: bool) -> None:
        send(header, frames, flag)

    case()


def _drained(stats: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Poll until the target has read everything (its rejection count stops moving)."""
    last = stats()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = stats()
        if now["rejected_total"] == last["rejected_total"]:
            return now
        last = now
    return last


@pytest.mark.parametrize("nightly", [False, pytest.param(True, marks=pytest.mark.nightly)])
def test_fuzzed_messages_to_a_live_sender(live_sender: SenderProcess, nightly: bool) -> None:
    examples = 5000 if nightly else 1000
    child = psutil.Process(live_sender.pid)
    fresh, greeted = RogueClient(live_sender.endpoint), RogueClient(live_sender.endpoint)
    greeted.handshake(SMALL)
    rss = child.memory_info().rss
    _fuzz(examples, lambda h, f, flag: (greeted if flag else fresh).send(parts=[h, *f]))
    st = _drained(lambda: live_sender.stats()["stats"])
    fresh.close()
    greeted.close()
    assert child.memory_info().rss - rss < 2 * CFG.max_message_bytes
    assert st["rejected_total"] >= 0.9 * examples  # they really were read
    assert st.get("internal_errors", 0) == 0 and live_sender.stats()["alive"]
    receiver = KVReceiver(CFG, KVPool.allocate(SMALL, 64))
    receiver.start()
    try:
        before = crcs(receiver.pool)
        params = live_sender.register("after-fuzz", [1, 2, 3], num_tokens=48)
        receiver.pull(params, [7, 8, 9], timeout_s=5)
        assert_landed(receiver.pool, [1, 2, 3], [7, 8, 9], before)
    finally:
        receiver.close()


@pytest.mark.parametrize("nightly", [False, pytest.param(True, marks=pytest.mark.nightly)])
def test_fuzzed_messages_to_a_live_receiver(live_sender: SenderProcess, nightly: bool) -> None:
    """A rogue sender floods a receiver's connection while one of its pulls is in flight."""
    examples = 5000 if nightly else 1000
    pulls: list[PullRequest] = []
    rogue = RogueSender(SMALL, lambda p: pulls.append(p) or [])
    receiver = KVReceiver(CFG, KVPool.allocate(SMALL, 64))
    receiver.start()
    try:
        before = crcs(receiver.pool)
        in_flight = receiver.pull_async(rogue.params([1, 2]), [20, 21])
        deadline = time.monotonic() + 5
        while not pulls and time.monotonic() < deadline:
            time.sleep(0.01)
        identity = rogue.identities[0]
        _fuzz(examples, lambda h, f, _: rogue.push([identity, h, *f]))
        st = _drained(receiver.stats)
        assert receiver.is_alive() and st.get("internal_errors", 0) == 0
        assert st["rejected_total"] >= 0.9 * examples
        after = crcs(receiver.pool)
        assert [a for b, a in enumerate(after) if b not in (20, 21)] == [
            x for b, x in enumerate(before) if b not in (20, 21)
        ]
        receiver.abort(rogue.params([1, 2]))
        with pytest.raises(Exception):  # noqa: B017 - failed or aborted, either is fine
            in_flight.result(timeout=5)
        # The same receiver still pulls honest KV.
        params = live_sender.register("after-rogue", [4, 5], num_tokens=32)
        receiver.pull(params, [30, 31], timeout_s=5)
        assert_landed(receiver.pool, [4, 5], [30, 31], after)
    finally:
        receiver.close()
        rogue.close()
