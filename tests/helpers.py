"""Factory helpers for tests: configs, requests, and driving an engine by hand."""

from __future__ import annotations

from typing import Any

from cluster.common.protocol import FirstToken
from cluster.common.sampling_params import SamplingParams
from cluster.config import ClusterConfig, config_from_dict, load_config
from cluster.engine.request import EngineRequest


def make_config(**overrides: Any) -> ClusterConfig:
    """A validated config; overrides are dotted paths: ``make_config(**{"cache.num_blocks": 8})``
    or section mappings: ``make_config(cache={"num_blocks": 8})``."""
    base = load_config().to_dict()
    dotted = {k: v for k, v in overrides.items() if "." in k}
    for key, value in overrides.items():
        if "." not in key:
            if isinstance(value, dict):
                base[key].update(value)
            else:
                raise ValueError(f"make_config: {key} must be a section mapping or a dotted key")
    cfg = config_from_dict(base)
    return cfg.replace(dotted) if dotted else cfg


# A replica going away waits this long before it first checks for calls in flight (Serve's
# default: 2 s). Tests delete ~40 apps: 1 s each instead of 3. Draining still polls until done.
SHORT_SHUTDOWN_WAIT = {
    f"{section}.graceful_shutdown_wait_loop_s": 0.2 for section in ("router", "prefill", "decode")
}
# The same as `--set` arguments of a `pdserve` command.
SHORT_SHUTDOWN_SETS = tuple(
    a for k, v in SHORT_SHUTDOWN_WAIT.items() for a in ("--set", f"{k}={v}")
)


def fake_config(**overrides: Any) -> ClusterConfig:
    """The fake runner with a small pool, in test mode (orchestration and fault tests: fault
    points and forced preemption may be set)."""
    defaults: dict[str, Any] = {
        "testing.enabled": True,
        "model.runner": "fake",
        "model.num_threads": 1,
        "cache.num_blocks": 64,
        "scheduler.max_num_seqs": 8,
        "scheduler.max_num_batched_tokens": 64,
        "scheduler.chunk_size": 16,
        **SHORT_SHUTDOWN_WAIT,
    }
    defaults.update(overrides)
    return make_config(**defaults)


def tiny_config(model_dir: Any, **overrides: Any) -> ClusterConfig:
    """The tiny random Llama at ``model_dir`` (exactness tests): one thread, 16-token chunks."""
    defaults: dict[str, Any] = {
        "model.path": str(model_dir),
        "model.num_threads": 1,
        "scheduler.chunk_size": 16,
        "scheduler.max_num_batched_tokens": 64,
    }
    defaults.update(overrides)
    return make_config(**defaults)


def prefilled(pre: Any, request: EngineRequest) -> tuple[Any, tuple[FirstToken, ...]]:
    """Run ``request`` on a prefill-role engine to its first tokens: (sample 0's output, which
    holds the blocks unless its token ended it; every sample's first token as a
    ``PrefillReply`` carries them)."""
    from cluster.engine.parallel import sample_ids  # (this module stays torch-free to import)
    from cluster.prefill_worker.worker import first_token

    ids = sample_ids(request.request_id, request.n)
    pre.add(request)
    lead, samples = None, []
    while lead is None:
        for o in pre.step():
            if o.request_id in ids and o.new_token_ids:
                if o.index == 0:
                    lead = o
                else:
                    samples.append(o)
    samples.sort(key=lambda o: o.index)
    return lead, tuple(first_token(o) for o in (lead, *samples))


def remote_prefill(pre: Any, dec: Any, rid: str, prompt: list[int], params: Any, seed: int) -> Any:
    """Drive one request through a prefill-role and a decode-role engine by hand, as the pools
    do (prefill, reserve, copy the KV, release, first token and arrival); returns the prefill
    replica's output, its first token included. ``dec`` then decodes the rest."""
    first, first_tokens = prefilled(pre, EngineRequest(rid, prompt, params, seed=seed))
    assert first.held_block_ids is not None
    dec.add(EngineRequest(rid, prompt, params, prefill="remote", seed=seed))
    dec.step()
    (res,) = dec.take_reservations()
    dec.runner.kv_cache[res.block_ids] = pre.runner.kv_cache[first.held_block_ids]
    assert pre.release(rid)
    assert dec.kv_arrived(rid, first_tokens) == []
    return first


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    """Greedy with EOS ignored: a fixed number of tokens, comparable with a reference."""
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True, **kw
    )


def run_until_done(engine: Any, max_steps: int = 100_000) -> dict[str, list[int]]:
    """Step an engine until idle; returns the tokens produced per request id."""
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return tokens
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    raise AssertionError(f"engine not idle after {max_steps} steps")


def decode_only_meta(
    tables: Any, lens: Any, block_size: int, num_layers: int, kv_heads: int
) -> Any:
    """The torch attention path's metadata for a batch of decode rows only (``tables``: [B, W]
    block ids, ``lens``: [B] context lengths): what the paged decode kernels are checked against."""
    import torch

    from cluster.engine.attention import AttentionMetadata, decode_row_index

    width = tables.shape[1] * block_size
    mask = torch.zeros(len(lens), width)
    mask.masked_fill_(torch.arange(width)[None, :] >= lens[:, None], float("-inf"))
    return AttentionMetadata(
        slot_blocks=torch.empty(0, dtype=torch.long),
        slot_offsets=torch.empty(0, dtype=torch.long),
        num_decodes=len(lens),
        decode_rows=decode_row_index(tables, block_size, num_layers, kv_heads),
        decode_mask=mask,
        prefills=[],
    )
