"""The receiver's half of the handshake: is this the peer the handle names, with our layout,
and which transport does the pair use (the first of our preferences it offers and allows)."""

from __future__ import annotations

from cluster.common.kv_layout import KVLayout
from cluster.kv_transfer.protocol import HelloReply, KVTransferError, Reason
from cluster.kv_transfer.transports import TRANSPORTS
from cluster.kv_transfer.transports.base import ReceiverContext, ReceiverSide


def check_reply(
    reply: HelloReply, key: tuple[str, str, int], endpoint: str, layout: KVLayout
) -> None:
    """Raise ``KVTransferError`` unless the sender accepted us and is who the handle says."""
    if not reply.ok:
        raise KVTransferError(
            reply.reason or Reason.MALFORMED, f"handshake refused: {reply.message}"
        )
    if (reply.instance_id, reply.epoch) != key[1:]:
        raise KVTransferError(
            Reason.STALE_EPOCH,
            f"{endpoint} is now instance {reply.instance_id} epoch {reply.epoch}, "
            f"the handle names {key[1]} epoch {key[2]} (the sender restarted)",
        )
    mismatch = layout.mismatch(reply.layout)  # (a layout that does not decode is malformed)
    if mismatch is not None:
        raise KVTransferError(Reason.LAYOUT_MISMATCH, f"KV layout differs: {mismatch}")


def open_transport(ctx: ReceiverContext, reply: HelloReply) -> tuple[str, ReceiverSide]:
    """Our first preference that the sender offers, the pair allows and that opens."""
    tried = []
    for name in ctx.config.transports:
        spec = TRANSPORTS[name]
        if name not in reply.transports or not spec.pair_ok(ctx.local, reply):
            continue
        try:
            return name, spec.open_receiver(ctx, reply)
        except KVTransferError as e:  # e.g. the shared pool cannot be mapped: try the next
            tried.append(f"{name}: {e.detail}")
    raise KVTransferError(
        Reason.NO_TRANSPORT,
        f"no common transport: this side {list(ctx.config.transports)}, sender "
        f"{list(reply.transports)} {'; '.join(tried)}",
    )
