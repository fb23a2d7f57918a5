"""The tests' sender peer: ``benchmarks.kv_sender_peer``'s child with faults injected.

Two more spec keys: ``faults`` (fault points, ``testing.fault_points`` syntax, e.g.
``"p.mid_send_frame_k:4=kill"``) and ``wire_faults`` (one mapping of ``FaultRule`` fields per
rule). The child runs as ``python -m tests.harness.kv_sender_peer`` from the repository root.
"""

from __future__ import annotations

import sys
from pathlib import Path

from benchmarks.kv_sender_peer import SenderProcess, read_message, serve
from cluster.common.faults import FaultPoints
from tests.harness.kv_faults import FaultRule, FaultyTransport

ROOT = Path(__file__).resolve().parents[2]


class FaultySenderProcess(SenderProcess):
    module = "tests.harness.kv_sender_peer"
    cwd = ROOT
    spec_keys = SenderProcess.spec_keys | {"faults", "wire_faults"}


def main() -> None:
    spec = read_message(sys.stdin.buffer)
    rules = [FaultRule(**r) for r in spec.get("wire_faults", [])]
    serve(
        spec,
        fault_points=FaultPoints(spec.get("faults", [])),
        faults=FaultyTransport(rules) if rules else None,
    )


if __name__ == "__main__":
    main()
