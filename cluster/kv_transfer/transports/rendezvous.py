"""The torch_dist rendezvous store, bound where the config says (never on every interface).

``TCPStore`` on its own listens on all interfaces; handing it a socket we bound ourselves keeps
it on ``bind_host`` like every other pdserve socket (reliability matrix S1). The store carries no
authentication of its own: on a non-loopback bind only use torch_dist on a trusted network.
"""

from __future__ import annotations

import datetime
import socket
from typing import Any

import torch.distributed as dist

from cluster.config import TransferConfig, advertise_host


class RendezvousStore:
    def __init__(self, config: TransferConfig) -> None:
        family = socket.AF_INET6 if ":" in config.bind_host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((config.bind_host, 0))
            listener.listen(128)
            self.port = listener.getsockname()[1]
            self.store: Any = dist.TCPStore(
                config.bind_host,
                self.port,
                None,
                True,
                timeout=datetime.timedelta(seconds=config.transfer_timeout_s),
                wait_for_workers=False,
                master_listen_fd=listener.fileno(),
            )
        except BaseException:
            listener.close()
            raise
        listener.detach()  # the store owns the descriptor now and closes it
        host = advertise_host(config)
        self.address = f"{host}:{self.port}"

    def close(self) -> None:
        self.store = None


def start_store(config: TransferConfig) -> RendezvousStore:
    return RendezvousStore(config)
