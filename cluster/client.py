"""A small Python gRPC client for a running pdserve cluster (torch-free).

from cluster.client import PDServeClient
client = PDServeClient("127.0.0.1:9000")
for msg in client.generate(messages=[{"role": "user", "content": "Hi!"}], max_tokens=32):
    print(msg.text, end="", flush=True)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc


class PDServeClient:
    def __init__(
        self,
        target: str = "127.0.0.1:9000",
        api_key: str | None = None,
        max_message_bytes: int = 4 << 20,
    ) -> None:
        self.channel = grpc.insecure_channel(
            target,
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
            ],
        )
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.metadata = [("authorization", f"Bearer {api_key}")] if api_key else []

    def is_serving(self, timeout: float = 1.0) -> bool:
        try:
            reply = self.health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[Mapping[str, str]] | None = None,
        token_ids: Sequence[int] | None = None,
        request_id: str = "",
        timeout: float | None = None,
        **sampling: Any,
    ) -> Iterator[pb.GenerateResponse]:
        """Stream a generation; sampling keywords are SamplingParameters fields."""
        req = pb.GenerateRequest(request_id=request_id, sampling=pb.SamplingParameters(**sampling))
        if messages is not None:
            req.messages.messages.extend(pb.ChatMessage(**m) for m in messages)
        elif token_ids is not None:
            req.token_ids.ids.extend(token_ids)
        elif prompt is not None:
            req.prompt = prompt
        else:
            raise ValueError("prompt, messages or token_ids is required")
        yield from self.stub.Generate(req, timeout=timeout, metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()
