"""A total deadline for a handler's network exchange, enforced on its sockets (design §6).

Socket timeouts bound one operation, not the exchange: a peer that sends a byte per timeout
holds a handler, and the lease its heartbeat keeps alive, forever. A `SocketDeadline` shuts
down every socket registered with it once its time is up, from a timer thread, so the read
blocked on it returns at once. It works in any thread: the API runs handlers in its request
threads, where no signal can interrupt them.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from types import TracebackType


class SocketDeadline:
    """`seconds` from entering the `with` block; sockets registered are shut down after it.

    Use `remaining()` for each operation's own timeout, `register(sock)` for every socket the
    exchange opens, and `expired` to tell a deadline from any other failure.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._ends = time.monotonic() + seconds
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._expired = False
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def __enter__(self) -> SocketDeadline:
        self._ends = time.monotonic() + self.seconds
        self._timer.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._timer.cancel()

    @property
    def expired(self) -> bool:
        """Whether the deadline passed (and the registered sockets were shut down)."""
        return self._expired or time.monotonic() >= self._ends

    def remaining(self) -> float:
        """Seconds left, at least a millisecond (a timeout of 0 would mean non-blocking)."""
        return max(self._ends - time.monotonic(), 0.001)

    def register(self, sock: socket.socket) -> None:
        """Shut `sock` down when the deadline passes (at once if it has)."""
        with self._lock:
            if not self._expired:
                self._sockets.append(sock)
                return
        _shut_down(sock)

    def _expire(self) -> None:
        with self._lock:
            self._expired = True
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            _shut_down(sock)


def _shut_down(sock: socket.socket) -> None:
    # shutdown, not close: the owner still closes its descriptor, and a blocked recv returns.
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
