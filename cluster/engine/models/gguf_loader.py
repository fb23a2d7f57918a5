"""Load a Llama, Qwen2, Qwen3 or Qwen3-MoE GGUF file with its quantized tensors kept as they are
(``model.weights: gguf``).

The model's shape, RoPE and tokenizer come from the transformers checkpoint converted from the
same file (``default_model.py``); the weights come from the GGUF file itself: Q4_0, Q4_1 and Q8_0
tensors stay packed (``PackedWeight``), F32/F16/BF16 tensors become dense tensors. llama.cpp
stores a Llama's attn_q / attn_k rows permuted for its RoPE layout; transformers' GGUF loader
un-permutes them, and so do we, moving whole packed rows, so every value equals the de-quantized
reference. Qwen2, Qwen3 and Qwen3-MoE files keep their rows in order (llama.cpp runs them with
NEOX RoPE); Qwen2's q/k/v biases and Qwen3's per-head q/k norms are read as dense vectors, and
Qwen3-MoE's stacked experts ([experts, rows, cols]) become one packed weight per expert.

Every tensor's name, type and shape is checked before any is read, so a file the loader cannot
run fails with an error naming the tensor and its type and leaves nothing loaded.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cluster.engine.kernels.quant import BLOCK, Q4_0, Q4_1, Q8_0
from cluster.engine.models.gguf_index import GGUFIndex, GGUFTensor, read_gguf_index
from cluster.engine.models.layer_ops import LayerOps
from cluster.engine.models.llama import LayerWeights, LlamaArch, LlamaModel
from cluster.engine.models.loader import build_model, is_moe_layer, read_arch
from cluster.engine.models.moe import ExpertWeights
from cluster.engine.models.packed import PackedWeight, Weight

logger = logging.getLogger(__name__)

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe")
# general.architecture -> the checkpoint architecture it converts to (a mismatch is refused)
_CHECKPOINT_ARCH = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
_EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")  # [E, rows, cols] each
_ROPE_PERMUTED = ("llama",)  # llama.cpp's converter permutes q/k rows for these only
PACKED_TYPES = {"Q4_0": Q4_0, "Q4_1": Q4_1, "Q8_0": Q8_0}
DENSE_TYPES = ("F32", "F16", "BF16")
_LAYER_TENSORS = (
    "attn_norm",
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_norm",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
)


def expected_shapes(
    arch: LlamaArch, moe_layers: frozenset[int] = frozenset(), expert_rows: int = 0
) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> [out_features, in_features] (or [n]; [experts, out, in] for the
    stacked experts of ``moe_layers``, each with ``expert_rows`` intermediate rows) the
    architecture needs."""
    h, d, i = arch.hidden_size, arch.head_dim, arch.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (arch.vocab_size, h),
        "output_norm.weight": (h,),
    }
    for n in range(arch.num_layers):
        p = f"blk.{n}."
        if arch.qk_norm:
            shapes[f"{p}attn_q_norm.weight"] = (d,)
            shapes[f"{p}attn_k_norm.weight"] = (d,)
        if arch.qkv_bias:
            shapes[f"{p}attn_q.bias"] = (arch.num_heads * d,)
            shapes[f"{p}attn_k.bias"] = (arch.num_kv_heads * d,)
            shapes[f"{p}attn_v.bias"] = (arch.num_kv_heads * d,)
        shapes.update(
            {
                f"{p}attn_norm.weight": (h,),
                f"{p}attn_q.weight": (arch.num_heads * d, h),
                f"{p}attn_k.weight": (arch.num_kv_heads * d, h),
                f"{p}attn_v.weight": (arch.num_kv_heads * d, h),
                f"{p}attn_output.weight": (h, arch.num_heads * d),
                f"{p}ffn_norm.weight": (h,),
            }
        )
        if n in moe_layers:
            e, m = arch.num_experts, expert_rows
            shapes[f"{p}ffn_gate_inp.weight"] = (e, h)
            shapes[f"{p}ffn_gate_exps.weight"] = (e, m, h)
            shapes[f"{p}ffn_up_exps.weight"] = (e, m, h)
            shapes[f"{p}ffn_down_exps.weight"] = (e, h, m)
        else:
            shapes[f"{p}ffn_gate.weight"] = (i, h)
            shapes[f"{p}ffn_up.weight"] = (i, h)
            shapes[f"{p}ffn_down.weight"] = (h, i)
    return shapes


def check_gguf(
    index: GGUFIndex,
    path: Path,
    arch: LlamaArch,
    moe_layers: frozenset[int] = frozenset(),
    expert_rows: int = 0,
) -> dict[str, GGUFTensor]:
    """The tensors to load by name, after checking architecture, names, types and shapes."""
    gguf_arch = index.field("general.architecture")
    if gguf_arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"{path.name}: GGUF architecture {gguf_arch!r} is not one the quantized loader knows "
            f"(supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}); use model.weights=dense, "
            "which de-quantizes through transformers"
        )
    if _CHECKPOINT_ARCH[gguf_arch] != arch.architecture:
        raise ValueError(
            f"{path.name}: GGUF architecture {gguf_arch!r} does not match its converted "
            f"checkpoint's {arch.architecture}"
        )
    tensors = {t.name: t for t in index.tensors}
    shapes = expected_shapes(arch, moe_layers, expert_rows)
    if not arch.tie_word_embeddings:
        shapes["output.weight"] = (arch.vocab_size, arch.hidden_size)
    missing = [name for name in shapes if name not in tensors]
    if missing:
        raise ValueError(f"{path.name}: missing tensors {missing[:4]} (of {len(missing)})")
    for name, want in shapes.items():
        t = tensors[name]
        kind = t.tensor_type.name
        if kind not in PACKED_TYPES and kind not in DENSE_TYPES:
            raise ValueError(
                f"{path.name}: tensor {name!r} has type {kind}, which the quantized loader does "
                f"not support (supported: {', '.join([*PACKED_TYPES, *DENSE_TYPES])}); use "
                "model.weights=dense, which de-quantizes through transformers"
            )
        got = tuple(int(x) for x in reversed(t.shape))  # ggml lists the fastest dim first
        if got != want:
            raise ValueError(f"{path.name}: tensor {name!r} is {list(got)}, expected {list(want)}")
        if kind in PACKED_TYPES and (got[-1] % BLOCK or len(got) == 1):
            raise ValueError(f"{path.name}: tensor {name!r} rows are not whole {kind} blocks")
    return {name: tensors[name] for name in shapes}


def rope_row_permutation(rows: int, num_heads: int) -> torch.Tensor:
    """The row order transformers' GGUF loader restores for attn_q / attn_k (llama.cpp's
    convert script interleaves the two RoPE halves of each head)."""
    dim = rows // num_heads // 2
    return torch.arange(rows).view(num_heads, dim, 2).transpose(1, 2).reshape(rows)


def _tensor(t: GGUFTensor, dtype: torch.dtype, device: torch.device) -> Weight:
    data = torch.from_numpy(np.array(t.data))  # a copy: the file's memory map is let go
    kind = t.tensor_type.name
    if kind in PACKED_TYPES:
        cols = int(t.shape[0])
        return PackedWeight.of(PACKED_TYPES[kind], data.view(torch.uint8), cols)
    if kind == "BF16":
        data = data.view(torch.bfloat16)
    shape = tuple(int(x) for x in reversed(t.shape))
    return data.reshape(shape).to(device=device, dtype=dtype)


def _experts(t: GGUFTensor, dtype: torch.dtype, device: torch.device) -> list[Weight]:
    """A stacked [experts, rows, cols] tensor as one weight per expert (packed rows kept)."""
    num = int(t.shape[2])
    kind = t.tensor_type.name
    data = np.array(t.data).reshape(num, int(t.shape[1]), -1)  # a copy: the map is let go
    if kind in PACKED_TYPES:
        cols = int(t.shape[0])
        return [
            PackedWeight.of(PACKED_TYPES[kind], torch.from_numpy(data[e]).view(torch.uint8), cols)
            for e in range(num)
        ]
    dense = torch.from_numpy(data)
    if kind == "BF16":
        dense = dense.view(torch.bfloat16)
    return [dense[e].to(device=device, dtype=dtype).contiguous() for e in range(num)]


def _cat(parts: list[Weight]) -> Weight:
    if all(isinstance(p, PackedWeight) for p in parts):
        return PackedWeight.cat(parts)  # type: ignore[arg-type]
    dense = [p.dequantize() if isinstance(p, PackedWeight) else p for p in parts]
    return torch.cat([d.to(dense[-1].dtype) for d in dense]).contiguous()


def _permuted(w: Weight, num_heads: int) -> Weight:
    perm = rope_row_permutation(w.shape[0] if isinstance(w, torch.Tensor) else w.rows, num_heads)
    return w.permute_rows(perm) if isinstance(w, PackedWeight) else w[perm].contiguous()


def load_gguf_llama(
    gguf_path: Path,
    config_dir: Path,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int | None,
    ops: LayerOps,
) -> tuple[LlamaModel, Any]:
    arch, hf_config = read_arch(config_dir)
    index = read_gguf_index(gguf_path)
    moe_layers = frozenset(n for n in range(arch.num_layers) if is_moe_layer(hf_config, arch, n))
    expert_rows = int(getattr(hf_config, "moe_intermediate_size", 0) or arch.intermediate_size)
    tensors = check_gguf(index, gguf_path, arch, moe_layers, expert_rows)
    permuted = index.field("general.architecture") in _ROPE_PERMUTED

    def w(name: str) -> Weight:
        return _tensor(tensors[name], dtype, device)

    def norm(name: str) -> torch.Tensor:
        t = w(name)
        assert isinstance(t, torch.Tensor)
        return t

    layers = []
    for n in range(arch.num_layers):
        p = f"blk.{n}."
        q, k = w(f"{p}attn_q.weight"), w(f"{p}attn_k.weight")
        if permuted:
            q, k = _permuted(q, arch.num_heads), _permuted(k, arch.num_kv_heads)
        bias = None
        if arch.qkv_bias:
            bias = torch.cat([norm(f"{p}attn_{x}.bias") for x in "qkv"]).contiguous()
        moe = None
        if n in moe_layers:
            gates, ups, downs = (
                _experts(tensors[f"{p}{x}.weight"], dtype, device) for x in _EXPERT_TENSORS
            )
            moe = ExpertWeights(
                router=norm(f"{p}ffn_gate_inp.weight"),
                gate_up=[_cat([g, u]) for g, u in zip(gates, ups, strict=True)],
                down=downs,
                top_k=arch.num_experts_per_tok,
                norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", False)),
            )
        layers.append(
            LayerWeights(
                input_norm=norm(f"{p}attn_norm.weight"),
                qkv=_cat([q, k, w(f"{p}attn_v.weight")]),
                qkv_bias=bias,
                o=w(f"{p}attn_output.weight"),
                post_norm=norm(f"{p}ffn_norm.weight"),
                gate_up=None if moe else _cat([w(f"{p}ffn_gate.weight"), w(f"{p}ffn_up.weight")]),
                down=None if moe else w(f"{p}ffn_down.weight"),
                moe=moe,
                qk_norm=(
                    (norm(f"{p}attn_q_norm.weight"), norm(f"{p}attn_k_norm.weight"))
                    if arch.qk_norm
                    else None
                ),
            )
        )
    embed = w("token_embd.weight")
    lm_head = embed if arch.tie_word_embeddings else w("output.weight")
    final_norm = norm("output_norm.weight")
    tensors.clear()  # the index and its memory map go with this frame
    del index
    model = build_model(
        arch,
        hf_config,
        embed,
        layers,
        final_norm,
        lm_head,
        max_model_len,
        ops,
        str(gguf_path),
    )
    return model, hf_config
