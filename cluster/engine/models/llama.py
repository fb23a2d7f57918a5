"""Llama-family decoder (Llama, Qwen2, Qwen3, Mistral, Phi-3, SmolLM; Mixtral and Qwen3-MoE
with mixture-of-experts layers: ``moe``) with paged attention.

GQA, RoPE with its scaling variants (inverse frequencies from transformers' own RoPE code),
RMSNorm, SwiGLU, optional q/k/v bias (Qwen2), optional per-head q/k RMSNorm before RoPE
(Qwen3), tied or untied embeddings. q/k/v and gate/up
projections are fused into one matmul each. Numerics follow transformers' implementation so
greedy outputs match a transformers run token for token (fp32).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from cluster.engine.attention import AttentionMetadata, paged_attention
from cluster.engine.kv_codec import FLOAT_KV, KVCodec
from cluster.engine.models.layer_ops import LayerOps, TorchOps, rms_norm
from cluster.engine.models.moe import ExpertLoad, ExpertWeights, moe_add
from cluster.engine.models.packed import PackedLinear, PackedWeight, Weight, weight_format


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
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k before RoPE
    num_experts: int = 0  # mixture of experts (Mixtral, Qwen3-MoE): experts per MoE layer
    num_experts_per_tok: int = 0  # the top k each token is routed to
    # Gemma 3: GeGLU, a scaled embedding, its own attention scale, a RoPE table per layer type
    activation: str = "silu"  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embed_scale: float = 1.0  # the embedding rows are multiplied by it
    attn_scale: float | None = None  # None: head_dim ** -0.5
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    layer_rope: tuple[str, ...] = ()  # each layer's RoPE table (``rope_tables``); (): one table


@dataclass
class LayerWeights:
    # Matrices are dense tensors or PackedWeight (quantized rows), [out_features, in_features].
    input_norm: torch.Tensor  # [H]
    qkv: Weight  # [(Hq + 2*Hkv) * D, H]
    qkv_bias: torch.Tensor | None  # [(Hq + 2*Hkv) * D]
    o: Weight  # [H, Hq * D]
    post_norm: torch.Tensor  # [H]
    gate_up: Weight | None  # [2 * I, H]; None in a mixture-of-experts layer
    down: Weight | None  # [H, I]; None in a mixture-of-experts layer
    qk_norm: tuple[torch.Tensor, torch.Tensor] | None = None  # q and k norms [D] (Qwen3)
    moe: ExpertWeights | None = None  # the layer's experts and router (its MLP), if any
    # Gemma 3's "sandwich": the attention's and the MLP's outputs normalized before each is
    # added to the residual (``post_norm`` is then its pre-feed-forward norm)
    post_attn_norm: torch.Tensor | None = None  # [H]
    post_ffn_norm: torch.Tensor | None = None  # [H]

    def matrices(self) -> list[Weight]:
        dense = [m for m in (self.gate_up, self.down) if m is not None]
        return [self.qkv, self.o, *dense, *(self.moe.matrices() if self.moe else [])]


# (x [N, in], weight [out, in], bias) -> [N, out]; PackedLinear also takes PackedWeight
Linear = Callable[[torch.Tensor, Any, torch.Tensor | None], torch.Tensor]


class LlamaModel:
    def __init__(
        self,
        arch: LlamaArch,
        embed: Weight,
        layers: list[LayerWeights],
        final_norm: torch.Tensor,
        lm_head: Weight,
        inv_freq: torch.Tensor | dict[str, tuple[torch.Tensor, float]],
        attention_scaling: float,
        max_model_len: int,
        ops: LayerOps | None = None,
    ) -> None:
        """``inv_freq``: the RoPE inverse frequencies, or one (frequencies, scaling) per layer
        type named in ``arch.layer_rope`` (Gemma 3's local and global layers)."""
        self.arch = arch
        self.ops: LayerOps = ops or TorchOps(F.linear)
        self.embed = embed  # [V, H]
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head  # [V, H] (the embedding itself when tied)
        self.kv_codec: KVCodec = FLOAT_KV  # how K/V rows are stored; the runner sets it
        # Tensor parallelism: this rank's collectives (``tensor_parallel.ShardedForward``), set
        # where the model is one rank's shard; None: the whole model.
        self.tp: Any = None
        # Pipeline parallelism: a stage holds layers first_layer .. first_layer + len(layers)
        # (their KV at those layer indices of the shared cache); the whole model: 0.
        self.first_layer = 0
        # tokens per expert, for the engine's stats (a mixture-of-experts model only)
        self.expert_load = ExpertLoad(arch.num_experts) if arch.num_experts else None
        self.scale = arch.attn_scale if arch.attn_scale is not None else arch.head_dim**-0.5
        # Gemma's embedding multiplier, rounded to the weights' dtype as transformers does, made
        # once on the model's device: a step then holds no host tensor (CUDA graphs capture it).
        self.embed_scale = (
            torch.tensor(arch.embed_scale, dtype=torch.float32)
            .to(final_norm.dtype)
            .to(final_norm.device)
        )
        tables = inv_freq if isinstance(inv_freq, dict) else {"": (inv_freq, attention_scaling)}
        self.rope_tables = {
            name: _rope_table(f, scaling, max_model_len, final_norm)
            for name, (f, scaling) in tables.items()
        }
        self.cos, self.sin = next(iter(self.rope_tables.values()))  # [max_model_len, D] each

    @property
    def dtype(self) -> torch.dtype:
        return self.final_norm.dtype

    @property
    def device(self) -> torch.device:
        return self.final_norm.device

    def matrices(self) -> list[Weight]:
        return [self.embed, self.lm_head] + [m for lw in self.layers for m in lw.matrices()]

    @property
    def int8_activations(self) -> bool:
        """Whether its linear multiplies packed weights with int8 activations (model.numerics:
        fast)."""
        linear = self.ops.linear
        return isinstance(linear, PackedLinear) and linear.fast

    @property
    def weight_format(self) -> str:
        """``dense float32``, or the packed formats in use (``Q4_1 + Q8_0``, ``int8``), and
        ``, int8 activations (fast)`` where its linear runs them so (model.numerics)."""
        return weight_format(self.matrices(), self.int8_activations)

    def weight_bytes(self) -> int:
        """Resident bytes of every weight (shared storage, e.g. a tied lm_head, counted once)."""
        seen: dict[int, int] = {}
        tensors: list[torch.Tensor] = [self.final_norm]
        for lw in self.layers:
            tensors += [lw.input_norm, lw.post_norm]
            tensors += [n for n in (lw.post_attn_norm, lw.post_ffn_norm) if n is not None]
            tensors += [lw.qkv_bias] if lw.qkv_bias is not None else []
            tensors += list(lw.qk_norm) if lw.qk_norm is not None else []
            tensors += [lw.moe.router] if lw.moe is not None else []
        for m in self.matrices():
            if isinstance(m, PackedWeight):
                for s in m.segments:
                    tensors += [s.data] + ([s.scales] if s.scales is not None else [])
            else:
                tensors.append(m)
        for t in tensors:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [N]
        positions: torch.Tensor,  # [N]
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,  # [num_blocks, num_layers, 2, block_size, Hkv, D]
    ) -> torch.Tensor:
        return self.forward_layers(self.embed_tokens(input_ids), positions, meta, kv_cache)

    @torch.inference_mode()
    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first layer's input: [N] ids -> [N, H]."""
        a, ops, tp = self.arch, self.ops, self.tp
        h = ops.embed(self.embed, input_ids) if tp is None else tp.embed(ops, self.embed, input_ids)
        if a.embed_scale != 1.0:  # (Gemma: in the weights' dtype, as transformers does)
            scale = self.embed_scale
            if scale.dtype != h.dtype:  # an embedding in another dtype than the model's
                scale = torch.tensor(a.embed_scale, dtype=torch.float32).to(h.dtype)
            h = h * scale
        return h

    @torch.inference_mode()
    def forward_layers(
        self,
        h: torch.Tensor,  # [N, H]: the embedding, or the previous pipeline stage's output
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """This model's layers (a pipeline stage's) over ``h``: [N, H]."""
        a = self.arch
        n = h.shape[0]
        hq, hkv, d = a.num_heads, a.num_kv_heads, a.head_dim
        eps, inter = a.rms_norm_eps, a.intermediate_size
        ops = self.ops
        if ops.run_layers(self, h, positions, meta, kv_cache):
            return h
        if a.layer_rope:
            return self._sandwich_layers(h, positions, meta, kv_cache)
        rope = ops.rope_state(self.cos, self.sin, positions)
        if self.expert_load is not None:
            self.expert_load.start_step()
        for i, lw in enumerate(self.layers, self.first_layer):
            qkv = ops.norm_linear(h, lw.input_norm, eps, lw.qkv, lw.qkv_bias)  # [N, (Hq+2Hkv)*D]
            if lw.qk_norm is not None:  # Qwen3: each head's q and k normalized, in place
                ops.qk_norm(qkv, lw.qk_norm, hq, hkv, d, eps)
            q, k, v = ops.rope(qkv, rope, hq, hkv, d)  # [N, Hq, D], [N, Hkv, D], [N, Hkv, D]
            ops.write_kv(kv_cache, i, k, v, meta, self.kv_codec)
            attn = paged_attention(q, k, v, kv_cache, i, meta, self.scale, self.kv_codec)
            h = self._row_parallel(ops.linear_add, h, attn.reshape(n, hq * d), lw.o)
            if lw.moe is not None:  # the experts the router picks for each token
                x = rms_norm(h, lw.post_norm, eps)
                h = moe_add(h, x, lw.moe, ops, self.expert_load)
                continue
            assert lw.gate_up is not None and lw.down is not None
            gu = ops.norm_linear(h, lw.post_norm, eps, lw.gate_up, None)  # [N, 2 * I]
            h = self._row_parallel(lambda r, x, w: ops.mlp_add(r, x, w, inter), h, gu, lw.down)
        return h  # [N, H]

    def _row_parallel(
        self,
        add: Callable[[torch.Tensor, torch.Tensor, Weight], torch.Tensor],
        h: torch.Tensor,
        x: torch.Tensor,
        w: Weight,
    ) -> torch.Tensor:
        """``add(h, x, w)`` (h plus a product with ``w``); on a tensor-parallel rank, of its
        slice of ``w``, summed across the ranks (rank 0's carrying ``h``)."""
        tp = self.tp
        if tp is None:
            return add(h, x, w)
        return tp.reduce(add(tp.residual(h), x, w))

    def _reduced(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.tp is None else self.tp.reduce(out)

    def _sandwich_layers(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Gemma 3's layers: q/k norms, each layer's RoPE table, the attention's and the MLP's
        outputs normalized before the residual adds, GeGLU."""
        a, ops = self.arch, self.ops
        n, hq, hkv, d, eps = h.shape[0], a.num_heads, a.num_kv_heads, a.head_dim, a.rms_norm_eps
        ropes = {k: ops.rope_state(c, s, positions) for k, (c, s) in self.rope_tables.items()}
        for i, lw in enumerate(self.layers, self.first_layer):
            assert lw.gate_up is not None and lw.down is not None
            assert lw.post_attn_norm is not None and lw.post_ffn_norm is not None
            qkv = ops.norm_linear(h, lw.input_norm, eps, lw.qkv, lw.qkv_bias)
            if lw.qk_norm is not None:
                ops.qk_norm(qkv, lw.qk_norm, hq, hkv, d, eps)
            q, k, v = ops.rope(qkv, ropes[a.layer_rope[i]], hq, hkv, d)
            ops.write_kv(kv_cache, i, k, v, meta, self.kv_codec)
            attn = paged_attention(q, k, v, kv_cache, i, meta, self.scale, self.kv_codec)
            out = self._reduced(ops.linear(attn.reshape(n, hq * d), lw.o, None))
            h = h + rms_norm(out, lw.post_attn_norm, eps)
            gu = ops.norm_linear(h, lw.post_norm, eps, lw.gate_up, None)
            inter = gu.shape[1] // 2
            act = F.gelu(gu[:, :inter], approximate="tanh") * gu[:, inter:]
            down = self._reduced(ops.linear(act, lw.down, None))
            h = h + rms_norm(down, lw.post_ffn_norm, eps)
        return h

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden: [S, H] -> [S, V] in fp32; a tensor-parallel rank other than 0 computes its
        vocabulary slice for rank 0 and returns None."""
        ops = self.ops
        logits = ops.norm_linear(
            hidden, self.final_norm, self.arch.rms_norm_eps, self.lm_head, None
        ).float()
        if self.tp is not None:
            gathered = self.tp.logits(logits)
            if gathered is None:
                return None
            logits = gathered
        cap = self.arch.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


def _rope_table(
    inv_freq: torch.Tensor, scaling: float, max_model_len: int, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE cos and sin for every position, as transformers computes them (fp32, then cast)."""
    pos = torch.arange(max_model_len, dtype=torch.float32, device=like.device)
    freqs = pos[:, None] * inv_freq.to(device=like.device, dtype=torch.float32)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(like.dtype), (emb.sin() * scaling).to(like.dtype)
