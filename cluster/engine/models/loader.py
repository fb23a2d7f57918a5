"""Load a Llama-family transformers checkpoint directory into ``LlamaModel`` (Llama, Mistral,
Qwen2, Qwen3, Phi-3: the same decoder, with biases, q/k norms or fused projections; Mixtral and
Qwen3-MoE, whose MLPs are mixtures of experts)."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from cluster.config.model_paths import resolve_max_model_len
from cluster.engine.models.layer_ops import LayerOps, TorchOps
from cluster.engine.models.llama import LayerWeights, Linear, LlamaArch, LlamaModel
from cluster.engine.models.moe import ExpertWeights
from cluster.engine.models.packed import Weight

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = (
    "Gemma3ForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Phi3ForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
)
_MODEL_TYPES = {
    "gemma3_text": "Gemma3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
_QK_NORM = ("Gemma3ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
_GEMMA = "Gemma3ForCausalLM"
# Mixture of experts: where each architecture names a layer's router and experts, and the
# expert's gate, up and down projections.
_MOE_NAMES = {
    "MixtralForCausalLM": ("block_sparse_moe", ("w1", "w3", "w2")),
    "Qwen3MoeForCausalLM": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}
_STATIC_ROPE = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")


# The transformers config classes' defaults for the fields the loader reads: config.json may
# leave out a field equal to its class's default. tests/unit/engine/test_checkpoint_config.py
# checks these against transformers itself. (Llama's num_key_value_heads and head_dim, when
# absent, follow from the attention heads, as in transformers.)
_CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "Gemma3ForCausalLM": {
        "hidden_size": 2304,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "intermediate_size": 9216,
        "vocab_size": 262208,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "max_position_embeddings": 131072,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    },
    "LlamaForCausalLM": {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "intermediate_size": 11008,
        "vocab_size": 32000,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "max_position_embeddings": 2048,
        "hidden_act": "silu",
    },
    "MistralForCausalLM": {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 32000,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False,
        "max_position_embeddings": 131072,
        "hidden_act": "silu",
        "sliding_window": 4096,
    },
    "MixtralForCausalLM": {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 32000,
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False,
        "max_position_embeddings": 131072,
        "hidden_act": "silu",
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "sliding_window": None,
    },
    "Qwen3MoeForCausalLM": {
        "hidden_size": 2048,
        "num_hidden_layers": 24,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "vocab_size": 151936,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "max_position_embeddings": 32768,
        "hidden_act": "silu",
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "use_sliding_window": False,
    },
    "Phi3ForCausalLM": {
        "hidden_size": 3072,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "intermediate_size": 8192,
        "vocab_size": 32064,
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False,
        "max_position_embeddings": 4096,
        "hidden_act": "silu",
        "sliding_window": None,
    },
    "Qwen2ForCausalLM": {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,  # Qwen2's own default (null still means the heads)
        "intermediate_size": 22016,
        "vocab_size": 151936,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False,
        "max_position_embeddings": 32768,
        "hidden_act": "silu",
        "use_sliding_window": False,
    },
    "Qwen3ForCausalLM": {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "head_dim": 128,
        "intermediate_size": 22016,
        "vocab_size": 151936,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "max_position_embeddings": 32768,
        "hidden_act": "silu",
        "use_sliding_window": False,
    },
}


class CheckpointConfig:
    """A checkpoint's config.json over its architecture's defaults, read as attributes.

    Importing transformers to parse config.json costs about 4 s of one core at every replica
    start; the loader needs a dozen numbers from it. Only a RoPE scaling that transformers
    computes (llama3, yarn, ...) loads the transformers config (``transformers_config``)."""

    def __init__(self, model_dir: Path, values: dict[str, Any]) -> None:
        self.model_dir = model_dir
        self._values = values

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_values"][name]
        except KeyError:
            raise AttributeError(name) from None

    def to_dict(self) -> dict[str, Any]:
        return dict(self._values)

    def transformers_config(self) -> Any:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.model_dir, local_files_only=True)


def read_hf_config(model_dir: Path) -> tuple[CheckpointConfig, str]:
    with (model_dir / "config.json").open() as f:
        raw = json.load(f)
    archs = raw.get("architectures") or []
    if not archs and raw.get("model_type") in _MODEL_TYPES:
        archs = [_MODEL_TYPES[raw["model_type"]]]
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"model.path: unsupported architecture {archs or raw.get('model_type')!r} in "
            f"{model_dir}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    values = {**_CLASS_DEFAULTS[arch], **raw}
    return CheckpointConfig(model_dir, values), arch


def _rope(hf_config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    params = getattr(hf_config, "rope_parameters", None) or {}
    legacy = getattr(hf_config, "rope_scaling", None) or {}
    rope_type = (
        params.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
    )
    if rope_type not in _STATIC_ROPE:
        raise ValueError(f"model: unsupported RoPE type {rope_type!r}; supported: {_STATIC_ROPE}")
    if rope_type in ("default", "dynamic"):
        # dynamic NTK only changes frequencies beyond the original context, which
        # resolve_max_model_len never exceeds.
        theta = float(params.get("rope_theta") or getattr(hf_config, "rope_theta", None) or 1e4)
        return _default_inv_freq(theta, head_dim), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if isinstance(hf_config, CheckpointConfig):
        hf_config = hf_config.transformers_config()
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    return inv_freq, float(scaling)


def _default_inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    """Plain RoPE's inverse frequencies, as transformers computes them (fp32)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))


def _ropes_per_layer_type(hf_config: Any, arch: LlamaArch) -> dict[str, tuple[torch.Tensor, float]]:
    """(inverse frequencies, scaling) per layer type, from transformers' own config and RoPE
    code (``rope_parameters`` keyed by layer type)."""
    cfg = hf_config.transformers_config() if isinstance(hf_config, CheckpointConfig) else hf_config
    out = {}
    for kind in dict.fromkeys(arch.layer_rope):
        params = cfg.rope_parameters[kind]
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            out[kind] = (_default_inv_freq(float(params["rope_theta"]), arch.head_dim), 1.0)
        elif rope_type in _STATIC_ROPE:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            freqs, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu", layer_type=kind)
            out[kind] = (freqs, float(scaling))
        else:
            raise ValueError(f"model: unsupported RoPE type {rope_type!r} for {kind} layers")
    return out


class _WeightReader:
    """Tensors by name from safetensors files (or ``*.bin`` with ``weights_only=True``)."""

    def __init__(self, model_dir: Path) -> None:
        files = sorted(model_dir.glob("*.safetensors"))
        self._tensors: dict[str, torch.Tensor] = {}
        if files:
            from safetensors.torch import load_file

            for f in files:
                self._tensors.update(load_file(str(f)))
        else:
            bins = sorted(model_dir.glob("pytorch_model*.bin"))
            if not bins:
                raise FileNotFoundError(
                    f"model.path: no *.safetensors or pytorch_model*.bin weights in {model_dir}"
                )
            for f in bins:
                self._tensors.update(torch.load(f, map_location="cpu", weights_only=True))
        prefixes = ("model.", "")
        self._prefix = next(
            (p for p in prefixes if f"{p}embed_tokens.weight" in self._tensors), None
        )
        if self._prefix is None:
            raise ValueError(f"model.path: {model_dir} has no embed_tokens weight")

    def get(self, name: str, required: bool = True) -> torch.Tensor | None:
        for key in (f"{self._prefix}{name}", name):
            if key in self._tensors:
                return self._tensors[key]
        if required:
            raise ValueError(f"model weights: missing tensor {self._prefix}{name}")
        return None


def read_arch(model_dir: Path) -> tuple[LlamaArch, Any]:
    """The model's shape from its config.json (and the config itself)."""
    hf_config, arch_name = read_hf_config(model_dir)
    return arch_from_config(hf_config, arch_name), hf_config


def arch_from_config(hf_config: Any, arch_name: str) -> LlamaArch:
    """The shape, from a ``CheckpointConfig`` or a transformers config alike."""
    num_heads = int(hf_config.num_attention_heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads)
    arch = LlamaArch(
        architecture=arch_name,
        num_layers=int(hf_config.num_hidden_layers),
        hidden_size=int(hf_config.hidden_size),
        num_heads=num_heads,
        num_kv_heads=int(getattr(hf_config, "num_key_value_heads", None) or num_heads),
        head_dim=head_dim,
        intermediate_size=int(hf_config.intermediate_size),
        vocab_size=int(hf_config.vocab_size),
        rms_norm_eps=float(hf_config.rms_norm_eps),
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=arch_name == "Qwen2ForCausalLM"
        or bool(getattr(hf_config, "attention_bias", False)),
        max_position_embeddings=int(hf_config.max_position_embeddings),
        qk_norm=arch_name in _QK_NORM,
        num_experts=_num_experts(hf_config, arch_name),
        num_experts_per_tok=int(getattr(hf_config, "num_experts_per_tok", 0) or 0)
        if arch_name in _MOE_NAMES
        else 0,
    )
    if arch_name == _GEMMA:
        arch = dataclasses.replace(arch, **_gemma_fields(hf_config, arch))
    if arch.num_experts and not 0 < arch.num_experts_per_tok <= arch.num_experts:
        raise ValueError(
            f"model: num_experts_per_tok {arch.num_experts_per_tok} must be in 1.."
            f"{arch.num_experts} (the experts per layer)"
        )
    if arch_name != _GEMMA and getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"model: unsupported activation {hf_config.hidden_act!r} (need silu)")
    rope = getattr(hf_config, "rope_parameters", None) or {}
    partial = rope.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    if float(partial or 1.0) != 1.0:
        raise ValueError(
            f"model: partial rotary embeddings (partial_rotary_factor {partial}) are not "
            "supported; the rotary embedding covers the whole head"
        )
    return arch


def _gemma_fields(hf_config: Any, arch: LlamaArch) -> dict[str, Any]:
    """Gemma 3 text: GeGLU, the embedding scaled by sqrt(hidden), 1/sqrt(query_pre_attn_scalar)
    attention, a RoPE table per layer type (local sliding-window layers, global ones)."""
    act = getattr(hf_config, "hidden_activation", None) or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"model: unsupported Gemma activation {act!r} (need gelu_pytorch_tanh)")
    if getattr(hf_config, "attn_logit_softcapping", None) is not None:
        raise ValueError("model: attention logit soft-capping is not supported (Gemma 2)")
    types = getattr(hf_config, "layer_types", None)
    if not types:  # an older config.json: transformers derives them
        types = hf_config.transformers_config().layer_types
    if len(types) != arch.num_layers:
        raise ValueError(f"model: {len(types)} layer_types for {arch.num_layers} layers")
    cap = getattr(hf_config, "final_logit_softcapping", None)
    return {
        "activation": "gelu_tanh",
        "embed_scale": float(arch.hidden_size**0.5),
        "attn_scale": float(hf_config.query_pre_attn_scalar) ** -0.5,
        "final_logit_softcap": None if cap is None else float(cap),
        "layer_rope": tuple(str(t) for t in types),
    }


def _num_experts(hf_config: Any, arch_name: str) -> int:
    """Experts per MoE layer: ``num_local_experts`` (Mixtral; Qwen3-MoE as transformers 5
    writes it) or ``num_experts`` (Qwen3-MoE's own name)."""
    if arch_name not in _MOE_NAMES:
        return 0
    n = getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", None)
    if not n:
        raise ValueError(f"model: a {arch_name} config.json must name its number of experts")
    return int(n)


def is_moe_layer(hf_config: Any, arch: LlamaArch, layer: int) -> bool:
    """Whether layer ``layer`` has experts (Qwen3-MoE: every ``decoder_sparse_step``-th one,
    less its ``mlp_only_layers``; Mixtral: all of them)."""
    if not arch.num_experts:
        return False
    if arch.architecture != "Qwen3MoeForCausalLM":
        return True
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
    return layer not in dense and (layer + 1) % step == 0


def build_model(
    arch: LlamaArch,
    hf_config: Any,
    embed: Weight,
    layers: list[LayerWeights],
    final_norm: torch.Tensor,
    lm_head: Weight,
    max_model_len: int | None,
    ops: LayerOps,
    source: str,
) -> LlamaModel:
    max_len = resolve_max_model_len(hf_config.to_dict(), max_model_len)
    if arch.layer_rope:  # a table per layer type (Gemma 3's local and global layers)
        tables: Any = _ropes_per_layer_type(hf_config, arch)
        inv_freq, attention_scaling = tables, 1.0
    else:
        inv_freq, attention_scaling = _rope(hf_config, arch.head_dim)
    model = LlamaModel(
        arch,
        embed,
        layers,
        final_norm,
        lm_head,
        inv_freq,
        attention_scaling,
        max_len,
        ops,
    )
    logger.info(
        "loaded %s from %s: %d layers, %d/%d heads, max_model_len %d, %s on %s, weights %s "
        "(%.1f MiB)",
        arch.architecture,
        source,
        arch.num_layers,
        arch.num_heads,
        arch.num_kv_heads,
        max_len,
        model.dtype,
        model.device,
        model.weight_format,
        model.weight_bytes() / 2**20,
    )
    return model


def _experts(
    w: Callable[[str], torch.Tensor],
    has: Callable[[str], bool],
    hf_config: Any,
    arch: LlamaArch,
    layer: int,
) -> ExpertWeights:
    """Layer ``layer``'s router and experts (gate and up fused per expert, as dense MLPs are):
    one tensor per expert and projection as checkpoints store them, or transformers 5's
    in-memory layout (``experts.gate_up_proj`` [E, 2I, H], gate first, and ``down_proj``)."""
    block, (gate, up, down) = _MOE_NAMES[arch.architecture]
    p = f"layers.{layer}.{block}."
    experts = range(arch.num_experts)
    if has(f"{p}experts.gate_up_proj"):
        gate_up = list(w(f"{p}experts.gate_up_proj").unbind(0))
        downs = list(w(f"{p}experts.down_proj").unbind(0))
    else:
        gate_up = [
            torch.cat([w(f"{p}experts.{e}.{gate}.weight"), w(f"{p}experts.{e}.{up}.weight")])
            for e in experts
        ]
        downs = [w(f"{p}experts.{e}.{down}.weight") for e in experts]
    return ExpertWeights(
        router=w(f"{p}gate.weight"),
        gate_up=[g.contiguous() for g in gate_up],
        down=[d.contiguous() for d in downs],
        top_k=arch.num_experts_per_tok,
        # Mixtral always renormalizes the top k weights; Qwen3-MoE as its config says.
        norm_topk_prob=arch.architecture == "MixtralForCausalLM"
        or bool(getattr(hf_config, "norm_topk_prob", False)),
    )


def load_llama(
    model_dir: Path,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int | None,
    linear: Linear = F.linear,
) -> tuple[LlamaModel, Any]:
    arch, hf_config = read_arch(model_dir)
    reader = _WeightReader(model_dir)

    def w(name: str) -> torch.Tensor:
        t = reader.get(name)
        assert t is not None
        return t.to(device=device, dtype=dtype)

    gemma = arch.architecture == _GEMMA

    def has(name: str) -> bool:
        return reader.get(name, required=False) is not None

    def norm(name: str) -> torch.Tensor:
        """A norm's weight; Gemma's scale by (1 + w), folded in here (the same fp32 product)."""
        t = reader.get(name)
        assert t is not None
        t = t.float()
        return (1.0 + t if gemma else t).to(device=device, dtype=dtype)

    def fused(name: str, parts: list[str]) -> torch.Tensor:
        """``name`` as one tensor (Phi-3 stores q/k/v and gate/up fused, in that order), or
        its parts concatenated (Llama, Qwen, Mistral)."""
        if reader.get(name, required=False) is not None:
            return w(name)
        return torch.cat([w(part) for part in parts]).contiguous()

    layers = []
    for i in range(arch.num_layers):
        p = f"layers.{i}."
        bias = None
        if arch.qkv_bias:
            bias = torch.cat([w(f"{p}self_attn.{x}_proj.bias") for x in "qkv"]).contiguous()
        qkv_parts = [f"{p}self_attn.{x}_proj.weight" for x in "qkv"]
        gate_up_parts = [f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"]
        moe = (
            _experts(
                w, lambda name: reader.get(name, required=False) is not None, hf_config, arch, i
            )
            if is_moe_layer(hf_config, arch, i)
            else None
        )
        # Gemma: post_attention_layernorm normalizes the attention's output, and the MLP's
        # input norm is pre_feedforward_layernorm
        mlp_norm = "pre_feedforward_layernorm" if gemma else "post_attention_layernorm"
        layers.append(
            LayerWeights(
                input_norm=norm(f"{p}input_layernorm.weight"),
                qkv=fused(f"{p}self_attn.qkv_proj.weight", qkv_parts),
                qkv_bias=bias,
                o=w(f"{p}self_attn.o_proj.weight"),
                post_norm=norm(f"{p}{mlp_norm}.weight"),
                post_attn_norm=norm(f"{p}post_attention_layernorm.weight") if gemma else None,
                post_ffn_norm=norm(f"{p}post_feedforward_layernorm.weight") if gemma else None,
                gate_up=None if moe else fused(f"{p}mlp.gate_up_proj.weight", gate_up_parts),
                down=None if moe else w(f"{p}mlp.down_proj.weight"),
                moe=moe,
                qk_norm=(
                    (norm(f"{p}self_attn.q_norm.weight"), norm(f"{p}self_attn.k_norm.weight"))
                    if arch.qk_norm
                    else None
                ),
            )
        )
    embed = w("embed_tokens.weight")
    lm_head_raw = None if arch.tie_word_embeddings else reader.get("lm_head.weight", required=False)
    lm_head = embed if lm_head_raw is None else lm_head_raw.to(device=device, dtype=dtype)
    model = build_model(
        arch,
        hf_config,
        embed,
        layers,
        norm("norm.weight"),
        lm_head,
        max_model_len,
        TorchOps(linear),
        str(model_dir),
    )
    return model, hf_config
