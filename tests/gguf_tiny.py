"""A tiny random Llama as a GGUF file (``cluster.engine.models.tiny.write_tiny_gguf``: Q4_0,
Q4_1, Q8_0 mixed inside the fused q/k/v and gate/up projections, q/k rows permuted as llama.cpp
stores them), and the converted checkpoint next to it (what ``pdserve`` makes of a ``.gguf``
model.path) written by transformers' own GGUF loader: its weights are the fp32-dequantized
reference.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from cluster.config import ClusterConfig
from cluster.config.model_paths import COMPLETE_MARKER, gguf_model_dir
from cluster.engine.models.tiny import write_tiny_gguf

__all__ = ["convert_tiny_gguf", "write_tiny_gguf"]


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


def gguf_config(checkpoint: Path, root: Path, arch: str = "llama", **overrides: Any) -> Any:
    """``checkpoint`` written as GGUF under ``root`` and converted as pdserve converts a
    ``.gguf`` model.path; the config that serves the file (a tiny pool, 2 threads, 8-token
    chunks), plus dotted ``overrides``."""
    from tests.helpers import make_config

    path = write_tiny_gguf(checkpoint, root / f"{arch}.gguf", arch=arch)
    cfg = make_config(
        **{
            "model.path": str(path),
            "paths.cache_dir": str(root / "cache"),
            "cache.num_blocks": 96,
            "model.num_threads": 2,
            "scheduler.chunk_size": 8,
            **overrides,
        }
    )
    convert_tiny_gguf(cfg, path, checkpoint)
    return cfg
