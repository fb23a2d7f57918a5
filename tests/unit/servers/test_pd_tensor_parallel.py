"""The prefill -> decode hand-off between pools of unequal tensor parallelism (tiny Llama, in one
process, real KV transfer over zmq and shm): every rank's heads live in one shared cache, so a
TP=2 prefill replica ships whole blocks a TP=1 decode replica reads, and the reverse, with int8
KV and with prefix reuse (only the blocks missing on the decode side move). Streams decode like
a local TP=1 run; every test ends clean on both pools and the ranks stop with their replicas.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.engine.torch_runner import TorchModelRunner
from tests.unit.servers.test_pd_kv_dtype import (
    Pools,
    _assert_remote_like_local,
    _cfg,
    _local_run,
    _prompt,
)

pytestmark = pytest.mark.timeout(300)


def _ranks(pools: Pools) -> tuple[int, int]:
    out = []
    for worker in (pools.prefill, pools.decode):
        runner = worker.engine._engine.runner
        assert isinstance(runner, TorchModelRunner)
        out.append(1 + (len(runner._ranks.procs) if runner._ranks is not None else 0))
    return out[0], out[1]


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "kv_dtype", "transport"),
    [(2, 1, "auto", "zmq"), (1, 2, "int8", "zmq"), (2, 1, "int8", "shm"), (2, 2, "auto", "shm")],
)
def test_unequal_tensor_parallel_pools_hand_off_like_a_local_run(
    tiny_model_dir: Path, prefill_tp: int, decode_tp: int, kv_dtype: str, transport: str
) -> None:
    base = _cfg(tiny_model_dir, kv_dtype, transport)
    prompts = {f"r{i}": _prompt(30 + 17 * i, i) for i in range(3)}
    shared = _prompt(64, 7)  # 4 full blocks, then a request that extends them
    prompts["warm"], prompts["ext"] = shared, shared + _prompt(40, 9)
    expected = _local_run(base, prompts, 10)
    pools = Pools(
        base.replace({"prefill.tensor_parallel_size": prefill_tp}),
        base.replace({"decode.tensor_parallel_size": decode_tp}),
    )
    try:
        assert _ranks(pools) == (prefill_tp, decode_tp)
        for rid in ("r0", "r1", "r2", "warm"):
            _assert_remote_like_local(pools, {rid: prompts[rid]}, expected, 10)
        before = pools.decode.counters["pulled_blocks"]
        _assert_remote_like_local(pools, {"ext": prompts["ext"]}, expected, 10)
        assert pools.decode.counters["pulled_blocks"] - before == 3  # 7 blocks, 4 cached
        pools.wait_idle_clean()
    finally:
        pools.close()
