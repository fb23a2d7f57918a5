"""The README's calls (pdserve generate, Python gRPC, curl, openai) run as written against
`pdserve serve` (its own local Ray, the real default model), which then stops cleanly on Ctrl-C.
Only the ports change: the test picks free ones.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.serve_fixtures import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
SNIPPET = re.compile(r"<!-- snippet: (\w[\w-]*) -->\n```(\w+)\n(.*?)```", re.S)


def snippets() -> dict[str, tuple[str, str]]:
    text = (ROOT / "README.md").read_text()
    return {name: (lang, code) for name, lang, code in SNIPPET.findall(text)}


def test_readme_has_the_four_calls() -> None:
    found = snippets()
    assert set(found) == {"generate", "grpc", "curl", "openai"}
    assert found["generate"][1].startswith("pdserve generate")
    assert "127.0.0.1:9000" in found["grpc"][1]
    assert all(":8000" in found[k][1] for k in ("curl", "openai"))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("serve")
    ports = {"http": free_port(), "grpc": free_port()}
    cfg = tmp / "pdserve.yaml"
    cfg.write_text(
        yaml.safe_dump({"router": {"http_port": ports["http"], "grpc_port": ports["grpc"]}})
    )
    env = {
        **os.environ,
        "PDSERVE_CONFIG": str(cfg),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "RAY_ADDRESS": "",  # its own local Ray, never the test session's
    }
    log = (tmp / "serve.log").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "serve", "--config", str(cfg)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while "pdserve is up" not in (tmp / "serve.log").read_text():
            assert proc.poll() is None, (tmp / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "pdserve serve did not come up"
            time.sleep(1)
        yield {"ports": ports, "env": env, "proc": proc, "log": tmp / "serve.log"}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
        log.close()


@pytest.mark.parametrize("name", ["generate", "grpc", "curl", "openai"])
def test_snippet_runs_against_pdserve_serve(served: dict, name: str) -> None:
    lang, code = snippets()[name]
    code = code.replace(":9000", f":{served['ports']['grpc']}")
    code = code.replace(":8000", f":{served['ports']['http']}")
    argv = ["bash", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
    out = subprocess.run(
        argv, capture_output=True, text=True, timeout=240, env=served["env"], cwd=ROOT
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Paris" in out.stdout, out.stdout + out.stderr


def test_ctrl_c_stops_it_cleanly(served: dict) -> None:
    proc = served["proc"]
    text = served["log"].read_text()
    assert f"127.0.0.1:{served['ports']['grpc']}" in text  # it printed how to call it
    proc.send_signal(signal.SIGINT)
    try:
        code = proc.wait(90)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)  # its threads' stacks, into the log
        time.sleep(2)
        raise AssertionError(served["log"].read_text()[-6000:]) from None
    log = served["log"].read_text()
    assert code == 0, log[-3000:]
    assert "shutting down" in log and "Serve stopped" in log and "Ray stopped" in log, log[-3000:]
