"""A tiny random Llama as a GGUF file, the way llama.cpp's convert script writes one.

Tensors are quantized with the gguf package (Q4_0, Q4_1, Q8_0, mixed inside the fused q/k/v
and gate/up projections), attn_q / attn_k rows are permuted for llama.cpp's RoPE layout, and
the converted checkpoint next to it (what ``pdserve`` makes of a ``.gguf`` model.path) is
written by transformers' own GGUF loader: its weights are the fp32-dequantized reference.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np

from cluster.config import ClusterConfig
from cluster.config.model_paths import COMPLETE_MARKER, gguf_model_dir

# llama.cpp tensor name -> (transformers name, GGUF type)
_LAYER = {
    "attn_norm": ("input_layernorm", "F32"),
    "attn_q": ("self_attn.q_proj", "Q4_1"),
    "attn_k": ("self_attn.k_proj", "Q8_0"),
    "attn_v": ("self_attn.v_proj", "Q4_0"),
    "attn_output": ("self_attn.o_proj", "Q4_1"),
    "ffn_norm": ("post_attention_layernorm", "F32"),
    "ffn_gate": ("mlp.gate_proj", "Q4_0"),
    "ffn_up": ("mlp.up_proj", "Q4_1"),
    "ffn_down": ("mlp.down_proj", "Q8_0"),
}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q / k rows."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_tiny_gguf(
    checkpoint: Path, out: Path, *, types: dict[str, str] | None = None, arch: str = "llama"
) -> Path:
    """``checkpoint`` (a tiny transformers Llama) written as GGUF to ``out``."""
    import gguf
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(checkpoint)
    state = load_file(str(checkpoint / "model.safetensors"))
    kinds = {name: kind for name, (_, kind) in _LAYER.items()} | {"token_embd": "Q8_0"}
    kinds.update(types or {})
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name("pdserve-tiny")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or 10000.0))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)

    def add(name: str, t: torch.Tensor, kind: str) -> None:
        data = t.float().numpy()
        qtype = gguf.GGMLQuantizationType[kind]
        if kind != "F32":
            data = gguf.quants.quantize(data, qtype)
        writer.add_tensor(name, data, raw_dtype=qtype)

    add("token_embd.weight", state["model.embed_tokens.weight"], kinds["token_embd"])
    for i in range(cfg.num_hidden_layers):
        for gname, (hname, _) in _LAYER.items():
            w = state[f"model.layers.{i}.{hname}.weight"]
            if gname == "attn_q":
                w = torch.from_numpy(_permute(w.numpy(), cfg.num_attention_heads))
            elif gname == "attn_k":
                w = torch.from_numpy(_permute(w.numpy(), cfg.num_key_value_heads))
            add(f"blk.{i}.{gname}.weight", w, kinds[gname])
    add("output_norm.weight", state["model.norm.weight"], "F32")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def convert_tiny_gguf(config: ClusterConfig, gguf_path: Path, checkpoint: Path) -> Path:
    """The converted checkpoint of a tiny GGUF: transformers' de-quantized weights (the
    reference) with the tiny checkpoint's config and tokenizer (the GGUF carries none)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    target = gguf_model_dir(config, gguf_path)
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(checkpoint, target)
    model: Any = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    (target / COMPLETE_MARKER).write_text(f"converted from {gguf_path.name}\n")
    return target
