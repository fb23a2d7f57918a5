"""``anchor-serve``: pdserve against llama.cpp's ``llama-server`` as users would compare them,
with GuideLLM, on the same GGUF file and the same cores.

How (docs/benchmarks/index.md, "anchor-serve"):
  * Arms: ``pdserve_default`` (``pdserve serve`` as configured: by default 1 prefill + 1 decode
    replica), ``pdserve_colocated`` (one replica doing both, every core's thread, no
    disaggregation) and ``llamaserver`` (``llama-server`` on the config's GGUF file, the same
    thread count as the cores pdserve uses, 8 slots, continuous batching). The pdserve arms run
    on one local Ray/Serve instance, redeployed per arm; during the llama-server arm the
    pdserve application is deleted (Ray's own daemons stay).
  * Load: GuideLLM (``guidellm run``, openai_http backend, ``/v1/completions``, streaming),
    synthetic 256-token prompts (GuideLLM's tokenizer: the model's own) and 64-token outputs
    (``ignore_eos``), a concurrent profile at 1 and at 8 streams, 60 s each (quick: 30), from
    one GuideLLM process.
    One warm-up request per arm first, not measured.
  * Arms in a shuffled order per repetition (``interleaved_order``), two repetitions; each
    figure is the median over them. GuideLLM's own figures: output tokens per second (its
    mean over the run) and the median TTFT.

Keys (ours over theirs): ``c1_out_tok_s_vs_llamaserver``, ``c8_out_tok_s_vs_llamaserver`` and
``c8_ttft_p50_vs_llamaserver`` for the better pdserve arm (higher output tok/s at 8 streams),
and the same three with ``_default`` for ``pdserve_default``. Without a llama-server (see
``benchmarks.llama_server``) the keys are NaN and the report says how to get one; ``--smoke``
runs the pdserve arms on the tiny model only.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks import llama_server
from benchmarks.harness import BenchContext, BenchReport, interleaved_order
from benchmarks.workloads import bench_model_dir, bench_threads
from cluster.planner.measure.arms import ARMS

PROMPT_TOKENS, OUTPUT_TOKENS = 256, 64
STREAMS = (1, 8)
SLOTS = 8  # llama-server's parallel sequences
PD_ARMS = ("pdserve_default", "pdserve_colocated")


def _pd_config(ctx: BenchContext, arm: str, model: str) -> Any:
    config = ctx.config.replace({"model.path": model}) if ctx.smoke else ctx.config
    if arm == "pdserve_colocated":
        spec = dict(ARMS["colocated"])
        spec["decode.num_threads"] = bench_threads(ctx)
        config = config.replace(spec)
    return config


def _post(url: str, body: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        reply: dict[str, Any] = json.loads(resp.read())
    return reply


def _wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {proc.returncode} while starting")
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url}: not ready within {timeout:.0f} s")


@contextmanager
def _llama_server(binary: Path, gguf: Path, threads: int, port: int) -> Iterator[str]:
    cmd = [
        *(str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads)),
        *("-np", str(SLOTS), "-c", str(SLOTS * (PROMPT_TOKENS + OUTPUT_TOKENS + 64))),
        *("--host", "127.0.0.1", "--port", str(port)),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_http(url + "/health", 300, proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def guidellm_run(
    target: str, seconds: float, tokenizer_dir: Path, out: Path
) -> dict[int, dict[str, float]]:
    """GuideLLM's concurrent runs against ``target``, one per entry of ``STREAMS`` (one
    process): per stream count, output tok/s, median TTFT (ms), requests that succeeded and
    that failed."""
    cmd = [
        *(sys.executable, "-m", "guidellm", "run"),
        *("--backend", f"kind=openai_http,target={target},request_format=/v1/completions"),
        *("--profile", f"kind=concurrent,streams={STREAMS[0]}"),
        *("--override", "profile.streams", ",".join(map(str, STREAMS))),
        *("--constraint", f"kind=max_duration,seconds={seconds}"),
        "--data",
        f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
        *("--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}"),
        *("--output", f"kind=json,path={out}"),
        "--disable-console",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if run.returncode != 0:
        raise RuntimeError(f"guidellm failed ({run.returncode}): {run.stderr[-2000:]}")
    return guidellm_figures(json.loads(out.read_text()))


def guidellm_figures(
    report: dict[str, Any], streams: tuple[int, ...] = STREAMS
) -> dict[int, dict[str, float]]:
    """What ``anchor-serve`` reads from GuideLLM's JSON report: per benchmark (a concurrent
    run at a stream count; one for each of ``streams``), its output tok/s (mean over the run),
    median TTFT and request totals."""
    out: dict[int, dict[str, float]] = {}
    for bench in report["benchmarks"]:
        metrics = bench["metrics"]
        totals = metrics["request_totals"]
        out[int(bench["config"]["strategy"]["streams"])] = {
            "out_tok_s": float(metrics["output_tokens_per_second"]["successful"]["mean"]),
            "ttft_p50_ms": float(metrics["time_to_first_token_ms"]["successful"]["median"]),
            "ok": float(totals["successful"]),
            "errors": float(totals["errored"]),
        }
    if sorted(out) != sorted(streams):
        raise RuntimeError(f"guidellm: benchmarks for streams {sorted(out)}, wanted {streams}")
    return out


Runs = dict[str, dict[int, list[dict[str, float]]]]  # arm -> streams -> one figure set per rep


def _measure_arm(
    ctx: BenchContext, arm: str, target: str, tokenizer_dir: Path, runs: Runs, tmp: Path
) -> None:
    rep = len(runs[arm][STREAMS[0]])
    out = tmp / f"{arm}-{rep}.json"
    for streams, figures in guidellm_run(target, ctx.pick(60, 30, 10), tokenizer_dir, out).items():
        runs[arm][streams].append(figures)
        ctx.progress(
            f"{arm} c{streams}: {figures['out_tok_s']:.1f} out tok/s, TTFT p50 "
            f"{figures['ttft_p50_ms']:.0f} ms, {figures['errors']:.0f} errors"
        )


def _warm(target: str) -> None:
    """One request through the arm's whole path (not measured)."""
    _post(target + "/v1/completions", {"prompt": "Hello, " * 60, "max_tokens": 8})


def run(ctx: BenchContext) -> BenchReport:
    from cluster.app import APP_NAME
    from cluster.engine.models.default_model import gguf_source
    from cluster.planner.measure.deploy import local_cluster

    model_dir = bench_model_dir(ctx)
    threads = bench_threads(ctx)
    cache_dir = ctx.config.paths.resolved_cache_dir
    binary = None if ctx.smoke else llama_server.find(cache_dir)
    gguf = None if ctx.smoke else gguf_source(ctx.config)
    arms = list(PD_ARMS)
    if binary is not None and gguf is not None:
        arms.append("llamaserver")
    else:
        why = "--smoke" if ctx.smoke else "no GGUF model" if gguf is None else "not found"
        ctx.progress(f"llama-server arm left out ({why}); {llama_server.HOW_TO_GET}")
    runs: Runs = {arm: {s: [] for s in STREAMS} for arm in arms}
    pd_target = f"http://127.0.0.1:{ctx.config.router.http_port}"
    with tempfile.TemporaryDirectory(prefix="pdserve-anchor-") as tmp, local_cluster() as put:
        for rep in range(ctx.pick(2, 2, 1)):
            for arm in interleaved_order(arms, rep):
                if arm == "llamaserver":
                    assert binary is not None and gguf is not None
                    _delete_app(APP_NAME)
                    with _llama_server(binary, gguf, threads, _free_port()) as url:
                        _warm(url)
                        _measure_arm(ctx, arm, url, model_dir, runs, Path(tmp))
                    continue
                put(_pd_config(ctx, arm, str(model_dir)))
                _warm(pd_target)
                _measure_arm(ctx, arm, pd_target, model_dir, runs, Path(tmp))
    return _report(runs, binary)


def _delete_app(name: str) -> None:
    import ray
    from ray import serve

    if ray.is_initialized() and name in serve.status().applications:
        serve.delete(name)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _median(runs: Runs, arm: str, streams: int, key: str) -> float:
    values = [r[key] for r in runs.get(arm, {}).get(streams, [])]
    return statistics.median(values) if values else math.nan


def _report(runs: Runs, binary: Path | None) -> BenchReport:
    best = max(PD_ARMS, key=lambda a: _median(runs, a, 8, "out_tok_s"))
    keys: dict[str, float] = {}
    for suffix, arm in (("", best), ("_default", "pdserve_default")):
        for streams, key, name in (
            (1, "out_tok_s", "c1_out_tok_s"),
            (8, "out_tok_s", "c8_out_tok_s"),
            (8, "ttft_p50_ms", "c8_ttft_p50"),
        ):
            ours = _median(runs, arm, streams, key)
            keys[f"{name}_vs_llamaserver{suffix}"] = ours / _median(
                runs, "llamaserver", streams, key
            )
    table = [
        {
            "arm": arm,
            "streams": s,
            "out_tok_s": _median(runs, arm, s, "out_tok_s"),
            "ttft_p50_ms": _median(runs, arm, s, "ttft_p50_ms"),
            "requests": sum(r["ok"] for r in runs[arm][s]),
            "errors": sum(r["errors"] for r in runs[arm][s]),
        }
        for arm in runs
        for s in STREAMS
    ]
    return BenchReport(
        keys=keys,
        table=table,
        details={"better_pdserve_arm": best, "llama_server": str(binary), "runs": runs},
        targets={
            "c1_out_tok_s_vs_llamaserver": ">= 1.0",
            "c8_out_tok_s_vs_llamaserver": ">= 1.5",
        },
    )
