"""The one sweep: taking back the leases of dead holders before a claim (design §4, "Dead
workers' leases"), and how often.

Dead: a worker whose heartbeat (`holder`) is older than the stale window. A worker child
sweeps every few seconds (`SweepSchedule`); any other caller, every pass.
"""

from __future__ import annotations

import time

from db import workers
from worker.processing import task_log
from worker.processing.database import PassDatabase
from worker.processing.observer import PassObserver
from worker.processing.result import PassResult, ResultCounter
from worker.processing.task_log import log

# A worker child sweeps at most this often (and at least every tenth of the stale window): a
# lease is taken over this much later at worst, against a round trip saved on nearly every
# claim.
SWEEP_INTERVAL_SECONDS = 5.0
# Leases taken back per sweep at most, so a mass crash costs each pass a slice.
SWEEP_LIMIT = 1000


class SweepSchedule:
    """When the sweep is next due, for a caller that runs pass after pass.

    Without one a pass sweeps before it claims, every time (`POST /workers/process`, tests).
    """

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._next = 0.0  # time.monotonic() from which the sweep is due: at once

    def due(self) -> bool:
        """Tell whether the next pass should sweep."""
        return time.monotonic() >= self._next

    def swept(self) -> None:
        """Record a sweep that ran now."""
        self._next = time.monotonic() + self.interval

    @classmethod
    def for_stale_window(cls, stale_after: float) -> SweepSchedule:
        """Every `SWEEP_INTERVAL_SECONDS`, or every tenth of a shorter stale window."""
        return cls(min(SWEEP_INTERVAL_SECONDS, stale_after / 10))


def sweep_dead_workers(
    db: PassDatabase,
    *,
    stale_after: float,
    schedule: SweepSchedule | None,
    counter: ResultCounter,
    observer: PassObserver,
) -> None:
    """Take back the leases of workers silent for `stale_after` seconds; fail the poison pills."""
    expired = db.write(
        lambda conn: workers.take_back_leases(conn, stale_after=stale_after, limit=SWEEP_LIMIT)
    )
    # A full sweep may have left more behind (a mass crash): sweep again next pass.
    if schedule is not None and len(expired) < SWEEP_LIMIT:
        schedule.swept()
    for task in expired:
        if not task.failed:
            fields = task_log.task_fields(task, "task.requeued", None, locked_by=task.locked_by)
            log.warning(task_log.MSG_LEASE_EXPIRED, fields, extra=fields)
            continue
        fields = task_log.task_fields(
            task, "task.failed", None, error_type="WorkerLost", locked_by=task.locked_by
        )
        log.warning(task_log.MSG_WORKER_LOST, fields, extra=fields)
        counter.add(PassResult(failed=1))
        observer.failed(task.type)
