"""The KV-transfer data plane: move a prefilled request's KV blocks from a prefill pool into a
decode pool (pull with a lease). The wire format and the conversation are in ``protocol.py``;
docs/kv-transfer.md walks through them.

    sender = KVSender(config.transfer, KVPool(kv_cache, layout), on_release=..., epoch=...)
    params = sender.register(request_id, block_ids, num_tokens=n)      # prefill side
    receiver.pull(params, reserved[k:], first_block=k)                  # decode side
"""

from __future__ import annotations

from cluster.kv_transfer.pool import KVPool
from cluster.kv_transfer.protocol import KVTransferError, KVTransferParams, Reason, TransferState
from cluster.kv_transfer.receiver import KVReceiver, PullResult
from cluster.kv_transfer.sender import KVSender, ReleaseReason
from cluster.kv_transfer.transports import TRANSPORTS, get_transport

__all__ = [
    "TRANSPORTS",
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
