"""The ``fake`` runner: a deterministic tiny "model" on the real KV cache.

For orchestration and fault tests (RELIABILITY.md, "Harness"). Each token's KV is a fixed
function of (token, position, layer, k/v, head, dim), written through the real block tables into
the real KV tensor; the next token is a function of the KV *read back from the cache* for the
last ``context_window`` positions. So corrupted, missing or foreign KV changes the output, and
any completed request can be checked token for token against a fault-free run. A configurable
delay emulates prefill and decode cost.
"""

from __future__ import annotations

import time

import torch

from cluster.common.kv_layout import KVLayout
from cluster.common.tokenizer import FakeTokenizer
from cluster.config import ClusterConfig
from cluster.config.model_paths import model_limits
from cluster.engine.runner import (
    KVAllocator,
    RunnerOutput,
    default_kv_allocator,
    num_kv_blocks,
    set_torch_threads,
)
from cluster.engine.sampler import draw_seed
from cluster.engine.scheduler import ScheduledBatch

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
        self.tokenizer = FakeTokenizer(fm.vocab_size, fm.eos_token_id)
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
            ids.extend(r.token_at(p) for p in range(start, end))
            pos.extend(range(start, end))
            blocks.extend(it.block_ids[p // bs] for p in range(start, end))
            if it.num_new_tokens > 1 or r.num_uncomputed_tokens > 1:
                num_prefill_tokens += it.num_new_tokens
            else:
                has_decode = True
        if ids:
            t_ids = torch.tensor(ids)
            t_pos = torch.tensor(pos)
            self.kv_cache[torch.tensor(blocks), :, :, t_pos % bs] = self.kv_values(t_ids, t_pos)
        delay = num_prefill_tokens * self.fm.prefill_delay_per_token_s
        if has_decode:
            delay += self.fm.decode_delay_s
        if delay:
            time.sleep(delay)
        out = RunnerOutput([], [], None, None)
        want_logprobs = False
        for it in batch.items:
            if not it.samples:
                continue
            r = it.request
            ctx = r.num_computed_tokens + it.num_new_tokens
            window = range(max(0, ctx - self.fm.context_window), ctx)
            b = torch.tensor([it.block_ids[p // bs] for p in window])
            o = torch.tensor([p % bs for p in window])
            checksum = int(self.kv_cache[b, :, :, o].double().sum().item())
            token = (checksum * 40503 + ctx) % self.vocab_size
            if not r.params.is_greedy:
                token = (token + draw_seed(r.seed, r.num_output_tokens)) % self.vocab_size
            if r.num_output_tokens < r.params.min_tokens and token in r.eos_token_ids:
                token = (token + 1) % self.vocab_size
            out.request_ids.append(r.request_id)
            out.token_ids.append(token)
            want_logprobs = want_logprobs or r.params.logprobs is not None
        if want_logprobs:
            out.logprobs = [0.0] * len(out.token_ids)
            out.top_logprobs = [[] for _ in out.token_ids]
        return out
