"""The two pools as Ray Serve deployments (fake model): hand-off over handles, both clean."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from ray import serve

from cluster.common.hashing import hash_block_tokens
from cluster.common.protocol import Accepted, GenerateCall
from cluster.config import allowed_cores
from cluster.decode_worker.deployment import DecodeServer
from cluster.engine.engine import EngineRequest, LLMEngine
from cluster.prefill_worker.deployment import PrefillServer
from cluster.serving.calls import Keepalive
from cluster.serving.cpu_binding import claim_file, start_time
from cluster.serving.options import deployment_options
from tests.helpers import fake_config, greedy, run_until_done
from tests.serve_fixtures import ServeCluster, wait_until

pytestmark = pytest.mark.timeout(300)

CFG = {
    "cache.num_blocks": 256,
    "transfer.transports": ["shm", "zmq"],
    "transfer.lease_s": 2.0,
    "transfer.heartbeat_s": 0.2,
    "decode.local_prefill_threshold": 16,
    "prefill.graceful_shutdown_timeout_s": 5.0,
    "decode.graceful_shutdown_timeout_s": 5.0,
    "prefill.num_cpus": 0.5,
    "decode.num_cpus": 0.5,
}


def deploy_pools(name: str, **overrides: Any) -> tuple[Any, Any]:
    cfg = fake_config(**{**CFG, **overrides})
    opts = deployment_options(cfg)
    plain = cfg.to_dict()
    prefill = PrefillServer.options(**opts["PrefillServer"]).bind(plain)
    decode = DecodeServer.options(**opts["DecodeServer"]).bind(plain, prefill)
    handle = serve.run(decode, name=name, route_prefix=None)
    return cfg, handle


def test_decode_pool_hands_off_to_prefill_pool(serve_cluster: ServeCluster) -> None:
    cfg, handle = deploy_pools("pools")
    try:
        prompts = {
            f"r{i}": [1 + (i * 29 + j * 7) % 500 for j in range(8 + 19 * i)] for i in range(6)
        }
        ref = LLMEngine(cfg)
        for rid, p in prompts.items():
            ref.add(EngineRequest(rid, p, greedy(10)))
        expected = run_until_done(ref)

        async def one(rid: str, p: list[int]) -> list[Any]:
            call = GenerateCall(rid, p, hash_block_tokens(p, 16), greedy(10))
            stream = handle.options(stream=True).generate.remote(call)
            return [x async for x in stream if not isinstance(x, Keepalive)]

        async def main() -> dict[str, list[Any]]:
            outs = await asyncio.gather(*(one(r, p) for r, p in prompts.items()))
            return dict(zip(prompts, outs))

        results = asyncio.run(main())
        for rid, items in results.items():
            assert isinstance(items[0], Accepted)
            assert [t for c in items[1:] for t in c.token_ids] == expected[rid], rid
        stats = handle.stats.remote().result()
        remote = sum(len(p) > 16 for p in prompts.values())
        assert stats["remote_prefills"] == remote and stats["local_prefills"] == 6 - remote
        assert stats["transfer"]["transfers_ok"] == remote
        assert handle.check_integrity.remote().result() == "ok"
        assert wait_until(lambda: handle.stats.remote().result()["kv_used_blocks"] == 0)
    finally:
        serve.delete("pools")


def test_pools_bound_to_cores_of_their_own_hand_off_and_give_them_back(
    serve_cluster: ServeCluster,
) -> None:
    """``cpu_binding: on`` (what ``pdserve serve`` sets in a Ray of its own): each replica holds
    cores no other replica holds, the hand-off works across them, and the claims go with the
    replicas."""
    cores = allowed_cores()
    on = {"prefill.cpu_binding": "on", "decode.cpu_binding": "on"}
    cfg, handle = deploy_pools("bound", **on)
    try:
        prefill = serve.get_deployment_handle("PrefillServer", "bound")
        decode_stats = handle.stats.remote().result()
        prefill_stats = prefill.stats.remote().result()
        if len(cores) >= 2:  # one thread each (fake_config): one core each, not the same one
            assert len(decode_stats["cores"]) == len(prefill_stats["cores"]) == 1
            assert decode_stats["cores"] != prefill_stats["cores"]
            assert set(decode_stats["cores"] + prefill_stats["cores"]) <= set(cores)
        prompt = [1 + (j * 7) % 500 for j in range(40)]  # > local_prefill_threshold: remote
        ref = LLMEngine(cfg)
        ref.add(EngineRequest("b", prompt, greedy(6)))
        expected = run_until_done(ref)["b"]

        async def one() -> list[Any]:
            call = GenerateCall("b", prompt, hash_block_tokens(prompt, 16), greedy(6))
            stream = handle.options(stream=True).generate.remote(call)
            return [x async for x in stream if not isinstance(x, Keepalive)]

        items = asyncio.run(one())
        assert [t for c in items[1:] for t in c.token_ids] == expected
        stats = handle.stats.remote().result()
        assert stats["remote_prefills"] == 1 and stats["transfer"]["transfers_ok"] == 1
        assert handle.check_integrity.remote().result() == "ok"
        assert wait_until(lambda: handle.stats.remote().result()["kv_used_blocks"] == 0)
        pids = {decode_stats["pid"], prefill_stats["pid"]}
    finally:
        serve.delete("bound")

    def released() -> bool:
        path = claim_file()
        claims = json.loads(path.read_text())["claims"] if path.exists() else []
        return not any(c["pid"] in pids and start_time(c["pid"]) == c["start"] for c in claims)

    assert wait_until(released, timeout=30)


def _rank_processes() -> int:
    """Tensor-parallel ranks alive on this host (``python -m cluster.engine.tp_rank_main``)."""
    import subprocess

    out = subprocess.run(["pgrep", "-f", "cluster.engine.tp_rank_main"], capture_output=True)
    return len(out.stdout.split())


def test_tensor_parallel_prefill_pool_hands_off_on_serve(
    serve_cluster: ServeCluster, tiny_model_dir: Any
) -> None:
    """A prefill pool at TP=2 (a replica and its second rank, a process it started) hands off
    to a decode pool at TP=1 through Serve: the tokens of a local TP=1 run, both pools clean,
    and the rank stops with its replica."""
    model = {"model.runner": "torch", "model.path": str(tiny_model_dir), "model.num_threads": 1}
    _, handle = deploy_pools("tp-pools", **model, **{"prefill.tensor_parallel_size": 2})
    try:
        prompts = {
            f"t{i}": [3 + (i * 31 + j * 5) % 400 for j in range(40 + 9 * i)] for i in range(3)
        }
        ref = LLMEngine(fake_config(**{**CFG, **model}))
        for rid, p in prompts.items():
            ref.add(EngineRequest(rid, p, greedy(8)))
        expected = run_until_done(ref)
        assert _rank_processes() >= 1

        async def one(rid: str, p: list[int]) -> list[int]:
            call = GenerateCall(rid, p, hash_block_tokens(p, 16), greedy(8))
            stream = handle.options(stream=True).generate.remote(call)
            items = [x async for x in stream if not isinstance(x, Keepalive)]
            return [t for c in items[1:] for t in c.token_ids]

        for rid, p in prompts.items():
            assert asyncio.run(one(rid, p)) == expected[rid], rid
        stats = handle.stats.remote().result()
        assert stats["remote_prefills"] == len(prompts)
        assert handle.check_integrity.remote().result() == "ok"
        assert wait_until(lambda: handle.stats.remote().result()["kv_used_blocks"] == 0)
    finally:
        serve.delete("tp-pools")
    assert wait_until(lambda: _rank_processes() == 0, timeout=30)


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_decode_rank_killed_or_stopped_mid_stream_ends_it_and_the_replica_is_replaced(
    serve_cluster: ServeCluster, tiny_model_dir: Any, how: str
) -> None:
    """A decode replica at TP=2 loses its second rank mid-stream (killed; or stopped, which the
    step sees within ``model.tensor_parallel_timeout_s``, 3 s here): the stream ends, ABORTED
    as for any decode engine dying mid-stream; the replica fails its health check and Serve
    replaces it (a new rank process, the old one gone); the new replica serves the next
    request with the tokens of a local run; both pools end clean."""
    import os
    import signal

    model = {"model.runner": "torch", "model.path": str(tiny_model_dir), "model.num_threads": 1}
    health = {
        "decode.health_check_period_s": 0.5,
        "decode.health_check_timeout_s": 5.0,
        "model.tensor_parallel_timeout_s": 3.0,
    }
    _, handle = deploy_pools("tp-fault", **model, **health, **{"decode.tensor_parallel_size": 2})
    try:
        assert wait_until(lambda: _rank_processes() == 1)
        old = subprocess_pids()
        prompt = [3 + (j * 7) % 400 for j in range(40)]
        call = GenerateCall("long", prompt, hash_block_tokens(prompt, 16), greedy(400))

        async def interrupted() -> tuple[list[int], BaseException | None]:
            tokens: list[int] = []
            try:
                async for item in handle.options(stream=True).generate.remote(call):
                    if isinstance(item, Keepalive | Accepted):
                        continue
                    tokens.extend(item.token_ids)
                    if len(tokens) >= 5 and old:
                        os.kill(old.pop(), getattr(signal, how))
            except Exception as exc:  # the stream's end: what the caller sees
                return tokens, exc
            return tokens, None

        tokens, error = asyncio.run(interrupted())
        assert error is not None and 5 <= len(tokens) < 400, (len(tokens), error)
        # the client has tokens: ABORTED, as for any decode engine dying mid-stream (the replica's
        # log names the rank and its exit code)
        assert "ABORTED: the decode replica failed" in str(error), error
        assert wait_until(lambda: _rank_processes() == 1 and subprocess_pids(), timeout=60)
        ref = LLMEngine(fake_config(**{**CFG, **model}))
        short = [5 + (j * 3) % 400 for j in range(30)]
        ref.add(EngineRequest("after", short, greedy(8)))
        expected = run_until_done(ref)["after"]

        def served() -> list[int] | None:
            async def one() -> list[int]:
                c = GenerateCall("after", short, hash_block_tokens(short, 16), greedy(8))
                items = [
                    x
                    async for x in handle.options(stream=True).generate.remote(c)
                    if not isinstance(x, Keepalive)
                ]
                return [t for x in items[1:] for t in x.token_ids]

            try:
                return asyncio.run(one())
            except Exception:  # the replica being replaced
                return None

        assert wait_until(lambda: served() == expected, timeout=60)
        assert handle.check_integrity.remote().result() == "ok"
        assert wait_until(lambda: handle.stats.remote().result()["kv_used_blocks"] == 0)
    finally:
        serve.delete("tp-fault")
    assert wait_until(lambda: _rank_processes() == 0, timeout=30)


def subprocess_pids() -> list[int]:
    import subprocess

    out = subprocess.run(["pgrep", "-f", "cluster.engine.tp_rank_main"], capture_output=True)
    return [int(p) for p in out.stdout.split()]
