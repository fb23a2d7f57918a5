"""Pipeline parallelism: an engine's layers in stages, one rank each, micro-batches flowing
through them (``model.pipeline_parallel_size``, ``model.pipeline_microbatches``).

Rank 0 (the driver) is stage 0: it schedules, deals the step's requests into micro-batches
(whole requests, balanced by rows), broadcasts their rows to every stage, and samples. Each
stage runs its layers (``models.tensor_parallel.keep_stage``) over one micro-batch at a time and
sends the hidden states to the next stage's queue (``ShmGroup.send_to``); the last stage
computes the micro-batch's logits and sends them back to stage 0. So while stage 1 works on
micro-batch i, stage 0 works on micro-batch i + 1: with M micro-batches and S stages a step
takes about (M + S - 1) / M stage-times instead of S. The KV cache is the one shared cache: a
stage writes and reads only its layers' rows.

Every stage sees the same rows, so each knows every message's shape; the queues are
first-in first-out per receiving rank, so a stage takes its inputs in micro-batch order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from cluster.config import ClusterConfig
from cluster.engine import prompt_logprobs
from cluster.engine.runner import RunnerOutput
from cluster.engine.scheduler import ScheduledBatch, ScheduledRequest
from cluster.engine.spec.verify import sample_and_verify
from cluster.engine.tp_group import ShmGroup

ForwardInputs = Any  # torch_runner.ForwardInputs (a step's tensors)


class StageRunner(Protocol):
    """What a stage needs of its runner (``TorchModelRunner``)."""

    config: ClusterConfig
    model: Any  # LlamaModel: embed_tokens, forward_layers, arch, dtype
    tp_rank: int
    kv_view: torch.Tensor
    vocab_size: int

    @property
    def group(self) -> ShmGroup | None: ...

    def collect_rows(self, items: list[ScheduledRequest]) -> Any: ...

    def step_inputs(self, rows: Any) -> ForwardInputs: ...

    def logits_of(self, hidden: torch.Tensor, inputs: ForwardInputs) -> torch.Tensor | None: ...


def deal(items: Sequence[ScheduledRequest], m: int) -> list[list[ScheduledRequest]]:
    """``items`` in at most ``m`` non-empty micro-batches of whole requests, the rows (new
    tokens) as even as a greedy deal of the largest first makes them; each keeps the batch's
    order."""
    m = max(1, min(m, len(items)))
    loads = [0] * m
    owner: dict[int, int] = {}
    for i in sorted(range(len(items)), key=lambda i: -items[i].num_new_tokens):
        j = loads.index(min(loads))
        owner[i] = j
        loads[j] += items[i].num_new_tokens
    return [[it for i, it in enumerate(items) if owner[i] == j] for j in range(m)]


def execute_pipelined(runner: StageRunner, batch: ScheduledBatch) -> RunnerOutput:
    """Rank 0's step: the micro-batches through every stage, then sampling."""
    group = runner.group
    assert group is not None
    parts = deal(batch.items, runner.config.model.pipeline_microbatches)
    rows = [runner.collect_rows(items) for items in parts]
    group.broadcast({"micro_batches": [r.wire() for r in rows]})
    inputs = [runner.step_inputs(r) for r in rows]
    logits = run_stage(runner, inputs)
    assert logits is not None
    counts = [int(i.sample_rows.shape[0]) for i in inputs]
    sampled = torch.cat([lg[:s] for lg, s in zip(logits, counts, strict=True)])
    items = [it for i in inputs for it in i.sampled]
    out = sample_and_verify(sampled, items, batch.masks)
    prompt = [p for i in inputs for p in i.prompt]
    scored = torch.cat([lg[s:] for lg, s in zip(logits, counts, strict=True)])
    out.prompt_logprobs = prompt_logprobs.score(scored, prompt)
    return out


def run_stage(runner: StageRunner, inputs: list[ForwardInputs]) -> list[torch.Tensor] | None:
    """This rank's stage over every micro-batch, in order: stage 0 returns each micro-batch's
    logits (sample rows, then prompt rows), the others None."""
    group, model = runner.group, runner.model
    assert group is not None
    stage, stages = runner.tp_rank, runner.config.model.pipeline_parallel_size
    last = stage == stages - 1
    hidden = model.arch.hidden_size
    dtype = model.dtype
    # Stage 0 keeps embedding and sending ahead of the last stage's logits: it takes micro-batch
    # i's logits only after sending micro-batch i + 1 (then the stages overlap).
    pending: list[int] = []
    logits: list[torch.Tensor] = []
    for i, inp in enumerate(inputs):
        n = int(inp.input_ids.shape[0])
        if stage == 0:
            h = model.embed_tokens(inp.input_ids)
        else:
            h = group.recv(torch.empty((n, hidden), dtype=dtype))
        h = model.forward_layers(h, inp.positions, inp.meta, runner.kv_view)
        if last:
            out = runner.logits_of(h, inp)
            assert out is not None
            group.send_to(0, out)
        else:
            group.send_to(stage + 1, h.contiguous())
        if stage == 0 and not last:
            pending.append(i)
            if len(pending) > 1:
                logits.append(_take(group, inputs[pending.pop(0)], runner.vocab_size))
    while stage == 0 and pending:
        logits.append(_take(group, inputs[pending.pop(0)], runner.vocab_size))
    return logits if stage == 0 else None


def _take(group: Any, inp: ForwardInputs, vocab: int) -> torch.Tensor:
    rows = int(inp.sample_rows.shape[0]) + int(inp.prompt_rows.shape[0])
    return group.recv(torch.empty((rows, vocab), dtype=torch.float32))
