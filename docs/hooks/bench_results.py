"""MkDocs hook: renders the benchmark results page from ``docs/benchmarks/results.csv``.

The CSV is the record (one row per run and key: date, benchmark, key, value, runs, mode, host,
commit, note); this page is a view of it, newest first per benchmark. A value ``lo..hi`` is a
range over ``runs`` runs whose single figures were not kept.
"""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path
from typing import Any

MARKER = "<!-- generated: benchmark-results -->"
RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results.csv"
COLUMNS = ("date", "benchmark", "key", "value", "runs", "mode", "host", "commit", "note")
# The order of the page's sections; a benchmark id outside it is an error (a typo).
BENCHMARKS = {
    "P1": "P1 `serve`: disaggregation under load",
    "P2": "P2 `engine`: continuous vs static batching",
    "P3": "P3 `prefix`: prefix cache",
    "P4": "P4 `kv-transfer`: the data plane",
    "P5": "P5 `kv-stream`: KV streamed while prefill runs",
    "P6": "P6 `decode-scaling`: decode batching",
    "P7": "P7 `chunked-prefill`: stall-free decoding",
    "P8": "P8 `routing`: prefix-aware routing",
    "P9": "P9 `spec`: speculative decoding",
    "P10": "P10 `gpu`: the GPU run",
    "P11": "P11 `quant`: quantized weights and KV",
    "P12": "P12 `parallel`: tensor and pipeline parallelism",
    "structured": "`structured`: constrained decoding",
    "anchor-serve": "`anchor-serve`: GuideLLM against pdserve and llama-server",
    "models": "`models`: every architecture against transformers",
    "plan-check": "`plan --validate`: the planner against the cluster",
    "accuracy": "Accuracy of the quantized formats (`tests/integration/test_quant_real.py`)",
    "formats": "Decode rate of the weight formats (one-off runs)",
}


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render())


def read_results(path: Path = RESULTS) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != COLUMNS:
            raise ValueError(f"{path}: columns must be {', '.join(COLUMNS)}")
        rows = list(reader)
    for i, row in enumerate(rows, start=2):
        if row["benchmark"] not in BENCHMARKS:
            raise ValueError(f"{path}:{i}: unknown benchmark {row['benchmark']!r}")
    return rows


def render() -> str:
    by_bench: dict[str, list[dict[str, str]]] = defaultdict(list)
    for row in read_results():
        by_bench[row["benchmark"]].append(row)
    out: list[str] = []
    for bench, title in BENCHMARKS.items():
        rows = sorted(by_bench.get(bench, []), key=lambda r: r["date"], reverse=True)
        if not rows:
            continue
        out += [f"## {title} {{ #{bench} }}", ""]
        out += ["| date | key | value | runs | mode | host | commit | note |"]
        out += ["|---|---|---|---|---|---|---|---|"]
        out += [_row(r) for r in rows]
        out.append("")
    return "\n".join(out)


def _row(r: dict[str, str]) -> str:
    value = r["value"].replace("..", " – ")
    cells = [r["date"], f"`{r['key']}`", value, r["runs"] or "?", r["mode"], r["host"]]
    cells += [f"`{r['commit']}`", r["note"].replace("|", "\\|")]
    return "| " + " | ".join(cells) + " |"
