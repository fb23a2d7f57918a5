"""``CheckpointConfig`` (config.json without transformers) gives the loader what transformers'
``AutoConfig`` gives it: the same shape, RoPE and context length, for full configs, for configs
that leave fields at their class's defaults, and for RoPE scalings only transformers computes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoConfig,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from cluster.config.model_paths import resolve_max_model_len
from cluster.engine.models.loader import (
    _CLASS_DEFAULTS,
    _MODEL_TYPES,
    _rope,
    arch_from_config,
    read_hf_config,
)

CLASSES = {
    "Gemma3ForCausalLM": Gemma3TextConfig,
    "LlamaForCausalLM": LlamaConfig,
    "MistralForCausalLM": MistralConfig,
    "MixtralForCausalLM": MixtralConfig,
    "Phi3ForCausalLM": Phi3Config,
    "Qwen3MoeForCausalLM": Qwen3MoeConfig,
    "Qwen2ForCausalLM": Qwen2Config,
    "Qwen3ForCausalLM": Qwen3Config,
}


@pytest.mark.parametrize("arch", sorted(CLASSES))
def test_the_defaults_are_transformers_own(arch: str) -> None:
    theirs = CLASSES[arch]().to_dict()
    assert {k: theirs[k] for k in _CLASS_DEFAULTS[arch]} == _CLASS_DEFAULTS[arch]


def _same_as_transformers(model_dir: Path) -> None:
    ours, arch = read_hf_config(model_dir)
    theirs = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    assert arch_from_config(ours, arch) == arch_from_config(theirs, arch)
    head_dim = arch_from_config(ours, arch).head_dim
    (f1, s1), (f2, s2) = _rope(ours, head_dim), _rope(theirs, head_dim)
    assert torch.equal(f1, f2) and s1 == s2
    for requested in (None, 64):
        assert resolve_max_model_len(ours.to_dict(), requested) == resolve_max_model_len(
            theirs.to_dict(), requested
        )


MODEL_TYPES = {arch: model_type for model_type, arch in _MODEL_TYPES.items()}


def _write(tmp_path: Path, name: str, raw: dict[str, Any]) -> Path:
    d = tmp_path / name
    d.mkdir()
    model_type = MODEL_TYPES.get((raw.get("architectures") or [""])[0], "")
    (d / "config.json").write_text(json.dumps({"model_type": model_type, **raw}))
    return d


SMALL = {"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 99}


@pytest.mark.parametrize(
    "raw",
    [
        {"architectures": ["LlamaForCausalLM"], **SMALL},  # everything else at its default
        {"model_type": "llama", **SMALL, "num_key_value_heads": None, "tie_word_embeddings": True},
        {"architectures": ["LlamaForCausalLM"], **SMALL, "rope_theta": 500000.0},  # legacy
        {"architectures": ["MistralForCausalLM"], **SMALL, "max_position_embeddings": 32768},
        {"architectures": ["MistralForCausalLM"], **SMALL, "sliding_window": None},
        {"architectures": ["Qwen2ForCausalLM"], **SMALL, "sliding_window": 64},
        {"architectures": ["Qwen3ForCausalLM"], **SMALL},  # head_dim 128 by its default
        {"model_type": "qwen3", **SMALL, "head_dim": 24, "tie_word_embeddings": True},
        {
            "architectures": ["Qwen2ForCausalLM"],
            **SMALL,
            "sliding_window": 64,
            "use_sliding_window": True,
        },
        {  # a scaling transformers computes: the loader asks transformers for it
            "architectures": ["LlamaForCausalLM"],
            **SMALL,
            "max_position_embeddings": 8192,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 1024,
            },
            "rope_theta": 500000.0,
        },
    ],
)
def test_a_config_reads_as_transformers_reads_it(tmp_path: Path, raw: dict[str, Any]) -> None:
    _same_as_transformers(_write(tmp_path, "m", raw))


def test_the_tiny_checkpoint_reads_as_transformers_reads_it(
    tiny_model_dir: Path,
) -> None:
    _same_as_transformers(tiny_model_dir)


@pytest.mark.integration
def test_the_default_model_reads_as_transformers_reads_it(real_model_dir: Path) -> None:
    _same_as_transformers(real_model_dir)


def test_an_unsupported_architecture_is_named(tmp_path: Path) -> None:
    d = _write(tmp_path, "m", {"architectures": ["GPT2LMHeadModel"], **SMALL})
    with pytest.raises(ValueError, match="unsupported architecture \\['GPT2LMHeadModel'\\]"):
        read_hf_config(d)


def test_longrope_serves_up_to_its_original_context_and_partial_rotary_is_refused(
    tmp_path: Path,
) -> None:
    """LongRoPE's short factors (the static RoPE pdserve computes) are the model's own only up
    to ``original_max_position_embeddings``: the served context stops there. A rotary embedding
    over part of the head is refused at load, naming the factor."""
    raw = {
        "architectures": ["Phi3ForCausalLM"],
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [4.0] * 48},
    }
    cfg, _ = read_hf_config(_write(tmp_path, "phi3-128k", raw))
    assert resolve_max_model_len(cfg.to_dict(), None) == 4096
    with pytest.raises(ValueError, match="exceeds the model's limit of 4096"):
        resolve_max_model_len(cfg.to_dict(), 8192)
    partial = {"architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 0.5}
    cfg, arch = read_hf_config(_write(tmp_path, "phi3-partial", partial))
    with pytest.raises(ValueError, match="partial_rotary_factor 0.5"):
        arch_from_config(cfg, arch)


def test_gemma3_serves_within_its_sliding_window_and_refuses_attention_soft_capping(
    tmp_path: Path,
) -> None:
    """Gemma 3's local layers attend to the last ``sliding_window`` tokens: the served context
    stops there (where they equal full attention). Attention-logit soft-capping (Gemma 2's)
    has no kernel here: refused at load, named."""
    raw = {"architectures": ["Gemma3ForCausalLM"], "sliding_window": 512}
    cfg, arch = read_hf_config(_write(tmp_path, "gemma3", raw))
    assert resolve_max_model_len(cfg.to_dict(), None) == 512
    shape = arch_from_config(cfg, arch)
    assert shape.activation == "gelu_tanh" and shape.attn_scale == 256**-0.5
    assert set(shape.layer_rope) == {"sliding_attention", "full_attention"}
    capped = {**raw, "attn_logit_softcapping": 50.0}
    cfg, arch = read_hf_config(_write(tmp_path, "gemma2ish", capped))
    with pytest.raises(ValueError, match="soft-capping is not supported"):
        arch_from_config(cfg, arch)
