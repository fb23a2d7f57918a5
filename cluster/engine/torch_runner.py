"""The ``torch`` model runner: Llama-family models with paged attention over block tables."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cluster.common.kv_layout import SCHEMES, KVLayout
from cluster.common.tokenizer import Tokenizer
from cluster.config import ClusterConfig
from cluster.config.model_paths import model_name
from cluster.engine import prompt_logprobs
from cluster.engine.attention import AttentionMetadata, PrefillSeq, decode_row_index
from cluster.engine.kernels import load_paged_decode
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
        # CPU fp32 fast paths (model.kernels): oneDNN linear layers, the quantized linear and
        # the paged decode kernels.
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
                config.model.kernels == "native",
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
        self.decode_kernel = self._load_decode_kernel(config, dtype)
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

    def _load_decode_kernel(self, config: ClusterConfig, dtype: torch.dtype) -> Any:
        kernel = None
        if self.native and self.layout.dtype in ("float32", "int8"):
            arch = self.model.arch
            kernel = load_paged_decode(
                config.paths.resolved_cache_dir,
                torch.get_num_threads(),
                arch.num_heads,
                arch.num_kv_heads,
                int8=self.layout.dtype == "int8",
            )
        if kernel is None and config.model.kernels == "native":
            raise ValueError(
                "model.kernels: native needs a C compiler (cc) and an fp32 or int8 KV cache"
            )
        return kernel

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
        bs = self.block_size
        dev = self.device
        # A decode with drafts is 1 + k decode rows over its one table (row j sees its context
        # up to itself): the same batched pass verifies them.
        decodes = [it for it in batch.items if it.num_new_tokens == 1 + len(it.draft_token_ids)]
        prefills = [it for it in batch.items if it.num_new_tokens > 1 + len(it.draft_token_ids)]
        ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        sampled: list[ScheduledRequest] = []
        prompt: list[prompt_logprobs.PromptRows] = []
        prompt_rows: list[int] = []
        # Decode rows (a token each, its own context length), attended in one batched pass.
        dec_tables: list[list[int]] = []
        dec_lens: list[int] = []
        for it in decodes:
            self._score_prompt(it, len(ids), prompt, prompt_rows)
            for p, token in enumerate(it.input_token_ids(), it.request.num_computed_tokens):
                ids.append(token)
                positions.append(p)
                dec_lens.append(p + 1)
                dec_tables.append(it.block_ids[: p // bs + 1])
                if it.samples:
                    sample_rows.append(len(ids) - 1)
            if it.samples:
                sampled.append(it)
        slot_blocks = [t[-1] for t in dec_tables]
        slot_offsets = [p % bs for p in positions]
        pref: list[PrefillSeq] = []
        for it in prefills:
            r = it.request
            start, n = r.num_computed_tokens, it.num_new_tokens
            end = start + n
            ids.extend(it.input_token_ids())
            row0 = len(positions)
            self._score_prompt(it, row0, prompt, prompt_rows)
            positions.extend(range(start, end))
            table = it.block_ids[: -(-end // bs)]
            slot_blocks.extend(table[p // bs] for p in range(start, end))
            slot_offsets.extend(p % bs for p in range(start, end))
            pref.append(PrefillSeq(row0, n, start, torch.tensor(table, device=dev)))
            if it.samples:
                sample_rows.append(row0 + n - 1)
                sampled.append(it)
        dec_rows = dec_mask = dec_table_t = dec_lens_t = None
        if decodes:
            width = max(len(t) for t in dec_tables)
            dec_table_t = torch.tensor(
                [t + [0] * (width - len(t)) for t in dec_tables], dtype=torch.long, device=dev
            )
            dec_lens_t = torch.tensor(dec_lens, dtype=torch.long, device=dev)
        if decodes and self.decode_kernel is None:
            assert dec_table_t is not None and dec_lens_t is not None
            layout = self.layout
            dec_rows = decode_row_index(dec_table_t, bs, layout.num_layers, layout.num_kv_heads)
            lens = dec_lens_t
            cols = torch.arange(width * bs, device=dev)
            dec_mask = torch.zeros((len(dec_lens), width * bs), dtype=self.model.dtype, device=dev)
            dec_mask.masked_fill_(cols[None, :] >= lens[:, None], float("-inf"))
        meta = AttentionMetadata(
            slot_blocks=torch.tensor(slot_blocks, dtype=torch.long, device=dev),
            slot_offsets=torch.tensor(slot_offsets, dtype=torch.long, device=dev),
            num_decodes=len(dec_lens),
            decode_rows=dec_rows,
            decode_mask=dec_mask,
            prefills=pref,
            decode_kernel=self.decode_kernel,
            decode_block_tables=dec_table_t,
            decode_ctx_lens=dec_lens_t,
        )
        return ForwardInputs(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            meta=meta,
            sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=dev),
            sampled=sampled,
            prompt_rows=torch.tensor(prompt_rows, dtype=torch.long, device=dev),
            prompt=prompt,
        )

    @staticmethod
    def _score_prompt(
        it: ScheduledRequest, row0: int, out: list[prompt_logprobs.PromptRows], rows: list[int]
    ) -> None:
        scored = prompt_logprobs.positions(it)
        if scored is not None:
            out.append(scored)
            rows.extend(range(row0, row0 + len(scored.targets)))


@dataclass(slots=True)
class ForwardInputs:
    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [S]: rows whose logits are sampled
    sampled: list[ScheduledRequest]  # the requests of those rows, same order (num_sampled_rows)
    prompt_rows: torch.Tensor  # rows scored for prompt logprobs, ``prompt``'s in order
    prompt: list[prompt_logprobs.PromptRows]
