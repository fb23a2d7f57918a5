"""P4 places its two sides as ``pdserve serve`` places one replica of each pool: the prefill side
(the sender children, the raw peer) and the decode side (the benchmark's process) on cores of
their own, and the benchmark's process gets all its cores back afterwards."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from benchmarks import kv_transfer, run_benchmark
from benchmarks.kv_sender_peer import SenderProcess
from cluster.config import allowed_cores
from cluster.serving.cpu_binding import split_for_pools, thread_ids
from tests.helpers import make_config

pytestmark = pytest.mark.timeout(120)


def test_the_two_sides_run_on_cores_of_their_own_and_the_cores_come_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = allowed_cores()
    binds: list[tuple[int, ...]] = []
    real_bind = kv_transfer.bind_process

    def spy_bind(cores: Any) -> None:
        binds.append(tuple(cores))
        real_bind(cores)

    specs: list[dict[str, Any]] = []
    real_init = SenderProcess.__init__

    def spy_init(self: SenderProcess, spec: dict[str, Any], **kw: Any) -> None:
        specs.append(spec)
        real_init(self, spec, **kw)

    monkeypatch.setattr(kv_transfer, "bind_process", spy_bind)
    monkeypatch.setattr(SenderProcess, "__init__", spy_init)
    assert run_benchmark("kv-transfer", "smoke", make_config(), results_dir=tmp_path) == 0

    cores = json.loads((tmp_path / "kv-transfer.json").read_text())["details"]["cores"]
    split = split_for_pools(before)
    if split is None:  # one core: nothing to split, nothing bound
        assert cores == {"prefill_side": [], "decode_side": []} and binds == []
    else:
        prefill, decode = split
        assert (tuple(cores["prefill_side"]), tuple(cores["decode_side"])) == split
        assert set(prefill).isdisjoint(decode) and set(prefill) | set(decode) == set(before)
        # every sender child: fp32, int8, and the hmac and curve arms'
        assert [s["cpus"] for s in specs] == [list(prefill)] * 4
        assert binds == [decode, before]  # bound for the arms, then every core back
    masks = []
    for tid in thread_ids():
        try:
            masks.append(os.sched_getaffinity(tid))
        except ProcessLookupError:  # a thread that just ended
            continue
    assert masks and all(m == set(before) for m in masks)
