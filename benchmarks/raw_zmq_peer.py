"""The transport's own limit for P4: a child answering each request with one contiguous buffer.

``python -m benchmarks.raw_zmq_peer MAX_BYTES [CORES]`` (``CORES``: e.g. ``1`` or ``2,3``, the
cores to run on, as the sender children of P4 do) binds a ROUTER on tcp 127.0.0.1 and on ipc,
prints ``{"tcp": ..., "ipc": ...}`` on stdout, then answers every ``[size]`` request with the
first ``size`` bytes of a pre-touched buffer, sent zero-copy. It exits when stdin closes.
No torch here, so it starts in a fraction of a second.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import numpy as np
import zmq


def main() -> None:
    max_bytes = int(sys.argv[1])
    if len(sys.argv) > 2 and sys.argv[2]:
        os.sched_setaffinity(0, {int(c) for c in sys.argv[2].split(",")})  # before any thread
    buf = np.full(max_bytes, 7, dtype=np.uint8)  # touched: no page faults while timed
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context(io_threads=1)
    ctx.linger = 0
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:0")
    tcp = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    path = os.path.join(tempfile.gettempdir(), f"pdserve-raw-{os.getpid()}.sock")
    sock.bind(f"ipc://{path}")
    print(json.dumps({"tcp": tcp, "ipc": f"ipc://{path}"}), flush=True)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(sys.stdin.fileno(), zmq.POLLIN)
    try:
        while True:
            events = dict(poller.poll())
            if sys.stdin.fileno() in events and not os.read(sys.stdin.fileno(), 1):
                return
            if sock in events:
                identity, size = sock.recv_multipart()
                sock.send_multipart([identity, buf[: int(size)].data], copy=False)
    finally:
        sock.close(linger=0)
        ctx.term()
        os.unlink(path)


if __name__ == "__main__":
    main()
