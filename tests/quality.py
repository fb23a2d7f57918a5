"""Teacher-forced quality of a runner on a text: perplexity and the top-1 prediction at every
position, through the runner's own model and paged KV cache (prefilled in chunks, so later
chunks attend to earlier ones through the cache, whatever its dtype)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cluster.engine.attention import AttentionMetadata, PrefillSeq

TEXT = Path(__file__).parent / "data" / "declaration.txt"


@dataclass
class TeacherForced:
    nll: torch.Tensor  # [n - 1] negative log-likelihood of each next token
    top1: torch.Tensor  # [n - 1] the model's argmax at each position

    @property
    def perplexity(self) -> float:
        return math.exp(float(self.nll.double().mean()))


@torch.inference_mode()
def teacher_forced(runner: Any, ids: list[int], chunk: int = 256) -> TeacherForced:
    """Run ``ids`` through ``runner.model`` in chunks over blocks 0.. of its KV cache."""
    bs = runner.block_size
    num_blocks = -(-len(ids) // bs)
    assert num_blocks <= runner.num_blocks, "the runner's cache must hold the whole text"
    tokens = torch.tensor(ids, dtype=torch.long)
    nll, top1 = [], []
    for start in range(0, len(ids), chunk):
        end = min(len(ids), start + chunk)
        pos = torch.arange(start, end)
        meta = AttentionMetadata(
            slot_blocks=pos // bs,
            slot_offsets=pos % bs,
            num_decodes=0,
            decode_rows=None,
            decode_mask=None,
            prefills=[PrefillSeq(0, end - start, start, torch.arange(-(-end // bs)))],
        )
        hidden = runner.model.forward(tokens[start:end], pos, meta, runner.kv_cache)
        logits = runner.model.compute_logits(hidden).float()  # [chunk, V]
        logp = torch.log_softmax(logits, dim=-1)
        targets = tokens[start + 1 : end + 1]
        m = targets.shape[0]  # the last position of the text has no next token
        nll.append(-logp[torch.arange(m), targets])
        top1.append(logits[:m].argmax(dim=-1))
    return TeacherForced(torch.cat(nll), torch.cat(top1))
