"""The captured decode step's CPU twin: the same bucket, padding and static-buffer logic as the
CUDA graphs, run eagerly. With a tiny random Llama, a step of 3 real rows padded to bucket 4
gives the real rows the unpadded step's logits, pad rows touch no real block, and a batch above
the largest bucket runs eagerly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cluster.engine.attention import AttentionMetadata
from cluster.engine.gpu.graphs import StepGraphs, gather_decode
from cluster.engine.models.default_model import ModelSource
from cluster.engine.models.llama import LlamaModel
from cluster.engine.models.weights import LoadSpec, load_model
from tests.helpers import tiny_config

pytestmark = pytest.mark.timeout(120)

BS = 16
NUM_BLOCKS = 40
MAX_LEN = 256
SCRATCH = NUM_BLOCKS - 1  # reserved: no table below uses it


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LlamaModel:
    config = tiny_config(tiny_model_dir, **{"model.kernels": "torch"})
    spec = LoadSpec(
        ModelSource(tiny_model_dir, None),
        torch.float32,
        torch.device("cpu"),
        MAX_LEN,
        False,
        tmp_path_factory.mktemp("cache"),
        False,
        "exact",
    )
    return load_model(config, spec)


def _cache(model: LlamaModel) -> torch.Tensor:
    a = model.arch
    g = torch.Generator().manual_seed(0)
    shape = (NUM_BLOCKS, a.num_layers, 2, BS, a.num_kv_heads, a.head_dim)
    return torch.randn(shape, generator=g)  # random earlier context


def _step_inputs(
    lens: list[int], seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Decode rows whose new token lands at position len - 1, tables over distinct blocks."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // BS) for n in lens)
    perm = torch.randperm(SCRATCH, generator=g)[: len(lens) * width].view(len(lens), width)
    ctx = torch.tensor(lens, dtype=torch.long)
    pos = ctx - 1
    rows = torch.arange(len(lens))
    meta = AttentionMetadata(
        slot_blocks=perm[rows, pos // BS].contiguous(),
        slot_offsets=pos % BS,
        num_decodes=len(lens),
        decode_rows=None,
        decode_mask=None,
        prefills=[],
        decode_kernel=gather_decode,
        decode_block_tables=perm.contiguous(),
        decode_ctx_lens=ctx,
    )
    ids = torch.randint(0, 500, (len(lens),), generator=g)
    return ids, pos, meta


def _stepper(model: LlamaModel, kv: torch.Tensor):  # type: ignore[no-untyped-def]
    def step(ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return model.compute_logits(model.forward(ids, pos, meta, kv))

    return step


def _graphs(model: LlamaModel, kv: torch.Tensor, buckets: tuple[int, ...]) -> StepGraphs:
    return StepGraphs(
        _stepper(model, kv),
        gather_decode,
        max_blocks=MAX_LEN // BS,
        scratch_block=SCRATCH,
        device=torch.device("cpu"),
        buckets=buckets,
    )


def _head(
    inputs: tuple[torch.Tensor, torch.Tensor, AttentionMetadata], k: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """The first ``k`` rows of a decode step."""
    ids, pos, m = inputs
    assert m.decode_block_tables is not None and m.decode_ctx_lens is not None
    meta = AttentionMetadata(
        slot_blocks=m.slot_blocks[:k],
        slot_offsets=m.slot_offsets[:k],
        num_decodes=k,
        decode_rows=None,
        decode_mask=None,
        prefills=[],
        decode_kernel=m.decode_kernel,
        decode_block_tables=m.decode_block_tables[:k],
        decode_ctx_lens=m.decode_ctx_lens[:k],
    )
    return ids[:k], pos[:k], meta


def test_pad_rows_change_no_real_row(model: LlamaModel) -> None:
    """3 real rows (contexts across block boundaries) padded to bucket 4. Against the same rows
    with a fourth real row in the pad row's place (the same matrix shapes): bit-identical
    logits and KV, so the pad row's contents do not reach a real row. Against the unpadded
    3-row step: equal to 1e-5 (CPU BLAS rounds a 3-row and a 4-row product differently in
    the last bits; the greedy tokens agree). The pad row wrote slot 0 of the scratch block and
    nothing else."""
    kv0 = _cache(model)
    four = _step_inputs([5, 17, 33, 9])
    three = _head(four, 3)
    kv_twin, kv_four, kv_three = kv0.clone(), kv0.clone(), kv0.clone()
    graphs = _graphs(model, kv_twin, (1, 2, 4, 8))
    assert graphs.capture_all() == 0.0 and not graphs.graphs  # no capture on CPU
    got = graphs.run(*three)
    assert (graphs.last_mode, graphs.last_bucket) == ("twin", 4)
    ref4 = _stepper(model, kv_four)(*four)
    assert got.shape == (3, ref4.shape[1])
    assert torch.equal(got, ref4[:3])
    ref3 = _stepper(model, kv_three)(*three)
    torch.testing.assert_close(got, ref3, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.argmax(-1), ref3.argmax(-1))
    real = set(three[2].slot_blocks.tolist())
    for blk in range(SCRATCH):  # the real rows' blocks as the 4-row step wrote them; others as were
        if blk in real:
            assert torch.equal(kv_twin[blk], kv_four[blk]), blk
        else:
            assert torch.equal(kv_twin[blk], kv0[blk]), blk
    assert not torch.equal(kv_twin[SCRATCH, :, :, 0], kv0[SCRATCH, :, :, 0])
    assert torch.equal(kv_twin[SCRATCH, :, :, 1:], kv0[SCRATCH, :, :, 1:])  # slot 0 only


def test_buffers_are_refilled_each_step(model: LlamaModel) -> None:
    """A smaller step after a larger one: the rows the larger one left become pad rows, and the
    same bucket with other inputs gives those inputs' outputs."""
    kv = _cache(model)
    graphs = _graphs(model, kv, (2, 4))
    big = _step_inputs([40, 2, 18, 30], seed=2)
    small = _step_inputs([9, 25], seed=3)
    graphs.run(*big)
    assert graphs.last_bucket == 4
    first = graphs.run(*small).clone()
    assert graphs.last_bucket == 2
    assert graphs.buf.ctx_lens[:2].tolist() == [9, 25]
    again = graphs.run(*big)
    torch.testing.assert_close(graphs.run(*big), again)
    three = _head(big, 3)  # bucket 4 again: the fourth row is a pad row now
    graphs.run(*three)
    assert graphs.buf.ctx_lens.tolist() == [40, 2, 18, 1]
    assert torch.equal(graphs.buf.block_tables[3], torch.full((MAX_LEN // BS,), SCRATCH))
    assert graphs.buf.slot_blocks[3] == SCRATCH and graphs.buf.input_ids[3] == 0
    torch.testing.assert_close(graphs.run(*small), first)


def test_above_the_largest_bucket_runs_eagerly(model: LlamaModel) -> None:
    kv0 = _cache(model)
    ids, pos, meta = _step_inputs([3, 4, 5, 6, 7, 20])
    kv_eager, kv_twin = kv0.clone(), kv0.clone()
    ref = _stepper(model, kv_eager)(ids, pos, meta)
    graphs = _graphs(model, kv_twin, (1, 2, 4))
    got = graphs.run(ids, pos, meta)
    assert (graphs.last_mode, graphs.last_bucket) == ("eager", 0)
    assert torch.equal(got, ref)
    assert torch.equal(kv_twin, kv_eager)  # nothing padded: the scratch block is untouched


def test_mixed_steps_are_refused(model: LlamaModel) -> None:
    ids, pos, meta = _step_inputs([3, 4])
    meta.num_decodes = 1
    with pytest.raises(ValueError, match="decode-only"):
        _graphs(model, _cache(model), (2,)).run(ids, pos, meta)
    with pytest.raises(ValueError, match="buckets"):
        StepGraphs(
            _stepper(model, _cache(model)),
            gather_decode,
            max_blocks=4,
            scratch_block=0,
            device=torch.device("cpu"),
            buckets=(),
        )
