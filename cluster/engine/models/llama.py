"""Llama-family decoder (Llama, Qwen2, Mistral, SmolLM) with paged attention.

GQA, RoPE with its scaling variants (inverse frequencies from transformers' own RoPE code),
RMSNorm, SwiGLU, optional q/k/v bias (Qwen2), tied or untied embeddings. q/k/v and gate/up
projections are fused into one matmul each. Numerics follow transformers' implementation so
greedy outputs match a transformers run token for token (fp32).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cluster.engine.attention import AttentionMetadata, paged_attention, write_kv


@dataclass(frozen=True)
class LlamaArch:
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    max_position_embeddings: int


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(Hq + 2*Hkv) * D, H]
    qkv_bias: torch.Tensor | None  # [(Hq + 2*Hkv) * D]
    o: torch.Tensor  # [H, Hq * D]
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2 * I, H]
    down: torch.Tensor  # [H, I]


Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


@functools.cache
def onednn_linear() -> Linear | None:
    """oneDNN's linear on CPU where it is faster than ``F.linear`` on this machine.

    A private torch op: probed against ``F.linear`` once for equal results, then timed against it
    at decode batch 1 and at batch 32, since which one wins depends on the CPU, torch's build and
    the batch (on one Xeon oneDNN was 1.3-2x faster at batch 1; on a Sapphire Rapids it was
    slower at batch 1 and ~20% faster from batch 16 on). Returns oneDNN for the batch sizes where
    it won, ``F.linear`` below or above, or ``None`` when the op is missing, wrong or never faster.
    """
    op = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
    if op is None:
        return None

    def onednn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return op(x, w, b, "none", [], "")

    try:
        g = torch.Generator().manual_seed(0)
        x, w, b = torch.randn(3, 64, generator=g), torch.randn(48, 64, generator=g), None
        if not torch.allclose(onednn(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-4):
            return None
        small, large = _faster(onednn, F.linear, 1), _faster(onednn, F.linear, 32)
    except RuntimeError:
        return None
    if small and large:
        return onednn
    if not small and not large:
        return None
    split = SMALL_BATCH_ROWS

    def mixed(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        return (onednn if (rows > split) == large else F.linear)(x, w, b)

    return mixed


SMALL_BATCH_ROWS = 8  # up to this many rows a matmul counts as "batch 1" for the choice above


def _faster(candidate: Linear, baseline: Linear, rows: int, rounds: int = 9) -> bool:
    """Whether ``candidate`` beats ``baseline`` by >= 5% on [rows, 1536] x [1536, 576] (an MLP
    down projection; median of interleaved rounds, so a busy neighbour slows both alike)."""
    import time

    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(rows, 1536, generator=g), torch.randn(576, 1536, generator=g)
    ratios = []
    for _ in range(rounds):
        times = []
        for f in (candidate, baseline):
            f(x, w, None)  # warm
            t0 = time.perf_counter()
            for _ in range(10):
                f(x, w, None)
            times.append(time.perf_counter() - t0)
        ratios.append(times[0] / times[1])
    ratios.sort()
    return ratios[len(ratios) // 2] < 0.95


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [N, heads, D]; cos, sin: [N, 1, D]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LlamaModel:
    def __init__(
        self,
        arch: LlamaArch,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        final_norm: torch.Tensor,
        lm_head: torch.Tensor,
        inv_freq: torch.Tensor,
        attention_scaling: float,
        max_model_len: int,
        linear: Linear = F.linear,
    ) -> None:
        self.arch = arch
        self.linear = linear
        self.embed = embed  # [V, H]
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head  # [V, H] (the embedding itself when tied)
        self.scale = arch.head_dim**-0.5
        dtype, device = embed.dtype, embed.device
        # RoPE tables for every position, as transformers computes them (fp32, then cast).
        pos = torch.arange(max_model_len, dtype=torch.float32, device=device)
        freqs = pos[:, None] * inv_freq.to(device=device, dtype=torch.float32)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * attention_scaling).to(dtype)  # [max_model_len, D]
        self.sin = (emb.sin() * attention_scaling).to(dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [N]
        positions: torch.Tensor,  # [N]
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, Hkv, D]
    ) -> torch.Tensor:
        a = self.arch
        n = input_ids.shape[0]
        hq, hkv, d = a.num_heads, a.num_kv_heads, a.head_dim
        q_size, kv_size = hq * d, hkv * d
        cos = self.cos[positions].unsqueeze(1)  # [N, 1, D]
        sin = self.sin[positions].unsqueeze(1)
        lin = self.linear
        h = F.embedding(input_ids, self.embed)  # [N, H]
        for i, lw in enumerate(self.layers):
            x = rms_norm(h, lw.input_norm, a.rms_norm_eps)
            qkv = lin(x, lw.qkv, lw.qkv_bias)  # [N, (Hq + 2*Hkv) * D]
            q = qkv[:, :q_size].view(n, hq, d)
            k = qkv[:, q_size : q_size + kv_size].view(n, hkv, d)
            v = qkv[:, q_size + kv_size :].view(n, hkv, d)
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
            k_cache = kv_cache[:, i, 0]  # [num_blocks, block_size, Hkv, D]
            v_cache = kv_cache[:, i, 1]
            write_kv(k_cache, v_cache, k, v, meta)
            attn = paged_attention(q, k, v, kv_cache, i, meta, self.scale)  # [N, Hq, D]
            h = h + lin(attn.reshape(n, q_size), lw.o, None)
            x = rms_norm(h, lw.post_norm, a.rms_norm_eps)
            gu = lin(x, lw.gate_up, None)  # [N, 2 * I]
            inter = a.intermediate_size
            h = h + lin(F.silu(gu[:, :inter]) * gu[:, inter:], lw.down, None)
        return h  # [N, H]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [S, H] -> [S, V] in fp32
        x = rms_norm(hidden, self.final_norm, self.arch.rms_norm_eps)
        return self.linear(x, self.lm_head, None).float()
