"""``model.weights`` -> how the model's weights are loaded and multiplied (one loader each).

    dense  the checkpoint's tensors in model.dtype (a GGUF source: its fp32 de-quantized copy)
    gguf   the GGUF file's own Q4_0 / Q4_1 / Q8_0 blocks, kept packed (``gguf_loader.py``)
    int8   the dense weights quantized at load to int8 per output channel (the tied
           embedding / lm_head included), weight-only: activations stay fp32

Every format runs through ``PackedLinear`` (its three paths: torch reference, native kernel,
de-quantized tiles + BLAS): natively on a CPU fp32 model where the native library loads
(``model.kernels: native`` requires it), the torch reference elsewhere. ``model.numerics:
fast`` (packed formats only) gives the packed formats' ``PackedLinear`` int8 activations on its
kernel path, the experts' and the int8-quantized matrices included: they all run through it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from cluster.config import ClusterConfig
from cluster.engine.kernels.native import NativeKernels, load_native
from cluster.engine.models.default_model import ModelSource
from cluster.engine.models.gguf_loader import load_gguf_llama
from cluster.engine.models.int8 import quantize_int8_groups, quantize_int8_rows
from cluster.engine.models.layer_ops import LayerOps, NativeOps, TorchOps
from cluster.engine.models.llama import LlamaModel
from cluster.engine.models.loader import load_llama
from cluster.engine.models.packed import PackedLinear, PackedWeight, has_packed_rows

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadSpec:
    source: ModelSource
    dtype: torch.dtype
    device: torch.device
    max_model_len: int | None
    native: bool  # CPU fp32 fast paths allowed (model.kernels != torch)
    cache_dir: Path
    require_native: bool  # model.kernels: native, or model.numerics: fast
    numerics: str  # model.numerics resolved: exact | fast (packed formats only)


def native_kernels(spec: LoadSpec) -> NativeKernels | None:
    """The native library where the model may use it (CPU fp32), or None; ``model.kernels:
    native`` without it is an error naming why."""
    if not spec.native:
        return None
    kernels = load_native(spec.cache_dir, torch.get_num_threads())
    if kernels is None and spec.require_native:
        raise ValueError(
            "model.kernels: native or model.numerics: fast, but the native library is "
            "unavailable (see the log: usually no C compiler); use model.kernels auto or torch "
            "and model.numerics auto or exact"
        )
    return kernels


def _dense(spec: LoadSpec) -> LlamaModel:
    # Dense weights keep the per-layer torch ops; their linears run on the native kernel (F32)
    # up to kernel_max_rows rows and on BLAS beyond.
    model, _ = load_llama(
        spec.source.model_dir,
        spec.dtype,
        spec.device,
        spec.max_model_len,
        PackedLinear(native_kernels(spec)),
    )
    return model


def packed_ops(spec: LoadSpec) -> LayerOps:
    """The layer ops for packed weights: native where the library loaded, torch otherwise;
    int8 activations on the kernel path under ``numerics: fast``."""
    kernels = native_kernels(spec)
    lin = PackedLinear(kernels, fast=spec.numerics == "fast" and kernels is not None)
    if lin.kernels is None:
        logger.warning("packed weights without the native library: de-quantized per call (slow)")
        return TorchOps(lin, lin.embed)
    return NativeOps(lin, lin.kernels)


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
        if lw.moe is not None:  # every expert's matrices (the router stays dense)
            lw.moe.gate_up = [
                quantize(w) if isinstance(w, torch.Tensor) else w for w in lw.moe.gate_up
            ]
            lw.moe.down = [quantize(w) if isinstance(w, torch.Tensor) else w for w in lw.moe.down]
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
    model = WEIGHT_LOADERS[config.model.resolved_weights](spec)
    if spec.numerics == "fast":
        for lw in model.layers:  # q/k/v keep fp32 activations (PackedWeight.fp32_activations)
            if isinstance(lw.qkv, PackedWeight):
                lw.qkv.fp32_activations = True
    if spec.numerics == "fast" and not has_packed_rows(model.matrices()):
        raise ValueError(
            f"model.numerics: fast needs packed weights, but every matrix of this "
            f"model.weights: {config.model.weights} model is dense ({model.weight_format}: "
            f"e.g. an unquantized GGUF file); use model.numerics exact"
        )
    return model
