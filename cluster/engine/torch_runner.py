"""The ``torch`` model runner: Llama-family models with paged attention over block tables."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cluster.common.kv_layout import SCHEMES, KVLayout
from cluster.common.tokenizer import Tokenizer
from cluster.config import ClusterConfig
from cluster.config.model_paths import model_name
from cluster.engine import prompt_logprobs
from cluster.engine.attention import AttentionMetadata, PrefillSeq, decode_row_index
from cluster.engine.kernels.native import MAX_GROUP, load_native
from cluster.engine.kv_codec import kv_codec_for
from cluster.engine.models.default_model import ModelSource, model_source
from cluster.engine.models.weights import LoadSpec, load_model
from cluster.engine.runner import (
    KVAllocator,
    RunnerOutput,
    default_kv_allocator,
    num_kv_blocks,
    resolve_device,
    resolve_dtype,
    resolve_kv_dtype,
    set_torch_threads,
)
from cluster.engine.scheduler import ScheduledBatch, ScheduledRequest
from cluster.engine.spec.verify import sample_and_verify

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
    ) -> None:
        self.config = config
        set_torch_threads(config)
        self.device = resolve_device(config)
        dtype = resolve_dtype(config, self.device)
        source = ModelSource(model_dir, None) if model_dir is not None else model_source(config)
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
        arch = self.model.arch
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
        self.num_blocks = num_kv_blocks(config, self.layout.bytes_per_block, self.device)
        self.decode_kernel = self._load_decode_kernel(config)
        # Fast numerics round every activation to int8, so a last-bit difference upstream of a
        # matrix becomes a whole rounding step, and then other tokens. Prefill chunks' rows
        # are attended as decode rows are (the paged decode kernel, one row over its own
        # context), so each row's arithmetic is the same whichever step, chunk size, prefix
        # hit or pool computes it, and with the linear kernels' batch invariance a request's
        # output does not depend on how it was scheduled.
        self.rows_as_decodes = self.decode_kernel is not None and self.model.int8_activations
        self.kv_cache = kv_allocator(self.layout, self.num_blocks, self.device)
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

    def _load_decode_kernel(self, config: ClusterConfig) -> DecodeKernel | None:
        """The native paged decode attention (fp32 or int8 KV), or None: the torch gather."""
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

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        inputs = self.prepare(batch)
        logits = self.forward(inputs)
        s = inputs.sample_rows.shape[0]
        out = sample_and_verify(logits[:s], inputs.sampled, batch.masks)
        out.prompt_logprobs = prompt_logprobs.score(logits[s:], inputs.prompt)
        return out

    def forward(self, inputs: ForwardInputs) -> torch.Tensor:
        """Logits (fp32) of the rows sampled: each request's last known token's and, with
        drafts, each draft's (``ScheduledRequest.num_sampled_rows``); then the prompt rows
        scored for prompt logprobs (``prompt_logprobs``)."""
        hidden = self.model.forward(inputs.input_ids, inputs.positions, inputs.meta, self.kv_cache)
        rows = inputs.sample_rows
        if inputs.prompt:
            rows = torch.cat([rows, inputs.prompt_rows])
        return self.model.compute_logits(hidden[rows])

    def prepare(self, batch: ScheduledBatch) -> ForwardInputs:
        # A decode with drafts is 1 + k decode rows over its one table (row j sees its context
        # up to itself): the same batched pass verifies them. Decode rows come first.
        # Under fast numerics every row is a decode row, prefill chunks too: see rows_as_decodes.
        rows = _StepRows()
        decodes = [it for it in batch.items if self._as_decode(it)]
        for it in decodes:
            self._add_decode(rows, it)
        for it in batch.items:
            if not self._as_decode(it):
                self._add_prefill(rows, it)
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
        block_ids = torch.tensor(table, device=self.device)
        rows.prefills.append(PrefillSeq(row0, n, start, block_ids))
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
            prefills=rows.prefills,
            decode_kernel=self.decode_kernel,
        )
        if not rows.dec_lens:
            return meta
        width = max(len(t) for t in rows.dec_tables)
        tables = long([t + [0] * (width - len(t)) for t in rows.dec_tables])
        lens = long(rows.dec_lens)
        meta.decode_block_tables, meta.decode_ctx_lens = tables, lens
        if self.decode_kernel is None:  # the torch gather: row indices and a padding mask
            bs, layout = self.block_size, self.layout
            meta.decode_rows = decode_row_index(tables, bs, layout.num_layers, layout.num_kv_heads)
            cols = torch.arange(width * bs, device=self.device)
            mask = torch.zeros((len(lens), width * bs), dtype=self.model.dtype, device=self.device)
            meta.decode_mask = mask.masked_fill_(cols[None, :] >= lens[:, None], float("-inf"))
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
    prefills: list[PrefillSeq] = field(default_factory=list)


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
