"""The transport registry: the single source of transport names (config validates against it).

A transport is chosen per peer pair at the handshake: the first name of the receiver's
``transfer.transports`` that the sender offers and the pair allows (``TransportSpec.pair_ok``).
"""

from __future__ import annotations

from cluster.kv_transfer.transports.base import TransportSpec
from cluster.kv_transfer.transports.cuda_ipc import CUDA_IPC
from cluster.kv_transfer.transports.direct import LOOPBACK, SHM
from cluster.kv_transfer.transports.torch_dist import TORCH_DIST
from cluster.kv_transfer.transports.zmq_frames import ZMQ

TRANSPORTS: dict[str, TransportSpec] = {
    spec.name: spec for spec in (LOOPBACK, SHM, ZMQ, TORCH_DIST, CUDA_IPC)
}


def get_transport(name: str) -> TransportSpec:
    try:
        return TRANSPORTS[name]
    except KeyError:
        raise ValueError(f"transport: unknown {name!r}; valid: {', '.join(TRANSPORTS)}") from None


__all__ = ["TRANSPORTS", "TransportSpec", "get_transport"]
