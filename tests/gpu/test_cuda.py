"""The GPU exactness tests (``pytest -m gpu``; ``pdserve bench gpu`` runs them first): the engine
on CUDA against transformers on CUDA, chunked prefill and preemption, the cuda_ipc transport
between two processes on one device, and a prefill and a decode worker process sharing the GPU
token-identical to the offline LLM. Skipped without a CUDA device (tests/conftest.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from cluster.common.hashing import hash_block_tokens
from cluster.common.protocol import GenerateCall
from cluster.engine.engine import EngineRequest, LLMEngine
from tests.helpers import greedy, make_config, run_until_done
from tests.reference import capture_logits, check_run_against_references, hf_greedy, load_hf

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

TEXTS = [
    "The quick brown fox",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a kingdom by the sea, there lived a princess who",
    "In 1969, the first humans landed on the Moon. The mission was called",
]


def _prompts(model_dir: Path) -> dict[str, list[int]]:
    from cluster.common.tokenizer import Tokenizer

    tok = Tokenizer(model_dir)
    return {f"p{i}": tok.encode(t * (1 + 6 * (i % 2))) for i, t in enumerate(TEXTS)}


def cuda_references(model_dir: Path) -> tuple[dict[str, list[int]], dict[str, Any]]:
    """The prompts and transformers' 32 greedy tokens of each on CUDA (EOS suppressed), the
    reference model freed before the engine loads."""
    from cluster.common.tokenizer import Tokenizer

    prompts = _prompts(model_dir)
    hf = load_hf(model_dir).to("cuda")
    suppress = Tokenizer(model_dir).eos_token_ids
    refs = {rid: hf_greedy(hf, p, 32, suppress) for rid, p in prompts.items()}
    del hf
    torch.cuda.empty_cache()
    return prompts, refs


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"scheduler.chunk_size": 16, "scheduler.max_num_batched_tokens": 64},
        {"cache.num_blocks": 24, "scheduler.chunk_size": 32},  # preemption under pressure
    ],
    ids=["batched", "chunked", "preempted"],
)
def test_engine_on_cuda_matches_transformers(real_model_dir: Path, overrides: dict) -> None:
    prompts, refs = cuda_references(real_model_dir)
    cfg = make_config(
        **{
            "model.path": str(real_model_dir),
            "model.device": "cuda",
            "model.dtype": "float32",  # as the reference: bf16 rounds differently
            "cache.num_blocks": 256,
            **overrides,
        }
    )
    engine = LLMEngine(cfg)
    captured = capture_logits(engine)
    for rid, p in prompts.items():
        engine.add(EngineRequest(rid, p, greedy(32)))
    tokens = run_until_done(engine)
    check_run_against_references(engine, prompts, refs, tokens, captured)
    engine.check_integrity()
    assert engine.block_manager.num_used_blocks == 0


def test_cuda_ipc_pull_between_two_processes_is_bit_identical() -> None:
    from benchmarks.kv_sender_peer import SenderProcess, pattern_block
    from cluster.kv_transfer import KVPool, KVReceiver
    from tests.unit.kv_transfer.helpers import BIG, transfer_config

    layout = BIG
    sender = SenderProcess(
        {
            "layout": layout.to_dict(),
            "num_blocks": 64,
            "device": "cuda",
            "seed": 5,
            "transfer": {"transports": ["cuda_ipc"], "lease_s": 5.0, "heartbeat_s": 1.0},
        }
    )
    pool = KVPool.allocate(layout, 64, device="cuda")
    receiver = KVReceiver(transfer_config(transports=("cuda_ipc",), transfer_timeout_s=10.0), pool)
    receiver.start()
    try:
        src, dst = [3, 4, 5, 9, 20, 40], [50, 51, 2, 3, 7, 8]
        params = sender.register("ipc", src, num_tokens=len(src) * 16)
        result = receiver.pull(params, dst)
        assert result.transport == "cuda_ipc" and result.num_blocks == len(src)
        for s, d in zip(src, dst):
            assert torch.equal(pool.tensor[d].cpu(), pattern_block(layout, 5, s)[0]), (s, d)
        assert sender.wait_until(lambda st: st["released"] == [["ipc", "acked"]])["released"]
    finally:
        receiver.close()
        sender.close()


def test_prefill_and_decode_processes_on_one_gpu_match_offline(
    real_model_dir: Path, tmp_path: Path
) -> None:
    """A PD run between two processes on the same device: the hand-off is cuda_ipc."""
    from cluster import LLM
    from tests.harness.launcher import start_worker, stop_workers
    from tests.harness.rpc import RpcClient

    cfg = make_config(
        **{
            "model.path": str(real_model_dir),
            "model.device": "cuda",
            "cache.num_blocks": 512,
            "decode.local_prefill_threshold": 16,
            "transfer.transports": ["cuda_ipc"],
            "transfer.stream_min_tokens": 64,  # the long prompts stream their KV
        }
    )
    llm = LLM(config=cfg)
    prompts = {rid: p * 12 for rid, p in _prompts(real_model_dir).items()}
    prompts["short"] = _prompts(real_model_dir)["p0"]
    params = greedy(24)
    ref = {rid: llm.generate([p], params)[0].token_ids for rid, p in prompts.items()}
    del llm
    torch.cuda.empty_cache()
    prefill = start_worker("prefill", cfg, tmp_path)
    decode = start_worker("decode", cfg, tmp_path, prefill=[prefill.endpoint])
    try:

        async def main() -> tuple[dict, dict, str, str]:
            client = RpcClient(decode.endpoint)
            pclient = RpcClient(prefill.endpoint)
            out = {}
            for rid, p in prompts.items():  # one at a time: the batch is the reference's
                call = GenerateCall(rid, p, hash_block_tokens(p, 16), params)
                out[rid] = [t async for c in client.stream("generate", call) for t in c.token_ids]
            stats = await client.call("stats")
            integ = await client.call("integrity"), await pclient.call("integrity")
            client.close()
            pclient.close()
            return out, stats, *integ

        got, stats, d_ok, p_ok = asyncio.run(main())
    finally:
        stop_workers([decode, prefill])
    assert got == ref
    assert stats["remote_prefills"] == len(prompts) - 1
    assert stats["transfer"]["transfers_ok"] == len(prompts) - 1
    assert stats["streamed_parts"] >= 1
    assert d_ok == "ok" and p_ok == "ok"
