"""The tiny random-weight model of each architecture family pdserve runs (``build_tiny_llama``
keyword arguments by family): the exactness tests and the hand-off tests build the same ones."""

from __future__ import annotations

from typing import Any

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    # head_dim 24, not hidden / heads = 16: Qwen3 configs name theirs
    "qwen3": {"head_dim": 24},
    "qwen2": {},  # q/k/v biases
    "mistral": {"sliding_window": 512},  # the context stops at the window
    "phi3": {},  # fused qkv_proj and gate_up_proj
    # 4 experts, top 2 (renormalized, as Mixtral always does)
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    # 6 experts, top 2 of softmax weights left as they are; layer 1 a dense MLP
    "qwen3_moe": {
        "num_experts": 6,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 48,
        "norm_topk_prob": False,
        "mlp_only_layers": [1],
        "head_dim": 16,
    },
    # a local (sliding-window) layer and a global one, each with its RoPE base; an attention
    # scale that is not 1/sqrt(head_dim); final logits soft-capped
    "gemma3": {
        "head_dim": 16,
        "query_pre_attn_scalar": 24,
        "sliding_window": 512,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        "final_logit_softcapping": 10.0,
    },
}
