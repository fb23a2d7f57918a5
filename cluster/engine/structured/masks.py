"""One step's token masks: filled for the whole batch, applied to the logits before sampling.

``BatchMasks`` is built as soon as the batch is scheduled; llguidance computes the whole batch's
bitmasks in parallel, without the GIL. With the model on a GPU the fill runs on a helper thread
while the model computes the logits; with the model on the CPU it runs at once, before the forward
(a thread would take cores from the model's own, spinning, OpenMP threads). ``apply``
(``spec.verify``, before any row is sampled) waits for it and sets every disallowed token's logit to
-inf. A request with drafts gets a mask per sampled row: row ``j`` is the grammar's state after its
drafts ``d1..dj`` (llguidance advances a scratch state over them and rolls it back), so verification
samples each row as decoding without drafts would.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import numpy as np
import torch

from cluster.engine.batch import ScheduledRequest

# (request id, its matcher, its first mask row, its drafts)
MaskRow = tuple[str, llguidance.LLMatcher, int, list[int]]


class BatchMasks:
    def __init__(
        self,
        pool: ThreadPoolExecutor | None,
        executor: llguidance.LLExecutor,
        rows: list[MaskRow],
        num_rows: int,
        vocab: llguidance.LLTokenizer,
    ) -> None:
        self.row_of = {rid: k for rid, _m, k, _d in rows}
        self.bitmask = np.full((num_rows, (vocab.vocab_size + 31) // 32), -1, dtype=np.int32)
        entries = [(m, k, d) for _rid, m, k, d in rows]
        self._future: Future[None] | None = None
        if pool is not None:
            self._future = pool.submit(self._fill, executor, entries, vocab.eos_token)
        else:
            self._fill(executor, entries, vocab.eos_token)

    def _fill(
        self,
        executor: llguidance.LLExecutor,
        entries: list[tuple[llguidance.LLMatcher, int, list[int]]],
        eos: int,
    ) -> None:
        mask = self.bitmask
        ptr, row_bytes, num_rows = mask.ctypes.data, mask.shape[1] * 4, mask.shape[0]
        plain = [(m, k) for m, k, d in entries if not d]
        if plain:
            executor.unsafe_compute_mask_ptr(plain, ptr, row_bytes, num_rows)
        drafted = [e for e in entries if e[2]]
        if drafted:
            executor.unsafe_compute_mask_ptr_with_draft_token(drafted, ptr, row_bytes, num_rows)
        # A state the vocabulary cannot continue (no token allowed): EOS ends the request.
        dead = ~mask.any(axis=1)
        if dead.any():
            mask.view(np.uint32)[dead, eos // 32] |= np.uint32(1 << (eos % 32))

    def apply(self, logits: torch.Tensor, items: Sequence[ScheduledRequest]) -> torch.Tensor:
        """logits: [sum of items' num_sampled_rows, V], each item's rows in order; returns them
        with every token the grammar refuses at -inf (a new tensor: the model's logits may be
        inference tensors)."""
        if self._future is not None:
            self._future.result()
        logit_rows: list[int] = []
        mask_rows: list[int] = []
        first = 0
        for it in items:
            n = it.num_sampled_rows
            k = self.row_of.get(it.request.request_id)
            if k is not None:
                logit_rows.extend(range(first, first + n))
                mask_rows.extend(range(k, k + n))
            first += n
        if not logit_rows:
            return logits
        bits = np.unpackbits(self.bitmask[mask_rows].view(np.uint8), axis=1, bitorder="little")
        width = min(logits.shape[1], bits.shape[1])
        refused = np.zeros(tuple(logits.shape), dtype=np.bool_)
        refused[logit_rows] = True  # tokens past the grammar's vocabulary too
        refused[logit_rows, :width] = bits[:, :width] == 0
        return logits.masked_fill(torch.from_numpy(refused).to(logits.device), float("-inf"))
