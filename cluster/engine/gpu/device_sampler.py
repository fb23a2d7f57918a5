"""Sampling on the device: one batched pass over ``[B, V]`` logits, no host round trip per row.

Every row has its own temperature, top-k, top-p and min-p (tensors), filtered as
``cluster/engine/sampler.py`` filters one row: top-k keeps the values >= the k-th largest (ties
kept), then softmax, then top-p drops a token once the mass before it reaches ``top_p`` (the
first always stays; off at 1.0), then min-p drops probabilities below ``min_p`` times the largest.
Greedy rows (temperature 0 or top-k 1) take the argmax of the logits.

Randomness is counter-based, so a draw depends on (seed, output index, vocabulary id) and nothing
else: not on the device, the batch's other rows or any generator state. Each row's key is
``draw_seed(seed, output_index)`` (splitmix64 of the pair, as the host sampler keys its
generator), computed here in int64 tensor ops (multiplication wraps modulo 2**64, shifts are
made logical by masking); vocabulary id ``i`` gets the ``i``-th splitmix64 output of that key,
whose top 53 bits give ``u`` in (0, 1] and an exponential ``E = -log(u)``; the token is
``argmax(p / E)`` over the kept tokens, an exact draw from ``p`` (the exponential race). The same
(seed, index) gives the same token on CPU and CUDA (up to a 1-ulp tie in ``log``); the stream is
not the host sampler's (which draws from torch's per-device generators), so switching a
deployment between the two changes seeded outputs once, not their reproducibility.

Logprobs are the host sampler's: of the raw logits (``log_softmax``), the chosen token's and the
top ``k``, gathered on the device and brought to the host in one copy (``to_host``).

Not here (the host sampler keeps them): repetition/presence/frequency penalties, ``logit_bias``
and suppressed ids below ``min_tokens``; ``supported`` says which rows can come here. A boolean
``allowed`` mask ([B, V], structured output) is applied to the logits first, greedy rows too.

In the engine (``sample_rows``, the sampler ``spec.verify.sample_and_verify`` is given by the
torch runner on CUDA where ``gpu.plan`` turns device sampling on): every row ``supported`` is
drawn here, drafts' rows, structured-output rows (masked first) and parallel samples' first
tokens included, so which stream draws a token depends on its own request's parameters and
output index only, never on the batch around it. So on CUDA a seeded, sampled request's tokens
differ from what the same seed gives the host sampler (before this path was wired, with
``model.kernels: torch``, or on the CPU): the same seed still gives the same tokens every run
and on every CUDA replica, speculation on or off, and greedy outputs do not change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cluster.engine.sampler import SampleRequest, SamplerOutput, sample


def _signed(c: int) -> int:
    """A 64-bit constant as the int64 of the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)
_LOW63 = (1 << 63) - 1


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's ``>>`` is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def draw_seeds(seeds: torch.Tensor, output_index: torch.Tensor) -> torch.Tensor:
    """``sampler.draw_seed`` of each pair, on the pairs' device: [B] int64 -> [B] int64."""
    return _mix(seeds * _GOLDEN + output_index + 1) & _LOW63


def exponentials(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B] keys -> [B, V] fp32 Exp(1) values, the key's splitmix64 stream at each vocab id."""
    ids = torch.arange(1, vocab_size + 1, dtype=torch.long, device=keys.device)
    bits = _shr(_mix(keys[:, None] + ids[None, :] * _GOLDEN), 11)  # 53 random bits
    u = (bits + 1).to(torch.float64) * 2.0**-53  # (0, 1]
    return (-torch.log(u)).to(torch.float32)


@dataclass(slots=True)
class DeviceSamplingParams:
    """Each row's sampling parameters as [B] tensors on the device."""

    temperature: torch.Tensor  # fp32; 0: greedy
    top_k: torch.Tensor  # long; <= 0: off
    top_p: torch.Tensor  # fp32; 1.0: off
    min_p: torch.Tensor  # fp32; 0.0: off
    seed: torch.Tensor  # long: the request's seed
    output_index: torch.Tensor  # long: the index of the token drawn among its outputs

    @classmethod
    def of(cls, rows: Sequence[SampleRequest], device: torch.device) -> DeviceSamplingParams:
        """One host-to-device copy per field for the whole batch."""

        def col(values: list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        ps = [r.params for r in rows]
        return cls(
            col([0.0 if p.is_greedy else p.temperature for p in ps], torch.float32),
            col([p.top_k for p in ps], torch.long),
            col([p.top_p for p in ps], torch.float32),
            col([p.min_p for p in ps], torch.float32),
            col([r.seed for r in rows], torch.long),
            col([r.output_index for r in rows], torch.long),
        )


def supported(r: SampleRequest) -> bool:
    """Whether the device sampler draws what the host sampler would for this row's params."""
    p = r.params
    return not (r.suppress_token_ids or p.logit_bias or p.has_penalties)


@dataclass(slots=True)
class DeviceSample:
    token_ids: torch.Tensor  # [B] long
    logprobs: torch.Tensor | None  # [B] fp32: each chosen token's, under the raw logits
    top_ids: torch.Tensor | None  # [B, k] long
    top_logprobs: torch.Tensor | None  # [B, k] fp32

    def to_host(self) -> tuple[list[int], list[float] | None, list[list[tuple[int, float]]]]:
        """(token ids, chosen logprobs, top (id, logprob) pairs per row), one copy each."""
        ids = self.token_ids.tolist()
        lps = self.logprobs.tolist() if self.logprobs is not None else None
        if self.top_ids is None or self.top_logprobs is None:
            return ids, lps, [[] for _ in ids]
        tops = [list(zip(i, v)) for i, v in zip(self.top_ids.tolist(), self.top_logprobs.tolist())]
        return ids, lps, tops


def filtered_probs(logits: torch.Tensor, params: DeviceSamplingParams) -> torch.Tensor:
    """[B, V] fp32 logits -> each row's probabilities after temperature, top-k, top-p, min-p."""
    v = logits.shape[1]
    temp = torch.where(params.temperature > 0, params.temperature, 1.0)
    x = logits / temp[:, None]
    sorted_x, order = x.sort(dim=-1, descending=True)
    k = torch.where((params.top_k > 0) & (params.top_k < v), params.top_k, v)
    kth = sorted_x.gather(1, (k - 1)[:, None])  # [B, 1]
    probs = torch.softmax(x.masked_fill(x < kth, float("-inf")), dim=-1)
    sp = probs.gather(1, order)  # in descending order
    drop_sorted = (sp.cumsum(1) - sp) >= params.top_p[:, None]
    drop_sorted &= (params.top_p < 1.0)[:, None]
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    probs = probs.masked_fill(drop, 0.0)
    floor = params.min_p[:, None] * probs.amax(dim=1, keepdim=True)
    return probs.masked_fill(probs < floor, 0.0)


def sample_on_device(
    logits: torch.Tensor,
    params: DeviceSamplingParams,
    num_top_logprobs: int | None = None,
    allowed: torch.Tensor | None = None,
) -> DeviceSample:
    """logits: [B, V] fp32. ``num_top_logprobs``: None for no logprobs, k >= 0 for the chosen
    token's and the top k. ``allowed``: [B, V] bool, tokens a row may pick (structured output)."""
    raw = logits
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    greedy = logits.argmax(dim=-1)
    probs = filtered_probs(logits, params)
    noise = exponentials(draw_seeds(params.seed, params.output_index), logits.shape[1])
    drawn = (probs / noise).argmax(dim=-1)
    tokens = torch.where(params.temperature > 0, drawn, greedy)
    if num_top_logprobs is None:
        return DeviceSample(tokens, None, None, None)
    lp = torch.log_softmax(raw, dim=-1)
    chosen = lp.gather(1, tokens[:, None]).squeeze(1)
    top_vals, top_ids = lp.topk(num_top_logprobs, dim=-1)
    return DeviceSample(tokens, chosen, top_ids, top_vals)


def sample_rows(logits: torch.Tensor, rows: list[SampleRequest]) -> SamplerOutput:
    """``sampler.sample`` with every ``supported`` row drawn here: the same output (tokens,
    logprobs of the given logits, top k per row), the rows ``supported`` refuses drawn by the
    host sampler. A step of greedy rows only goes to the host sampler whole (on CUDA that is
    one device argmax: the same tokens). logits: [len(rows), V] fp32 (masks already applied)."""
    here = [i for i, r in enumerate(rows) if supported(r)]
    if not here or all(rows[i].params.is_greedy for i in here):
        return sample(logits, rows)
    want = any(r.params.logprobs is not None for r in rows)
    tokens = [0] * len(rows)
    lps = [0.0] * len(rows)
    tops: list[list[tuple[int, float]]] = [[] for _ in rows]
    k = max(r.params.logprobs or 0 for r in rows) if want else None
    sub = logits if len(here) == len(rows) else logits[here]
    mine = [rows[i] for i in here]
    ids, dev_lps, dev_tops = sample_on_device(
        sub, DeviceSamplingParams.of(mine, logits.device), k
    ).to_host()
    for j, i in enumerate(here):
        tokens[i] = ids[j]
        if dev_lps is not None and rows[i].params.logprobs is not None:
            lps[i] = dev_lps[j]
            tops[i] = dev_tops[j][: rows[i].params.logprobs]
    taken = set(here)
    rest = [i for i in range(len(rows)) if i not in taken]
    if rest:
        out = sample(logits[rest], [rows[i] for i in rest])
        for j, i in enumerate(rest):
            tokens[i] = out.token_ids[j]
            if out.logprobs is not None and out.top_logprobs is not None:
                lps[i], tops[i] = out.logprobs[j], out.top_logprobs[j]
    return SamplerOutput(tokens, lps if want else None, tops if want else None)
