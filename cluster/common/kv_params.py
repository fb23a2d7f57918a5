"""The KV transfer handle a prefill replica gives a decode replica, beside ``KVLayout``.

It travels inside ``PrefillReply`` / ``PrefillProgress`` over Ray (which serializes the objects
themselves, once, at the boundary) and is read back as this type, never as a dict. Its plain form
for pdserve's own pipes and sockets is ``cluster.kv_transfer.protocol``'s codec, which also checks
``protocol_version`` (``check_params``) before a pull uses a handle.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.common.kv_layout import KVLayout

# The KV transfer protocol's version (``cluster.kv_transfer.protocol``): every wire header and
# every handle carries it. Bump on any change to a message's fields or meaning (or to the
# block-hash chain). 2: PullRequest.final (streamed leases are pulled in parts),
# HelloReply.cuda_ipc.
PROTOCOL_VERSION = 2


@dataclass(frozen=True, slots=True)
class KVTransferParams:
    """What a decode replica needs to pull a prefilled request's KV.

    ``block_ids`` are the source pool's block ids in prompt order (one per block of
    ``num_tokens``, the last possibly partial); ``block_hashes`` the prefix-cache hashes of the
    full ones. The lease is named by ``transfer_id`` (unique per registration), not by the
    request id, so a replayed or late message for an earlier request with the same id is stale.
    """

    request_id: str
    transfer_id: str
    endpoint: str  # tcp://host:port of the sender's transfer socket
    ipc_endpoint: str  # ipc://path, usable when host_id matches; "" when not offered
    instance_id: str  # the sender process; with epoch, names one incarnation
    epoch: int
    host_id: str  # hostname/boot id: equal means shared memory is possible
    block_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]
    num_tokens: int
    layout: KVLayout  # the sender pool's
    protocol_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        if not self.request_id or not self.transfer_id:
            raise ValueError("request_id and transfer_id must be non-empty")
        if self.num_tokens < 1 or not self.block_ids:
            raise ValueError("a transfer needs at least one token and one block")
        if len(self.block_hashes) > len(self.block_ids):
            raise ValueError("more block hashes than blocks")
        if any(b < 0 for b in self.block_ids):
            raise ValueError("block ids must be >= 0")
        if not isinstance(self.layout, KVLayout):
            raise ValueError(f"layout: must be a KVLayout, got {type(self.layout).__name__}")

    @property
    def peer_key(self) -> tuple[str, str, int]:
        """One connection per (endpoint, instance, epoch): a restarted peer is a new peer."""
        return (self.endpoint, self.instance_id, self.epoch)
