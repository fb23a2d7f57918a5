"""The transformers reference arm: the same checkpoint through ``AutoModelForCausalLM``.

fp32, ``attn_implementation="sdpa"``, in this process with the same torch threads as the engine.
Prompts are token ids, so both arms see exactly the same inputs.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

import torch


def load_hf_model(model_dir: Path, device: torch.device | str = "cpu") -> Any:
    """fp32 on ``device`` (the engine's, so a GPU run compares like with like)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    model.eval()
    return model.to(torch.device(device))  # type: ignore[arg-type]


def pad_token_id(model: Any) -> int:
    """Pad with EOS, as docs/benchmarks/index.md's HF arm does (padded rows are masked anyway)."""
    eos = model.config.eos_token_id
    return int(eos[0] if isinstance(eos, list) else eos)


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids, attention_mask: [B, max_len], padding on the left (decoder-only generate)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids, mask


@torch.inference_mode()
def generate_exact(
    model: Any, prompts: list[list[int]], num_new_tokens: int, streamer: Any = None
) -> torch.Tensor:
    """Static batch: greedy, KV cache on, every row runs exactly ``num_new_tokens`` steps."""
    pad = pad_token_id(model)
    ids, mask = left_pad(prompts, pad)
    ids, mask = ids.to(model.device), mask.to(model.device)
    out: torch.Tensor = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=num_new_tokens,
        min_new_tokens=num_new_tokens,  # EOS suppressed until the end: EOS ignored
        pad_token_id=pad,
        use_cache=True,
        streamer=streamer,
    )
    return out[:, ids.shape[1] :]


@torch.inference_mode()
def forward_time(model: Any, prompt: list[int]) -> float:
    """Seconds for one prefill forward of ``prompt`` (the first token's compute).

    ``logits_to_keep=1`` as ``generate`` does for its prefill: only the last row's logits, as
    our engine computes them.
    """
    ids = torch.tensor([prompt], dtype=torch.long, device=model.device)
    t0 = time.perf_counter()
    model(input_ids=ids, use_cache=True, logits_to_keep=1)
    if ids.is_cuda:
        torch.cuda.synchronize(ids.device)
    return time.perf_counter() - t0


class TokenClock:
    """A ``generate`` streamer that stamps each call: the prompt first, then one per new token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def step_times(self) -> list[float]:
        """Gaps between consecutive new tokens (decode steps; the prefill step left out)."""
        t = self.times[1:]  # times[0]: the prompt, pushed before any compute
        return [b - a for a, b in itertools.pairwise(t)]


def decode_step_times(model: Any, prompt: list[int], num_new_tokens: int) -> list[float]:
    """bs1 ``generate`` decode step times (seconds) after the prompt's prefill."""
    clock = TokenClock()
    generate_exact(model, [prompt], num_new_tokens, streamer=clock)
    return clock.step_times()
