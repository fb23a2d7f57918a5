"""Structured output through the cluster on Ray Serve (the fake model, ASCII tokens on).

Every schema of the acceptance set, greedy and 8 seeds at temperature 0.8, over HTTP (the
official openai client, ``response_format``) and gRPC (``json_schema``), remote- and locally-
prefilled: every output parses and validates, those the budget ended (``length``: the engine
closes the document within ``max_tokens``, ``structured.close_at_budget``) too, also at budgets
just over each schema's shortest document; gRPC outputs equal an engine run in this process
token for token (the decode replica rebuilt the grammar state, and closes the document, from
the prefill replica's first token alone). Bad schemas get a 400 / INVALID_ARGUMENT naming the
problem without reaching any worker, and so does a ``max_tokens`` below the schema's shortest
document (from the engine, naming the minimum); afterwards no matcher, block or lease is left.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import jsonschema
import openai
import pytest

from cluster.common.sampling_params import SamplingParams
from cluster.engine.engine import EngineRequest, LLMEngine
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from tests.helpers import fake_config
from tests.serve.cluster_helpers import App
from tests.serve_fixtures import ServeCluster
from tests.structured_schemas import BAD_SCHEMAS, SCHEMAS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

APP = "pdserve-structured"
THRESHOLD = 16  # prompts longer than this are prefilled remotely
MAX_TOKENS = 300
RUNS = [None, *range(8)]  # greedy, then 8 seeds at temperature 0.8
CFG = {
    "cache.num_blocks": 512,
    "transfer.transports": ["shm", "zmq"],
    "transfer.lease_s": 2.0,
    "transfer.heartbeat_s": 0.2,
    "decode.local_prefill_threshold": THRESHOLD,
    "prefill.graceful_shutdown_timeout_s": 5.0,
    "decode.graceful_shutdown_timeout_s": 5.0,
    "prefill.num_cpus": 0.5,
    "decode.num_cpus": 0.5,
    "router.assignment_timeout_s": 20.0,
    "testing.fake_model.ascii_tokens": True,
}


@pytest.fixture(scope="module")
def app(serve_cluster: ServeCluster) -> Iterator[App]:
    deployed = App(serve_cluster, fake_config(**CFG), APP)
    try:
        yield deployed
    finally:
        deployed.close()


def _prompt(i: int, remote: bool) -> list[int]:
    n = THRESHOLD + 9 if remote else 6
    return [200 + (i * 13 + j * 7) % 300 for j in range(n)]


def _sampling(seed: int | None) -> dict[str, Any]:
    return {"temperature": 0.0} if seed is None else {"temperature": 0.8, "seed": seed}


def _validate(text: str, reason: str | None, schema: dict[str, Any]) -> bool:
    """Every output parses and validates; True: the grammar ended it (``stop``), False: the
    budget did (``length``: closed within it)."""
    assert reason in ("stop", "length"), (reason, text)
    jsonschema.validate(json.loads(text), schema)
    return reason == "stop"


def _shortest() -> dict[str, int]:
    """Each schema's shortest document, in tokens (what admission checks max_tokens against)."""
    cache = LLMEngine(fake_config(**CFG)).structured.cache
    return {name: len(cache.shortest(json.dumps(s)) or []) for name, s in SCHEMAS.items()}


def _structured_stats(app: App) -> list[dict[str, Any]]:
    roles = ("decode", "prefill")
    return [s["engine"]["structured"] for r in roles for s in app.stats(r).values()]


@pytest.mark.parametrize("budget", ["ample", "tight"])
def test_grpc_outputs_validate_and_equal_the_engine(app: App, budget: str) -> None:
    """``ample``: max_tokens 300; ``tight``: each schema's shortest document + 2 tokens."""
    shortest = _shortest()
    first = 0 if budget == "ample" else 120  # other prompts: no prefix-cache hit, some remote
    jobs = []
    for i, (name, schema) in enumerate(SCHEMAS.items()):
        for k, seed in enumerate(RUNS):
            n = MAX_TOKENS if budget == "ample" else shortest[name] + 2
            jobs.append(
                (f"{name}.{seed}.{budget}", _prompt(i * 9 + k + first, k % 2 == 0), seed, schema, n)
            )
    engine = LLMEngine(fake_config(**CFG))
    for rid, p, seed, schema, n in jobs:
        engine.add(
            EngineRequest(
                rid,
                p,
                SamplingParams(max_tokens=n, json_schema=json.dumps(schema), **_sampling(seed)),
            )
        )
    expected: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            expected.setdefault(o.request_id, []).extend(o.new_token_ids)

    def call(job: tuple[str, list[int], int | None, Any, int]) -> list[pb.GenerateResponse]:
        rid, p, seed, schema, n = job
        sampling = pb.SamplingParameters(
            max_tokens=n, json_schema=json.dumps(schema), **_sampling(seed)
        )
        return app.generate(
            pb.GenerateRequest(request_id=rid, token_ids=pb.TokenIds(ids=p), sampling=sampling),
            timeout=120,
        )

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(call, jobs))
    valid = cut = 0
    modes = set()
    for (rid, _p, _seed, schema, _n), msgs in zip(jobs, results, strict=True):
        assert [t for m in msgs for t in m.token_ids] == expected[rid], rid
        reason = pb.FinishReason.Name(msgs[-1].finish_reason)
        ok = _validate(
            "".join(m.text for m in msgs),
            {"FINISH_REASON_STOP": "stop", "FINISH_REASON_LENGTH": "length"}.get(reason),
            schema,
        )
        valid, cut = valid + ok, cut + (not ok)
        modes.add(msgs[-1].usage.prefill_mode)
    assert modes == {"local", "remote"}
    assert valid + cut == len(jobs), (valid, cut)  # every one parsed and validated
    assert cut > 0 or budget == "ample"
    app.assert_clean()
    assert all(s["num_active"] == 0 for s in _structured_stats(app))


@pytest.mark.parametrize("budget", ["ample", "tight"])
def test_openai_client_outputs_validate_local_and_remote(app: App, budget: str) -> None:
    client = openai.OpenAI(base_url=app.cluster.http_url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    shortest = _shortest()
    jobs = []
    for i, (name, schema) in enumerate(SCHEMAS.items()):
        for k, seed in enumerate(RUNS):
            words = 2 if k % 2 else THRESHOLD + 4  # the chat template adds a few: remote
            content = " ".join(f"w{i}x{j}{budget}" for j in range(words))
            n = MAX_TOKENS if budget == "ample" else shortest[name] + 2
            jobs.append((name, seed, schema, content, n))

    def call(job: tuple[str, int | None, Any, str, int]) -> tuple[str, str | None, str]:
        name, seed, schema, content, n = job
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": content}],
            max_tokens=n,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": name, "schema": schema, "strict": True},
            },
            **_sampling(seed),
        )
        mode = reply.usage.model_extra["pdserve"]["prefill_mode"] if reply.usage else ""
        return reply.choices[0].message.content or "", reply.choices[0].finish_reason, mode

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(call, jobs))
    valid = cut = 0
    for (_name, _seed, schema, _c, _n), (text, reason, _mode) in zip(jobs, results, strict=True):
        ok = _validate(text, reason, schema)
        valid, cut = valid + ok, cut + (not ok)
    assert {mode for _t, _r, mode in results} == {"local", "remote"}
    assert valid + cut == len(jobs), (valid, cut)  # every one parsed and validated
    assert cut > 0 or budget == "ample"
    if budget == "tight":
        app.assert_clean()
        return
    # JSON mode and plain text (the OpenAI default many clients send) work too.
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        response_format={"type": "text"},
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    app.assert_clean()


def test_bad_schemas_are_refused_before_any_worker(app: App) -> None:
    def calls() -> int:
        return sum(s["local_prefills"] + s["remote_prefills"] for s in app.stats("decode").values())

    before = calls()
    client = openai.OpenAI(base_url=app.cluster.http_url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    for name, (text, phrase) in BAD_SCHEMAS.items():
        req = pb.GenerateRequest(prompt="x", sampling=pb.SamplingParameters(json_schema=text))
        t0 = time.perf_counter()
        with pytest.raises(grpc.RpcError) as e:
            app.generate(req)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        assert e.value.details().startswith("json_schema:") and phrase in e.value.details()
        assert time.perf_counter() - t0 < 1.0  # the router's check: < 50 ms, see the unit test
        if name == "not_json":
            continue
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "x"}],
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": name, "schema": json.loads(text)},
                },
            )
        assert "response_format.json_schema.schema" in str(bad.value), str(bad.value)
    big = json.dumps({"enum": [f"value-{i}" for i in range(20000)]})
    with pytest.raises(grpc.RpcError) as e:
        app.generate(
            pb.GenerateRequest(prompt="x", sampling=pb.SamplingParameters(json_schema=big))
        )
    assert (
        e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "over the limit" in e.value.details()
    )
    assert calls() == before  # no worker was touched


def test_max_tokens_below_the_shortest_document_is_refused_naming_the_minimum(app: App) -> None:
    need = _shortest()["long_fixed_keys"]
    schema = SCHEMAS["long_fixed_keys"]
    sampling = pb.SamplingParameters(max_tokens=need - 1, json_schema=json.dumps(schema))
    with pytest.raises(grpc.RpcError) as e:
        app.generate(pb.GenerateRequest(prompt="x", sampling=sampling))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
    assert f"max_tokens must be >= {need}" in e.value.details(), e.value.details()
    client = openai.OpenAI(base_url=app.cluster.http_url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=need - 1,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "keys", "schema": schema},
            },
        )
    assert f"max_tokens must be >= {need}" in str(bad.value), str(bad.value)
    app.assert_clean()
