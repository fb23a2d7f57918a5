"""Acceptance: speculative decoding through the cluster on Ray Serve, the real default model.

1 prefill + 1 decode replica, ``decode.speculative.method: ngram``. Greedy outputs over gRPC,
for concurrent requests remote- and locally-prefilled (copy-heavy ones among them), are
token-identical to the offline engine without speculation, computed first, in this process;
the decode pool drafted and was right often; every block is free afterwards.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.spec_workloads import copy_heavy
from cluster.common.sampling_params import SamplingParams
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from tests.helpers import make_config
from tests.serve.cluster_helpers import App
from tests.serve_fixtures import ServeCluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

NUM_NEW = 32
THRESHOLD = 40  # prompts with more uncached tokens are prefilled by the prefill pool
SHORT = ["The capital of France is", "def fibonacci(n):\n    ", "1, 1, 2, 3, 5, 8, 13,"]


@pytest.fixture(scope="module")
def workload(real_model_dir: Path) -> dict[str, Any]:
    from cluster.engine.llm import LLM

    llm = LLM(config=make_config(**{"model.num_threads": 2}))
    prompts = {f"s{i}": llm.tokenizer.encode(t) for i, t in enumerate(SHORT)}
    for i, conv in enumerate(copy_heavy()[::3]):
        prompts[f"c{i}"] = llm.tokenizer.encode_chat(conv)
    assert len(prompts) >= 8
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, min_tokens=NUM_NEW, ignore_eos=True)
    outs = llm.generate(list(prompts.values()), params)
    refs = {rid: o.token_ids for rid, o in zip(prompts, outs, strict=True)}
    del llm
    return {"prompts": prompts, "refs": refs}


@pytest.fixture(scope="module")
def app(serve_cluster: ServeCluster, workload: dict[str, Any]) -> Iterator[App]:
    cfg = make_config(
        **{
            "prefill.num_threads": 1,
            "decode.num_threads": 1,
            "prefill.num_cpus": 0.5,
            "decode.num_cpus": 0.5,
            "decode.local_prefill_threshold": THRESHOLD,
            "decode.speculative.method": "ngram",
            "transfer.transports": ["shm", "zmq"],
            "cache.memory_bytes": 256 << 20,
        }
    )
    deployed = App(serve_cluster, cfg, "pdserve-spec-real")
    try:
        yield deployed
    finally:
        deployed.close()


def test_speculation_through_the_cluster_matches_offline(
    app: App, workload: dict[str, Any]
) -> None:
    prompts, refs = workload["prompts"], workload["refs"]
    results: dict[str, list[pb.GenerateResponse]] = {}

    def run(rid: str) -> None:
        req = pb.GenerateRequest(
            request_id=rid,
            token_ids=pb.TokenIds(ids=prompts[rid]),
            sampling=pb.SamplingParameters(
                max_tokens=NUM_NEW, min_tokens=NUM_NEW, temperature=0.0, ignore_eos=True
            ),
        )
        results[rid] = app.generate(req, timeout=600)

    threads = [threading.Thread(target=run, args=(rid,)) for rid in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(700)
    assert set(results) == set(prompts)
    modes = set()
    accepted = 0
    for rid, msgs in results.items():
        assert [t for m in msgs for t in m.token_ids] == refs[rid], rid
        usage = msgs[-1].usage
        modes.add(usage.prefill_mode)
        accepted += usage.accepted_draft_tokens
        assert usage.draft_tokens >= usage.accepted_draft_tokens
    assert modes == {"local", "remote"}
    assert accepted > NUM_NEW  # the copy-heavy prompts were quoted and the drafts accepted
    app.assert_clean()
    (decode,) = app.stats("decode").values()  # idle now: its engine stats are up to date
    assert decode["remote_prefills"] > 0 and decode["local_prefills"] > 0
    assert decode["engine"]["spec"]["num_accepted_tokens"] >= accepted
