"""Hand work from any thread to a sender's or receiver's own thread, waking its poll loop.

The socket-owning thread polls a pipe next to its zmq sockets (zmq sockets are not thread-safe,
so other threads never touch them): ``call_soon`` queues a callable and writes one byte.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable


class CommandQueue:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._commands: list[Callable[[], None]] = []
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)

    def fileno(self) -> int:
        return self._read_fd

    def call_soon(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._commands.append(fn)
        self.wake()

    def wake(self) -> None:
        # A full pipe means a wake-up is already pending; a closed one, that we are done.
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._write_fd, b"x")

    def run_pending(self) -> None:
        """On the owning thread: drain the pipe, then run what was queued, in order."""
        with contextlib.suppress(BlockingIOError):
            while os.read(self._read_fd, 4096):
                pass
        with self._lock:
            commands, self._commands = self._commands, []
        for fn in commands:
            fn()

    def close(self) -> None:
        for fd in (self._read_fd, self._write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
