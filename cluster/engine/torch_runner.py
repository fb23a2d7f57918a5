"""The ``torch`` model runner: Llama-family models with paged attention over block tables."""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from cluster.common import shared_regions
from cluster.common.kv_layout import SCHEMES, KVLayout
from cluster.common.tokenizer import Tokenizer
from cluster.config import ClusterConfig
from cluster.config.model_paths import model_name
from cluster.engine import prompt_logprobs
from cluster.engine.attention import (
    AttentionMetadata,
    PrefillSeq,
    decode_row_index,
    padding_mask,
)
from cluster.engine.gpu.device_sampler import sample_rows
from cluster.engine.gpu.graphs import DEFAULT_BUCKETS, StepGraphs
from cluster.engine.gpu.plan import GpuPath, choose_gpu_path, triton_imports
from cluster.engine.gpu.triton_attention import prefill_kernel_for, triton_paged_decode
from cluster.engine.kernels.native import MAX_GROUP, load_native
from cluster.engine.kv_codec import kv_codec_for
from cluster.engine.models.default_model import ModelSource, model_source
from cluster.engine.models.packed import has_packed_rows
from cluster.engine.models.tensor_parallel import (
    keep_stage,
    plan_shards,
    plan_stages,
    shard_model,
)
from cluster.engine.models.weights import LoadSpec, load_model
from cluster.engine.pipeline import execute_pipelined, run_stage
from cluster.engine.runner import (
    KVAllocator,
    RunnerOutput,
    default_kv_allocator,
    map_shared_kv,
    num_kv_blocks,
    resolve_device,
    resolve_dtype,
    resolve_kv_dtype,
    set_torch_threads,
    shared_kv_allocator,
    shared_kv_path,
)
from cluster.engine.sampler import sample
from cluster.engine.scheduler import ScheduledBatch, ScheduledRequest
from cluster.engine.spec.verify import sample_and_verify
from cluster.engine.tp_group import RankFailure, ShmGroup
from cluster.engine.tp_ranks import STOP, Ranks, RankSpec, driver_gone, spawn_ranks

# Messages a pipeline stage's queue holds (each up to the group's slot size)
PIPE_SLOTS = 8

# The integer kernels' variants where model.numerics auto means fast (when the gates chose fast):
# the AVX-512 ones beat the exact kernel 2-4x on batches; AVX2's maddubs path does not.
FAST_PAYS = ("avx512bw", "avx512vnni")

logger = logging.getLogger(__name__)


class TorchModelRunner:
    def __init__(
        self,
        config: ClusterConfig,
        model_dir: Path | None = None,
        kv_allocator: KVAllocator = default_kv_allocator,
        rank: RankSpec | None = None,
    ) -> None:
        """``rank``: this process is one of a tensor-parallel engine's other ranks
        (``tp_ranks``); None: the engine's own runner (with ``model.tensor_parallel_size`` > 1,
        rank 0, which starts the others)."""
        self.config = config
        set_torch_threads(config)
        self.device = resolve_device(config)
        dtype = resolve_dtype(config, self.device)
        source = ModelSource(model_dir, None) if model_dir is not None else model_source(config)
        self.tp_rank = rank.rank if rank is not None else 0
        self._group: ShmGroup | None = None
        self._ranks: Ranks | None = None
        self._shared_kv: list[int] = []  # the address of a shared KV cache it allocated
        self._release: Callable[[], Any] = lambda: None
        try:
            self._start(config, source, dtype, kv_allocator, rank, model_dir)
        except BaseException:
            self.close()
            raise

    def _start(
        self,
        config: ClusterConfig,
        source: ModelSource,
        dtype: torch.dtype,
        kv_allocator: KVAllocator,
        rank: RankSpec | None,
        model_dir: Path | None,
    ) -> None:
        world = config.model.tensor_parallel_size * config.model.pipeline_parallel_size
        if world > 1:
            self._join_group(config, model_dir, rank, world)
        # CPU fp32: the native library's linear, layer ops and paged decode attention
        # (model.kernels).
        self.native = config.model.kernels != "torch" and (
            self.device.type == "cpu" and dtype == torch.float32
        )
        if config.model.kernels == "native" and not self.native:
            raise ValueError("model.kernels: native needs a CPU fp32 model; use auto or torch")
        self.model = load_model(
            config,
            LoadSpec(
                source,
                dtype,
                self.device,
                config.model.max_model_len,
                self.native,
                config.paths.resolved_cache_dir,
                config.model.kernels == "native" or config.model.numerics == "fast",
                numerics_for(config, self.native, f"{self.device.type} {dtype}"),
            ),
        )
        self.tokenizer = Tokenizer(source.model_dir)
        if self._group is not None and config.model.pipeline_parallel_size > 1:
            stages = plan_stages(self.model.arch, world)
            keep_stage(self.model, self.tp_rank, stages)
        elif self._group is not None:
            packed = has_packed_rows(self.model.matrices())
            shard = plan_shards(self.model.arch, world, packed)[self.tp_rank]
            shard_model(self.model, shard, self._group)
        arch = self.model.tp.full if self.model.tp is not None else self.model.arch
        self.vocab_size = arch.vocab_size
        self.max_model_len = self.model.cos.shape[0]
        self.block_size = config.cache.block_size
        kv_dtype = resolve_kv_dtype(config, dtype)
        self.layout = KVLayout(
            model_name(config),
            kv_dtype,
            self.block_size,
            arch.num_layers,
            arch.num_kv_heads,
            arch.head_dim,
            SCHEMES[kv_dtype],
        )
        self.model.kv_codec = kv_codec_for(self.layout)
        self.gpu = self._gpu_path(config)
        self.decode_kernel = self._load_decode_kernel(config)
        # Fast numerics round every activation to int8, so a last-bit difference upstream of a
        # matrix becomes a whole rounding step, and then other tokens. Prefill chunks' rows
        # are attended as decode rows are (the paged decode kernel, one row over its own
        # context), so each row's arithmetic is the same whichever step, chunk size, prefix
        # hit or pool computes it, and with the linear kernels' batch invariance a request's
        # output does not depend on how it was scheduled.
        self.rows_as_decodes = self.decode_kernel is not None and self.model.int8_activations
        self._allocate_kv(config, kv_allocator, rank)
        self.graphs: StepGraphs | None = None
        if self.gpu.cuda_graphs:
            self.graphs = self._capture_graphs(config)
        self.formats = {"weights": self.model.weight_format, "kv_cache": self.layout.dtype}
        logger.info(
            "weights %s (%.1f MiB); KV cache %s: %d blocks of %d tokens (%.1f MiB, %d bytes a "
            "token)",
            self.model.weight_format,
            self.model.weight_bytes() / 2**20,
            self.layout.dtype,
            self.num_blocks,
            self.block_size,
            self.num_blocks * self.layout.bytes_per_block / 2**20,
            self.layout.bytes_per_token,
        )

    # -- tensor parallelism -------------------------------------------------------------------

    def _join_group(
        self, config: ClusterConfig, model_dir: Path | None, rank: RankSpec | None, world: int
    ) -> None:
        """Rank 0 creates the ranks' group and starts the others (they load while it does, the
        same ``model_dir`` or the config's model); another rank attaches to the group."""
        if self.device.type != "cpu":
            raise ValueError(
                f"model.tensor_parallel_size: {world} runs CPU ranks on one host; ranks on CUDA "
                "devices (NCCL) are not built: use 1 there"
            )
        timeout = config.model.tensor_parallel_timeout_s
        pipes = PIPE_SLOTS if config.model.pipeline_parallel_size > 1 else 0
        if rank is None:
            group = self._group = ShmGroup.create(world, timeout, pipe_slots=pipes)
            ranks = self._ranks = spawn_ranks(config, model_dir, group.path, world)
            group.peer_alive = ranks.peer_alive
            group.wake_fds = ranks.wake_fds
            self._release = weakref.finalize(self, _stop_ranks, ranks, group, self._shared_kv)
            return
        self._group = ShmGroup.attach(rank.group_path, rank.rank, world, timeout, pipe_slots=pipes)
        self._group.peer_alive = lambda: driver_gone(rank.driver_pid)
        self._group.wake_fd = rank.wake_fd
        _bind_rank_cores(rank.rank, world, torch.get_num_threads())

    def _allocate_kv(
        self, config: ClusterConfig, kv_allocator: KVAllocator, rank: RankSpec | None
    ) -> None:
        """The KV cache, every rank's heads in one tensor; a tensor-parallel rank attends over
        its view of its heads (``kv_view``). Rank 0 allocates it, in shared memory where there
        are other ranks, and tells them where it is and how many blocks it holds."""
        group = self._group
        if rank is not None:  # another rank: map the driver's cache
            assert group is not None
            where = group.broadcast()
            assert isinstance(where, dict)
            self.num_blocks = int(where["num_blocks"])
            self.kv_cache = map_shared_kv(str(where["path"]), self.layout, self.num_blocks)
        else:
            self.num_blocks = num_kv_blocks(config, self.layout.bytes_per_block, self.device)
            if group is not None and kv_allocator is default_kv_allocator:
                kv_allocator = shared_kv_allocator
            # CUDA graphs: one more block, after the block manager's, where pad rows write
            scratch = 1 if self.gpu.cuda_graphs else 0
            kv = kv_allocator(self.layout, self.num_blocks + scratch, self.device)
            if group is not None and kv_allocator is shared_kv_allocator:
                self._shared_kv.append(kv.data_ptr())
            if group is not None and shared_kv_path(kv) is None:
                raise ValueError(
                    "model.tensor_parallel_size > 1: the server's KV allocator gave private "
                    "memory; the ranks need it shared (shared_kv_allocator, KVPool shared)"
                )
            self.kv_cache = kv
            if group is not None:
                path = shared_kv_path(kv)
                group.broadcast({"path": path, "num_blocks": self.num_blocks})
                assert self._ranks is not None
                self._ranks.wait_ready(config.model.tensor_parallel_timeout_s + 600)
        tp = self.model.tp
        self.kv_heads = tp.shard.kv_heads if tp is not None else (0, self.layout.num_kv_heads)
        self.kv_view = self.kv_cache
        if tp is not None:
            self.kv_view = self.kv_cache[..., self.kv_heads[0] : self.kv_heads[1], :]

    def follow_driver(self) -> None:
        """Another rank's life after start-up: each step rank 0 broadcasts, until ``STOP``."""
        group = self._group
        assert group is not None and self.tp_rank > 0
        while True:
            message = group.broadcast()
            if message == STOP:
                return
            assert isinstance(message, dict)
            if "micro_batches" in message:  # a pipeline stage
                parts = message["micro_batches"]
                run_stage(self, [self.step_inputs(_StepRows.from_wire(w)) for w in parts])
                continue
            self.forward(self.step_inputs(_StepRows.from_wire(message)))

    def problem(self) -> str | None:
        """Why a step cannot run: a tensor-parallel rank that exited (its exit code); None."""
        return self._ranks.peer_alive() if self._ranks is not None else None

    def close(self) -> None:
        """Stop the other ranks (rank 0) and let go of the group and the shared cache's fd
        (also done when the runner is collected, or at exit)."""
        self._ranks = None
        self._group = None
        self._release()

    def _gpu_path(self, config: ClusterConfig) -> GpuPath:
        """What of the GPU path this runner uses (``gpu.plan``; none of it on the CPU)."""
        if self.device.type != "cuda":
            return GpuPath()
        path = choose_gpu_path(
            device_type=self.device.type,
            kernels=config.model.kernels,
            kv_dtype=self.layout.dtype,
            head_dim=self.layout.head_dim,
            triton_available=triton_imports(),
            tensor_parallel=self.model.tp is not None,
            moe=self.model.expert_load is not None,
            packed_weights=has_packed_rows(self.model.matrices()),
        )
        logger.info("GPU path: %s", path.describe())
        return path

    def _capture_graphs(self, config: ClusterConfig) -> StepGraphs | None:
        """Decode-only steps as CUDA graphs, one per batch bucket up to the most rows such a
        step can have (a larger one runs eagerly); pad rows write only the scratch block. A
        capture that fails leaves every step eager (logged with its error), not the replica
        down."""
        assert self.decode_kernel is not None
        spec = config.decode.speculative
        per_seq = 1 + (spec.num_speculative_tokens if spec.method != "none" else 0)
        rows = min(config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs * per_seq)
        top = next((b for b in DEFAULT_BUCKETS if b >= rows), DEFAULT_BUCKETS[-1])
        graphs = StepGraphs(
            self._graph_step,
            self.decode_kernel,
            max_blocks=-(-self.max_model_len // self.block_size),
            scratch_block=self.num_blocks,
            device=self.device,
            buckets=[b for b in DEFAULT_BUCKETS if b <= top],
        )
        try:
            seconds = graphs.capture_all()
        except RuntimeError as e:
            logger.warning("CUDA graphs: the capture failed, decode steps run eagerly: %s", e)
            del graphs
            torch.cuda.empty_cache()
            return None
        logger.info(
            "CUDA graphs: decode steps of %s rows captured in %.1f s", list(graphs.buckets), seconds
        )
        return graphs

    def _graph_step(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """What a captured step runs: every row's logits."""
        hidden = self.model.forward(input_ids, positions, meta, self.kv_view)
        logits = self.model.compute_logits(hidden)
        assert logits is not None
        return logits

    def _load_decode_kernel(self, config: ClusterConfig) -> DecodeKernel | None:
        """The native paged decode attention (fp32 or int8 KV) on the CPU, the Triton one on
        CUDA (``self.gpu``), or None: the torch gather."""
        if self.gpu.triton_attention:
            return triton_paged_decode
        arch = self.model.arch
        kernels = None
        if (
            self.native
            and self.layout.dtype in ("float32", "int8")
            and arch.num_heads // arch.num_kv_heads <= MAX_GROUP
        ):
            kernels = load_native(config.paths.resolved_cache_dir, torch.get_num_threads())
        if kernels is None and config.model.kernels == "native":
            raise ValueError(
                "model.kernels: native needs the native library (a C compiler to build it), an "
                f"fp32 or int8 KV cache and at most {MAX_GROUP} query heads per kv head"
            )
        return kernels.paged_decode if kernels is not None else None

    # -- the step -----------------------------------------------------------------------------

    @property
    def group(self) -> ShmGroup | None:
        """The ranks' group (tensor or pipeline parallelism), or None."""
        return self._group

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        if self.config.model.pipeline_parallel_size > 1:
            return execute_pipelined(self, batch)
        inputs = self.prepare(batch)
        logits = self.forward(inputs)
        assert logits is not None
        s = inputs.sample_rows.shape[0]
        sampler = sample_rows if self.gpu.device_sampling else sample
        out = sample_and_verify(logits[:s], inputs.sampled, batch.masks, sampler)
        out.prompt_logprobs = prompt_logprobs.score(logits[s:], inputs.prompt)
        return out

    def forward(self, inputs: ForwardInputs) -> torch.Tensor | None:
        """Logits (fp32) of the rows sampled: each request's last known token's and, with
        drafts, each draft's (``ScheduledRequest.num_sampled_rows``); then the prompt rows
        scored for prompt logprobs (``prompt_logprobs``). None on a tensor-parallel rank other
        than 0 (its slice went to rank 0). A decode-only step without prompt rows replays its
        bucket's CUDA graph where ``self.graphs`` holds them."""
        n = inputs.input_ids.shape[0]
        meta = inputs.meta
        if self.graphs is not None and not inputs.prompt and 0 < n == meta.num_decodes:
            return self.graphs.run(inputs.input_ids, inputs.positions, meta)[inputs.sample_rows]
        hidden = self.model.forward(inputs.input_ids, inputs.positions, inputs.meta, self.kv_view)
        return self.logits_of(hidden, inputs)

    def logits_of(self, hidden: torch.Tensor, inputs: ForwardInputs) -> torch.Tensor | None:
        """The logits of a step's sampled rows, then its prompt rows, from the last layer's
        output (None on a tensor-parallel rank other than 0)."""
        rows = inputs.sample_rows
        if inputs.prompt_rows.numel():
            rows = torch.cat([rows, inputs.prompt_rows])
        return self.model.compute_logits(hidden[rows])

    def prepare(self, batch: ScheduledBatch) -> ForwardInputs:
        """The step's tensors; with other tensor-parallel ranks, its rows go to them too (they
        then run the step: ``forward`` must follow)."""
        rows = self.collect_rows(batch.items)
        if self._group is not None:  # the other ranks run the same step on their shards
            self._group.broadcast(rows.wire())
        return self.step_inputs(rows)

    def collect_rows(self, items: list[ScheduledRequest]) -> _StepRows:
        """The rows of a step's requests (all of them, or a pipeline's micro-batch)."""
        # A decode with drafts is 1 + k decode rows over its one table (row j sees its context
        # up to itself): the same batched pass verifies them. Decode rows come first.
        # Under fast numerics every row is a decode row, prefill chunks too: see rows_as_decodes.
        rows = _StepRows()
        decodes = [it for it in items if self._as_decode(it)]
        for it in decodes:
            self._add_decode(rows, it)
        for it in items:
            if not self._as_decode(it):
                self._add_prefill(rows, it)
        return rows

    def step_inputs(self, rows: _StepRows) -> ForwardInputs:
        """The step's tensors from its rows (on every rank, from the same rows)."""
        dev = self.device

        def long(values: list[int] | list[list[int]]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=dev)

        return ForwardInputs(
            input_ids=long(rows.ids),
            positions=long(rows.positions),
            meta=self._metadata(rows, long),
            sample_rows=long(rows.sample_rows),
            sampled=rows.sampled,
            prompt_rows=long(rows.prompt_rows),
            prompt=rows.prompt,
        )

    def _as_decode(self, it: ScheduledRequest) -> bool:
        """Whether ``it``'s rows are decode rows: a decode with or without drafts, or any chunk
        where ``rows_as_decodes``."""
        return self.rows_as_decodes or _decoding(it)

    def _add_decode(self, rows: _StepRows, it: ScheduledRequest) -> None:
        """Rows attended one by one over their block table, each with its own context length:
        a decode's token and drafts (each row sampled), or a prefill chunk (its last row
        sampled, if any)."""
        bs = self.block_size
        self._score_prompt(it, len(rows.ids), rows.prompt, rows.prompt_rows)
        every_row = _decoding(it)
        for p, token in enumerate(it.input_token_ids(), it.request.num_computed_tokens):
            rows.ids.append(token)
            rows.positions.append(p)
            rows.dec_lens.append(p + 1)
            table = it.block_ids[: p // bs + 1]
            rows.dec_tables.append(table)
            rows.slot_blocks.append(table[-1])
            rows.slot_offsets.append(p % bs)
            if it.samples and every_row:
                rows.sample_rows.append(len(rows.ids) - 1)
        if it.samples:
            if not every_row:
                rows.sample_rows.append(len(rows.ids) - 1)
            rows.sampled.append(it)

    def _add_prefill(self, rows: _StepRows, it: ScheduledRequest) -> None:
        """A prefill chunk's rows, attended one sequence at a time."""
        bs = self.block_size
        start, n = it.request.num_computed_tokens, it.num_new_tokens
        end = start + n
        row0 = len(rows.positions)
        rows.ids.extend(it.input_token_ids())
        self._score_prompt(it, row0, rows.prompt, rows.prompt_rows)
        rows.positions.extend(range(start, end))
        table = it.block_ids[: -(-end // bs)]
        rows.slot_blocks.extend(table[p // bs] for p in range(start, end))
        rows.slot_offsets.extend(p % bs for p in range(start, end))
        rows.prefills.append((row0, n, start, table))
        if it.samples:
            rows.sample_rows.append(row0 + n - 1)
            rows.sampled.append(it)

    def _metadata(
        self, rows: _StepRows, long: Callable[[list[int] | list[list[int]]], torch.Tensor]
    ) -> AttentionMetadata:
        meta = AttentionMetadata(
            slot_blocks=long(rows.slot_blocks),
            slot_offsets=long(rows.slot_offsets),
            num_decodes=len(rows.dec_lens),
            decode_rows=None,
            decode_mask=None,
            prefills=[PrefillSeq(r, n, c, long(table)) for r, n, c, table in rows.prefills],
            decode_kernel=self.decode_kernel,
        )
        if self.gpu.triton_attention and meta.prefills:
            meta.prefill_kernel = prefill_kernel_for(meta.prefills, self.device)
        if not rows.dec_lens:
            return meta
        width = max(len(t) for t in rows.dec_tables)
        tables = long([t + [0] * (width - len(t)) for t in rows.dec_tables])
        lens = long(rows.dec_lens)
        meta.decode_block_tables, meta.decode_ctx_lens = tables, lens
        if self.decode_kernel is None:  # the torch gather: row indices and a padding mask
            bs, layout = self.block_size, self.layout
            meta.decode_rows = decode_row_index(
                tables, bs, layout.num_layers, layout.num_kv_heads, self.kv_heads
            )
            meta.decode_mask = padding_mask(lens, width * bs, self.model.dtype)
        return meta

    @staticmethod
    def _score_prompt(
        it: ScheduledRequest, row0: int, out: list[prompt_logprobs.PromptRows], rows: list[int]
    ) -> None:
        scored = prompt_logprobs.positions(it)
        if scored is not None:
            out.append(scored)
            rows.extend(range(row0, row0 + len(scored.targets)))


DecodeKernel = Callable[..., torch.Tensor]  # NativeKernels.paged_decode


def _stop_ranks(ranks: Ranks, group: ShmGroup, shared_kv: list[int]) -> None:
    """Rank 0's end: ``STOP`` to the others (where they all live), then their processes, the
    group and the fd of the shared cache it allocated."""
    if ranks.peer_alive() is None:  # a rank that hangs has 2 s to take it, then is killed
        with contextlib.suppress(RankFailure):
            group.broadcast(STOP, timeout_s=2.0)
    ranks.close()
    group.close()
    for address in shared_kv:
        fd = shared_regions.forget(address)
        if fd >= 0:
            os.close(fd)


def _bind_rank_cores(rank: int, world: int, threads: int) -> None:
    """A rank other than 0 on cores of its own where the engine holds exactly the cores its
    ranks' threads need (a replica bound by ``cpu_binding``, or a host that size): rank r takes
    the r-th ``threads`` of them, rank 0 keeps the rest to share with its other threads."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) != world * threads:
        return
    mine = set(cores[rank * threads : (rank + 1) * threads])
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(tid), mine)


def _decoding(it: ScheduledRequest) -> bool:
    """A decode: its last token and any drafts, each row sampled (not a prefill chunk)."""
    return it.num_new_tokens == 1 + len(it.draft_token_ids)


@dataclass(slots=True)
class _StepRows:
    """A step's rows as ``prepare`` collects them: decode rows first, then prefill chunks."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_blocks: list[int] = field(default_factory=list)
    slot_offsets: list[int] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    sampled: list[ScheduledRequest] = field(default_factory=list)
    prompt: list[prompt_logprobs.PromptRows] = field(default_factory=list)
    prompt_rows: list[int] = field(default_factory=list)
    dec_tables: list[list[int]] = field(default_factory=list)
    dec_lens: list[int] = field(default_factory=list)
    # each prefill chunk: first row, rows, tokens of context before it, its block table
    prefills: list[tuple[int, int, int, list[int]]] = field(default_factory=list)

    # What the other tensor-parallel ranks need: the rows, not the requests they sample.
    _WIRE: ClassVar[tuple[str, ...]] = (
        "ids", "positions", "slot_blocks", "slot_offsets", "sample_rows", "prompt_rows",
        "dec_tables", "dec_lens", "prefills",
    )  # fmt: skip

    def wire(self) -> dict[str, list[Any]]:
        return {key: getattr(self, key) for key in self._WIRE}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> _StepRows:
        rows = cls(**{key: data[key] for key in cls._WIRE})
        rows.prefills = [tuple(p) for p in rows.prefills]  # type: ignore[misc]
        return rows


@dataclass(slots=True)
class ForwardInputs:
    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [S]: rows whose logits are sampled
    sampled: list[ScheduledRequest]  # the requests of those rows, same order (num_sampled_rows)
    prompt_rows: torch.Tensor  # rows scored for prompt logprobs, ``prompt``'s in order
    prompt: list[prompt_logprobs.PromptRows]


def numerics_for(config: ClusterConfig, native: bool, model: str) -> str:
    """model.numerics for a model: fast (asked for, or auto's default) runs on the native kernels
    of a CPU fp32 model only (``native``; ``model`` names its device and dtype for the error);
    auto means fast only where the integer kernels pay (``FAST_PAYS``), exact elsewhere."""
    numerics = config.model.resolved_numerics
    if numerics != "fast":
        return numerics
    if not native:
        if config.model.numerics == "fast":
            raise ValueError(
                f"model.numerics: fast needs the native kernels of a CPU fp32 model, not {model} "
                "(model.device, model.dtype); use model.numerics exact"
            )
        return "exact"
    if config.model.numerics == "auto":
        kernels = load_native(config.paths.resolved_cache_dir, 1)
        isa = kernels.qlinear_isa if kernels is not None else "none"
        if isa not in FAST_PAYS:
            logger.info("model.numerics auto: exact (the integer kernels here: %s)", isa)
            return "exact"
    return numerics
