"""The ``fake`` runner: a deterministic tiny "model" on the real KV cache.

For orchestration and fault tests (reliability matrix, "Harness"). Each token's KV is a fixed
function of (token, position, layer, k/v, head, dim), written through the real block tables into
the real KV tensor; the next-token distribution is a function of the KV *read back from the
cache* for the last ``context_window`` positions: logits ``-((v - base) mod V)`` around a base
token computed from it, sampled by the real sampler (greedy: the base). So corrupted, missing or
foreign KV changes the output, and any completed request can be checked token for token against
a fault-free run. Configurable delays emulate prefill and decode cost and the model's load time.
"""

from __future__ import annotations

import time

import torch

from cluster.common.kv_layout import KVLayout
from cluster.common.tokenizer import FakeTokenizer
from cluster.config import ClusterConfig
from cluster.config.model_paths import model_limits
from cluster.engine import prompt_logprobs
from cluster.engine.runner import (
    KVAllocator,
    RunnerOutput,
    default_kv_allocator,
    num_kv_blocks,
    set_torch_threads,
)
from cluster.engine.scheduler import ScheduledBatch
from cluster.engine.spec.verify import sample_and_verify

_MOD = 2039  # KV values are integers below this: exact in fp16


class FakeModelRunner:
    def __init__(
        self, config: ClusterConfig, kv_allocator: KVAllocator = default_kv_allocator
    ) -> None:
        set_torch_threads(config)
        fm = config.testing.fake_model
        self.fm = fm
        self.device = torch.device("cpu")
        self.block_size = config.cache.block_size
        self.vocab_size = fm.vocab_size
        self.max_model_len = model_limits(config).max_model_len
        self.tokenizer = FakeTokenizer(fm.vocab_size, fm.eos_token_id, fm.ascii_tokens)
        self.layout = KVLayout(
            model="pdserve-fake",
            dtype="float16",
            block_size=self.block_size,
            num_layers=fm.num_layers,
            num_kv_heads=fm.num_kv_heads,
            head_dim=fm.head_dim,
        )
        self.num_blocks = num_kv_blocks(config, self.layout.bytes_per_block, self.device)
        self.kv_cache = kv_allocator(self.layout, self.num_blocks, self.device)
        # Per-element offset of (layer, k/v, head, dim): [L, 2, H, D]
        lg = torch.arange(fm.num_layers).view(-1, 1, 1, 1) * 17
        jg = torch.arange(2).view(1, -1, 1, 1) * 7
        hg = torch.arange(fm.num_kv_heads).view(1, 1, -1, 1) * 5
        dg = torch.arange(fm.head_dim).view(1, 1, 1, -1) * 3
        self._grid = lg + jg + hg + dg
        if fm.load_delay_s:
            time.sleep(fm.load_delay_s)  # a pool replica is not ready until its model is loaded

    def kv_values(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The KV the fake model writes for these tokens: [N, L, 2, H, D] fp16."""
        base = (token_ids * 131 + positions * 31).view(-1, 1, 1, 1, 1)
        return ((base + self._grid) % _MOD).to(torch.float16)

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        blocks: list[int] = []
        num_prefill_tokens = 0
        has_decode = False
        for it in batch.items:
            r = it.request
            start, end = r.num_computed_tokens, r.num_computed_tokens + it.num_new_tokens
            ids.extend(it.input_token_ids())
            pos.extend(range(start, end))
            blocks.extend(it.block_ids[p // bs] for p in range(start, end))
            if it.num_new_tokens - len(it.draft_token_ids) > 1 or r.num_uncomputed_tokens > 1:
                num_prefill_tokens += it.num_new_tokens
            else:
                has_decode = True  # a decode, with or without drafts to verify
        if ids:
            t_ids = torch.tensor(ids)
            t_pos = torch.tensor(pos)
            self.kv_cache[torch.tensor(blocks), :, :, t_pos % bs] = self.kv_values(t_ids, t_pos)
        delay = num_prefill_tokens * self.fm.prefill_delay_per_token_s
        if has_decode:
            delay += self.fm.decode_delay_s
        if delay:
            time.sleep(delay)
        sampled = [it for it in batch.items if it.samples]
        contexts: list[tuple[list[int], int]] = []  # (block table, tokens before) per row
        for it in sampled:
            first_ctx = it.request.num_computed_tokens + it.num_new_tokens
            first_ctx -= len(it.draft_token_ids)
            rows = range(first_ctx, first_ctx + it.num_sampled_rows)
            contexts.extend((it.block_ids, c) for c in rows)
        logits = self.logits(self.next_token_bases(contexts))
        out = sample_and_verify(logits, sampled, batch.masks)
        scored = [s for s in map(prompt_logprobs.positions, batch.items) if s is not None]
        if scored:  # each scored position's logits: those of the context up to it
            tables = {it.request.request_id: it.block_ids for it in batch.items}
            ctxs = [
                (tables[s.request_id], s.start + j + 1)
                for s in scored
                for j in range(len(s.targets))
            ]
            out.prompt_logprobs = prompt_logprobs.score(
                self.logits(self.next_token_bases(ctxs)), scored
            )
        return out

    def next_token_bases(self, contexts: list[tuple[list[int], int]]) -> torch.Tensor:
        """The most likely next token after each (block table, ctx) context: a function of the
        KV read back for its last ``context_window`` positions. Returns [S] long."""
        bs, w = self.block_size, self.fm.context_window
        if not contexts:
            return torch.empty(0, dtype=torch.long)
        blocks: list[int] = []
        offsets: list[int] = []
        valid: list[bool] = []
        for table, ctx in contexts:
            for p in range(ctx - w, ctx):
                blocks.append(table[p // bs] if p >= 0 else 0)
                offsets.append(p % bs)
                valid.append(p >= 0)
        kv = self.kv_cache[torch.tensor(blocks), :, :, torch.tensor(offsets)]  # [S*w, L, 2, H, D]
        sums = kv.double().flatten(1).sum(1) * torch.tensor(valid, dtype=torch.float64)
        checksums = sums.view(len(contexts), w).sum(1).to(torch.long)
        ctxs = torch.tensor([c for _, c in contexts], dtype=torch.long)
        return (checksums * 40503 + ctxs) % self.vocab_size

    def logits(self, bases: torch.Tensor) -> torch.Tensor:
        """[S] base tokens -> [S, V] fp32 logits: ``-((v - base) mod V)``, so a token ``m``
        above the base has probability proportional to ``exp(-m / temperature)`` (a known
        next-token distribution: greedy picks the base)."""
        v = torch.arange(self.vocab_size).view(1, -1)
        return -((v - bases.view(-1, 1)) % self.vocab_size).to(torch.float32)
