"""The lease keeper: a thread that works for a running pass beside its handlers.

While a pass runs its batch, the keeper writes the completions that are due, so they need
not wait for the end of the pass; writes the timeout outcome of a handler that overran its
deadline (`timeouts`, `overruns`), from outside the handler's thread, which is busy with it;
reads the batch's pauses again when a batch starts nothing for a while (`pauses`); and, every
heartbeat interval, beats the pass's holder when the pass registered its own (a pass outside a
worker child; a child's liveness thread beats the child's: decision 0010).
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

from common import logging as fairq_logging
from db import engine as db_engine
from worker.processing.task_log import log

# How often the keeper wakes to look for due heartbeats and completions.
TICK_SECONDS = 0.05
# While the database is down the keeper retries every tick: one warning per this many seconds.
WARN_EVERY_SECONDS = 5.0


class KeptPass(Protocol):
    """What the keeper needs of the pass it works for (`one_pass.ProcessingPass`)."""

    @property
    def heartbeat_interval(self) -> float:
        """Seconds between two beats of the pass's own holder."""
        ...

    def heartbeat(self) -> None:
        """Beat the pass's own holder, if it has one."""

    def flush_due_completions(self) -> None:
        """Write the completions that have waited long enough."""

    def write_overruns(self) -> None:
        """Write the timeout outcome of each handler past its deadline and the grace."""

    def refresh_pauses(self) -> None:
        """Read again which of the batch's companies are paused, once the last read ages."""


class LeaseKeeper:
    """A thread that flushes the attached pass's due completions, watches its deadlines and
    pauses, and beats its own holder.

    A worker child keeps one for its life, attaching each pass in turn (docs/decisions/0003);
    a pass given none starts its own. The thread wakes every `TICK_SECONDS` (or heartbeat
    interval, if shorter), attached or not, so `attach` need not wake it.
    """

    def __init__(self) -> None:
        # Guards everything below; held by the thread while it works for a pass, so
        # `detach` waits for the database call in flight, if any.
        self._lock = threading.Condition()
        self._owner: KeptPass | None = None
        self._next_beat = 0.0
        self._closed = False
        self._quiet_until = 0.0  # time.monotonic() before which transient errors are counted
        self._suppressed = 0
        self._thread = threading.Thread(target=self._run, name="fairq-lease-keeper", daemon=True)
        self._thread.start()

    def attach(self, owner: KeptPass) -> None:
        """Keep `owner`'s leases from now on (from the thread's next tick)."""
        with self._lock:
            self._owner = owner
            self._next_beat = time.monotonic() + owner.heartbeat_interval
            # A heartbeat interval shorter than the tick (tests) must not wait a whole tick.
            if owner.heartbeat_interval < TICK_SECONDS:
                self._lock.notify()

    def detach(self) -> None:
        """Stop working for the attached pass; return once no call for it is in flight."""
        with self._lock:
            self._owner = None

    def close(self) -> None:
        """Stop and wait for the thread."""
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join()

    def _run(self) -> None:
        with self._lock:
            while not self._closed:
                owner = self._owner
                tick = TICK_SECONDS if owner is None else owner.heartbeat_interval
                self._lock.wait(min(TICK_SECONDS, tick))
                owner = self._owner
                if owner is not None and not self._closed:
                    self._tick(owner)

    def _tick(self, owner: KeptPass) -> None:
        # Whatever fails, the thread goes on: it serves every later pass of the child too.
        try:
            owner.write_overruns()
            if time.monotonic() >= self._next_beat:
                self._next_beat = time.monotonic() + owner.heartbeat_interval
                owner.heartbeat()
            owner.flush_due_completions()
            owner.refresh_pauses()
            # Lines of a pass of slow tasks must not wait for the end of the pass.
            fairq_logging.write_due()
        except Exception as exc:
            # A failed beat or flush is retried next tick; the pass's final flush reports
            # what still fails.
            self._log_failure(exc)

    def _log_failure(self, exc: Exception) -> None:
        """Log a failed database call: a bug with its traceback, an outage rate-limited.

        While the database is down every tick fails the same way; one line per
        `WARN_EVERY_SECONDS`, counting the failures it stands for, says as much.
        """
        if not db_engine.is_transient(exc):
            log.exception("lease keeper: database call failed")
            return
        now = time.monotonic()
        if now < self._quiet_until:
            self._suppressed += 1
            return
        log.warning(
            "lease keeper: database unavailable (%s); retrying every %.2fs (%d failures "
            "not logged since the last warning)",
            type(exc).__name__, TICK_SECONDS, self._suppressed,
            extra={"event": "keeper.db_error", "suppressed": self._suppressed},
        )  # fmt: skip
        self._quiet_until = now + WARN_EVERY_SECONDS
        self._suppressed = 0
