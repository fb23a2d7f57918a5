"""The KV-transfer data plane: move a prefilled request's KV blocks from a prefill pool into a
decode pool (pull with a lease). See README.md, "KV transfer", for the wire format and the protocol.

    sender = KVSender(config.transfer, KVPool(kv_cache, layout), on_release=..., epoch=...)
    params = sender.register(request_id, block_ids, num_tokens=n)      # prefill side
    receiver.pull(params, reserved[k:], first_block=k)                  # decode side
"""

from __future__ import annotations

from cluster.common.kv_wire import KVTransferError, KVTransferParams, Reason, TransferState
from cluster.kv_transfer.faulty import FaultRule, FaultyTransport
from cluster.kv_transfer.pool import KVPool
from cluster.kv_transfer.receiver import KVReceiver, PullResult
from cluster.kv_transfer.sender import KVSender, ReleaseReason
from cluster.kv_transfer.transports import TRANSPORTS, get_transport

__all__ = [
    "TRANSPORTS",
    "FaultRule",
    "FaultyTransport",
    "KVPool",
    "KVReceiver",
    "KVSender",
    "KVTransferError",
    "KVTransferParams",
    "PullResult",
    "Reason",
    "ReleaseReason",
    "TransferState",
    "get_transport",
]
