"""The torch_dist rendezvous store, bound where the config says (never on every interface).

``TCPStore`` on its own listens on all interfaces; handing it a socket we bound ourselves keeps
it on ``bind_host`` like every other pdserve socket (reliability matrix S1). The store has no
authentication of its own: any client that reaches the port may read and write any key. With
``auth: hmac`` or ``curve`` each pair's keys therefore live under a namespace derived from the
secret, and every value gloo or NCCL writes there is sealed with a MAC over its key and checked
when read (``SealedStore``), so a client without the secret cannot plant or alter a value a pair
would use (S10); it can still list the keys or fill the store. Only the rendezvous is covered:
the gloo/NCCL streams the pair then opens carry the KV unauthenticated.
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from cluster.config import TransferConfig, advertise_host
from cluster.kv_transfer.security import StoreSealer


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


class SealedStore(dist.Store):
    """One pair's view of the rendezvous store: its keys under ``prefix``, its values sealed.

    gloo and NCCL rendezvous through ``set``/``get``/``wait``; the rest is there so that any
    other call they make works too. Counters (``add``) stay plain: a counter's value is an
    integer the store itself increments. A forged value read here raises ``KVTransferError``
    (``bad_auth``), which fails the pair's setup and so the pull.
    """

    def __init__(self, inner: Any, prefix: str, sealer: StoreSealer) -> None:
        super().__init__()
        self._inner: Any = dist.PrefixStore(prefix, inner)
        self._raw = inner
        self._prefix = prefix
        self._sealer = sealer
        dist.Store.set_timeout(self, inner.timeout)  # waits in C++ read this store's own

    def _seal(self, key: str, value: Any) -> bytes:
        data = value.encode("utf-8") if isinstance(value, str) else bytes(value)
        return self._sealer.seal(f"{self._prefix}/{key}", data)  # the key as stored

    def _open(self, key: str, sealed: bytes) -> bytes:
        return self._sealer.open(f"{self._prefix}/{key}", sealed)

    def set(self, key: str, value: Any) -> None:
        self._inner.set(key, self._seal(key, value))

    def get(self, key: str) -> bytes:
        return self._open(key, self._inner.get(key))

    def multi_set(self, keys: Sequence[str], values: Sequence[Any]) -> None:
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return [self.get(key) for key in keys]

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        sealed_expected = self._seal(key, expected) if expected else b""
        current = self._inner.compare_set(key, sealed_expected, self._seal(key, desired))
        return self._open(key, current)

    def add(self, key: str, amount: int) -> int:
        return int(self._inner.add(key, amount))

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self._inner.check(list(keys)))

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        if timeout is None:
            self._inner.wait(list(keys))
        else:
            self._inner.wait(list(keys), timeout)

    def delete_key(self, key: str) -> bool:
        return bool(self._inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self._inner.num_keys())

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._inner.set_timeout(timeout)

    def clone(self) -> SealedStore:
        return SealedStore(self._raw.clone(), self._prefix, self._sealer)

    def has_extended_api(self) -> bool:
        return False  # multi_get / multi_set / append: callers fall back to get / set
