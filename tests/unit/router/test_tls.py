"""TLS and mTLS on the router's gRPC listener (reliability matrix S6, issue 12.10): real sockets and
handshakes against ``GrpcListener`` with certificates made here. A plaintext client, a client
that trusts another CA, and (mTLS) a client without a certificate or with one from another CA
are all refused; the right client gets SERVING."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.config import RouterConfig
from cluster.router.grpc_server import GrpcListener

pytest.importorskip("cryptography.x509")
from tests.tls_certs import Pem, cert, pem


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Pem]:
    ca, rogue = cert("pdserve test CA", None, True), cert("another CA", None, True)
    return {
        "ca": pem(*ca),
        "rogue_ca": pem(*rogue),
        "server": pem(*cert("router", ca, False)),
        "client": pem(*cert("client", ca, False)),
        "rogue_client": pem(*cert("client", rogue, False)),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(params=[False, True], ids=["tls", "mtls"])
def listener(request: Any, pki: dict[str, Pem], tmp_path: Path) -> Iterator[tuple[int, bool]]:
    files = {}
    for name, data in (
        ("cert", pki["server"][0]),
        ("key", pki["server"][1]),
        ("ca", pki["ca"][0]),
    ):
        files[name] = tmp_path / f"{name}.pem"
        files[name].write_bytes(data)
    mtls = request.param
    config = RouterConfig(
        grpc_port=_free_port(),
        tls_cert_file=str(files["cert"]),
        tls_key_file=str(files["key"]),
        tls_client_ca_file=str(files["ca"]) if mtls else "",
    )

    def unused(*args: Any) -> Any:
        raise AssertionError("not called in this test")

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> tuple[GrpcListener, int]:  # grpc.aio binds to the loop it starts on
        server = GrpcListener(
            config, generate=unused, model_info=unused, ready=lambda: True, admit=lambda: None
        )
        return server, await server.start()

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        yield port, mtls
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def _check(channel: grpc.Channel) -> int:
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status


def _secure(port: int, ca: bytes, client: Pem | None = None) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(
        root_certificates=ca,
        private_key=client[1] if client else None,
        certificate_chain=client[0] if client else None,
    )
    return grpc.secure_channel(f"localhost:{port}", creds)


def _refused(channel: grpc.Channel) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        _check(channel)
    return e.value.code()


def test_only_a_client_that_trusts_the_router_and_is_trusted_gets_through(
    listener: tuple[int, bool], pki: dict[str, Pem]
) -> None:
    port, mtls = listener
    serving = health_pb2.HealthCheckResponse.SERVING
    ca = pki["ca"][0]
    # Plaintext to a TLS port: the handshake fails.
    assert _refused(grpc.insecure_channel(f"127.0.0.1:{port}")) == grpc.StatusCode.UNAVAILABLE
    # A client that trusts another CA refuses the router's certificate.
    rogue = _secure(port, pki["rogue_ca"][0], pki["client"])
    assert _refused(rogue) == grpc.StatusCode.UNAVAILABLE
    if mtls:
        assert _refused(_secure(port, ca)) == grpc.StatusCode.UNAVAILABLE  # no client cert
        foreign = _secure(port, ca, pki["rogue_client"])  # a client cert from another CA
        assert _refused(foreign) == grpc.StatusCode.UNAVAILABLE
    else:
        assert _check(_secure(port, ca)) == serving  # TLS alone: no client cert needed
    assert _check(_secure(port, ca, pki["client"])) == serving


def test_https_on_the_http_proxy_uses_the_same_certificate() -> None:
    from cluster.serve_main import http_options

    plain = http_options(RouterConfig())
    assert plain.ssl_certfile is None and plain.ssl_keyfile is None
    tls = http_options(RouterConfig(tls_cert_file="/c.pem", tls_key_file="/k.pem"))
    assert (tls.ssl_certfile, tls.ssl_keyfile) == ("/c.pem", "/k.pem")
