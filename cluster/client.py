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
        *,
        tls_ca_file: str | None = None,
        tls_client_cert_file: str | None = None,
        tls_client_key_file: str | None = None,
    ) -> None:
        """``tls_ca_file``: TLS, trusting that CA's certificates (the router's
        ``router.tls_cert_file``); with the client pair as well: mTLS."""
        options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
        if tls_ca_file is None:
            if tls_client_cert_file or tls_client_key_file:
                raise ValueError("a client certificate needs TLS: give tls_ca_file as well")
            self.channel = grpc.insecure_channel(target, options=options)
        else:
            creds = grpc.ssl_channel_credentials(
                root_certificates=_read(tls_ca_file),
                private_key=_read(tls_client_key_file) if tls_client_key_file else None,
                certificate_chain=_read(tls_client_cert_file) if tls_client_cert_file else None,
            )
            self.channel = grpc.secure_channel(target, creds, options=options)
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


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
