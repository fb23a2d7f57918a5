"""Arms side by side each get a gRPC port of their own (``measure.deploy.arm_ports``): the first
arm's, then the next free ones up. The first often comes from the ephemeral range, where the
next port up may be another process's: the plan check's smoke run once failed to deploy its
third arm on one."""

from __future__ import annotations

import socket

from cluster.planner.measure.deploy import arm_ports
from tests.helpers import make_config


def _listening_port() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_each_arm_its_own_free_port_skipping_taken_ones() -> None:
    taken = _listening_port()
    base = taken.getsockname()[1] - 1  # the second arm's natural port is taken
    try:
        cfg = make_config(**{"router.grpc_port": base})
        ports = {
            arm: c.router.grpc_port for arm, c in arm_ports({"a": cfg, "b": cfg, "c": cfg}).items()
        }
    finally:
        taken.close()
    assert ports["a"] == base  # the first arm keeps the configured port
    assert ports["b"] > base + 1 and ports["c"] > ports["b"]  # up, around the taken one
    assert len(set(ports.values())) == 3
