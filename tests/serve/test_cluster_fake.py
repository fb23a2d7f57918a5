"""The whole cluster on Ray Serve with the fake model: API edges, bad input, auth, cancellation
at each phase, replicas killed mid-request (docs/reliability/matrix.md B1-B5, B7, B9, S5, F4, F8).

One deployment for the module (2 prefill replicas, 1 decode replica, API keys on); tests run in
file order and the kill tests come last. Every test ends with the block-integrity check.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import hypothesis
import openai
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import strategies as st

from cluster.common.sampling_params import SamplingParams
from cluster.engine.engine import EngineRequest, LLMEngine
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from tests.helpers import fake_config, greedy, run_until_done
from tests.serve.cluster_helpers import App, delta, outcome_counters, wait_replicas_ready
from tests.serve_fixtures import ServeCluster, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

KEY = "test-key-0123456789"
APP = "pdserve-fake"
THRESHOLD = 16  # prompts longer than this are prefilled remotely
CFG = {
    "cache.num_blocks": 256,
    "transfer.transports": ["shm", "zmq"],
    "transfer.lease_s": 2.0,
    "transfer.heartbeat_s": 0.2,
    "decode.local_prefill_threshold": THRESHOLD,
    "prefill.num_replicas": 2,
    "prefill.graceful_shutdown_timeout_s": 5.0,
    "decode.graceful_shutdown_timeout_s": 5.0,
    "prefill.num_cpus": 0.5,
    "decode.num_cpus": 0.5,
    "router.api_keys": [KEY],
    "router.assignment_timeout_s": 20.0,
}


@pytest.fixture(scope="module")
def app(serve_cluster: ServeCluster) -> Iterator[App]:
    deployed = App(serve_cluster, fake_config(**CFG), APP)
    try:
        yield deployed
    finally:
        deployed.close()


def prompt(i: int, n: int) -> list[int]:
    return [1 + (i * 31 + j * 7) % 500 for j in range(n)]


def reference(app: App, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    engine = LLMEngine(app.config)
    for rid, p in prompts.items():
        engine.add(EngineRequest(rid, p, greedy(max_tokens)))
    return run_until_done(engine)


def greedy_req(p: list[int], max_tokens: int, rid: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        token_ids=pb.TokenIds(ids=p),
        sampling=pb.SamplingParameters(
            max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0, ignore_eos=True
        ),
    )


def tokens(msgs: list[pb.GenerateResponse]) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


def http(
    app: App, path: str, body: Any = None, key: str | None = KEY, raw: bytes | None = None
) -> tuple[int, Any]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    req = urllib.request.Request(app.cluster.http_url + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def worker_calls(app: App) -> int:
    return sum(s["local_prefills"] + s["remote_prefills"] for s in app.stats("decode").values())


# -- the happy path over both APIs ----------------------------------------------------------------


def test_grpc_and_openai_match_the_engine(app: App) -> None:
    prompts = {f"g{i}": prompt(i, 5 + 11 * i) for i in range(6)}
    expected = reference(app, prompts, 12)
    results: dict[str, list[pb.GenerateResponse]] = {}

    def call(rid: str) -> None:
        results[rid] = app.generate(greedy_req(prompts[rid], 12, rid), KEY)

    threads = [threading.Thread(target=call, args=(rid,)) for rid in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for rid, msgs in results.items():
        assert tokens(msgs) == expected[rid], rid
        assert all(m.request_id == rid for m in msgs)
        last = msgs[-1]
        assert last.finish_reason == pb.FINISH_REASON_LENGTH
        assert last.usage.completion_tokens == 12
        mode = "remote" if len(prompts[rid]) > THRESHOLD else "local"
        assert last.usage.prefill_mode == mode, rid
        assert last.usage.phases.decode_ms > 0
    assert len(results) == len(prompts)

    client = openai.OpenAI(base_url=app.cluster.http_url + "/v1", api_key=KEY)
    model = client.models.list().data[0].id
    p = prompts["g3"]
    extra = {"min_tokens": 12, "ignore_eos": True}
    done = client.completions.create(
        model=model, prompt=p, max_tokens=12, temperature=0, extra_body=extra
    )
    assert done.usage is not None and done.usage.completion_tokens == 12
    fake_text = "".join(f" t{t}" for t in expected["g3"])
    assert done.choices[0].text == fake_text
    stream = client.completions.create(
        model=model,
        prompt=p,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == fake_text
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == len(p)
    # Every replica froze its start-up objects out of the garbage collector (serving.heap).
    heaps = [s["heap"] for role in ("prefill", "decode") for s in app.stats(role).values()]
    heaps.append(app.router.stats.remote().result(timeout_s=30)["heap"])
    assert heaps and all(h["frozen"] > 10_000 for h in heaps), heaps
    app.assert_clean()


# -- parallel sampling and API breadth (issue 11) -------------------------------------------------


def sampled_reference(app: App, p: list[int], n: int, seed: int, max_tokens: int) -> list[Any]:
    """n seeded samples of ``p`` by an engine in this process, before the cluster answers."""
    from cluster.common.sampling_params import SamplingParams
    from cluster.engine.parallel import sample_ids

    engine = LLMEngine(app.config)
    params = SamplingParams(temperature=0.8, max_tokens=max_tokens, ignore_eos=True, seed=seed)
    engine.add(EngineRequest("ref", p, params, n=n))
    out = run_until_done(engine)
    return [out[rid] for rid in sample_ids("ref", n)]


@pytest.mark.parametrize("length", [9, 60])  # local prefill, remote prefill
def test_n_samples_over_openai_and_grpc(app: App, length: int) -> None:
    p = prompt(7, length)
    expected = sampled_reference(app, p, 4, 21, 10)
    texts = ["".join(f" t{t}" for t in toks) for toks in expected]
    remote_before = sum(s["remote_prefills"] for s in app.stats("decode").values())
    sampling = pb.SamplingParameters(max_tokens=10, temperature=0.8, ignore_eos=True, seed=21, n=4)
    msgs = app.generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=p), sampling=sampling), KEY)
    got: list[list[int]] = [[] for _ in range(4)]
    for m in msgs:
        got[m.index].extend(m.token_ids)
    assert got == expected
    assert msgs[-1].usage.prompt_tokens == length and msgs[-1].usage.completion_tokens == 40
    assert sum(m.finish_reason == pb.FINISH_REASON_LENGTH for m in msgs) == 4

    client = openai.OpenAI(base_url=app.cluster.http_url + "/v1", api_key=KEY)
    model = client.models.list().data[0].id
    extra = {"ignore_eos": True}
    done = client.completions.create(
        model=model, prompt=p, max_tokens=10, temperature=0.8, seed=21, n=4, extra_body=extra
    )
    assert [c.text for c in sorted(done.choices, key=lambda c: c.index)] == texts
    assert done.usage is not None and done.usage.prompt_tokens == length
    assert done.usage.completion_tokens == 40
    stream = client.completions.create(
        model=model,
        prompt=p,
        max_tokens=10,
        temperature=0.8,
        seed=21,
        n=4,
        stream=True,
        extra_body=extra,
    )
    streamed = ["", "", "", ""]
    for chunk in stream:
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == texts
    greedy_chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "t5 t6 t7"}],
        max_tokens=8,
        temperature=0,
        n=3,
    )
    answers = {c.message.content for c in greedy_chat.choices}
    assert len(greedy_chat.choices) == 3 and len(answers) == 1  # greedy: n identical
    best = client.completions.create(
        model=model, prompt=p, max_tokens=10, temperature=0.8, seed=21, n=1, best_of=4
    )
    assert len(best.choices) == 1 and best.choices[0].text in texts
    assert best.choices[0].logprobs is None  # ranked by logprobs the client did not ask for
    remote_after = sum(s["remote_prefills"] for s in app.stats("decode").values())
    # At most one remote prefill per request (gRPC, 2 completions, best_of; later ones may hit
    # the decode replica's own prefix cache), never one per sample.
    if length > THRESHOLD:
        assert 1 <= remote_after - remote_before <= 4
    else:
        assert remote_after == remote_before
    app.assert_clean()


def test_cancelling_n_samples_mid_stream_frees_every_block(app: App) -> None:
    client = openai.OpenAI(base_url=app.cluster.http_url + "/v1", api_key=KEY)
    stream = client.completions.create(
        model=client.models.list().data[0].id,
        prompt=prompt(3, 80),
        max_tokens=2000,
        n=8,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    seen = set()
    for chunk in stream:
        seen.update(c.index for c in chunk.choices)
        if len(seen) == 8:
            break  # all 8 samples are decoding
    stream.close()
    assert seen == set(range(8))
    app.assert_clean()


def test_tokenize_detokenize_echo_logit_bias_and_stop_strings(app: App) -> None:
    status, got = http(app, "/tokenize", {"prompt": "t5 t6 t7"})
    assert status == 200 and got["tokens"] == [5, 6, 7] and got["count"] == 3
    status, got = http(app, "/detokenize", {"tokens": [5, 6, 7]})
    assert status == 200 and got == {"prompt": " t5 t6 t7"}
    status, err = http(app, "/detokenize", {"tokens": [10**6]})
    assert status == 400 and err["error"]["param"] == "tokens"
    assert http(app, "/tokenize", {"prompt": "x"}, key=None)[0] == 401

    client = openai.OpenAI(base_url=app.cluster.http_url + "/v1", api_key=KEY)
    model = client.models.list().data[0].id
    p = prompt(4, 30)
    plain = client.completions.create(
        model=model, prompt=p, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    words = plain.choices[0].text.split()
    echoed = client.completions.create(model=model, prompt="t5 t6", max_tokens=3, echo=True)
    assert echoed.choices[0].text.startswith("t5 t6")
    banned = {str(int(w[1:])): -100 for w in set(words)}
    other = client.completions.create(
        model=model, prompt=p, max_tokens=8, temperature=0, logit_bias=banned
    )
    assert not set(other.choices[0].text.split()) & set(words)
    stop = f" {words[3]}"
    for include in (False, True):
        cut = client.completions.create(
            model=model,
            prompt=p,
            max_tokens=8,
            temperature=0,
            stop=[stop],
            extra_body={"ignore_eos": True, "include_stop_str_in_output": include},
        )
        head = plain.choices[0].text[: plain.choices[0].text.index(stop)]
        assert cut.choices[0].text == (head + stop if include else head)
        assert cut.choices[0].finish_reason == "stop"
    app.assert_clean()


def test_echo_with_logprobs_returns_the_prompts_logprobs(app: App) -> None:
    """Completions with echo and logprobs (engine: prompt_logprobs, prefilled where the decode
    replica is): the prompt's tokens lead each choice's logprobs, streamed or not, through the
    official client, equal to an offline engine's; the completion's part equals a request
    without echo."""
    p = prompt(6, 40)  # long enough for a remote prefill: such requests prefill locally
    engine = LLMEngine(app.config)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    engine.add(EngineRequest("ref", p, params))
    ref = None
    while engine.has_unfinished_requests():
        outs = engine.step()
        ref = ref or next((o.prompt_logprobs for o in outs if o.prompt_logprobs), None)
    assert ref is not None and len(ref) == len(p)

    client = openai.OpenAI(base_url=app.cluster.http_url + "/v1", api_key=KEY)
    model = client.models.list().data[0].id
    kw: dict[str, Any] = {"model": model, "max_tokens": 4, "temperature": 0, "logprobs": 2}
    kw["extra_body"] = {"ignore_eos": True}
    plain = client.completions.create(prompt=p, **kw).choices[0]
    echoed = client.completions.create(prompt=p, echo=True, **kw).choices[0]
    lp, base = echoed.logprobs, plain.logprobs
    assert lp is not None and base is not None and base.tokens is not None
    assert echoed.text.endswith(plain.text) and len(echoed.text) > len(plain.text)
    assert lp.tokens is not None and len(lp.tokens) == len(p) + 4
    assert lp.tokens[len(p) :] == base.tokens
    assert lp.token_logprobs is not None and lp.token_logprobs[len(p) :] == base.token_logprobs
    expected = [None] + [pytest.approx(e[0], abs=1e-6) for e in ref[1:]]
    assert lp.token_logprobs[: len(p)] == expected
    assert lp.top_logprobs is not None and lp.top_logprobs[0] is None
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset is not None and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    streamed = list(client.completions.create(prompt=p, echo=True, stream=True, **kw))
    first = streamed[0].choices[0]
    assert first.text.startswith(echoed.text[:10]) and first.logprobs is not None
    assert first.logprobs.token_logprobs is not None
    assert first.logprobs.token_logprobs[: len(p)] == expected
    assert "".join(c.choices[0].text for c in streamed) == echoed.text
    app.assert_clean()


# -- bad input and auth ---------------------------------------------------------------------------


def grpc_code(app: App, req: pb.GenerateRequest, key: str | None = KEY) -> tuple[Any, str]:
    with pytest.raises(grpc.RpcError) as info:
        app.generate(req, key)
    return info.value.code(), info.value.details()


def test_bad_input_gets_the_right_status_and_touches_no_worker(app: App) -> None:
    before = worker_calls(app)
    vocab, ctx = app.config.testing.fake_model.vocab_size, 4096
    cases = [
        (pb.GenerateRequest(prompt=""), "prompt"),  # B1
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[])), "prompt"),  # B1
        (greedy_req([1] * ctx, 1), "prompt"),  # B2
        (greedy_req([1] * (ctx - 10), 11), "max_tokens"),  # B2: prompt + max_tokens
        (greedy_req([1, 2], 0), "max_tokens"),  # B3
        (greedy_req([1, 2], 2**40), "max_tokens"),  # B3
        (pb.GenerateRequest(prompt="x", sampling=pb.SamplingParameters(top_p=0)), "top_p"),
        (
            pb.GenerateRequest(
                prompt="x", sampling=pb.SamplingParameters(temperature=float("nan"))
            ),
            "temperature",
        ),  # B4
        (greedy_req([1, vocab], 2), "prompt_token_ids"),  # B5
        (greedy_req([1, -4], 2), "prompt_token_ids"),  # B5
    ]
    for req, field in cases:
        t0 = time.monotonic()
        code, details = grpc_code(app, req)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (field, details)
        assert details.startswith(field), details
        assert "Traceback" not in details
        assert time.monotonic() - t0 < 2.0
    # B9: a deadline that already passed
    code, _ = grpc_code(app, pb.GenerateRequest(prompt="x", timeout_ms=0))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    # B7: a message over the proxy's limit (the fixture sets 1 MiB)
    code, _ = grpc_code(app, pb.GenerateRequest(prompt="x" * (5 << 20)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    # ... and over HTTP, with OpenAI's error shape naming the field
    status, body = http(app, "/v1/completions", {"prompt": "x", "max_tokens": 0})
    assert status == 400 and body["error"]["param"] == "max_tokens"
    assert body["error"]["type"] == "invalid_request_error"
    status, body = http(app, "/v1/completions", {"prompt": [1, vocab + 1]})
    assert status == 400 and body["error"]["message"].startswith("prompt_token_ids")
    status, body = http(app, "/v1/chat/completions", {"messages": [], "model": "x"})
    assert status in (400, 404) and "error" in body
    status, body = http(app, "/v1/completions", {"prompt": "x", "tools": [{"type": "f"}]})
    assert status == 400 and body["error"]["param"] == "tools"
    status, body = http(app, "/v1/completions", raw=b"{not json")
    assert status == 400 and "JSON" in body["error"]["message"]
    status, body = http(app, "/v1/completions", raw=b"x" * (5 << 20))
    # 413, never 429: the OpenAI SDKs retry a 429, resending the oversized body
    assert status == 413 and "exceeds" in body["error"]["message"]
    assert worker_calls(app) == before  # nothing reached a pool
    app.assert_clean()


def _fuzz_bodies(vocab: int) -> st.SearchStrategy[dict[str, Any]]:
    """Completion bodies, valid and not: each field is absent, well-formed, out of range, of
    the wrong type, or hostile (NaN, integers of 41 and 401 digits, ids past the vocabulary)."""
    number = st.one_of(
        st.floats(-3, 3),
        st.sampled_from([float("nan"), float("inf"), 10**40, -(10**400)]),
        st.none(),
    )
    count = st.one_of(
        st.integers(-2, 12), st.sampled_from([10**40, 10**400, 2.5, "3", True]), st.none()
    )
    return st.fixed_dictionaries(
        {
            "prompt": st.one_of(
                st.text(min_size=1, max_size=24),
                st.lists(st.integers(-2, vocab + 2), min_size=1, max_size=12),
                st.sampled_from(["", [], 7, None]),
            )
        },
        optional={
            "max_tokens": count,
            "min_tokens": st.integers(-1, 4),
            "n": st.one_of(st.integers(0, 3), st.just(99)),
            "temperature": number,
            "top_p": number,
            "top_k": st.one_of(st.integers(-3, 50), st.just("x")),
            "min_p": number,
            "presence_penalty": number,
            "frequency_penalty": number,
            "repetition_penalty": number,
            "seed": st.one_of(st.integers(-1, 2**64), st.just(10**40)),
            "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3)),
            "logit_bias": st.dictionaries(
                st.one_of(st.integers(0, vocab + 2).map(str), st.just("x"), st.just("9" * 40)),
                st.one_of(st.floats(-150, 150), st.just("1")),
                max_size=3,
            ),
            "ignore_eos": st.booleans(),
            "user": st.text(max_size=8),
            "frobnicate": st.integers(),
        },
    )


def test_b4_http_fuzz_never_a_5xx_and_valid_bodies_reach_the_engine(app: App) -> None:
    """B4 over HTTP: generated completion bodies. Every answer is a 200 that carries tokens
    the engine generated (within max_tokens) or a 400 whose message names a field of the body
    (or the body itself); never a 5xx, nothing leaked."""
    vocab = app.config.testing.fake_model.vocab_size
    seen: collections.Counter[int] = collections.Counter()

    def generated() -> int:
        return sum(s["engine"]["num_generated_tokens"] for s in app.stats("decode").values())

    generated_before = generated()

    @hypothesis.settings(
        max_examples=200,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(hypothesis.HealthCheck),
    )
    @hypothesis.given(body=_fuzz_bodies(vocab))
    def check(body: dict[str, Any]) -> None:
        status, reply = http(app, "/v1/completions", body)
        seen[status] += 1
        assert status in (200, 400), (status, body, reply)
        if status == 200:
            usage = reply["usage"]
            assert usage["completion_tokens"] >= len(reply["choices"]) >= 1, reply
            limit = body.get("max_tokens")
            if isinstance(limit, int) and not isinstance(limit, bool):
                assert usage["completion_tokens"] <= limit * len(reply["choices"]), reply
            return
        message = reply["error"]["message"]
        head = message.split(":", 1)[0].split("[", 1)[0]
        assert head in set(body) | {"body", "prompt_token_ids", "max_tokens"}, (message, body)

    check()
    print(f"B4 HTTP fuzz: {dict(seen)}")
    assert seen[200] >= 8 and seen[400] >= 8, seen  # both kinds were exercised
    assert generated() - generated_before >= seen[200], seen  # the 200s' tokens are the engine's
    app.assert_clean()


def test_a_chunked_body_over_the_limit_is_refused_without_being_buffered(app: App) -> None:
    """B7: no Content-Length to check first; the router stops reading at the limit and answers
    413 while the client is still sending, its memory untouched by the rest."""
    limit = app.config.router.max_request_bytes
    router = psutil.Process(app.router.pid.remote().result(timeout_s=30))
    rss_before = router.memory_info().rss
    sent = 0
    total = 16 * limit
    with socket.create_connection(("127.0.0.1", app.cluster.http_port), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {KEY}\r\n".encode()
            + b"Transfer-Encoding: chunked\r\n\r\n"
        )
        piece = b'{"prompt": "' + b"x" * (64 << 10)
        chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
        sock.settimeout(0.05)
        reply = b""
        while sent < total and not reply:
            try:
                sock.sendall(chunk)
                sent += len(piece)
            except OSError:  # the server closed the connection after answering
                break
            with contextlib.suppress(TimeoutError, BlockingIOError):
                reply = sock.recv(65536)
        sock.settimeout(30)
        while b"exceeds" not in reply:  # the headers, then the error body
            more = sock.recv(65536)
            if not more:
                break
            reply += more
    status_line = reply.split(b"\r\n", 1)[0]
    assert b" 413 " in status_line, reply[:300]
    assert b"exceeds" in reply
    assert sent < total / 2, (sent, total)  # answered long before the client had sent it all
    assert router.memory_info().rss - rss_before < 10 << 20
    app.assert_clean()


def test_auth_on_every_method_but_health(app: App) -> None:
    service = pb.DESCRIPTOR.services_by_name["Generation"]
    requests = {"Generate": pb.GenerateRequest(prompt="x"), "GetModelInfo": pb.ModelInfoRequest()}
    assert set(requests) == {m.name for m in service.methods}  # read from the descriptor
    for method in service.methods:
        call = getattr(app.stub, method.name)
        for key in (None, "wrong-key-000000"):
            with pytest.raises(grpc.RpcError) as info:
                out = call(requests[method.name], metadata=app.auth(key), timeout=30)
                list(out) if method.server_streaming else out
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, method.name
    info_ok = app.stub.GetModelInfo(pb.ModelInfoRequest(), metadata=app.auth(KEY), timeout=30)
    assert info_ok.vocab_size == app.config.testing.fake_model.vocab_size
    health = health_pb2_grpc.HealthStub(app.channel)
    ok = health.Check(health_pb2.HealthCheckRequest(), metadata=app.metadata, timeout=30)
    assert ok.status == health_pb2.HealthCheckResponse.SERVING
    for path, body in (
        ("/v1/models", None),
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ):
        status, err = http(app, path, body, key=None)
        assert status == 401 and err["error"]["type"] == "authentication_error", path
    assert http(app, "/health", key=None)[0] == 200
    status, listing = http(app, "/v1/models")
    assert status == 200
    assert listing["data"][0]["weights"] == "none (the fake runner)"
    assert listing["data"][0]["kv_cache"].startswith("model dtype")
    app.assert_clean()


# -- a reused client request id (K10) -------------------------------------------------------------


def test_a_reused_request_id_leaves_the_running_request_alone(app: App) -> None:
    """K10: a second request with the id of one still running (in the decode engine, its blocks
    reserved, paused before its pull) is served on its own; the first then finishes normally.
    Both oracle-identical."""
    point = "d.after_alloc_before_pull"
    first_p, second_p = prompt(21, 40), prompt(22, 40)  # remote prefill: leases, reservations
    expected = reference(app, {"a": first_p, "b": second_p}, 12)
    app.arm("decode", f"{point}=pause")
    _call, got, t = start_stream(app, greedy_req(first_p, 12, "k10-same"))
    try:
        app.wait_paused("decode", point)
        second = app.generate(greedy_req(second_p, 12, "k10-same"), KEY)
        assert tokens(second) == expected["b"]
        assert all(m.request_id == "k10-same" for m in second)
    finally:
        app.release("decode", point)
    t.join(60)
    assert got and not isinstance(got[-1], grpc.RpcError), got[-1]
    assert tokens(got) == expected["a"]
    assert got[-1].finish_reason == pb.FINISH_REASON_LENGTH
    app.assert_clean()


def test_fifty_requests_sharing_ids_in_pairs_all_finish(app: App) -> None:
    """K10, 50 tries: 25 ids, each used by two concurrent requests (gRPC and HTTP)."""
    prompts = {f"k{i}": prompt(30 + i, 20 + 3 * i) for i in range(50)}
    expected = reference(app, prompts, 8)
    results: dict[str, list[int]] = {}
    errors: list[BaseException] = []

    def call(i: int) -> None:
        key, rid = f"k{i}", f"pair-{i // 2}"
        try:
            if i % 2:
                body = {"prompt": prompts[key], "max_tokens": 8, "temperature": 0.0}
                body.update(min_tokens=8, ignore_eos=True, request_id=rid)
                status, out = http(app, "/v1/completions", body)
                assert status == 200 and out["id"] == rid, out
                results[key] = [int(w[1:]) for w in out["choices"][0]["text"].split()]
            else:
                results[key] = tokens(app.generate(greedy_req(prompts[key], 8, rid), KEY))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]
    assert results == expected
    app.assert_clean()


# -- text that is not Unicode (B6); errors say what, not how (S8) ---------------------------------


def test_text_that_is_not_unicode_is_a_client_error(app: App) -> None:
    """B6: lone surrogates in JSON strings, invalid UTF-8 bodies and protobuf strings are 4xx
    naming the field, before any worker is touched; a valid surrogate pair is ordinary text."""
    before = worker_calls(app)
    chat = "/v1/chat/completions"
    cases = [  # json.dumps escapes each lone surrogate as \udXXX, as a client would send it
        ("/v1/completions", {"prompt": "a\ud800b", "max_tokens": 2}, "prompt"),
        (chat, {"messages": [{"role": "user", "content": "x\udfff"}]}, "messages[0].content"),
        (
            chat,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]},
            "messages[0].content[0].text",
        ),
        (chat, {"messages": [{"role": "us\udc00er", "content": "x"}]}, "messages[0].role"),
        ("/v1/completions", {"prompt": "x", "stop": ["ok", "\udc00"]}, "stop[1]"),
        ("/v1/completions", {"prompt": "x", "\ud800": 1}, "body"),
    ]
    for path, body, field in cases:
        status, err = http(app, path, body)
        assert status == 400, (body, status, err)
        assert err["error"]["message"].startswith(field), err
        assert err["error"]["type"] == "invalid_request_error"
    for raw in (b'{"prompt": "\xff\xfe"}', b'{"prompt": "\xed\xa0\x80"}'):  # UTF-8 broken
        status, err = http(app, "/v1/completions", raw=raw)
        assert status == 400 and err["error"]["message"].startswith("body: not valid UTF-8"), err
    assert worker_calls(app) == before
    # gRPC: a prompt string whose bytes are not UTF-8 (the server parses it: INVALID_ARGUMENT)
    data = pb.GenerateRequest(prompt="ab").SerializeToString().replace(b"ab", b"a\xff")
    generate = app.channel.unary_stream(
        "/pdserve.v1.Generation/Generate",
        request_serializer=None,
        response_deserializer=pb.GenerateResponse.FromString,
    )
    with pytest.raises(grpc.RpcError) as info:
        list(generate(data, metadata=app.auth(KEY), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    assert info.value.details().startswith("request: not a valid GenerateRequest")
    assert worker_calls(app) == before
    # an escaped surrogate *pair* is an ordinary character (here an emoji)
    status, body = http(app, "/v1/completions", {"prompt": "hi \ud83d\ude00", "max_tokens": 2})
    assert status == 200, body
    app.assert_clean()


def assert_says_what_not_how(text: str) -> None:
    for leak in ("Traceback", "FaultInjected", "Error", ".py", 'File "', "ray.", "tcp://"):
        assert leak not in text, text
    assert not re.search(r"/[\w.-]+/", text), text  # no paths


def test_internal_errors_show_a_code_and_the_request_id_only(app: App) -> None:
    """S8: a bug in the router (forced with a fault point) reaches each API as a code, a fixed
    message and the request id; the stack trace stays in the router's log."""
    point = "router.before_relay=raise"
    app.router.arm_fault.remote(point).result(timeout_s=30)
    with pytest.raises(grpc.RpcError) as info:
        app.generate(greedy_req(prompt(1, 8), 4, "s8-grpc"), KEY)
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert info.value.details() == "internal error (request s8-grpc)"
    app.router.arm_fault.remote(point).result(timeout_s=30)
    body = {"prompt": [1, 2, 3], "max_tokens": 2, "request_id": "s8-http"}
    status, err = http(app, "/v1/completions", body)
    assert status == 500, err
    assert err == {
        "error": {
            "message": "internal error",
            "type": "server_error",
            "param": None,
            "code": "internal",
            "request_id": "s8-http",
        }
    }
    app.router.arm_fault.remote(point).result(timeout_s=30)
    req = urllib.request.Request(
        app.cluster.http_url + "/v1/completions",
        data=json.dumps({**body, "stream": True, "request_id": "s8-sse"}).encode(),
        headers={"content-type": "application/json", "authorization": f"Bearer {KEY}"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        events = [line for line in r.read().decode().splitlines() if line.startswith("data: ")]
    last = json.loads(events[-1][len("data: ") :])
    assert last["error"]["message"] == "internal error", events
    assert last["error"]["request_id"] == "s8-sse"
    for text in (info.value.details(), json.dumps(err), *events):
        assert_says_what_not_how(text)
    # the router keeps serving
    p = prompt(2, 8)
    assert tokens(app.generate(greedy_req(p, 4), KEY)) == reference(app, {"x": p}, 4)["x"]
    app.assert_clean()


# -- cancellation at each phase (F4, F8) ----------------------------------------------------------


def start_stream(app: App, req: pb.GenerateRequest) -> tuple[Any, list[Any], threading.Thread]:
    call = app.stub.Generate(req, metadata=app.auth(KEY), timeout=120)
    got: list[Any] = []

    def drain() -> None:
        try:
            for m in call:
                got.append(m)
        except grpc.RpcError as e:
            got.append(e)

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    return call, got, t


# phase: (role paused, fault point, prompt length, the request reaches decode, leases acked).
# Between prefill and decode the pause may be released before the cancel reaches the decode
# replica (the test releases once the client saw CANCELLED): then the pull runs and its lease
# is acked before the request is aborted (1 in one CI run beside the other worker), else the
# lease is aborted. Either way the request is aborted and nothing is left to expire.
CANCEL_PHASES: dict[str, tuple[str, str, int, bool, tuple[int, ...]]] = {
    "router queue": ("router", "router.before_relay", 8, False, (0,)),
    "decode queue": ("decode", "engine.step", 8, True, (0,)),
    "prefill queue": ("prefill", "engine.step", 40, True, (0,)),
    "prefilling": ("prefill", "p.after_prefill_before_publish", 40, True, (0,)),
    "between prefill and decode": ("decode", "d.after_alloc_before_pull", 40, True, (0, 1)),
    "decoding": ("decode", "d.mid_decode_token_k", 40, True, (1,)),
}
LONG = 2000  # tokens a decoding request still has to go when it is held mid-decode


def pause_at(app: App, role: str, point: str) -> None:
    if role == "router":
        app.router.arm_fault.remote(f"{point}=pause").result(timeout_s=30)
    else:
        app.arm(role, f"{point}=pause")


def wait_paused(app: App, role: str, point: str) -> None:
    if role != "router":
        app.wait_paused(role, point)
        return

    def paused() -> bool:
        return point in app.router.stats.remote().result(timeout_s=30)["paused_faults"]

    assert wait_until(paused, 30, 0.1), f"the router never paused at {point}"


def release_at(app: App, role: str, point: str) -> None:
    if role == "router":
        app.router.release_fault.remote(point).result(timeout_s=30)
    else:
        app.release(role, point)


def hold_decode_engine(app: App) -> None:
    """With a stream held at ``d.mid_decode_token_k``, the decode engine would go on to finish
    the request on its own (the fake model takes no time): hold it too, mid-generation, so only
    an abort can end the request."""
    app.arm("decode", "engine.step=pause")
    app.wait_paused("decode", "engine.step")


@pytest.mark.parametrize("phase", list(CANCEL_PHASES))
def test_cancel_at_each_phase_frees_every_block(app: App, phase: str) -> None:
    """F4/F8: a stream cancelled while its request sits at each phase. A cancel that was
    ignored would still free the blocks once the request finished, so the test asserts how
    the pools ended it: aborted on decode and never completed, no lease left to expire, and,
    in the router's queue, no pool ever saw it."""
    role, point, length, reaches_decode, acked = CANCEL_PHASES[phase]
    decoding = point == "d.mid_decode_token_k"
    before = outcome_counters(app)
    pause_at(app, role, point)
    req = greedy_req(prompt(7, length), LONG if decoding else 30, f"cancel-{role}")
    call, got, t = start_stream(app, req)
    try:
        wait_paused(app, role, point)
        if decoding:
            hold_decode_engine(app)
        call.cancel()
        t.join(30)
        assert got and isinstance(got[-1], grpc.RpcError)
        assert got[-1].code() == grpc.StatusCode.CANCELLED
    finally:
        if decoding:
            app.release("decode", "engine.step")
        release_at(app, role, point)
    app.assert_clean()
    ended = delta(before, outcome_counters(app))
    print(f"cancel while {phase}: {ended}")
    assert ended["decode.completed"] == 0, ended  # the cancelled request never completed
    assert ended["decode.aborted"] == (1 if reaches_decode else 0), ended
    assert ended["lease.expired"] == 0, ended  # nothing was left for a lease timeout to end
    assert ended["lease.acked"] in acked, ended
    if not reaches_decode:
        assert not any(ended.values()), ended
        assert app.router.stats.remote().result(timeout_s=30)["in_flight"] == 0
    # the next request succeeds
    p = prompt(8, length)
    assert tokens(app.generate(greedy_req(p, 6), KEY)) == reference(app, {"x": p}, 6)["x"]
    app.assert_clean()


def test_a_deadline_that_expires_mid_decode_ends_the_request_everywhere(app: App) -> None:
    """B9 mid-stream: a request whose timeout_ms passes while it decodes (stream and engine
    held mid-generation past the deadline) gets DEADLINE_EXCEEDED after its first tokens, and
    the decode pool aborts it: it never completes, its blocks are freed, no lease expires."""
    point = "d.mid_decode_token_k"
    before = outcome_counters(app)
    app.arm("decode", f"{point}=pause")
    req = greedy_req(prompt(9, 40), LONG, "deadline-mid-decode")
    req.timeout_ms = 3000
    t0 = time.monotonic()
    _call, got, t = start_stream(app, req)
    try:
        app.wait_paused("decode", point)
        hold_decode_engine(app)
        t.join(30)  # the deadline ends the call; nothing releases the pauses before
        took = time.monotonic() - t0
    finally:
        app.release("decode", "engine.step")
        app.release("decode", point)
    assert not t.is_alive()
    assert any(isinstance(m, pb.GenerateResponse) and m.token_ids for m in got), got
    assert isinstance(got[-1], grpc.RpcError), got[-1]
    assert got[-1].code() == grpc.StatusCode.DEADLINE_EXCEEDED, got[-1]
    assert 2.5 < took < 20, took
    app.assert_clean()
    ended = delta(before, outcome_counters(app))
    print(f"deadline mid-decode after {took:.2f} s: {ended}")
    assert ended["decode.completed"] == 0 and ended["decode.aborted"] == 1, ended
    assert ended["lease.expired"] == 0 and ended["lease.acked"] == 1, ended


def test_tiny_grpc_deadline_cancels_the_work(app: App) -> None:
    # B9: a 1 ms deadline: the client sees DEADLINE_EXCEEDED, the pools free the blocks.
    for i in range(5):
        with pytest.raises(grpc.RpcError) as info:
            list(
                app.stub.Generate(
                    greedy_req(prompt(i, 40), 50), metadata=app.auth(KEY), timeout=0.001
                )
            )
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    app.assert_clean()


# -- replicas killed (acceptance 4) ---------------------------------------------------------------


def test_prefill_killed_before_first_token_is_retried_on_another_replica(app: App) -> None:
    point = "p.after_prefill_before_publish"
    p = prompt(11, 48)
    expected = reference(app, {"k": p}, 10)["k"]
    retries_before = sum(s["prefill_retries"] for s in app.stats("decode").values())
    app.arm("prefill", f"{point}=pause")
    _call, got, t = start_stream(app, greedy_req(p, 10, "kill-prefill"))
    victim = app.wait_paused("prefill", point)
    try:
        os.kill(victim["pid"], signal.SIGKILL)
        # The survivor was armed too: let it through for the retry.
        handle, _ = app.pool("prefill")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and t.is_alive():
            with contextlib.suppress(Exception):
                handle.release_fault.remote(point).result(timeout_s=5)
            t.join(0.5)
        t.join(60)
    finally:
        wait_replicas_ready(app, "prefill", victim["pid"])
        app.release("prefill", point)
    assert got and not isinstance(got[-1], grpc.RpcError), got[-1]
    assert tokens(got) == expected
    assert got[-1].usage.prefill_mode == "remote"  # retried on the other prefill replica
    stats = app.stats("decode")
    assert sum(s["prefill_retries"] for s in stats.values()) > retries_before
    app.assert_clean()


def test_decode_killed_mid_stream_ends_the_stream_with_an_error(app: App) -> None:
    point = "d.mid_decode_token_k"
    app.arm("decode", f"{point}=pause")
    _call, got, t = start_stream(app, greedy_req(prompt(12, 40), 30, "kill-decode"))
    victim = app.wait_paused("decode", point)
    os.kill(victim["pid"], signal.SIGKILL)
    t.join(60)
    assert not t.is_alive()
    assert any(isinstance(m, pb.GenerateResponse) and m.token_ids for m in got)  # it had started
    err = got[-1]
    assert isinstance(err, grpc.RpcError), "the stream ended without an error status"
    assert err.code() in (grpc.StatusCode.ABORTED, grpc.StatusCode.UNAVAILABLE), err
    wait_replicas_ready(app, "decode", victim["pid"])
    # untouched requests succeed on the new replica; the prefill side's lease expired
    p = prompt(13, 40)
    assert tokens(app.generate(greedy_req(p, 6), KEY)) == reference(app, {"x": p}, 6)["x"]
    app.assert_clean()
