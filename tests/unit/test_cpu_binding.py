"""Pool replicas on cores of their own (``cluster.serving.cpu_binding``): the node-local claims
are disjoint across live processes, come back when a process is gone (even when its pid is
reused), survive a damaged claim file, and the binding covers every thread of the process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from cluster.config import allowed_cores, load_config
from cluster.serve_main import local_threads
from cluster.serving import cpu_binding
from cluster.serving.cpu_binding import bind_replica, claim_cores, release, start_time

pytestmark = pytest.mark.timeout(60)
CORES = allowed_cores()
two_cores = pytest.mark.skipif(len(CORES) < 2, reason="needs 2 cores this process may use")

# A child that claims ``n`` cores from the claim file, prints them, and holds them until stdin
# closes (or is killed).
HOLDER = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from cluster.serving.cpu_binding import claim_cores
    cores = claim_cores(int(sys.argv[2]), path=Path(sys.argv[1]))
    print(json.dumps(cores), flush=True)
    sys.stdin.read()
    """
)


def _holder(path: Path, n: int) -> tuple[subprocess.Popen[str], list[int] | None]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path), str(n)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())


def _end(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(timeout=30)


@two_cores
def test_live_claims_are_disjoint_and_a_dead_process_gives_its_cores_back(tmp_path: Path) -> None:
    path = tmp_path / "cpus.json"
    first, cores_a = _holder(path, 1)
    try:
        assert cores_a == [CORES[0]]  # the lowest free core
        second, cores_b = _holder(path, len(CORES) - 1)
        assert cores_b == list(CORES[1:])  # every other core: none held twice
        third, none = _holder(path, 1)
        assert none is None  # all held: that process runs unbound
        _end(third)
        first.kill()  # no release: its claim must still go
        first.wait(timeout=30)
        fourth, again = _holder(path, 1)
        assert again == [CORES[0]]
        _end(fourth)
        _end(second)
    finally:
        for p in (first,):
            if p.poll() is None:
                p.kill()
    claims = json.loads(path.read_text())["claims"]
    # The holders that ended normally released; the killed one was dropped as gone.
    assert all(c["pid"] != first.pid for c in claims)


def test_a_reused_pid_is_not_its_predecessor(tmp_path: Path) -> None:
    path = tmp_path / "cpus.json"
    # pid 1 is alive, but this claim's start time is not its: a predecessor that is gone.
    path.write_text(json.dumps({"claims": [{"pid": 1, "start": -5, "cores": list(CORES)}]}))
    try:
        assert claim_cores(1, path=path) == (CORES[0],)
        claims = json.loads(path.read_text())["claims"]
        assert [c["pid"] for c in claims] == [os.getpid()]
        assert claims[0]["start"] == start_time(os.getpid())
    finally:
        release(path=path)
    assert json.loads(path.read_text())["claims"] == []


def test_a_damaged_claim_file_is_started_afresh(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "cpus.json"
    path.write_text('{"claims": [{"pid": ')  # torn write
    try:
        assert claim_cores(1, path=path) == (CORES[0],)
    finally:
        release(path=path)
    assert "unreadable" in caplog.text


def test_more_cores_than_the_process_may_use_is_no_claim(tmp_path: Path) -> None:
    path = tmp_path / "cpus.json"
    assert claim_cores(len(CORES) + 1, path=path) is None
    assert json.loads(path.read_text())["claims"] == []
    with pytest.raises(ValueError, match="must be >= 1"):
        claim_cores(0, path=path)


def test_binding_covers_every_thread_of_the_process() -> None:
    # In a child: binding this test process would pin the rest of the session.
    code = textwrap.dedent(
        """
        import os, threading
        from cluster.serving.cpu_binding import bind_process, thread_ids
        stop = threading.Event()
        before = threading.Thread(target=stop.wait); before.start()
        core = sorted(os.sched_getaffinity(0))[-1]
        bind_process([core])
        after = threading.Thread(target=stop.wait); after.start()  # inherits the binding
        masks = {tid: sorted(os.sched_getaffinity(tid)) for tid in thread_ids()}
        stop.set(); before.join(); after.join()
        assert len(masks) >= 3, masks
        assert all(m == [core] for m in masks.values()), masks
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_a_replica_binds_only_when_on_and_sized(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def fake_claim(n: int) -> tuple[int, ...]:
        calls.append(n)
        return tuple(range(n))

    bound: list[tuple[int, ...]] = []
    monkeypatch.setattr(cpu_binding, "claim_cores", fake_claim)
    monkeypatch.setattr(cpu_binding, "bind_process", lambda cores: bound.append(tuple(cores)))
    assert bind_replica("decode", "off", 1) is None
    assert bind_replica("decode", "auto", 1) is None  # auto is resolved by the launcher
    assert bind_replica("decode", "on", None) is None  # all cores: nothing to own
    assert bind_replica("decode", "on", 2) == (0, 1)
    assert calls == [2] and bound == [(0, 1)]
    monkeypatch.setattr(cpu_binding, "claim_cores", lambda n: None)
    assert bind_replica("prefill", "on", 1) is None  # none free: unbound
    assert bound == [(0, 1)]


def test_the_local_launcher_turns_auto_on_and_keeps_an_explicit_choice() -> None:
    cfg = local_threads(load_config(None))
    assert (cfg.prefill.cpu_binding, cfg.decode.cpu_binding) == ("on", "on")
    assert cfg.prefill.num_threads is not None and cfg.decode.num_threads is not None
    cfg = local_threads(load_config(None).replace({"decode.cpu_binding": "off"}))
    assert (cfg.prefill.cpu_binding, cfg.decode.cpu_binding) == ("on", "off")
    assert load_config(None).decode.cpu_binding == "auto"  # joining a cluster: left off
    with pytest.raises(ValueError, match="decode.cpu_binding"):
        load_config(None).replace({"decode.cpu_binding": "always"})


def test_the_local_launcher_counts_every_rank_of_a_tensor_parallel_replica(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import cluster.serve_main as serve_main

    monkeypatch.setattr(serve_main, "cpu_count", lambda: 16)
    cfg = local_threads(load_config(None).replace({"decode.tensor_parallel_size": 2}))
    # 1 prefill replica + 1 decode replica of 2 ranks: 3 ranks, 5 threads each
    assert (cfg.prefill.num_threads, cfg.decode.num_threads) == (5, 5)
    cfg = local_threads(load_config(None))
    assert (cfg.prefill.num_threads, cfg.decode.num_threads) == (8, 8)


def test_an_unbound_replica_takes_cores_once_they_are_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from cluster.serving import replica as replica_mod
    from cluster.serving.replica import REBIND_S, PoolReplica

    free: list[tuple[int, ...] | None] = [None, (3,)]  # held by an old replica, then freed
    tries: list[bool] = []

    def fake_bind(config: Any, role: str, *, retry: bool = False) -> tuple[int, ...] | None:
        tries.append(retry)
        return free.pop(0)

    monkeypatch.setattr(replica_mod, "bind_pool_replica", fake_bind)
    r = object.__new__(PoolReplica)  # the method alone: no worker, no Serve
    r.role = "decode"  # type: ignore[misc]
    r.config = load_config(None).replace({"decode.cpu_binding": "on"})
    r.pool = r.config.decode
    r.cores = None
    r._next_bind = 100.0
    r.maybe_rebind(99.0)  # not yet
    assert tries == []
    r.maybe_rebind(100.0)  # none free
    assert tries == [True] and r.cores is None
    r.maybe_rebind(100.0 + REBIND_S / 2)  # waits its period
    assert tries == [True]
    r.maybe_rebind(100.0 + REBIND_S)
    assert r.cores == (3,)
    r.maybe_rebind(1e9)  # bound: never again
    assert tries == [True, True]
    r.pool = load_config(None).decode  # auto (unresolved): never
    r.cores = None
    r.maybe_rebind(2e9)
    assert tries == [True, True]
