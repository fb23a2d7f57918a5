"""A transformers reference for exactness tests: a plain greedy argmax loop at batch 1.

EOS ids are suppressed at every step, as ``generate(min_new_tokens=max_new_tokens)`` does, so
the reference and the engine (``min_tokens == max_tokens``) produce the same number of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

NEAR_TIE = 2e-3  # a divergence is acceptable only where the reference's top-2 logits are closer
LOGIT_ATOL = 1e-3


@dataclass
class Reference:
    tokens: list[int]
    logits: list[torch.Tensor]  # per generated token: the full [V] logits it was chosen from

    def top2_gap(self, step: int) -> float:
        top = self.logits[step].topk(2).values
        return float(top[0] - top[1])


def load_hf(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_greedy(
    model: Any, prompt: list[int], max_new_tokens: int, suppress: tuple[int, ...]
) -> Reference:
    device = getattr(model, "device", torch.device("cpu"))  # the GPU tests run it on CUDA
    ids = torch.tensor([prompt], device=device)
    out = model(ids, use_cache=True)
    past = out.past_key_values
    tokens: list[int] = []
    logits_list: list[torch.Tensor] = []
    logits = out.logits[0, -1].float().cpu()
    for _ in range(max_new_tokens):
        logits = logits.clone()
        logits_list.append(logits.clone())
        if suppress:
            logits[list(suppress)] = float("-inf")
        tok = int(logits.argmax())
        tokens.append(tok)
        out = model(torch.tensor([[tok]], device=device), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[0, -1].float().cpu()
    return Reference(tokens, logits_list)


def assert_matches_reference(got: list[int], ref: Reference, label: str = "") -> int:
    """Token-identical up to the first divergence, which must be a genuine near-tie.

    Returns the number of tokens compared (the full length when identical).
    """
    assert len(got) == len(ref.tokens), f"{label}: {len(got)} tokens, reference {len(ref.tokens)}"
    for i, (a, b) in enumerate(zip(got, ref.tokens)):
        if a != b:
            gap = ref.top2_gap(i)
            assert gap <= NEAR_TIE, (
                f"{label}: diverged at token {i} ({a} vs reference {b}) where the reference's "
                f"top-2 logit gap is {gap:.2e} > {NEAR_TIE} (not a near-tie)"
            )
            return i
    return len(got)


def capture_logits(engine: Any) -> dict[tuple[str, int], torch.Tensor]:
    """Record the logits each sampled token came from: (request id, output index) -> [V]."""
    captured: dict[tuple[str, int], torch.Tensor] = {}
    forward = engine.runner.forward

    def recording_forward(inputs: Any) -> torch.Tensor:
        logits = forward(inputs)
        row = 0
        for item in inputs.sampled:
            r = item.request
            # Only the first row of an item with drafts follows the known tokens for sure.
            captured[(r.request_id, r.num_output_tokens)] = logits[row].float().cpu()
            row += item.num_sampled_rows
        return logits

    engine.runner.forward = recording_forward
    return captured


def check_run_against_references(
    engine: Any,
    prompts: dict[str, list[int]],
    refs: dict[str, Reference],
    tokens: dict[str, list[int]],
    captured: dict[tuple[str, int], torch.Tensor],
) -> None:
    """Every request: tokens identical up to a near-tie, logits within LOGIT_ATOL until then."""
    for rid in prompts:
        n = assert_matches_reference(tokens[rid], refs[rid], rid)
        for i in range(n):
            ours = captured[(rid, i)]
            diff = float((ours - refs[rid].logits[i]).abs().max())
            assert diff <= LOGIT_ATOL, f"{rid}: token {i} logits differ by {diff:.2e}"


@torch.inference_mode()
def hf_greedy_batch(
    model: Any, prompts: list[list[int]], max_new_tokens: int, suppress: tuple[int, ...]
) -> list[Reference]:
    """``hf_greedy`` for several prompts in one batch (left-padded, masked, positions from 0).

    Batch-1 decode streams every weight per token, so a batch of nine costs about one: the
    session's references take one pass instead of nine."""
    device = getattr(model, "device", torch.device("cpu"))
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, device=device)
        mask[i, width - len(p) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(ids, attention_mask=mask, position_ids=positions, use_cache=True)
    past = out.past_key_values
    refs = [Reference([], []) for _ in prompts]
    logits = out.logits[:, -1].float().cpu()
    for _ in range(max_new_tokens):
        step = logits.clone()
        if suppress:
            step[:, list(suppress)] = float("-inf")
        toks = step.argmax(-1)
        for i, ref in enumerate(refs):
            ref.logits.append(logits[i].clone())
            ref.tokens.append(int(toks[i]))
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        positions = positions[:, -1:] + 1
        out = model(
            toks[:, None].to(device),
            attention_mask=mask,
            position_ids=positions,
            past_key_values=past,
            use_cache=True,
        )
        past = out.past_key_values
        logits = out.logits[:, -1].float().cpu()
    return refs
