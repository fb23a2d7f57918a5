"""How the zmq transport groups a pull's planned frames into messages (``messages``): a
scattered pull's many small frames share a few messages, a contiguous pull's large frames keep
one each (so a large pull still arrives in several, copied while the next is on the wire)."""

from __future__ import annotations

from cluster.kv_transfer.plan import PIPELINE_MIN_FRAME_BYTES
from cluster.kv_transfer.transports.zmq_frames import messages

MIB = 1 << 20
FP32_BLOCK = 737_280  # the default layout's block
LIMIT = 8 * MIB  # transfer.frame_bytes


def _sizes(groups: list[range], sizes: list[int]) -> list[int]:
    return [sum(sizes[i] for i in g) for g in groups]


def test_every_frame_once_in_order() -> None:
    for sizes in ([FP32_BLOCK] * 32, [3 * MIB, 100, 5 * MIB, 7, 7], [1] * 1000, [LIMIT]):
        groups = messages(sizes, LIMIT)
        assert [i for g in groups for i in g] == list(range(len(sizes)))
        assert all(len(g) >= 1 for g in groups)
    assert messages([], LIMIT) == []


def test_a_scattered_pull_goes_in_about_four_messages() -> None:
    sizes = [FP32_BLOCK] * 32  # 512 tokens, one frame per block
    groups = messages(sizes, LIMIT)
    assert [len(g) for g in groups] == [8, 8, 8, 8]  # a quarter of the pull each
    sizes = [FP32_BLOCK] * 64  # 1024 tokens: a quarter would exceed the frame limit
    assert all(s <= LIMIT for s in _sizes(messages(sizes, LIMIT), sizes))


def test_a_small_pull_is_one_message() -> None:
    sizes = [64 << 10] * 5 + [FP32_BLOCK]
    assert messages(sizes, LIMIT) == [range(6)]
    assert sum(sizes) < PIPELINE_MIN_FRAME_BYTES


def test_large_frames_keep_a_message_each() -> None:
    four = [5_898_240] * 4  # 512 fp32 tokens, contiguous: the plan's four frames
    assert messages(four, LIMIT) == [range(i, i + 1) for i in range(4)]
    two = [42 * 195_840, 22 * 195_840]  # 1024 int8 tokens, contiguous
    assert messages(two, LIMIT) == [range(0, 1), range(1, 2)]


def test_the_frame_limit_caps_a_message() -> None:
    sizes = [64 << 10] * 8
    assert messages(sizes, 64 << 10) == [range(i, i + 1) for i in range(8)]
    assert _sizes(messages(sizes, 128 << 10), sizes) == [128 << 10] * 4
