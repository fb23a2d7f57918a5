"""Frame planning (coalescing, packing small blocks) and the sender's checks of a plan."""

from __future__ import annotations

import pytest

from cluster.kv_transfer.plan import MIN_FRAME_BYTES, check_source_frames, plan_frames
from cluster.kv_transfer.protocol import KVTransferError, Reason

BIG = 737_280  # default model, fp32, block 16
SMALL = 8192


def test_runs_consecutive_on_both_sides_coalesce_into_one_frame() -> None:
    plan = plan_frames([3, 4, 5, 9, 10], [20, 21, 22, 23, 40], BIG, 64 << 20)
    # 3-5 -> 20-22 is one run; 9 -> 23 starts another (source gap), 10 -> 40 too (dest gap)
    assert plan.frames == (((3, 20, 3),), ((9, 23, 1),), ((10, 40, 1),))
    assert plan.num_blocks == 5 and plan.num_bytes == 5 * BIG
    assert plan.wire_frames() == (((3, 3),), ((9, 1),), ((10, 1),))


def test_frames_are_capped_at_the_frame_size() -> None:
    plan = plan_frames(list(range(10)), list(range(10)), BIG, 2 << 20)  # 2 blocks per frame
    assert [plan.frame_nbytes(i) for i in range(len(plan.frames))] == [2 * BIG] * 5


def test_a_large_transfer_goes_in_at_least_four_frames_so_they_pipeline() -> None:
    plan = plan_frames(list(range(32)), list(range(32)), BIG, 64 << 20)  # 23.6 MB
    assert [plan.frame_nbytes(i) for i in range(len(plan.frames))] == [8 * BIG] * 4
    # under 4 x PIPELINE_MIN_FRAME_BYTES (16 MiB): one frame, as the frame size allows
    int8_block = 195_840  # default model, int8 KV, block 16
    assert len(plan_frames(list(range(32)), list(range(32)), int8_block, 64 << 20).frames) == 1
    assert len(plan_frames(list(range(5)), list(range(5)), BIG, 64 << 20).frames) == 1


def test_small_blocks_pack_to_at_least_64_kib() -> None:
    src = list(range(0, 64, 2))  # 32 scattered blocks of 8 KiB
    plan = plan_frames(src, list(range(32)), SMALL, 1 << 20)
    sizes = [plan.frame_nbytes(i) for i in range(len(plan.frames))]
    assert all(s >= MIN_FRAME_BYTES for s in sizes), sizes
    assert sum(sizes) == 32 * SMALL


def test_a_transfer_smaller_than_64_kib_is_one_frame() -> None:
    plan = plan_frames([5, 9], [1, 2], SMALL, 1 << 20)
    assert len(plan.frames) == 1 and plan.frame_nbytes(0) == 2 * SMALL


@pytest.mark.parametrize(
    ("frames", "needle"),
    [
        ((), "0 frames"),
        (((),), "empty frame"),
        ((((1, 0),),), "outside the pool"),
        ((((60, 10),),), "outside the pool"),
        ((((-1, 1),),), "outside the pool"),
        ((((7, 1),),), "not in this lease"),
        ((((1, 2),), ((2, 1),)), "requested twice"),
        ((((1, 3),),), "exceeds the limit"),
    ],
)
def test_the_sender_refuses_foreign_or_malformed_plans(frames: tuple, needle: str) -> None:
    with pytest.raises(KVTransferError) as e:
        check_source_frames(frames, frozenset({1, 2, 3}), 64, BIG, 2 * BIG)
    assert e.value.reason == Reason.BAD_BLOCKS and needle in e.value.detail
