"""int8 KV cache (``cache.kv_dtype: int8``) on the tiny model: the layout, and an engine whose
prefix caching, chunking, preemption and kernels all read back the same quantized KV."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cluster.common.kv_layout import SCHEMES, KVLayout
from cluster.engine.engine import EngineRequest, LLMEngine
from tests.helpers import greedy, make_config, run_until_done
from tests.reference import capture_logits


def _layout(dtype: str) -> KVLayout:
    return KVLayout("m", dtype, 16, 30, 3, 64, SCHEMES[dtype])


def test_the_int8_layout_keeps_scales_inside_each_block() -> None:
    fp32, int8 = _layout("float32"), _layout("int8")
    assert int8.block_shape == (30, 2, 16, 3, 68) and int8.storage_dtype == "uint8"
    assert int8.bytes_per_token == 30 * 2 * 3 * (64 + 4)  # values and one fp32 scale a row
    assert int8.bytes_per_token / fp32.bytes_per_token <= 0.27
    assert int8.bytes_per_block == int8.bytes_per_token * 16
    with pytest.raises(ValueError, match="quantization"):
        KVLayout("m", "int8", 16, 30, 3, 64)  # an int8 layout always names its scheme
    mismatch = fp32.mismatch(int8)
    assert mismatch is not None
    assert "dtype: 'float32' here, 'int8' at the peer" in mismatch
    assert "absmax_row_f32" in mismatch and "quantization='none'" in mismatch  # both layouts


def _engine(model_dir: Path, **overrides: Any) -> LLMEngine:
    base = {
        "model.path": str(model_dir),
        "model.num_threads": 2,
        "cache.kv_dtype": "int8",
        "cache.num_blocks": 128,
        "scheduler.chunk_size": 8,
        "scheduler.max_num_batched_tokens": 64,
    }
    base.update(overrides)
    return LLMEngine(make_config(**base))


PROMPTS = {f"r{i}": [5 + (i * 31 + j * 7) % 400 for j in range(6 + 13 * i)] for i in range(5)}


def _run(eng: LLMEngine, tag: str = "", max_tokens: int = 20) -> dict[str, list[int]]:
    for rid, p in PROMPTS.items():
        eng.add(EngineRequest(f"{tag}{rid}", p, greedy(max_tokens)))
    out = run_until_done(eng)
    eng.check_integrity()
    assert eng.block_manager.num_used_blocks == 0
    return {rid.removeprefix(tag): toks for rid, toks in out.items()}


def test_int8_kv_engine_reads_back_the_same_kv_on_every_path(tiny_model_dir: Path) -> None:
    eng = _engine(tiny_model_dir)
    assert eng.runner.layout.dtype == "int8" and eng.runner.kv_cache.dtype.itemsize == 1
    first = _run(eng, "a-")
    second = _run(eng, "b-")  # the prompts again: prefixes come from the int8 cache
    assert eng.stats()["num_cached_prompt_tokens"] > 0
    assert second == first
    unchunked = _run(_engine(tiny_model_dir, **{"scheduler.chunk_size": None}))
    assert unchunked == first  # a chunk attends to its own KV as the cache will return it
    tight = _engine(
        tiny_model_dir, **{"cache.num_blocks": 12, "cache.enable_prefix_caching": False}
    )
    assert _run(tight) == first
    assert tight.scheduler.num_preemptions > 0  # recomputed after preemption: same tokens
    torch_kernels = _run(_engine(tiny_model_dir, **{"model.kernels": "torch"}))
    assert torch_kernels == first  # the torch decode path de-quantizes the same bytes


@pytest.mark.parametrize("weights", ["dense", "int8"])
def test_int8_kv_stays_close_to_fp32_kv(tiny_model_dir: Path, weights: str) -> None:
    ref = _engine(tiny_model_dir, **{"cache.kv_dtype": "auto", "model.weights": weights})
    eng = _engine(tiny_model_dir, **{"model.weights": weights})
    assert ref.runner.layout.dtype == "float32"
    logits = [capture_logits(e) for e in (ref, eng)]
    _run(ref, max_tokens=1), _run(eng, max_tokens=1)
    for key, row in logits[0].items():  # next-token logits of every prompt
        err = float((logits[1][key] - row).abs().max())
        assert err <= 0.05 * float(row.abs().max()), (key, err)
    # accuracy gate on the real model: tests/integration/test_quant_real.py


def test_kv_dtype_is_validated() -> None:
    with pytest.raises(ValueError, match="cache.kv_dtype: unknown value 'int4'"):
        make_config(**{"cache.kv_dtype": "int4"})
