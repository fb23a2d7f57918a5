"""L1's second client: one call at a time from a process of its own, while the test's burst
overloads the router (``python -m tests.serve.l1_probe TARGET``).

The burst's 200 calls leave one asyncio process on a shared machine, so the latencies that
client measures include its own send loop. This client measures what a caller arriving during
the overload sees. It prints READY once connected, then calls Generate (the first chunk, then
it cancels) every 20 ms until its stdin closes, and prints one JSON line: [code, seconds] per
call.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import grpc

from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc


def main(target: str) -> None:
    channel = grpc.insecure_channel(target)
    stub = pb_grpc.GenerationStub(channel)
    grpc.channel_ready_future(channel).result(timeout=30)
    req = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[5 + i % 97 for i in range(24)]),
        sampling=pb.SamplingParameters(
            max_tokens=16, min_tokens=16, temperature=0.0, ignore_eos=True
        ),
    )
    done = threading.Event()

    def until_stdin_closes() -> None:
        sys.stdin.read()
        done.set()

    threading.Thread(target=until_stdin_closes, daemon=True).start()
    print("READY", flush=True)
    out: list[tuple[str, float]] = []
    while not done.is_set():
        t0 = time.perf_counter()
        code = "OK"
        call = stub.Generate(req, timeout=30)
        try:
            for msg in call:
                if msg.token_ids:
                    break
        except grpc.RpcError as e:
            code = e.code().name
        out.append((code, time.perf_counter() - t0))
        call.cancel()
        done.wait(0.02)
    channel.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
