"""L1's floor: the router's own gRPC listener alone, refusing every call, in a process of its own
(``python -m tests.serve.l1_floor PORT``).

No Ray, no pools, no admitted work: ``GrpcListener`` with an admission check that always says
RESOURCE_EXHAUSTED. What a burst of refusals costs on this machine before the cluster does
anything is what L1's burst client measures against it here; the test prints both. Prints READY
once serving, and stops when its stdin closes. Its event loop is uvloop, as in a Ray actor.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from collections.abc import AsyncIterator, Mapping
from typing import Any

from cluster.common.errors import ErrorCode, PDServeError
from cluster.config import config_from_dict
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.router.grpc_server import GrpcListener


def refuse() -> None:
    raise PDServeError(ErrorCode.RESOURCE_EXHAUSTED, "the floor server refuses every call")


async def never(
    _request: pb.GenerateRequest, _metadata: Mapping[str, str], _remaining: float | None
) -> AsyncIterator[Any]:  # admission refuses first: never called
    raise AssertionError("unreachable")
    yield


async def main(port: int) -> None:
    config = dataclasses.replace(config_from_dict({}).router, grpc_port=port)
    listener = GrpcListener(
        config,
        generate=never,
        model_info=lambda _metadata: pb.ModelInfo(),
        ready=lambda: True,
        admit=refuse,
    )
    await listener.start()
    print("READY", flush=True)
    await asyncio.to_thread(sys.stdin.read)
    await listener.stop(0)


if __name__ == "__main__":
    try:
        import uvloop  # Ray Serve's own loop (a dependency of ray[serve])
    except ImportError:
        asyncio.run(main(int(sys.argv[1])))
    else:
        uvloop.run(main(int(sys.argv[1])))
