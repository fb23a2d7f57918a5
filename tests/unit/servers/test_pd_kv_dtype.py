"""int8 KV, and Qwen3's, through the prefill -> decode hand-off (tiny real models, in one
process, real KV transfer): the int8 blocks and their scales move as they are, and pools whose
KV layouts differ are refused before any work with an error naming both layouts. Every test
ends clean."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from cluster.common.errors import PDServeError
from cluster.common.hashing import hash_block_tokens
from cluster.common.protocol import GenerateCall, StreamChunk
from cluster.decode_worker.worker import DecodeWorker
from cluster.engine.engine import EngineRequest, LLMEngine
from cluster.prefill_worker.worker import PrefillWorker
from tests.helpers import greedy, make_config, run_until_done
from tests.tiny_families import FAMILIES
from tests.unit.servers.test_pd_cores import InProcessPrefill

pytestmark = pytest.mark.timeout(300)


def _cfg(model_dir: Path, kv_dtype: str, transport: str = "zmq", **overrides: Any) -> Any:
    base = {
        "model.path": str(model_dir),
        "model.num_threads": 1,
        "cache.kv_dtype": kv_dtype,
        "cache.num_blocks": 128,
        "scheduler.chunk_size": 16,
        "transfer.transports": [transport],
        "transfer.lease_s": 5.0,
        "transfer.heartbeat_s": 0.5,
        "transfer.transfer_timeout_s": 5.0,
        "decode.local_prefill_threshold": 8,
    }
    base.update(overrides)
    return make_config(**base)


def _prompt(n: int, seed: int) -> list[int]:
    return [5 + (seed * 37 + i * 11) % 400 for i in range(n)]


class Pools:
    def __init__(self, prefill_cfg: Any, decode_cfg: Any) -> None:
        self.prefill = PrefillWorker(prefill_cfg).start()
        self.client = InProcessPrefill(self.prefill)
        self.decode = DecodeWorker(decode_cfg, self.client).start()

    def generate(self, rid: str, prompt: list[int], max_tokens: int) -> list[StreamChunk]:
        call = GenerateCall(rid, prompt, hash_block_tokens(prompt, 16), greedy(max_tokens))

        async def collect() -> list[StreamChunk]:
            return [c async for c in self.decode.generate(call)]

        return asyncio.run(collect())

    def wait_idle_clean(self, timeout: float = 10.0) -> None:
        def used() -> tuple[int, int]:
            p, d = self.prefill.engine.stats(), self.decode.engine.stats()
            return p["kv"]["num_used_blocks"], d["kv"]["num_used_blocks"]

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and (
            used() != (0, 0) or self.prefill.sender.num_active_leases
        ):
            time.sleep(0.05)
        self.prefill.engine.check_integrity()
        self.decode.engine.check_integrity()
        assert used() == (0, 0) and self.prefill.sender.num_active_leases == 0

    def close(self) -> None:
        self.decode.close()
        self.prefill.close()


def _tokens(chunks: list[StreamChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def _local_run(cfg: Any, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    """The reference: the same config, each prompt prefilled where it decodes."""
    local = LLMEngine(cfg)
    for rid, p in prompts.items():
        local.add(EngineRequest(rid, p, greedy(max_tokens)))
    return run_until_done(local)


def _assert_remote_like_local(
    pools: Pools, prompts: dict[str, list[int]], expected: dict[str, list[int]], max_tokens: int
) -> None:
    for rid, p in prompts.items():
        chunks = pools.generate(rid, p, max_tokens)
        assert chunks[-1].usage is not None and chunks[-1].usage.prefill_mode == "remote", rid
        assert _tokens(chunks) == expected[rid], rid


@pytest.mark.parametrize("transport", ["zmq", "shm"])
def test_int8_kv_remote_prefill_decodes_like_a_local_one(
    tiny_model_dir: Path, transport: str
) -> None:
    cfg = _cfg(tiny_model_dir, "int8", transport)
    prompts = {f"r{i}": _prompt(30 + 17 * i, i) for i in range(4)}
    expected = _local_run(cfg, prompts, 12)  # the same KV dtype
    pools = Pools(cfg, cfg)
    try:
        _assert_remote_like_local(pools, prompts, expected, 12)
        stats = pools.decode.stats()["transfer"]
        assert stats["transfers_ok"] == len(prompts)
        layout = pools.decode.engine.kv_layout
        assert layout.dtype == "int8"
        # int8 blocks with their scales, as stored: (head_dim + 4) bytes per (token, head).
        assert stats["bytes_received"] == pools.decode.counters["pulled_blocks"] * (
            layout.bytes_per_block
        )
        pools.wait_idle_clean()
    finally:
        pools.close()


@pytest.mark.parametrize("on_failure", ["fail", "recompute"])
def test_pools_with_different_kv_dtypes_are_refused_at_the_hand_off(
    tiny_model_dir: Path, on_failure: str
) -> None:
    prefill_cfg = _cfg(tiny_model_dir, "float32", **{"transfer.on_failure": on_failure})
    decode_cfg = _cfg(tiny_model_dir, "int8", **{"transfer.on_failure": on_failure})
    prompt = _prompt(60, 3)
    local = LLMEngine(decode_cfg)
    local.add(EngineRequest("x", prompt, greedy(10)))
    expected = run_until_done(local)["x"]
    pools = Pools(prefill_cfg, decode_cfg)
    try:
        if on_failure == "fail":
            with pytest.raises(PDServeError) as e:
                pools.generate("x", prompt, 10)
            msg = e.value.message
            assert "KV layout mismatch" in msg
            assert "dtype: 'float32' here, 'int8' at the peer" in msg
            assert "absmax_row_f32" in msg and "quantization='none'" in msg  # both layouts
        else:  # refused, then prefilled where it decodes: the decode pool's own output
            chunks = pools.generate("x", prompt, 10)
            assert _tokens(chunks) == expected
            assert chunks[-1].usage is not None and chunks[-1].usage.prefill_mode == "local"
            assert pools.decode.counters["recomputed_after_failure"] == 1
        assert pools.client.calls == 1
        assert pools.prefill.num_prefills == 0  # refused before computing anything
        assert pools.decode.stats()["transfer"].get("transfers_ok", 0) == 0
        pools.wait_idle_clean()
    finally:
        pools.close()


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "llama"])
def test_every_family_remote_prefill_decodes_like_a_local_one(
    tmp_path_factory: pytest.TempPathFactory, family: str
) -> None:
    """Each architecture through the hand-off (Qwen3's q/k normalized before RoPE with head_dim
    24, Qwen2's biases, Phi-3's fused projections, the mixtures of experts, Gemma 3's layers):
    its KV prefilled by one pool, pulled over zmq and decoded by the other, gives the tokens of
    a local run. (Llama: the tests above.)"""
    from cluster.engine.models.tiny import build_tiny_llama

    model_dir = build_tiny_llama(
        tmp_path_factory.mktemp(f"{family}-pd"), family=family, **FAMILIES[family]
    )
    cfg = _cfg(model_dir, "float32")
    prompts = {f"q{i}": _prompt(25 + 19 * i, i) for i in range(3)}
    expected = _local_run(cfg, prompts, 12)
    pools = Pools(cfg, cfg)
    try:
        _assert_remote_like_local(pools, prompts, expected, 12)
        head_dim = FAMILIES[family].get("head_dim", 16)
        assert pools.decode.engine.kv_layout.head_dim == head_dim
        assert pools.decode.stats()["transfer"]["transfers_ok"] == len(prompts)
        pools.wait_idle_clean()
    finally:
        pools.close()
