"""Tensor parallelism in one engine (``model.tensor_parallel_size``): the split
(``models.tensor_parallel``), the ranks' shared-memory collectives (``tp_group``) and the
engine at 2 (and 4) ranks against 1, token for token, with every feature that runs on the
driver alone (scheduling, sampling, drafts, samples) and the KV cache shared by the ranks.
Every run ends with the block-integrity check.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from cluster.common.sampling_params import SamplingParams
from cluster.engine.engine import EngineRequest, LLMEngine
from cluster.engine.kernels.quant import INT8_G32, INT8_ROW, Q4_0, Q4_1, Q8_0
from cluster.engine.models.llama import LlamaArch
from cluster.engine.models.packed import PackedWeight
from cluster.engine.models.tensor_parallel import plan_shards, take_cols, take_rows
from cluster.engine.torch_runner import TorchModelRunner
from cluster.engine.tp_group import RankFailure, ShmGroup
from tests.helpers import greedy, tiny_config
from tests.tiny_families import FAMILIES
from tests.unit.engine.test_quant_kernels import packed

pytestmark = pytest.mark.timeout(300)


def _arch(**kw: Any) -> LlamaArch:
    base: dict[str, Any] = dict(
        architecture="llama", num_layers=2, hidden_size=576, num_heads=9, num_kv_heads=3,
        head_dim=64, intermediate_size=1536, vocab_size=49152, rms_norm_eps=1e-5,
        tie_word_embeddings=True, qkv_bias=False, max_position_embeddings=2048,
    )  # fmt: skip
    return LlamaArch(**{**base, **kw})


# -- the split --------------------------------------------------------------------------------


def test_the_default_models_heads_split_by_kv_groups_two_and_one() -> None:
    a, b = plan_shards(_arch(), 2, packed=True)
    assert (a.kv_heads, b.kv_heads) == ((0, 2), (2, 3))
    assert (a.q_heads, b.q_heads) == ((0, 6), (6, 9))  # each KV head's 3 query heads with it
    assert (a.inter, b.inter) == ((0, 768), (768, 1536))
    assert (a.vocab, b.vocab) == ((0, 24576), (24576, 49152))


def test_fewer_kv_heads_than_ranks_replicates_them_and_splits_their_query_heads() -> None:
    shards = plan_shards(_arch(num_heads=8, num_kv_heads=2), 4, packed=False)
    assert [s.kv_heads for s in shards] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [s.q_heads for s in shards] == [(0, 2), (2, 4), (4, 6), (6, 8)]


@pytest.mark.parametrize(
    ("kw", "world", "packed", "words"),
    [
        ({}, 4, False, ["3 KV heads", "4 ranks"]),  # neither divides nor is a multiple
        ({"num_heads": 4, "num_kv_heads": 4, "head_dim": 40}, 2, True, ["quantization", "40"]),
        ({"num_experts": 4, "num_experts_per_tok": 2}, 2, False, ["experts"]),
        ({"intermediate_size": 32}, 2, True, ["32 intermediate"]),
    ],
)
def test_an_impossible_split_is_refused_naming_the_numbers(
    kw: dict[str, Any], world: int, packed: bool, words: list[str]
) -> None:
    with pytest.raises(ValueError) as err:
        plan_shards(_arch(**kw), world, packed)
    assert "model.tensor_parallel_size" in str(err.value)
    assert all(w in str(err.value) for w in words), str(err.value)


@pytest.mark.parametrize("qtype", [Q4_0, Q4_1, Q8_0, INT8_ROW, INT8_G32])
def test_slices_of_packed_weights_are_the_same_values(qtype: int) -> None:
    w = packed(qtype, 24, 128, seed=qtype)
    other = packed(Q8_0, 8, 128)
    fused = PackedWeight.cat([w, other])  # two segments, as q/k/v of mixed formats are
    full = fused.dequantize()
    rows = take_rows(fused, [(2, 5), (20, 30)])
    assert isinstance(rows, PackedWeight)
    assert torch.equal(rows.dequantize(), torch.cat([full[2:5], full[20:30]]))
    cols = take_cols(fused, 32, 96)
    assert isinstance(cols, PackedWeight) and cols.cols == 64
    assert torch.equal(cols.dequantize(), full[:, 32:96])
    if qtype != INT8_ROW:
        with pytest.raises(ValueError, match="quantization block"):
            take_cols(w, 16, 64)


# -- the collectives --------------------------------------------------------------------------


def _in_threads(world: int, body: Callable[[ShmGroup], Any], **kw: Any) -> list[Any]:
    """``body`` on every rank of one group, a thread each (the waits yield the GIL)."""
    root = ShmGroup.create(world, **kw)
    groups = [root] + [
        ShmGroup.attach(root.path, r, world, **kw) for r in range(1, world)
    ]  # fmt: skip
    results: list[Any] = [None] * world

    def run(r: int) -> None:
        try:
            results[r] = body(groups[r])
        except BaseException as exc:  # the test reads it
            results[r] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    root.close()
    return results


def test_all_reduce_gather_and_broadcast_across_slots_and_parities() -> None:
    def body(g: ShmGroup) -> list[Any]:
        seen = []
        for i in range(5):
            msg = g.broadcast({"i": i, "x": list(range(3000 * i))} if g.rank == 0 else None)
            seen.append(msg["i"] if isinstance(msg, dict) else None)
            t = torch.arange(5000, dtype=torch.float32) * (g.rank + 1) + i  # > one slot
            g.all_reduce(t)
            seen.append(float(t[7]))
            parts = g.gather(torch.full((50, 3 + g.rank), float(g.rank * 10 + i)))
            seen.append(None if parts is None else [(p.shape, float(p.mean())) for p in parts])
        return seen

    r0, r1, r2 = _in_threads(3, body, timeout_s=30.0, slot_bytes=4096)
    for i in range(5):
        assert r0[3 * i] == r1[3 * i] == r2[3 * i] == i
        assert r0[3 * i + 1] == r1[3 * i + 1] == r2[3 * i + 1] == 7 * 6 + 3 * i
        assert r0[3 * i + 2] == [((50, 3 + r), float(r * 10 + i)) for r in range(3)]
        assert r1[3 * i + 2] is None and r2[3 * i + 2] is None


def test_a_rank_that_never_arrives_fails_the_collective_in_its_timeout() -> None:
    root = ShmGroup.create(2, timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 did not reach collective 1 within 0.5 s"):
        root.all_reduce(torch.ones(4))
    assert time.monotonic() - t0 < 5
    root.peer_alive = lambda: "tensor-parallel rank 1 exited (-9)"
    with pytest.raises(RankFailure, match=r"rank 1 exited \(-9\)"):
        root.all_reduce(torch.ones(4))
    root.close()


# -- the engine at 2 ranks against 1 ----------------------------------------------------------


def _prompts() -> dict[str, list[int]]:
    shared = list(range(3, 40))  # a shared prefix: prefix-cache hits after the first
    return {
        "a": [*shared, 50, 51, 52],
        "b": [*shared, 60, 61],
        "c": list(range(100, 171)),  # several 16-token chunks
        "d": [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8],  # repeats: n-gram drafts find something
    }


def _run(
    model_dir: Path, tp: int, params: SamplingParams, n: int = 1, **overrides: Any
) -> dict[str, Any]:
    config = tiny_config(
        model_dir, **{"cache.num_blocks": 128, "model.tensor_parallel_size": tp, **overrides}
    )
    engine = LLMEngine(config)
    try:
        for i, (rid, prompt) in enumerate(_prompts().items()):
            engine.add(EngineRequest(rid, prompt, params, seed=100 + i, n=n))
            if i == 0:  # the others arrive while it runs: mixed prefill and decode steps
                engine.step()
        out = _run_all(engine)
        engine.check_integrity()
        return out
    finally:
        runner = engine.runner
        assert isinstance(runner, TorchModelRunner)
        runner.close()


def _run_all(engine: LLMEngine) -> dict[str, Any]:
    """Every request's tokens, and its logprobs and prompt logprobs where asked (rounded: the
    ranks sum in another order than one rank)."""
    out: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            got = out.setdefault(o.request_id, {"tokens": []})
            got["tokens"] += o.new_token_ids
            if o.new_logprobs:
                got.setdefault("logprobs", []).extend(round(x, 3) for x in o.new_logprobs)
            if o.prompt_logprobs:
                got["prompt"] = [None if p is None else round(p[0], 3) for p in o.prompt_logprobs]
    return out


SCENARIOS: dict[str, tuple[SamplingParams, dict[str, Any]]] = {
    "greedy": (greedy(12), {}),
    "int8_kv_seeded": (SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12), {
        "cache.kv_dtype": "int8"
    }),
    "ngram_drafts_and_samples": (SamplingParams(temperature=0.7, max_tokens=14), {
        "n": 2, "decode.speculative.method": "ngram",
        "decode.speculative.num_speculative_tokens": 3,
    }),
    "int8_weights": (greedy(12), {"model.weights": "int8"}),
    "torch_kernels": (greedy(12), {"model.kernels": "torch"}),
    "logprobs_and_prompt_logprobs": (greedy(6, logprobs=2, prompt_logprobs=2), {}),
}  # fmt: skip


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_two_ranks_give_the_tokens_of_one(tiny_model_dir: Path, scenario: str) -> None:
    params, overrides = SCENARIOS[scenario]
    one = _run(tiny_model_dir, 1, params, **overrides)
    two = _run(tiny_model_dir, 2, params, **overrides)
    assert two == one
    assert sum(len(t["tokens"]) for t in one.values()) >= 4 * params.max_tokens
    if params.prompt_logprobs:
        assert all(len(t["prompt"]) > 1 and len(t["logprobs"]) == 6 for t in one.values())


def test_four_ranks_replicate_the_kv_heads_and_give_the_same_tokens(tiny_model_dir: Path) -> None:
    # the tiny Llama: 4 query heads, 2 KV heads; 4 ranks hold one query head each
    one = _run(tiny_model_dir, 1, greedy(6))
    assert _run(tiny_model_dir, 4, greedy(6)) == one


@pytest.fixture(scope="module", params=["qwen3", "gemma3", "phi3"])
def family_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from cluster.engine.models.tiny import build_tiny_llama

    family = request.param
    return build_tiny_llama(tmp_path_factory.mktemp(family), family=family, **FAMILIES[family])


def test_other_families_split_too(family_dir: Path) -> None:
    assert _run(family_dir, 2, greedy(10)) == _run(family_dir, 1, greedy(10))


# -- faults -----------------------------------------------------------------------------------


@pytest.fixture
def two_ranks(tiny_model_dir: Path) -> Iterator[LLMEngine]:
    config = tiny_config(
        tiny_model_dir,
        **{
            "cache.num_blocks": 64,
            "model.tensor_parallel_size": 2,
            "model.tensor_parallel_timeout_s": 2.0,
        },
    )
    engine = LLMEngine(config)
    yield engine
    runner = engine.runner
    assert isinstance(runner, TorchModelRunner)
    runner.close()
    assert runner._ranks is None


def _rank_pid(engine: LLMEngine) -> int:
    runner = engine.runner
    assert isinstance(runner, TorchModelRunner) and runner._ranks is not None
    return runner._ranks.procs[0].pid


def test_a_dead_rank_fails_the_next_step_at_once_naming_it(two_ranks: LLMEngine) -> None:
    two_ranks.add(EngineRequest("r", list(range(5, 30)), greedy(20)))
    two_ranks.step()
    os.kill(_rank_pid(two_ranks), signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 exited \(-9\)"):
        for _ in range(20):
            two_ranks.step()
    assert time.monotonic() - t0 < 1.9  # seen dead, not waited out


def test_a_stopped_rank_fails_the_step_within_the_timeout(two_ranks: LLMEngine) -> None:
    two_ranks.add(EngineRequest("r", list(range(5, 30)), greedy(20)))
    two_ranks.step()
    pid = _rank_pid(two_ranks)
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(RankFailure, match=r"rank 1 did not reach collective \d+ within 2 s"):
            two_ranks.step()
        assert 1.9 < time.monotonic() - t0 < 30
    finally:
        os.kill(pid, signal.SIGKILL)
        os.kill(pid, signal.SIGCONT)


def test_a_rank_that_fails_to_start_reports_why(tiny_model_dir: Path) -> None:
    from cluster.engine.tp_ranks import spawn_ranks

    config = tiny_config(tiny_model_dir, **{"model.tensor_parallel_size": 2})
    ranks = spawn_ranks(config, tiny_model_dir, "/nonexistent/pdserve-tp-group", 2)
    try:
        with pytest.raises(RuntimeError, match="rank 1 failed to start: FileNotFoundError"):
            ranks.wait_ready(120)
    finally:
        ranks.close()


def test_a_rank_dying_while_idle_is_seen_by_the_liveness_check(two_ranks: LLMEngine) -> None:
    assert two_ranks.runner_problem() is None
    pid = _rank_pid(two_ranks)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while two_ranks.runner_problem() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert two_ranks.runner_problem() == "tensor-parallel rank 1 exited (-9)"


def test_closing_an_engine_whose_rank_hangs_does_not_wait_out_the_timeout(
    tiny_model_dir: Path,
) -> None:
    config = tiny_config(
        tiny_model_dir,
        **{"cache.num_blocks": 32, "model.tensor_parallel_size": 2},  # the 60 s default timeout
    )
    engine = LLMEngine(config)
    pid = _rank_pid(engine)
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        engine.close()
        assert time.monotonic() - t0 < 15
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            os.kill(pid, signal.SIGCONT)
