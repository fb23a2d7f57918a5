"""The engine and data-plane benchmarks run end to end in ``--smoke`` mode (seconds: the tiny
random model, a small KV layout).

Only the harness is checked: the RESULT line is the last stdout line and carries every key as
a finite number, and the JSON lands in the results dir. The figures themselves mean nothing on
the tiny model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks import BENCHMARKS, run_benchmark
from tests.helpers import make_config

EXPECTED_KEYS = {
    "engine": {"throughput_ratio", "e2el_ratio"},
    "decode-scaling": {
        "scaling_b32",
        "scaling_b32_ctx1024",
        "b1_vs_hf",
        "overhead_share",
        "kv_waste",
    },
    "prefix": {"ttft_speedup", "miss_vs_hf", "no_share_regression"},
    "chunked-prefill": {"p99_itl_ratio", "long_ttft_cost"},
    "spec": {
        "speedup_b1",
        "speedup_b8",
        "no_copy_ratio",
        "acceptance",
        "greedy_identical",
        "speedup_b1_gguf",
        "speedup_b8_gguf",
        "no_copy_ratio_gguf",
        "greedy_identical_gguf",
        "b1_vs_llamacpp_copy",
    },
    "structured": {
        "mask_overhead_b8",
        "forced_token_speedup",
        "greedy_identical",
        "mask_overhead_b8_gguf",
        "forced_token_speedup_gguf",
        "greedy_identical_gguf",
    },
    "quant": {
        "b1_vs_llamacpp",
        "b8_vs_llamacpp",
        "b32_vs_llamacpp",
        "prefill_vs_llamacpp_512",
        *(f"b{b}_{mode}_vs_llamacpp" for b in (1, 8, 32) for mode in ("exact", "fast")),
        "fast_vs_exact_b32",
        "b1_vs_fp32",
        "b32_vs_fp32",
        "kv_bytes_ratio",
        "kv_capacity_ratio",
    },
    # --smoke leaves out transfer_share_of_prefill_*: they time a prefill on the real model.
    "kv-transfer": {
        "shm_vs_memcpy_512",
        "zmq_ipc_vs_raw_512",
        "zmq_tcp_vs_raw_512",
        "zmq_ipc_vs_raw_32",
        "zmq_ipc_vs_raw_512_frag",
        "shm_vs_memcpy_512_frag",
        "int8_transfer_ms_ratio_512",
        "hmac_zmq_tcp_vs_none_512",
        "curve_zmq_tcp_vs_none_512",
    },
    "kv-stream": {"stream_tax_ratio", "stream_compute_ratio"},
    "models": {
        *(
            f"{arch}_b32_vs_hf"
            for arch in (
                "llama",
                "qwen2",
                "qwen3",
                "phi3",
                "mistral",
                "gemma3",
                "mixtral",
                "qwen3_moe",
            )
        ),
        "moe_grouped_vs_loop_b32",
    },
    "parallel": {
        "tp2_vs_tp1_b8",
        "collective_ms_per_step_b8",
        "reshard_pull_ratio_2048",
        "pp2_vs_pp1_b16",
    },
}


# Keys --smoke prints as nan: llama.cpp runs the real GGUF file only.
NAN_IN_SMOKE = {
    "quant": {k for k in EXPECTED_KEYS["quant"] if "llamacpp" in k},
    "spec": {"b1_vs_llamacpp_copy"},
}


def parse_result_line(line: str, name: str) -> dict[str, float]:
    head, bench_name, *pairs = line.split()
    assert (head, bench_name) == ("RESULT", name), line
    return {k: float(v) for k, v in (p.split("=", 1) for p in pairs)}


def test_every_engine_benchmark_is_registered() -> None:
    assert set(EXPECTED_KEYS) <= set(BENCHMARKS)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(EXPECTED_KEYS))
def test_smoke_run_writes_result_line_and_json(
    name: str, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = make_config(**{"model.path": str(tiny_model_dir), "model.num_threads": 2})

    assert run_benchmark(name, "smoke", config, results_dir=tmp_path) == 0

    lines = capsys.readouterr().out.strip().splitlines()
    keys = parse_result_line(lines[-1], name)
    assert set(keys) == EXPECTED_KEYS[name]
    may_be_nan = NAN_IN_SMOKE.get(name, set())
    assert all(math.isfinite(v) for k, v in keys.items() if k not in may_be_nan), keys
    payload = json.loads((tmp_path / f"{name}.json").read_text())
    assert payload["mode"] == "smoke"
    assert set(payload["keys"]) == EXPECTED_KEYS[name]
    assert payload["table"], "the human table has rows"


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="mode"):
        run_benchmark("engine", "fast", make_config())
