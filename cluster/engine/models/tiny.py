"""A tiny random-weight Llama checkpoint (unit tests and ``--smoke`` benchmarks).

Built from a transformers ``LlamaConfig``, saved with ``save_pretrained`` and loaded through the
real loading code, with a small byte-level BPE tokenizer trained on the spot (ChatML special
tokens and chat template), so nothing is downloaded and no real model is needed.
``write_tiny_gguf`` writes such a checkpoint as a GGUF file the way llama.cpp's convert script
does (quantized with the gguf package, q/k rows permuted for llama.cpp's RoPE layout).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

_CORPUS = """
The quick brown fox jumps over the lazy dog. Once upon a time there was a small model that
learned to count: one, two, three, four, five, six, seven, eight, nine, ten. What is the capital
of France? Paris is the capital of France. def add(a, b): return a + b. The rain in Spain stays
mainly in the plain. Serving systems batch requests, cache prefixes and move KV blocks between
prefill and decode pools. 0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ
"""

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_tokenizer(out: Path, vocab_size: int = 512) -> int:
    """Train and save a byte-level BPE tokenizer; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "pad_token": "<|im_end|>",
                "unk_token": "<|endoftext|>",
                "chat_template": CHATML_TEMPLATE,
                "model_max_length": 2048,
            },
            indent=2,
        )
    )
    return int(tok.get_vocab_size())


def build_tiny_llama(
    out: str | Path,
    *,
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = True,
    initializer_range: float = 0.3,
    family: str = "llama",
    **config_overrides: Any,
) -> Path:
    """Write a random checkpoint directory of a Llama-family architecture (``family``: llama,
    qwen3, phi3: fused q/k/v and gate/up projections; mixtral, qwen3_moe: experts, with
    ``num_local_experts`` / ``num_experts`` and the like in ``config_overrides``; gemma3: the
    text model); returns its path. Qwen3's q/k norms get
    random weights too (transformers starts them at 1, which would leave them untested)."""
    import torch
    import transformers

    classes = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
        "phi3": ("Phi3Config", "Phi3ForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
        "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
        "mistral": ("MistralConfig", "MistralForCausalLM"),
    }
    if family not in classes:
        raise ValueError(f"tiny model: unknown family {family!r}; known: {', '.join(classes)}")
    config_cls, model_cls = (getattr(transformers, name) for name in classes[family])
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    vocab_size = build_tokenizer(path)
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        # Large random weights make the logits peaky, so greedy decoding has few near-ties.
        initializer_range=initializer_range,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        **config_overrides,
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if family == "gemma3" and name.endswith("norm.weight"):
                param.uniform_(-0.3, 0.3)  # Gemma scales by (1 + w), starting at w = 0
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(0.5, 1.5)
            elif name.endswith("_proj.bias"):  # (Qwen2's q/k/v biases start at 0)
                param.normal_(0.0, initializer_range)
    model.save_pretrained(path)
    return path


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
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}  # Qwen3


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q / k rows."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _layer_tensors(
    state: dict[str, Any], cfg: Any, i: int, kinds: dict[str, str], *, permute: bool
) -> list[tuple[str, Any, str]]:
    """Layer ``i``'s GGUF tensors (name, tensor, type): q/k rows permuted as llama.cpp does
    for a Llama, biases and q/k norms (Qwen2, Qwen3) as F32."""
    import torch

    out = []
    moe = f"model.layers.{i}.mlp.gate.weight" in state
    for gname, (hname, _) in _LAYER.items():
        if moe and gname.startswith("ffn_") and gname != "ffn_norm":
            continue  # the experts below instead
        w = state[f"model.layers.{i}.{hname}.weight"]
        heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
        if permute and gname in heads:
            w = torch.from_numpy(_permute(w.numpy(), heads[gname]))
        out.append((f"blk.{i}.{gname}.weight", w, kinds[gname]))
        bias = state.get(f"model.layers.{i}.{hname}.bias")
        if bias is not None:
            out.append((f"blk.{i}.{gname}.bias", bias, "F32"))
    for gname, hname in _QK_NORMS.items():
        norm = state.get(f"model.layers.{i}.{hname}.weight")
        if norm is not None:
            out.append((f"blk.{i}.{gname}.weight", norm, "F32"))
    if moe:  # Qwen3-MoE: the router, and each projection of every expert as one 3-D tensor
        p = f"model.layers.{i}.mlp."
        num = state[f"{p}gate.weight"].shape[0]
        out.append((f"blk.{i}.ffn_gate_inp.weight", state[f"{p}gate.weight"], "F32"))
        for gname, hname, kind in (
            ("ffn_gate_exps", "gate_proj", "Q4_0"),
            ("ffn_up_exps", "up_proj", "Q4_1"),
            ("ffn_down_exps", "down_proj", "Q8_0"),
        ):
            stacked = torch.stack([state[f"{p}experts.{e}.{hname}.weight"] for e in range(num)])
            out.append((f"blk.{i}.{gname}.weight", stacked, kind))
    return out


def write_tiny_gguf(
    checkpoint: Path, out: Path, *, types: dict[str, str] | None = None, arch: str = "llama"
) -> Path:
    """``checkpoint`` (a tiny transformers Llama, or Qwen2 / Qwen3 / Qwen3-MoE with ``arch``
    qwen2, qwen3, qwen3moe: q/k rows in order, Qwen2's q/k/v biases and Qwen3's q/k norms as
    F32, Qwen3-MoE's experts stacked) written as GGUF to ``out``."""
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
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_rope_dimension_count(head_dim)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:  # Qwen3-MoE
        writer.add_expert_count(int(experts))
        writer.add_expert_used_count(int(cfg.num_experts_per_tok))
        writer.add_expert_feed_forward_length(int(cfg.moe_intermediate_size))
    if head_dim != cfg.hidden_size // cfg.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)

    def add(name: str, t: torch.Tensor, kind: str) -> None:
        data = t.float().numpy()
        qtype = gguf.GGMLQuantizationType[kind]
        if kind != "F32":
            data = gguf.quants.quantize(data, qtype)
        writer.add_tensor(name, data, raw_dtype=qtype)

    add("token_embd.weight", state["model.embed_tokens.weight"], kinds["token_embd"])
    for i in range(cfg.num_hidden_layers):
        for name, tensor, kind in _layer_tensors(state, cfg, i, kinds, permute=arch == "llama"):
            add(name, tensor, kind)
    add("output_norm.weight", state["model.norm.weight"], "F32")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
