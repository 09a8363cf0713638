"""A worker child's sign of life to its supervisor (design §5, "Hung children").

The child side: a thread writes a byte on the alive pipe while the main thread shows
progress. The supervisor reads the pipe each tick and kills a child silent for
`WORKER_CHILD_TIMEOUT_SECONDS`.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import threading
import time
from collections.abc import Iterator

log = logging.getLogger("fairq.worker.child")

# A child tells the supervisor it is alive this often (or four times per
# `WORKER_CHILD_TIMEOUT_SECONDS`, if that is shorter).
ALIVE_INTERVAL_SECONDS = 1.0


class AliveSignal:
    """A thread that tells the supervisor this child is alive: a byte on the alive pipe.

    Alive (design §5, "Hung children") means the process runs and its main thread is either
    in a processing pass or has shown progress (`progress()`) within `timeout`. In a pass a
    handler may run for minutes (`sleep`, a webhook up to its deadline) while the lease
    keeper keeps its leases: killing that child would run its task twice. Anywhere else the
    main thread shows progress at least every second while it waits (`worker.child`), and
    between database calls, each bounded by the statement or connect timeout; silence there
    means it is stuck. A stopped process (SIGSTOP, a frozen cgroup) or one whose GIL is never
    released stops this thread too.

    Writes never block: a full pipe already says "alive". Without a pipe (`fd` None: no
    supervisor) nothing is started.
    """

    def __init__(self, fd: int | None, *, timeout: float) -> None:
        self._fd = fd
        self._timeout = timeout
        self._interval = min(ALIVE_INTERVAL_SECONDS, timeout / 4)
        self._progress_at = time.monotonic()
        self._in_pass = False
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        if fd is not None:
            os.set_blocking(fd, False)
            self._thread = threading.Thread(target=self._run, name="fairq-alive", daemon=True)
            self._thread.start()

    def progress(self) -> None:
        """The main thread is not stuck: it got here (called often; one float store)."""
        self._progress_at = time.monotonic()

    @contextlib.contextmanager
    def in_pass(self) -> Iterator[None]:
        """Around a processing pass: the main thread may be silent as long as it lasts."""
        self._in_pass = True
        try:
            yield
        finally:
            self._in_pass = False
            self.progress()

    def close(self) -> None:
        """Stop the thread and close the pipe."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _run(self) -> None:
        assert self._fd is not None
        stuck = False
        while not self._closed.wait(self._interval):
            silent = time.monotonic() - self._progress_at
            if not self._in_pass and silent >= self._timeout:
                if not stuck:  # say where once; faulthandler writes to stderr without locks
                    stuck = True
                    log.error(
                        "child %d: main thread stuck for %.1fs outside a pass; no longer "
                        "telling the supervisor it is alive (stacks follow)", os.getpid(), silent
                    )  # fmt: skip
                    faulthandler.dump_traceback(all_threads=True)
                continue
            stuck = False
            try:
                os.write(self._fd, b".")
            except BlockingIOError:
                pass  # the supervisor has not read the earlier bytes yet: they say the same
            except OSError:
                return  # the supervisor is gone; the orphan check stops the child
