"""Which parts of the GPU path a runner uses: ``choose_gpu_path``, one pure decision.

The runner (``torch_runner.TorchModelRunner``) asks once, at start-up, from facts it knows (the
device, ``model.kernels``, the KV cache's dtype and head size, whether Triton imports, tensor
parallelism, the model's features) and logs the answer. On the CPU the answer is always "none
of it": the CPU path (native kernels or plain torch, the host sampler) is the tested one and is
not touched. On CUDA, with ``model.kernels`` auto:

* ``triton_attention``: decode rows through ``triton_paged_decode`` and prefill chunks through
  ``triton_prefill_batch``, reading the paged cache in place (no gather, no SDPA), where Triton
  imports and the KV cache is fp16/bf16/fp32, or int8 with ``head_dim % 4 == 0`` (the kernels
  read each row's fp32 scale aligned);
* ``cuda_graphs``: decode-only steps replayed from CUDA graphs (``graphs.StepGraphs``) where
  the Triton decode kernel runs (its context lengths are read on the device, so the step
  captures), except for a mixture-of-experts model (its expert-load statistics and per-expert
  dispatch read counts back to the host inside the step), packed (GGUF/int8) weights
  (de-quantized on each call: not worth capturing and not checked) and tensor parallelism
  (CPU ranks only);
* ``device_sampling``: a step's sampled rows drawn on the device (``device_sampler.sample_rows``
  as ``spec.verify.sample_and_verify``'s sampler): every row without penalties, bias or
  suppressed ids (``device_sampler.supported``), drafts' and structured-output rows included;
  the others on the host sampler.

``model.kernels: torch`` turns all three off on CUDA (plain torch ops, the host sampler): the
escape hatch, and the baseline the GPU benchmark compares against.
"""

from __future__ import annotations

from dataclasses import dataclass

FLOAT_KV = ("float16", "bfloat16", "float32")


@dataclass(frozen=True, slots=True)
class GpuPath:
    triton_attention: bool = False
    cuda_graphs: bool = False
    device_sampling: bool = False
    # why a part is off on CUDA (logged; empty on the CPU, where nothing is asked for)
    reasons: tuple[str, ...] = ()

    def describe(self) -> str:
        parts = [
            name
            for name, on in (
                ("Triton paged attention", self.triton_attention),
                ("CUDA graphs for decode steps", self.cuda_graphs),
                ("sampling on the device", self.device_sampling),
            )
            if on
        ]
        text = ", ".join(parts) if parts else "plain torch ops, the host sampler"
        return text + (f" ({'; '.join(self.reasons)})" if self.reasons else "")


def choose_gpu_path(
    *,
    device_type: str,
    kernels: str,
    kv_dtype: str,
    head_dim: int,
    triton_available: bool,
    tensor_parallel: bool = False,
    moe: bool = False,
    packed_weights: bool = False,
) -> GpuPath:
    """The parts of the GPU path a runner with these facts uses (see the module docstring)."""
    if device_type != "cuda":
        return GpuPath()
    if kernels == "torch":
        return GpuPath(reasons=("model.kernels: torch",))
    reasons: list[str] = []
    kv_ok = kv_dtype in FLOAT_KV or (kv_dtype == "int8" and head_dim % 4 == 0)
    if not triton_available:
        reasons.append("Triton does not import")
    elif not kv_ok:
        reasons.append(f"no Triton kernel for a {kv_dtype} KV cache of head size {head_dim}")
    triton = triton_available and kv_ok
    graphs = triton
    for off, why in (
        (tensor_parallel, "tensor parallelism"),
        (moe, "a mixture-of-experts model"),
        (packed_weights, "packed weights"),
    ):
        if graphs and off:
            reasons.append(f"no CUDA graphs with {why}")
            graphs = False
    if not triton:
        reasons.append("no CUDA graphs without the Triton decode kernel")
    return GpuPath(triton, graphs, True, tuple(reasons))


def triton_imports() -> bool:
    """Whether Triton imports here (it is a Linux dependency; a CUDA wheel pins its own)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
