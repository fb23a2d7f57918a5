"""The operations of one decoder layer around attention, in torch or natively (one per model).

``LlamaModel.forward`` is written once against these; the loader picks the implementation:

- ``TorchOps``: plain torch ops over any ``linear`` (dense tensors, or packed weights through
  ``PackedLinear``'s fallbacks), on any device. Numerics follow transformers.
- ``NativeOps``: CPU fp32 models with packed weights and the native library. RMSNorm, RoPE,
  the KV write (int8 quantization included) and SwiGLU are one C call each instead of 5-15
  torch ops, and the residual adds accumulate inside the linear kernel: at batch 1 the per-op
  dispatch cost of torch is larger than the arithmetic of a 135M model's layer.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F

from cluster.engine.attention import AttentionMetadata, write_kv
from cluster.engine.kernels.decode_forward import MAX_SEGMENTS, DecodeForward, LayerDescription
from cluster.engine.kernels.native import NativeKernels
from cluster.engine.kernels.quant import PackedRows
from cluster.engine.kv_codec import KVCodec
from cluster.engine.models.packed import PackedLinear, PackedWeight, Weight

Linear = Any  # (x [N, in], weight [out, in], bias) -> [N, out]


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


def dense_embedding(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, table)


class LayerOps(Protocol):
    linear: Linear

    def embed(self, table: Weight, ids: torch.Tensor) -> torch.Tensor: ...

    def rope_state(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> Any:
        """Whatever ``rope`` needs for this step's positions (computed once per forward)."""
        ...

    def norm_linear(
        self, h: torch.Tensor, norm: torch.Tensor, eps: float, w: Weight, b: torch.Tensor | None
    ) -> torch.Tensor:
        """linear(rms_norm(h), w, b): [N, H] -> [N, out]."""
        ...

    def rope(
        self, qkv: torch.Tensor, state: Any, hq: int, hkv: int, d: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fused qkv rows -> rotated q [N, Hq, D], rotated k and v [N, Hkv, D]."""
        ...

    def qk_norm(
        self,
        qkv: torch.Tensor,
        norms: tuple[torch.Tensor, torch.Tensor],
        hq: int,
        hkv: int,
        d: int,
        eps: float,
    ) -> None:
        """RMSNorm over each head of q and of k in the fused rows, in place (Qwen3)."""
        ...

    def write_kv(
        self,
        kv_cache: torch.Tensor,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        codec: KVCodec,
    ) -> None: ...

    def linear_add(self, h: torch.Tensor, x: torch.Tensor, w: Weight) -> torch.Tensor:
        """h + linear(x, w) (possibly in place)."""
        ...

    def mlp_add(self, h: torch.Tensor, gu: torch.Tensor, down: Weight, inter: int) -> torch.Tensor:
        """h + linear(silu(gate) * up, down), gu = [gate | up] rows."""
        ...

    def run_layers(
        self, model: Any, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> bool:  # fmt: skip
        """Every layer of the step over ``h`` in place, in one go, where the ops can (True);
        False leaves the step to the per-layer loop."""
        ...


def split_qkv(
    qkv: torch.Tensor, hq: int, hkv: int, d: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused projection's output as q [N, hq, d], k and v [N, hkv, d] (views)."""
    n, q_size, kv_size = qkv.shape[0], hq * d, hkv * d
    q = qkv[:, :q_size].view(n, hq, d)
    k = qkv[:, q_size : q_size + kv_size].view(n, hkv, d)
    return q, k, qkv[:, q_size + kv_size :].view(n, hkv, d)


class TorchOps:
    def __init__(self, linear: Linear, embedding: Any = dense_embedding) -> None:
        self.linear = linear
        self._embedding = embedding

    def embed(self, table: Weight, ids: torch.Tensor) -> torch.Tensor:
        return self._embedding(table, ids)

    def rope_state(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> Any:
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # [N, 1, D] each

    def norm_linear(
        self, h: torch.Tensor, norm: torch.Tensor, eps: float, w: Weight, b: torch.Tensor | None
    ) -> torch.Tensor:
        return self.linear(rms_norm(h, norm, eps), w, b)

    def rope(
        self, qkv: torch.Tensor, state: Any, hq: int, hkv: int, d: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cos, sin = state
        q, k, v = split_qkv(qkv, hq, hkv, d)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def qk_norm(
        self,
        qkv: torch.Tensor,
        norms: tuple[torch.Tensor, torch.Tensor],
        hq: int,
        hkv: int,
        d: int,
        eps: float,
    ) -> None:
        q, k, _ = split_qkv(qkv, hq, hkv, d)
        q.copy_(rms_norm(q, norms[0], eps))
        k.copy_(rms_norm(k, norms[1], eps))

    def write_kv(
        self,
        kv_cache: torch.Tensor,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        codec: KVCodec,
    ) -> None:
        write_kv(kv_cache[:, layer, 0], kv_cache[:, layer, 1], k, v, meta, codec)

    def linear_add(self, h: torch.Tensor, x: torch.Tensor, w: Weight) -> torch.Tensor:
        return h + self.linear(x, w, None)

    def mlp_add(self, h: torch.Tensor, gu: torch.Tensor, down: Weight, inter: int) -> torch.Tensor:
        return h + self.linear(F.silu(gu[:, :inter]) * gu[:, inter:], down, None)

    def run_layers(
        self, model: Any, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> bool:  # fmt: skip
        return False


class NativeOps(TorchOps):
    """CPU fp32 with the native kernel: the same expressions, one C call each."""

    def __init__(self, linear: PackedLinear, kernels: NativeKernels) -> None:
        super().__init__(linear, linear.embed)
        self.packed = linear
        self.kernels = kernels
        self._whole: DecodeForward | bool | None = None  # built on first use; False: cannot

    def run_layers(
        self, model: Any, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> bool:  # fmt: skip
        """A decode-only step of up to ``kernel_max_rows`` rows: all layers in one C call
        (``kernels/decode_forward.py``), the same kernels in the same order as the loop."""
        if (
            meta.decode_kernel is None
            or meta.prefills
            or meta.num_decodes != h.shape[0]
            or h.shape[0] > self.packed.kernel_max_rows
            or kv_cache.dtype not in (torch.float32, torch.uint8)
            or not (h.is_contiguous() and kv_cache.is_contiguous())
        ):
            return False
        if self._whole is None:
            self._whole = whole_forward(model, self.kernels, self.packed.fast) or False
        if self._whole is False:
            return False
        assert isinstance(self._whole, DecodeForward)
        assert meta.decode_block_tables is not None and meta.decode_ctx_lens is not None
        self._whole(
            h,
            positions.contiguous(),
            kv_cache,
            meta.decode_block_tables.contiguous(),
            meta.decode_ctx_lens.contiguous(),
            meta.slot_blocks.contiguous(),
            meta.slot_offsets.contiguous(),
        )
        return True

    def rope_state(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> Any:
        return cos, sin, positions.contiguous()

    def norm_linear(
        self, h: torch.Tensor, norm: torch.Tensor, eps: float, w: Weight, b: torch.Tensor | None
    ) -> torch.Tensor:
        return self.linear(self.kernels.rms_norm(h.contiguous(), norm, eps), w, b)

    def rope(
        self, qkv: torch.Tensor, state: Any, hq: int, hkv: int, d: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cos, sin, positions = state
        self.kernels.rope(qkv, hq + hkv, d, cos, sin, positions)  # q and k heads, in place
        return split_qkv(qkv, hq, hkv, d)

    def write_kv(
        self,
        kv_cache: torch.Tensor,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        codec: KVCodec,
    ) -> None:
        if kv_cache.dtype not in (torch.float32, torch.uint8) or k.stride(1) != k.shape[2]:
            super().write_kv(kv_cache, layer, k, v, meta, codec)
            return
        self.kernels.write_kv(
            kv_cache, layer, k, v, meta.slot_blocks, meta.slot_offsets, k.shape[2]
        )

    def linear_add(self, h: torch.Tensor, x: torch.Tensor, w: Weight) -> torch.Tensor:
        if isinstance(w, PackedWeight) and self.packed.accumulate(h, x, w):
            return h
        return h + self.linear(x, w, None)

    def mlp_add(self, h: torch.Tensor, gu: torch.Tensor, down: Weight, inter: int) -> torch.Tensor:
        return self.linear_add(h, self.kernels.swiglu(gu, inter), down)


def _described(w: Weight, fast: bool) -> tuple[int, tuple[PackedRows, ...], bool] | None:
    if not isinstance(w, PackedWeight) or not 0 < len(w.segments) <= MAX_SEGMENTS:
        return None
    return w.cols, w.segments, fast and not w.fp32_activations


def whole_forward(model: Any, kernels: NativeKernels, fast: bool = False) -> DecodeForward | None:
    """The C description of ``model``'s layers, or None where one is not packed (or has more
    segments than the call takes); ``fast``: its packed segments with int8 activations, as
    ``PackedLinear`` runs them (model.numerics)."""
    a = model.arch
    layers = []
    if a.layer_rope or a.embed_scale != 1.0 or a.activation != "silu":
        return None  # Gemma 3's layers: the one-call step has none of it; the layer loop runs
    if model.tp is not None:  # a tensor-parallel shard all-reduces between layers: the loop runs
        return None
    for lw in model.layers:
        if lw.moe is not None or lw.gate_up is None or lw.down is None:
            return None  # experts: the one-call step has none; the layer loop runs
        mats = [_described(m, fast) for m in (lw.qkv, lw.o, lw.gate_up, lw.down)]
        if any(m is None for m in mats) or not model.cos.is_contiguous():
            return None
        if lw.qk_norm is not None:  # the one-call step has no q/k norm: the layer loop runs
            return None
        qkv, o, gate_up, down = mats
        assert qkv and o and gate_up and down
        bias = lw.qkv_bias.contiguous() if lw.qkv_bias is not None else None
        norms = lw.input_norm.contiguous(), lw.post_norm.contiguous()
        layers.append(LayerDescription(*norms, bias, qkv, o, gate_up, down))
    shape = (a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim, a.intermediate_size)
    return DecodeForward(
        kernels.lib,
        layers,
        shape,
        a.rms_norm_eps,
        model.scale,
        model.cos,
        model.sin,
        kernels.num_threads,
        (model.first_layer, a.num_layers),  # a pipeline stage's layers in the whole cache
    )
