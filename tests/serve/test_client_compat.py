"""Third-party clients against the cluster, used as their users use them (issue 41): the
official ``openai`` SDK (sync, async, streaming with usage), LangChain's ``ChatOpenAI``, and
GuideLLM (a short concurrent run: no errors, and the token counts it reports are the ones the
router counted). The fake model; one deployment for the module; the integrity check last.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from benchmarks.anchor_serve import guidellm_figures
from tests.helpers import fake_config
from tests.serve.cluster_helpers import App
from tests.serve_fixtures import ServeCluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

APP = "pdserve-clients"
CFG = {
    "cache.num_blocks": 256,
    "scheduler.max_num_seqs": 16,
    "transfer.transports": ["shm", "zmq"],
    "decode.local_prefill_threshold": 16,  # longer prompts are prefilled remotely
    "prefill.num_cpus": 0.5,
    "decode.num_cpus": 0.5,
    "model.max_model_len": 1024,
}
PROMPT = " ".join(f"t{i}" for i in range(3, 40))  # 37 fake tokens: a remote prefill


@pytest.fixture(scope="module")
def app(serve_cluster: ServeCluster) -> Iterator[App]:
    deployed = App(serve_cluster, fake_config(**CFG), APP)
    try:
        yield deployed
    finally:
        deployed.close()


def router_counts(app: App) -> dict[str, int]:
    stats = app.router.stats.remote().result(timeout_s=30)
    return {k: stats[k] for k in ("requests", "errors", "prompt_tokens", "completion_tokens")}


def test_openai_sdk_sync_async_and_streaming_agree(app: App) -> None:
    client = openai.OpenAI(base_url=app.cluster.http_url + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    extra = {"ignore_eos": True}
    messages: Any = [{"role": "user", "content": PROMPT}]
    done = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0, extra_body=extra
    )
    text = done.choices[0].message.content
    assert text and done.usage is not None and done.usage.completion_tokens == 8
    assert done.choices[0].finish_reason == "length"

    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # cache hits and times differ
    assert [getattr(last.usage, k) for k in counts] == [getattr(done.usage, k) for k in counts]

    async def many() -> list[str | None]:
        aclient = openai.AsyncOpenAI(base_url=app.cluster.http_url + "/v1", api_key="unused")
        try:
            replies = await asyncio.gather(
                *(
                    aclient.chat.completions.create(
                        model=model,
                        messages=messages,
                        max_tokens=8,
                        temperature=0,
                        extra_body=extra,
                    )
                    for _ in range(4)
                )
            )
        finally:
            await aclient.close()
        return [r.choices[0].message.content for r in replies]

    assert asyncio.run(many()) == [text] * 4
    completion = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body=extra
    )
    assert completion.usage is not None and completion.usage.completion_tokens == 8
    app.assert_clean()


def test_langchain_chat_openai_invoke_and_stream(app: App) -> None:
    from langchain_core.messages import AIMessageChunk
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=app.cluster.http_url + "/v1",
        api_key="unused",  # type: ignore[arg-type]
        model="pdserve",
        temperature=0,
        max_tokens=8,  # type: ignore[call-arg]
        stream_usage=True,
        extra_body={"ignore_eos": True},
    )
    llm.model_name = (
        openai.OpenAI(base_url=app.cluster.http_url + "/v1", api_key="unused")
        .models.list()
        .data[0]
        .id
    )
    reply = llm.invoke(PROMPT)
    assert reply.content and reply.usage_metadata is not None
    assert reply.usage_metadata["output_tokens"] == 8
    total: AIMessageChunk | None = None
    for part in llm.stream(PROMPT):
        total = part if total is None else total + part
    assert total is not None and total.content == reply.content
    assert total.usage_metadata is not None and total.usage_metadata == reply.usage_metadata
    app.assert_clean()


def _guidellm_requests(report: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Every request GuideLLM recorded, by status, from its JSON report."""
    (benchmark,) = report["benchmarks"]
    requests: dict[str, list[dict[str, Any]]] = benchmark["requests"]
    return requests


def test_guidellm_runs_with_no_errors_and_counts_what_the_router_counted(
    app: App, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """GuideLLM streams every request with ``stream_options.continuous_usage_stats``,
    ``stop: null`` and ``ignore_eos``; 16 requests at 4 concurrent streams."""
    before = router_counts(app)
    out = tmp_path / "benchmarks.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [
        sys.executable, "-m", "guidellm", "run",
        "--backend", f"kind=openai_http,target={app.cluster.http_url},"
        "request_format=/v1/completions",
        "--profile", "kind=concurrent,streams=4",
        "--constraint", "kind=max_requests,count=16",
        "--data", "kind=synthetic_text,prompt_tokens=48,output_tokens=8",
        "--tokenizer", f"kind=huggingface_auto,model={tiny_model_dir}",
        "--output", f"kind=json,path={out}",
        "--disable-console-interactive",
    ]  # fmt: skip
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    report = json.loads(out.read_text())
    requests = _guidellm_requests(report)
    after = router_counts(app)
    assert after["errors"] == before["errors"]
    assert len(requests["successful"]) == 16 and not requests["errored"], requests["errored"]
    got_out = sum(r["output_metrics"]["text_tokens"] for r in requests["successful"])
    got_in = sum(r["input_metrics"]["text_tokens"] for r in requests["successful"])
    assert got_out == 16 * 8 == after["completion_tokens"] - before["completion_tokens"]
    assert got_in == after["prompt_tokens"] - before["prompt_tokens"]
    # bench anchor-serve reads its figures from the same report
    figures = guidellm_figures(report, streams=(4,))[4]
    assert figures["ok"] == 16 and figures["errors"] == 0
    assert figures["out_tok_s"] > 0 and figures["ttft_p50_ms"] > 0
    app.assert_clean()
