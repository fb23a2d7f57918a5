"""``model.weights`` -> how the model's weights are loaded and multiplied (one loader each).

    dense  the checkpoint's tensors in model.dtype (a GGUF source: its fp32 de-quantized copy)
    gguf   the GGUF file's own Q4_0 / Q4_1 / Q8_0 blocks, kept packed (``gguf_loader.py``)
    int8   the dense weights quantized at load to int8 per output channel (the tied
           embedding / lm_head included), weight-only: activations stay fp32

Packed formats run through ``PackedLinear``: the native kernel on a CPU fp32 model where it
compiles (``model.kernels: native`` requires it), torch de-quantization elsewhere.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from cluster.config import ClusterConfig
from cluster.engine.kernels.quant import QuantKernels, load_quant_kernels
from cluster.engine.kernels.rows import rows_linear
from cluster.engine.models.default_model import ModelSource
from cluster.engine.models.gguf_loader import load_gguf_llama
from cluster.engine.models.int8 import quantize_int8_groups, quantize_int8_rows
from cluster.engine.models.layer_ops import LayerOps, NativeOps, TorchOps
from cluster.engine.models.llama import LlamaModel, onednn_linear
from cluster.engine.models.loader import load_llama
from cluster.engine.models.packed import (
    PackedLinear,
    PackedWeight,
    probe_kernel_max_rows,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadSpec:
    source: ModelSource
    dtype: torch.dtype
    device: torch.device
    max_model_len: int | None
    native: bool  # CPU fp32 fast paths allowed (model.kernels != torch)
    cache_dir: Path
    require_native: bool  # model.kernels: native


def _dense(spec: LoadSpec) -> LlamaModel:
    linear = (onednn_linear() if spec.native else None) or F.linear
    if spec.native:  # steps of 1-32 rows: the rows kernel (one summation order per output)
        linear = rows_linear(spec.cache_dir, torch.get_num_threads(), linear) or linear
    model, _ = load_llama(
        spec.source.model_dir, spec.dtype, spec.device, spec.max_model_len, linear
    )
    return model


def packed_ops(spec: LoadSpec) -> LayerOps:
    """The layer ops for packed weights: native where the kernel loaded, torch otherwise."""
    lin = packed_linear(spec)
    return NativeOps(lin, lin.kernels) if lin.kernels is not None else TorchOps(lin, lin.embed)


def packed_linear(spec: LoadSpec) -> PackedLinear:
    dense = (onednn_linear() if spec.native else None) or F.linear
    kernels: QuantKernels | None = None
    if spec.native:
        kernels = load_quant_kernels(spec.cache_dir, torch.get_num_threads())
    if kernels is None and spec.require_native:
        raise ValueError("model.kernels: native needs a C compiler (cc) for packed weights")
    if kernels is None:
        logger.warning("packed weights without the native kernel: de-quantized per call (slow)")
        return PackedLinear(dense, None)
    return PackedLinear(dense, kernels, probe_kernel_max_rows(kernels, dense))


def _gguf(spec: LoadSpec) -> LlamaModel:
    if spec.source.gguf is None:
        raise ValueError("model.weights: gguf needs a GGUF source (the default model or a .gguf)")
    model, _ = load_gguf_llama(
        spec.source.gguf,
        spec.source.model_dir,
        spec.dtype,
        spec.device,
        spec.max_model_len,
        packed_ops(spec),
    )
    return model


def quantize_model_int8(
    model: LlamaModel, ops: LayerOps, quantize: Callable[[torch.Tensor], PackedWeight]
) -> LlamaModel:
    """Every matrix (embedding and lm_head too) to int8 by ``quantize``, in place."""
    tied = model.lm_head is model.embed
    for lw in model.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            w = getattr(lw, name)
            if isinstance(w, torch.Tensor):
                setattr(lw, name, quantize(w))
    if isinstance(model.embed, torch.Tensor):
        model.embed = quantize(model.embed)
    if tied:
        model.lm_head = model.embed
    elif isinstance(model.lm_head, torch.Tensor):
        model.lm_head = quantize(model.lm_head)
    model.ops = ops
    assert all(isinstance(m, PackedWeight) for m in model.matrices())
    return model


def _int8_loader(
    quantize: Callable[[torch.Tensor], PackedWeight], scheme: str
) -> Callable[[LoadSpec], LlamaModel]:
    def load(spec: LoadSpec) -> LlamaModel:
        model = quantize_model_int8(_dense(spec), packed_ops(spec), quantize)
        logger.info("weights quantized to int8 %s: %.1f MiB", scheme, model.weight_bytes() / 2**20)
        return model

    return load


WEIGHT_LOADERS: dict[str, Callable[[LoadSpec], LlamaModel]] = {
    "dense": _dense,
    "gguf": _gguf,
    "int8": _int8_loader(quantize_int8_groups, "in groups of 32"),
    "int8_rows": _int8_loader(quantize_int8_rows, "per output channel"),
}


def load_model(config: ClusterConfig, spec: LoadSpec) -> LlamaModel:
    return WEIGHT_LOADERS[config.model.resolved_weights](spec)
