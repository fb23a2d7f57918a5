"""Tensor parallelism: a Llama-family model split across the ranks of one engine.

Each rank holds a slice of every layer and runs the same forward on it:

- **Attention** by KV-head groups: a rank owns a contiguous range of KV heads and the query
  heads that read them (column-parallel q/k/v rows, its bias rows), so attention needs no
  communication; the output projection is row-parallel (its columns of those query heads).
  Heads are divided as evenly as the groups allow: the default model's 3 KV heads over 2 ranks
  are 2 + 1 (6 and 3 query heads). Fewer KV heads than ranks: each KV head is replicated on
  ``ranks / kv_heads`` ranks, which split its query heads.
- **MLP**: gate/up rows column-parallel (each rank its slice of the intermediate features),
  down row-parallel.
- **Embedding and lm_head** vocab-parallel: each rank its rows of the vocabulary; a token's
  embedding comes from the rank that holds its row, the logits are gathered on rank 0.

After each row-parallel matrix the partial outputs are summed across ranks (``Collectives``
all-reduce), rank 0's carrying the residual: ``h + Σ_r x_r W_r^T``. That is the same sum as one
rank computes, in another order, so outputs equal the single-rank model's to fp32 rounding
(greedy tokens equal except at near-ties).

Packed weights are sliced whole blocks at a time: a split whose column boundary falls inside a
32-value quantization block (the o projection's query-head columns, the down projection's
intermediate columns) is refused at start-up naming the numbers. So is a head count that cannot
be divided, and a model with experts (expert parallelism is not built).

Every rank's KV heads live in one cache tensor holding all of them (``head_range``): a rank
attends over its view ``kv[..., h0:h1, :]``, and the block ids, the block manager and every KV
transfer see the whole cache, whatever the ranks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch

from cluster.engine.kernels.quant import (
    BLOCK,
    BLOCK_BYTES,
    F32,
    INT8_ROW,
    PackedRows,
    to_blocks,
    to_planar,
)
from cluster.engine.models.llama import LayerWeights, LlamaArch, LlamaModel
from cluster.engine.models.packed import PackedWeight, Weight


class Collectives(Protocol):
    """What a sharded forward needs of its ranks' group (``tp_group.ShmGroup``)."""

    rank: int
    world: int

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The element-wise sum of every rank's ``t``, in place, the same bits on every rank."""
        ...

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``t`` (shapes may differ in the last dimension), on rank 0; None
        elsewhere."""
        ...


@dataclass(frozen=True, slots=True)
class RankShard:
    """What one rank holds: half-open ranges of heads, intermediate features and vocab rows."""

    rank: int
    world: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    inter: tuple[int, int]
    vocab: tuple[int, int]


def _even(total: int, world: int, align: int = 1) -> list[tuple[int, int]]:
    """``total`` units in ``world`` contiguous ranges as even as ``align`` allows (boundaries
    on multiples of it; the earlier ranges take the remainder)."""
    units, rest = divmod(total // align, world)
    out, start = [], 0
    for r in range(world):
        n = (units + (r < rest)) * align
        if r == world - 1:
            n = total - start
        out.append((start, start + n))
        start += n
    return out


def plan_shards(arch: LlamaArch, world: int, packed: bool) -> list[RankShard]:
    """Each rank's share of ``arch``; ``packed``: weights in 32-value blocks (columns cut only
    at block boundaries). Raises ValueError naming the numbers where no split works."""
    name = f"model.tensor_parallel_size: {world}"
    if arch.num_experts:
        raise ValueError(f"{name}: a mixture-of-experts model is not split (no expert parallelism)")
    hq, hkv, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
    group = hq // hkv
    if hkv >= world:
        kv = _even(hkv, world)
        q = [(a * group, b * group) for a, b in kv]
    elif world % hkv == 0 and group % (world // hkv) == 0:
        per = world // hkv  # ranks sharing one KV head, each a slice of its query heads
        kv = [(r // per, r // per + 1) for r in range(world)]
        q = [(r * group // per, (r + 1) * group // per) for r in range(world)]
    else:
        raise ValueError(
            f"{name}: {hkv} KV heads ({group} query heads each) cannot be divided among {world} "
            "ranks: use a size that divides the KV heads, or a multiple of them that divides "
            "each group's query heads"
        )
    align = BLOCK if packed else 1
    if packed and any((a * d) % BLOCK for a, _ in q):
        raise ValueError(
            f"{name}: query heads split at {[a for a, _ in q]} cut the o projection's 32-value "
            f"quantization blocks (head_dim {d}); use another size or model.weights dense"
        )
    if arch.intermediate_size // align < world:
        raise ValueError(
            f"{name}: {arch.intermediate_size} intermediate features cannot be split into "
            f"{world} ranges of whole 32-value blocks"
        )
    inter = _even(arch.intermediate_size, world, align)
    vocab = _even(arch.vocab_size, world)
    if any(a == b for a, b in q) or arch.vocab_size < world:
        raise ValueError(f"{name}: more ranks than the model has heads or vocabulary rows")
    return [RankShard(r, world, q[r], kv[r], inter[r], vocab[r]) for r in range(world)]


# -- slicing weights -------------------------------------------------------------------------


def _segment_rows(seg: PackedRows, a: int, b: int) -> PackedRows:
    scales = seg.scales[a:b].contiguous() if seg.scales is not None else None
    return PackedRows(seg.qtype, seg.data[a:b].contiguous(), scales)


def take_rows(w: Weight, ranges: list[tuple[int, int]]) -> Weight:
    """Rows ``ranges`` of ``w``, one after another (dense or packed: whole rows, exact)."""
    if not isinstance(w, PackedWeight):
        return torch.cat([w[a:b] for a, b in ranges]).contiguous()
    parts: list[PackedWeight] = []
    for a, b in ranges:
        start = 0
        for seg in w.segments:
            lo, hi = max(a, start), min(b, start + seg.rows)
            if lo < hi:
                rows = _segment_rows(seg, lo - start, hi - start)
                parts.append(PackedWeight((rows,), w.cols))
            start += seg.rows
    out = PackedWeight.cat(parts)
    out.fp32_activations = w.fp32_activations  # (cat keeps rows and formats only)
    return out


def _segment_cols(seg: PackedRows, a: int, b: int) -> PackedRows:
    if seg.qtype in (F32, INT8_ROW):  # a value per column (int8 rows keep their row scales)
        return PackedRows(seg.qtype, seg.data[:, a:b].contiguous(), seg.scales)
    rows = seg.data.shape[0]
    blocks = to_blocks(seg.qtype, seg.data).view(rows, -1, BLOCK_BYTES[seg.qtype])
    cut = blocks[:, a // BLOCK : b // BLOCK].reshape(rows, -1)
    return PackedRows(seg.qtype, to_planar(seg.qtype, cut), None)


def take_cols(w: Weight, a: int, b: int) -> Weight:
    """Columns ``[a, b)`` of ``w`` (packed: on block boundaries, else ValueError)."""
    if not isinstance(w, PackedWeight):
        return w[:, a:b].contiguous()
    if any(s.qtype not in (F32, INT8_ROW) for s in w.segments) and (a % BLOCK or b % BLOCK):
        raise ValueError(f"columns [{a}, {b}) cut a 32-value quantization block")
    segs = tuple(_segment_cols(s, a, b) for s in w.segments)
    return PackedWeight(segs, b - a, w.fp32_activations)


def _shard_layer(lw: LayerWeights, s: RankShard, arch: LlamaArch) -> LayerWeights:
    d, hq, hkv, inter = arch.head_dim, arch.num_heads, arch.num_kv_heads, arch.intermediate_size
    (q0, q1), (k0, k1), (i0, i1) = s.q_heads, s.kv_heads, s.inter
    qkv_rows = [(q0 * d, q1 * d), ((hq + k0) * d, (hq + k1) * d)]
    qkv_rows.append(((hq + hkv + k0) * d, (hq + hkv + k1) * d))
    assert lw.gate_up is not None and lw.down is not None
    bias = lw.qkv_bias
    return dataclasses.replace(
        lw,
        qkv=take_rows(lw.qkv, qkv_rows),
        qkv_bias=torch.cat([bias[a:b] for a, b in qkv_rows]) if bias is not None else None,
        o=take_cols(lw.o, q0 * d, q1 * d),
        gate_up=take_rows(lw.gate_up, [(i0, i1), (inter + i0, inter + i1)]),
        down=take_cols(lw.down, i0, i1),
    )


def shard_model(model: LlamaModel, shard: RankShard, group: Collectives) -> LlamaModel:
    """``model`` cut down to ``shard`` (its layers replaced in place), running its collectives
    through ``group``."""
    arch = model.arch
    layers = [_shard_layer(lw, shard, arch) for lw in model.layers]
    v0, v1 = shard.vocab
    tied = model.lm_head is model.embed
    embed = take_rows(model.embed, [(v0, v1)])
    lm_head = embed if tied else take_rows(model.lm_head, [(v0, v1)])
    model.layers = layers
    model.embed, model.lm_head = embed, lm_head
    model.arch = dataclasses.replace(
        arch,
        num_heads=shard.q_heads[1] - shard.q_heads[0],
        num_kv_heads=shard.kv_heads[1] - shard.kv_heads[0],
        intermediate_size=shard.inter[1] - shard.inter[0],
    )
    model.tp = ShardedForward(shard, group, arch)
    return model


class ShardedForward:
    """The collectives a sharded ``LlamaModel.forward`` runs (``model.tp``)."""

    def __init__(self, shard: RankShard, group: Collectives, full: LlamaArch) -> None:
        self.shard = shard
        self.group = group
        self.full = full  # the unsplit model's shape

    @property
    def world(self) -> int:
        return self.shard.world

    def residual(self, h: torch.Tensor) -> torch.Tensor:
        """What a row-parallel matrix adds its partial output to: the residual on rank 0, zeros
        elsewhere (so the all-reduce adds it once)."""
        return h if self.shard.rank == 0 else torch.zeros_like(h)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(x.contiguous())

    def embed(self, ops: object, table: Weight, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ids this rank holds, zeros for the others; summed across ranks."""
        v0, v1 = self.shard.vocab
        local = ids - v0
        held = (local >= 0) & (local < v1 - v0)
        h = ops.embed(table, local.clamp(0, v1 - v0 - 1))  # type: ignore[attr-defined]
        h = h * held.unsqueeze(1).to(h.dtype)
        return self.reduce(h)

    def logits(self, local: torch.Tensor) -> torch.Tensor | None:
        """Every rank's vocabulary slice of the logits, in order, on rank 0; None elsewhere."""
        parts = self.group.gather(local.contiguous())
        return torch.cat(parts, dim=1) if parts is not None else None


# -- pipeline stages ----------------------------------------------------------------------------


def plan_stages(arch: LlamaArch, stages: int) -> list[tuple[int, int]]:
    """Each pipeline stage's layers, contiguous and as even as they divide (the earlier stages
    take the remainder)."""
    if arch.num_layers < stages:
        raise ValueError(
            f"model.pipeline_parallel_size: {stages} stages, but the model has "
            f"{arch.num_layers} layers"
        )
    return _even(arch.num_layers, stages)


def keep_stage(model: LlamaModel, stage: int, layers: list[tuple[int, int]]) -> LlamaModel:
    """``model`` cut down to stage ``stage``'s layers (in place): the embedding stays on the first
    stage, the final norm and lm_head on the last (a tied embedding on both)."""
    l0, l1 = layers[stage]
    last = stage == len(layers) - 1
    tied = model.lm_head is model.embed
    model.layers = model.layers[l0:l1]
    model.first_layer = l0
    nothing = torch.empty(0, dtype=model.dtype, device=model.device)
    if stage != 0 and not (last and tied):
        model.embed = nothing
    if not last:
        model.lm_head = model.embed if (tied and stage == 0) else nothing
    return model
