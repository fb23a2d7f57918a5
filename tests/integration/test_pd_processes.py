"""Acceptance: a prefill core and a decode core in separate processes, on the real model, give
greedy output identical to the offline LLM; long prompts move KV, short ones prefill locally."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from cluster.common.hashing import hash_block_tokens
from cluster.common.protocol import GenerateCall
from tests.harness.launcher import start_worker, stop_workers
from tests.harness.rpc import RpcClient
from tests.helpers import greedy, make_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

TEXTS = [
    "Explain in detail how a paged KV cache works in an LLM serving system, and why block "
    "tables help memory fragmentation when many requests of different lengths run together. "
    "Then compare it with a contiguous cache, and describe prefix caching with block hashes.",
    "Write a short story about a lighthouse keeper who discovers that the light can talk. "
    "The story should have a beginning, a middle and an end, and it should be gentle.",
    "List the planets of the solar system in order from the Sun, with one fact about each "
    "of them, and finish with a sentence about dwarf planets such as Pluto and Ceres.",
    "Hi!",
    "2+2=",
    "The capital of France is",
]


def test_prefill_and_decode_processes_match_offline(real_model_dir: Path, tmp_path: Path) -> None:
    from cluster import LLM

    cfg = make_config(
        **{
            "model.path": str(real_model_dir),
            "model.num_threads": 1,
            "cache.num_blocks": 192,
            "decode.local_prefill_threshold": 16,
            "transfer.transports": ["zmq"],
        }
    )
    llm = LLM(config=cfg.replace({"model.num_threads": 2}))
    tok = llm.tokenizer
    prompts = {
        f"r{i}": tok.encode_chat([{"role": "user", "content": t}]) for i, t in enumerate(TEXTS)
    }
    prompts["raw0"], prompts["raw1"] = tok.encode("Hello"), tok.encode("The sky is")
    params = greedy(24)
    ref = {
        rid: o.token_ids for rid, o in zip(prompts, llm.generate(list(prompts.values()), params))
    }
    del llm

    prefill = start_worker("prefill", cfg, tmp_path)
    decode = start_worker("decode", cfg, tmp_path, prefill=[prefill.endpoint])
    try:

        async def main() -> tuple[dict, dict, dict, str, str]:
            client = RpcClient(decode.endpoint)
            pclient = RpcClient(prefill.endpoint)

            async def one(rid: str, p: list[int]) -> list:
                call = GenerateCall(rid, p, hash_block_tokens(p, 16), params)
                return [c async for c in client.stream("generate", call)]

            results = await asyncio.gather(*(one(r, p) for r, p in prompts.items()))
            stats = await client.call("stats")
            pstats = await pclient.call("stats")
            integ = await client.call("integrity"), await pclient.call("integrity")
            client.close()
            pclient.close()
            return dict(zip(prompts, results)), stats, pstats, *integ

        results, dstats, pstats, d_ok, p_ok = asyncio.run(main())
    finally:
        stop_workers([decode, prefill])
    for rid, chunks in results.items():
        assert [t for c in chunks for t in c.token_ids] == ref[rid], rid
        mode = chunks[-1].usage.prefill_mode
        long_prompt = len(prompts[rid]) > 16
        why = {k: v for k, v in dstats.items() if isinstance(v, int | float)}  # e.g. a recompute
        assert mode == ("remote" if long_prompt else "local"), (rid, len(prompts[rid]), mode, why)
    num_remote = sum(len(p) > 16 for p in prompts.values())
    assert dstats["remote_prefills"] == num_remote and dstats["local_prefills"] == 2
    assert dstats["transfer"]["transfers_ok"] == num_remote
    assert pstats["num_prefills"] == num_remote
    assert d_ok == "ok" and p_ok == "ok"
    assert dstats["kv_used_blocks"] == 0 and pstats["kv_used_blocks"] == 0
    assert pstats["num_active_leases"] == 0
