"""A pool worker process for tests: a PrefillWorker or DecodeWorker behind the test RPC.

    python -m tests.harness.worker prefill --config-json '{...}' --ready-file F
    python -m tests.harness.worker decode --config-json '{...}' --ready-file F --prefill EP [...]

Writes ``{"endpoint", "pid"}`` to the ready file once serving; exits when its parent dies.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from cluster.common.errors import ErrorCode, PDServeError
from cluster.common.protocol import GenerateCall, PrefillCall, PrefillReply, StreamChunk
from cluster.config import config_from_dict
from tests.harness.rpc import RpcClient, RpcServer

FIRST_REPLY_TIMEOUT_S = 3.0


class HarnessPrefillClient:
    """Round-robin over prefill workers; before the first reply, retry on another one."""

    def __init__(self, endpoints: list[str]) -> None:
        self.endpoints = endpoints
        self._clients: dict[str, RpcClient] = {}
        self._next = 0

    def _client(self, ep: str) -> RpcClient:
        if ep not in self._clients:
            self._clients[ep] = RpcClient(ep)
        return self._clients[ep]

    async def prefill(self, call: PrefillCall) -> AsyncIterator[PrefillReply]:
        order = self.endpoints[self._next :] + self.endpoints[: self._next]
        self._next = (self._next + 1) % len(self.endpoints)
        last: Exception | None = None
        for ep in order:  # excluding each failed replica in turn
            stream = self._client(ep).stream("prefill", call)
            try:
                # A dead worker's endpoint never connects (no disconnect event): bound the wait.
                first = await asyncio.wait_for(stream.__anext__(), FIRST_REPLY_TIMEOUT_S)
            except (PDServeError, asyncio.TimeoutError) as e:
                if isinstance(e, PDServeError) and e.code != ErrorCode.UNAVAILABLE:
                    raise
                last = e
                await stream.aclose()
                continue
            try:
                yield first
                async for item in stream:
                    yield item
            finally:
                await stream.aclose()
            return
        raise PDServeError(ErrorCode.UNAVAILABLE, f"no prefill worker answered: {last}")


class Target:
    def __init__(self, server: Any) -> None:
        self.server = server

    def prefill(self, call: PrefillCall) -> AsyncIterator[PrefillReply]:
        return self.server.prefill(call)

    def generate(self, call: GenerateCall) -> AsyncIterator[StreamChunk]:
        return self.server.generate(call)

    def stats(self) -> dict[str, Any]:
        s = dict(self.server.stats())
        s["kv_used_blocks"] = s["engine"]["kv"]["num_used_blocks"]  # as of the last step
        s["alive"] = self.server.is_alive()
        return s

    def integrity(self) -> str:
        try:
            self.server.engine.check_integrity()
        except AssertionError as e:
            return str(e)
        return "ok"

    def pid(self) -> int:
        return os.getpid()

    def release_fault(self, name: str) -> bool:
        self.server.faults.release(name)
        return True

    async def wait_paused(self, name: str, timeout: float) -> bool:
        return await asyncio.to_thread(self.server.faults.wait_paused, name, timeout)


async def _watch_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:
            os._exit(1)  # the launcher died: never linger as an orphan (F13)
        await asyncio.sleep(0.2)


async def main(args: argparse.Namespace) -> None:
    parent = os.getppid()
    config = config_from_dict(json.loads(args.config_json))
    server: Any
    if args.role == "prefill":
        from cluster.prefill_worker.worker import PrefillWorker

        server = PrefillWorker(config, kv_port=args.kv_port).start()
    else:
        from cluster.decode_worker.worker import DecodeWorker

        client = HarnessPrefillClient(args.prefill) if args.prefill else None
        server = DecodeWorker(config, client).start()
    rpc = RpcServer(Target(server), port=args.rpc_port)
    ready = Path(args.ready_file)
    tmp = ready.with_suffix(".tmp")
    tmp.write_text(json.dumps({"endpoint": rpc.endpoint, "pid": os.getpid()}))
    tmp.rename(ready)
    watcher = asyncio.create_task(_watch_parent(parent))
    try:
        await rpc.serve_forever()
    finally:
        watcher.cancel()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["prefill", "decode"])
    p.add_argument("--config-json", required=True)
    p.add_argument("--ready-file", required=True)
    p.add_argument("--prefill", action="append", default=[])
    p.add_argument("--rpc-port", type=int, default=0)  # fixed: a restart at the same address
    p.add_argument("--kv-port", type=int, default=0)
    logging.basicConfig(
        level=logging.DEBUG if os.environ.get("PDSERVE_TEST_DEBUG") else logging.INFO,
        format="%(asctime)s %(threadName)s %(name)s: %(message)s",
    )
    asyncio.run(main(p.parse_args()))
