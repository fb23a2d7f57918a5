"""`pdserve serve` as a process (its own local Ray, the fake model): public listeners without API
keys are refused before anything starts unless explicitly allowed (then with a warning), the
listeners follow ``router.host``, both serve TLS from ``router.tls_*`` (S6: gRPC on the router's
own listener and HTTPS on Serve's proxy, real handshakes; plaintext refused), and a SIGKILLed
launcher leaves no process behind (F13).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from cluster.client import PDServeClient
from tests.helpers import SHORT_SHUTDOWN_SETS
from tests.serve_fixtures import free_port
from tests.tls_certs import cert, pem

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
FAKE = [
    *("--set", "model.runner=fake"),
    *("--set", "testing.enabled=true"),
    *("--set", "cache.num_blocks=128"),
    *("--set", "prefill.num_cpus=0.25"),
    *("--set", "decode.num_cpus=0.25"),
    *SHORT_SHUTDOWN_SETS,
    *("--metrics-port", "0"),
]


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k not in ("PDSERVE_API_KEYS", "PDSERVE_CONFIG")}
    e["RAY_ADDRESS"] = ""  # its own local Ray, never the test session's
    return e


def serve_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "cluster.cli", "serve", *FAKE, *args]


def test_public_listeners_without_api_keys_are_refused_before_anything_starts() -> None:
    t0 = time.monotonic()
    out = subprocess.run(
        serve_cmd("--set", "router.host=0.0.0.0"),
        capture_output=True,
        text=True,
        timeout=120,
        env=env(),
        cwd=ROOT,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "router.host: '0.0.0.0' is not a loopback address and no API keys" in out.stderr
    assert "--allow-unauthenticated" in out.stderr
    assert "Started a local Ray" not in out.stdout + out.stderr
    assert time.monotonic() - t0 < 60


def listening(pids: set[int]) -> set[tuple[str, int]]:
    found = set()
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            for c in psutil.Process(pid).net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    found.add((c.laddr.ip, c.laddr.port))
    return found


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    left = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
    return left


def _tls_files(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A test CA and a router certificate signed by it: (ca, cert, key) PEM files."""
    ca = cert("pdserve test CA", None, True)
    files = {"ca": pem(*ca)[0], **dict(zip(("cert", "key"), pem(*cert("router", ca, False))))}
    for name, data in files.items():
        (tmp_path / f"{name}.pem").write_bytes(data)
    return tmp_path / "ca.pem", tmp_path / "cert.pem", tmp_path / "key.pem"


def _wait_until_up(proc: subprocess.Popen[bytes], log_path: Path) -> str:
    """The launcher's log once it says pdserve is up (fails if it exits or takes 240 s)."""
    deadline = time.monotonic() + 240
    while "pdserve is up" not in log_path.read_text():
        assert proc.poll() is None, log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, "pdserve serve did not come up"
        time.sleep(1)
    return log_path.read_text()


def _check_tls_only(grpc_port: int, http_port: int, ca_file: str) -> None:
    """Both listeners answer over TLS with the test CA and refuse plaintext."""
    client = PDServeClient(f"localhost:{grpc_port}", tls_ca_file=ca_file)
    plain = PDServeClient(f"localhost:{grpc_port}")
    try:
        assert [m.text for m in client.generate("t5 t6 t7", max_tokens=3, timeout=60)]
        assert not plain.is_serving(timeout=5)  # no plaintext gRPC
    finally:
        client.close()
        plain.close()
    https = ssl.create_default_context(cafile=ca_file)
    with urllib.request.urlopen(f"https://localhost:{http_port}/health", context=https) as r:
        assert r.status == 200
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        urllib.request.urlopen(f"http://localhost:{http_port}/health", timeout=10)


def _check_bound_to_every_interface(pids: set[int], grpc_port: int, http_port: int) -> None:
    bound = listening(pids)
    on = {port: {ip for ip, p in bound if p == port} for port in (grpc_port, http_port)}
    # gRPC takes the wildcard 0.0.0.0 for "every interface" and binds it dual-stack (::)
    assert on in (
        {grpc_port: {"0.0.0.0"}, http_port: {"0.0.0.0"}},
        {grpc_port: {"::"}, http_port: {"0.0.0.0"}},
    ), on


def _kill_launcher_and_check_nothing_is_left(
    proc: subprocess.Popen[bytes], tree: list[psutil.Process], ports: tuple[int, ...]
) -> None:
    """F13: the launcher dies without a chance to clean up; its processes and ports go too."""
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    deadline = time.monotonic() + 10
    while alive(tree) and time.monotonic() < deadline:
        time.sleep(0.2)
    survivors = [(p.pid, p.name()) for p in alive(tree)]
    assert not survivors, survivors
    for port in ports:  # released (connections may linger in TIME_WAIT,
        with socket.socket() as s:  # which a restarted server's SO_REUSEADDR binds over)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("0.0.0.0", port))


def test_opt_in_warns_follows_router_host_serves_tls_and_a_killed_launcher_leaves_nothing(
    tmp_path: Path,
) -> None:
    http_port, grpc_port = free_port(), free_port()
    log_path = tmp_path / "serve.log"
    ca_file, cert_file, key_file = _tls_files(tmp_path)
    args = (
        *("--allow-unauthenticated", "--set", "router.host=0.0.0.0"),
        *("--set", f"router.tls_cert_file={cert_file}"),
        *("--set", f"router.tls_key_file={key_file}"),
    )
    ports = ("--set", f"router.http_port={http_port}", "--set", f"router.grpc_port={grpc_port}")
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            serve_cmd(*args, *ports),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env(),
            cwd=ROOT,
            start_new_session=True,
        )
    tree: list[psutil.Process] = []
    try:
        text = _wait_until_up(proc, log_path)
        assert "WARNING: serving on 0.0.0.0" in text and "WITHOUT authentication" in text
        _check_tls_only(grpc_port, http_port, str(ca_file))
        tree = psutil.Process(proc.pid).children(recursive=True)
        _check_bound_to_every_interface({proc.pid, *(p.pid for p in tree)}, grpc_port, http_port)
        _kill_launcher_and_check_nothing_is_left(proc, tree, (grpc_port, http_port))
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in alive(tree):  # never leak processes into the rest of the suite
            p.kill()
