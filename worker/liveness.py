"""A worker child's sign of life, to its supervisor and to the database (design §5, decision 0010).

One thread, one answer to "is this child alive": while the main thread shows progress it
writes a byte on the alive pipe (the supervisor kills a child silent for
`WORKER_CHILD_TIMEOUT_SECONDS`) and beats the child's `workers` row (the sweep takes back the
leases of a worker whose row is silent for `STALE_AFTER_SECONDS`).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator

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

    The same condition keeps the child's `workers` row beating (`beat`, every
    `beat_interval`, from `start_beating` on): a child its supervisor would kill as hung is
    one whose leases the sweep takes back. A beat that fails (the database down) is logged
    and tried again at the next interval; the pass confirms its holder before each task
    when the beats have fallen behind (`processing.Holder`).

    Writes never block: a full pipe already says "alive". Without a pipe (`fd` None: no
    supervisor) the thread only beats, once `start_beating` is called.
    """

    def __init__(self, fd: int | None, *, timeout: float) -> None:
        self._fd = fd
        self._timeout = timeout
        self._interval = min(ALIVE_INTERVAL_SECONDS, timeout / 4)
        self._progress_at = time.monotonic()
        self._in_pass = False
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._beat: Callable[[], None] | None = None
        self._beat_interval = 0.0
        self._next_beat = 0.0
        if fd is not None:
            os.set_blocking(fd, False)
            self._start()

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="fairq-alive", daemon=True)
        self._thread.start()

    def start_beating(self, beat: Callable[[], None], interval: float) -> None:
        """Call `beat` every `interval` seconds from now on while the child is alive."""
        self._beat_interval = interval
        self._interval = min(self._interval, interval)
        self._next_beat = time.monotonic() + interval
        self._beat = beat
        if self._thread is None:
            self._start()

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
        stuck = False
        pipe_open = self._fd is not None
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
            # The byte first: a beat may wait on the database (its statement timeout).
            if pipe_open and self._fd is not None:
                try:
                    os.write(self._fd, b".")
                except BlockingIOError:
                    pass  # the supervisor has not read the earlier bytes yet: they say the same
                except OSError:
                    pipe_open = False  # the supervisor is gone; the orphan check stops the child
            if self._beat is not None and time.monotonic() >= self._next_beat:
                self._next_beat = time.monotonic() + self._beat_interval
                try:
                    self._beat()
                except Exception as exc:  # the database down: the next interval tries again
                    log.warning("child %d: worker heartbeat failed (%s: %s)", os.getpid(),
                                type(exc).__name__, exc)  # fmt: skip
