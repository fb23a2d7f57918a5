"""Driving a deployed pdserve app from tests: replicas, fault points, clean-up checks."""

from __future__ import annotations

import collections
import time
from typing import Any

import grpc
from ray import serve
from ray.serve.api import _run

from cluster.app import build_application
from cluster.config import ClusterConfig, RouterConfig
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc
from tests.helpers import SHORT_SHUTDOWN_WAIT
from tests.serve_fixtures import ServeCluster, free_port, wait_until

POOL_DEPLOYMENTS = {"decode": "DecodeServer", "prefill": "PrefillServer"}


class App:
    """One deployed app: handles to its pools, a gRPC stub on its router's own port (a free one
    unless the config names it)."""

    def __init__(
        self, cluster: ServeCluster, config: ClusterConfig, name: str, blocking: bool = True
    ) -> None:
        if config.router.grpc_port == RouterConfig().grpc_port:
            config = config.replace({"router.grpc_port": free_port()})
        if (
            config.router.graceful_shutdown_wait_loop_s
            == RouterConfig().graceful_shutdown_wait_loop_s
        ):
            config = config.replace(SHORT_SHUTDOWN_WAIT)  # real-model configs too
        self.cluster = cluster
        self.config = config
        self.name = name
        # Not blocking: returns as soon as the app is submitted (readiness tests watch it come up).
        _run(build_application(config), name=name, route_prefix="/", _blocking=blocking)
        self.decode = serve.get_deployment_handle(POOL_DEPLOYMENTS["decode"], name)
        self.prefill = (
            serve.get_deployment_handle(POOL_DEPLOYMENTS["prefill"], name)
            if config.prefill.num_replicas
            else None
        )
        self.router = serve.get_deployment_handle("Router", name)
        self.grpc_target = f"127.0.0.1:{config.router.grpc_port}"
        self.channel: Any = grpc.insecure_channel(self.grpc_target)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.metadata = [("application", name)]

    def close(self) -> None:
        if self.channel is not None:  # once
            self.channel.close()
            self.channel = None
            serve.delete(self.name)

    # -- calling -----------------------------------------------------------------------------

    def auth(self, key: str | None) -> list[tuple[str, str]]:
        return self.metadata + ([("authorization", f"Bearer {key}")] if key else [])

    def generate(
        self, req: pb.GenerateRequest, key: str | None = None, timeout: float = 60
    ) -> list[pb.GenerateResponse]:
        return list(self.stub.Generate(req, metadata=self.auth(key), timeout=timeout))

    # -- replicas ----------------------------------------------------------------------------

    @staticmethod
    def each_replica(
        handle: Any,
        method: str,
        *args: Any,
        replicas: int,
        within: float = 60,
        min_calls: int = 200,
    ) -> dict[str, Any]:
        """Call ``method`` until every one of ``replicas`` replicas answered (by replica id).

        Serve's router picks the replica; on a loaded machine it may avoid one whose queue-length
        probe was slow for a while, so this keeps asking (paced) for ``min_calls`` calls and up
        to ``within`` seconds."""
        seen: dict[str, Any] = {}
        deadline = time.monotonic() + within
        calls = 0
        while calls < min_calls or time.monotonic() < deadline:
            out = getattr(handle, method).remote(*args).result(timeout_s=30)
            calls += 1
            rid = out if isinstance(out, str) else out["replica_id"]
            seen[rid] = out
            if len(seen) >= replicas:
                return seen
            if calls >= 50:
                time.sleep(0.1)
        raise AssertionError(f"{method}: reached {len(seen)} of {replicas} replicas")

    def fresh_handle(self, role: str) -> Any:
        """A new handle to ``role``'s pool, kept as the app's from now on. After a replica was
        killed, the old handle's router can keep picking the survivor for a minute although
        Serve runs the replacement; a new handle starts from the controller's replica list."""
        handle = serve.get_deployment_handle(POOL_DEPLOYMENTS[role], self.name)
        setattr(self, role, handle)
        return handle

    def pool(self, role: str) -> tuple[Any, int]:
        if role == "decode":
            return self.decode, self.config.decode.num_replicas
        assert self.prefill is not None
        return self.prefill, self.config.prefill.num_replicas

    def stats(self, role: str) -> dict[str, dict[str, Any]]:
        handle, n = self.pool(role)
        return self.each_replica(handle, "stats", replicas=n)

    def arm(self, role: str, spec: str) -> None:
        handle, n = self.pool(role)
        self.each_replica(handle, "arm_fault", spec, replicas=n)

    def release(self, role: str, name: str) -> None:
        handle, n = self.pool(role)
        self.each_replica(handle, "release_fault", name, replicas=n)

    def wait_paused(self, role: str, name: str, timeout: float = 30) -> dict[str, Any]:
        """The stats of the replica paused at ``name``."""
        found: dict[str, Any] = {}

        def paused() -> bool:
            for s in self.stats(role).values():
                if name in s["paused_faults"]:
                    found.update(s)
                    return True
            return False

        assert wait_until(paused, timeout, 0.2), f"no {role} replica paused at {name}"
        return found

    def assert_clean(self, timeout: float | None = None) -> None:
        """0 KV blocks held and no leases on every replica; block integrity holds."""
        limit = timeout if timeout is not None else self.config.transfer.lease_s + 10

        def held() -> list[str]:
            bad = []
            for role in ("decode", "prefill") if self.prefill else ("decode",):
                for rid, s in self.stats(role).items():
                    if s["kv_used_blocks"] != 0 or s.get("num_active_leases"):
                        eng = s["engine"]  # who holds them: a live request, or no one (a leak)
                        live = ", ".join(
                            f"{k} {eng.get(k, 0)}"
                            for k in ("num_running", "num_waiting", "num_waiting_for_kv")
                        )
                        leases = s.get("num_active_leases", 0)
                        stages = s.get("handoff_stages", {})  # decode: streams still open
                        bad.append(
                            f"{role} {rid}: {s['kv_used_blocks']} blocks ({live}; leases "
                            f"{leases}; streams {stages})"
                        )
            return bad

        assert wait_until(lambda: not held(), limit, 0.25), held()
        for role in ("decode", "prefill") if self.prefill else ("decode",):
            handle, n = self.pool(role)
            for _ in range(4 * n):  # routing spreads the calls over the replicas
                assert handle.check_integrity.remote().result(timeout_s=30) == "ok"


def outcome_counters(app: App) -> collections.Counter[str]:
    """How the pools ended their requests, summed over the replicas: the engines' completed
    and aborted requests, the prefill side's leases by how they ended."""
    out: collections.Counter[str] = collections.Counter()
    for role in ("decode", "prefill"):
        for s in app.stats(role).values():
            engine = s["engine"]
            out[f"{role}.completed"] += engine["num_finished"] - engine["num_aborted"]
            out[f"{role}.aborted"] += engine["num_aborted"]
            if role == "prefill":
                for reason in ("acked", "aborted", "peer_aborted", "expired"):
                    out[f"lease.{reason}"] += s["transfer"].get(f"leases_{reason}", 0)
    return out


def delta(before: collections.Counter[str], after: collections.Counter[str]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in sorted(set(before) | set(after))}


def wait_replicas_ready(app: App, role: str, exclude_pid: int, timeout: float = 90) -> None:
    """After a kill: until the pool again has its replicas, none of them the killed one."""
    _, n = app.pool(role)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        handle = app.fresh_handle(role)  # one that knows the replacement once Serve runs it
        try:
            seen = app.each_replica(handle, "stats", replicas=n, within=3, min_calls=30)
            if all(s["pid"] != exclude_pid for s in seen.values()):
                return
        except Exception:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{role} pool did not recover within {timeout}s")
