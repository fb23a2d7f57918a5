"""Captured decode steps: one CUDA graph per batch-size bucket, fed through static buffers.

A decode-only step (every row a decode token or a draft: one query row over its own block
table) is launch-bound on a GPU: a small model issues hundreds of kernels per step. ``StepGraphs``
captures the step once per bucket of batch sizes (``DEFAULT_BUCKETS``, configurable) and replays
it: each step copies its inputs into static buffers in place (token ids, positions, the slots its
new KV goes to, block tables, context lengths) and replays the smallest bucket that holds it.

Padding: the rows between the real batch and its bucket are pad rows that cannot change a real
row. A pad row is token 0 at position 0 with context length 1, its block table all
``scratch_block`` and its new KV written to slot 0 of ``scratch_block``, a block the runner
reserves and never hands to a request: it writes nothing a real row reads, and reads only the
slot it has just written (so its values are finite whatever the cache held). Every other op of a
decode step is row-wise (embedding, norms, matmuls, rotary, per-row attention), so a real row's
result does not depend on the pad rows. Block table columns past a row's own blocks are filled
with ``scratch_block`` too (the kernel never reads them; the torch gather reads them masked).

On CUDA (``capture``) the buckets are captured largest first into one shared memory pool, after
warm-up runs on a side stream (all pad rows: nothing real is written); a step replays its
bucket's graph, and its logits are a view of the graph's static output (valid until the next
replay). Elsewhere the CPU twin runs exactly the same buffer filling and padding, then the step
function eagerly on the bucket's static views: that is what the unit tests check. A batch above
the largest bucket runs eagerly on its own inputs.

What the step function must be for capture: no host syncs (``.item()``, ``.tolist()``, tensors
built from Python values on the device) and its decode attention through
``AttentionMetadata.decode_kernel`` reading ``decode_block_tables`` / ``decode_ctx_lens`` in
place (``triton_paged_decode``; ``gather_decode`` is its torch stand-in for the CPU twin).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cluster.engine.attention import (
    AttentionMetadata,
    _decode_attention,
    decode_row_index,
    padding_mask,
)
from cluster.engine.kv_codec import FloatKV, Int8KV, KVCodec

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# (input_ids [B], positions [B], decode-only metadata) -> the rows' outputs [B, ...] (logits)
StepFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
DecodeKernel = Callable[..., torch.Tensor]


def gather_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    layer: int,
    scale: float,
) -> torch.Tensor:
    """attention.py's torch gather path with the ``decode_kernel`` signature (any device, no
    host sync): the CPU twin's stand-in for ``triton_paged_decode``."""
    _, _, _, bs, hkv, _ = kv_cache.shape
    d = q.shape[-1]
    codec: KVCodec = Int8KV(d) if kv_cache.dtype == torch.uint8 else FloatKV(kv_cache.dtype)
    mask = padding_mask(ctx_lens, block_tables.shape[1] * bs, q.dtype)
    meta = AttentionMetadata(
        slot_blocks=ctx_lens,
        slot_offsets=ctx_lens,
        num_decodes=q.shape[0],
        decode_rows=decode_row_index(block_tables, bs, kv_cache.shape[1], hkv),
        decode_mask=mask,
        prefills=[],
    )
    return _decode_attention(q, kv_cache, layer, meta, scale, codec)


@dataclass(slots=True)
class _Buffers:
    """The static inputs, sized for the largest bucket; a bucket's step reads their heads."""

    input_ids: torch.Tensor  # [Bmax]
    positions: torch.Tensor  # [Bmax]
    slot_blocks: torch.Tensor  # [Bmax]
    slot_offsets: torch.Tensor  # [Bmax]
    block_tables: torch.Tensor  # [Bmax, max_blocks]
    ctx_lens: torch.Tensor  # [Bmax]

    @classmethod
    def empty(cls, rows: int, max_blocks: int, device: torch.device) -> _Buffers:
        def z(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        return cls(z(rows), z(rows), z(rows), z(rows), z(rows, max_blocks), z(rows))


class StepGraphs:
    """Decode-only steps through per-bucket static buffers: CUDA graphs, or the eager CPU twin.

    ``step`` runs the model on (input_ids, positions, meta) and returns the rows' outputs;
    ``decode_kernel`` is the attention the static metadata names; ``max_blocks`` the widest
    block table (``ceil(max_model_len / block_size)``); ``scratch_block`` the reserved block pad
    rows write to. ``capture`` defaults to ``device.type == "cuda"``.
    """

    def __init__(
        self,
        step: StepFn,
        decode_kernel: DecodeKernel,
        *,
        max_blocks: int,
        scratch_block: int,
        device: torch.device,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        capture: bool | None = None,
    ) -> None:
        if not buckets or min(buckets) < 1:
            raise ValueError(f"buckets: batch sizes >= 1, got {list(buckets)}")
        self.step = step
        self.buckets = tuple(sorted(set(buckets)))
        self.max_blocks = max_blocks
        self.scratch_block = scratch_block
        self.device = device
        self.capture = device.type == "cuda" if capture is None else capture
        self.buf = _Buffers.empty(self.buckets[-1], max_blocks, device)
        self._pad(0, self.buckets[-1])
        self.metas = {b: self._static_meta(b, decode_kernel) for b in self.buckets}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool: Any = None  # the first capture's memory pool, shared by the others
        self.last_mode = ""  # how the last step ran: "graph", "twin" or "eager"
        self.last_bucket = 0  # its bucket (0: eager)

    def bucket_for(self, n: int) -> int | None:
        """The smallest bucket holding ``n`` rows; None above the largest (run eagerly)."""
        return next((b for b in self.buckets if b >= n), None)

    def _static_meta(self, b: int, kernel: DecodeKernel) -> AttentionMetadata:
        buf = self.buf
        return AttentionMetadata(
            slot_blocks=buf.slot_blocks[:b],
            slot_offsets=buf.slot_offsets[:b],
            num_decodes=b,
            decode_rows=None,
            decode_mask=None,
            prefills=[],
            decode_kernel=kernel,
            decode_block_tables=buf.block_tables[:b],
            decode_ctx_lens=buf.ctx_lens[:b],
        )

    # -- filling the buffers ------------------------------------------------------------------

    def _pad(self, start: int, end: int) -> None:
        """Rows [start, end) become pad rows (see the module docstring)."""
        buf = self.buf
        buf.input_ids[start:end] = 0
        buf.positions[start:end] = 0
        buf.slot_blocks[start:end] = self.scratch_block
        buf.slot_offsets[start:end] = 0
        buf.block_tables[start:end] = self.scratch_block
        buf.ctx_lens[start:end] = 1

    def _fill(
        self, n: int, b: int, input_ids: torch.Tensor, positions: torch.Tensor, m: AttentionMetadata
    ) -> None:
        assert m.decode_block_tables is not None and m.decode_ctx_lens is not None
        width = m.decode_block_tables.shape[1]
        if width > self.max_blocks:
            raise ValueError(f"a block table of {width} blocks; the graphs hold {self.max_blocks}")
        buf = self.buf
        buf.input_ids[:n].copy_(input_ids)
        buf.positions[:n].copy_(positions)
        buf.slot_blocks[:n].copy_(m.slot_blocks)
        buf.slot_offsets[:n].copy_(m.slot_offsets)
        buf.block_tables[:n, :width].copy_(m.decode_block_tables)
        buf.block_tables[:n, width:] = self.scratch_block
        buf.ctx_lens[:n].copy_(m.decode_ctx_lens)
        self._pad(n, b)

    # -- running ------------------------------------------------------------------------------

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """A decode-only step's outputs for its ``n`` real rows ([n, ...]): its bucket's graph
        (CUDA), the twin on the bucket's static buffers, or eagerly above the largest bucket."""
        n = input_ids.shape[0]
        if meta.num_decodes != n or meta.prefills:
            raise ValueError("StepGraphs runs decode-only steps; run mixed steps eagerly")
        b = self.bucket_for(n)
        if b is None:
            self.last_mode, self.last_bucket = "eager", 0
            return self.step(input_ids, positions, meta)
        self._fill(n, b, input_ids, positions, meta)
        self.last_bucket = b
        if b in self.graphs:
            graph, out = self.graphs[b]
            graph.replay()
            self.last_mode = "graph"
            return out[:n]
        self.last_mode = "twin"
        return self.step(self.buf.input_ids[:b], self.buf.positions[:b], self.metas[b])[:n]

    def capture_all(self, warmup: int = 2) -> float:
        """Capture every bucket, largest first, into one pool (CUDA with ``capture``; a no-op
        otherwise). Returns the seconds it took. Only pad rows run: nothing real is written."""
        t0 = time.perf_counter()
        if not self.capture:
            return 0.0
        self._pad(0, self.buckets[-1])
        for b in reversed(self.buckets):
            self._capture(b, warmup)
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def _capture(self, b: int, warmup: int) -> None:
        ids, pos, meta = self.buf.input_ids[:b], self.buf.positions[:b], self.metas[b]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(warmup):  # first-call work (kernel compiles, allocator) outside
                self.step(ids, pos, meta)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.step(ids, pos, meta)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[b] = (graph, out)
