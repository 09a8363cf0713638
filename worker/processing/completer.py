"""Where a pass hands every task whose handler returned: the completer (River's `JobCompleter`).

One interface, `Completer`, used by the pass's runners (`complete`), its lease keeper (`flush`,
what is due) and its end (`flush` of everything, or `take` what a database error kept from
being written). One implementation, `BatchCompleter`: completions wait up to
`FLUSH_AFTER_SECONDS` and are written together, one fenced statement per flush, so a batch of
noop tasks costs one commit, not one per task (decision 0003).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from typing import NamedTuple, Protocol

from db import claims
from worker.processing import outcome, task_log
from worker.processing.database import PassDatabase
from worker.processing.held_leases import HeldLeases
from worker.processing.observer import PassObserver
from worker.processing.result import PassResult, ResultCounter
from worker.processing.task_log import log

# A completion waits at most about this long (plus one lease keeper tick) before it is
# written: writing them together cuts commits per task, waiting longer would only delay
# their visibility.
FLUSH_AFTER_SECONDS = 0.1


class Completion(NamedTuple):
    """A task whose handler returned, not yet written as completed."""

    task: claims.ClaimedTask
    seconds: float  # how long the handler ran
    at: float  # time.monotonic() when it returned
    result: str | None = None  # what it returned, as JSON text (`task_result.encode`)


class Completer(Protocol):
    """Takes the completions of a pass and writes them, fenced by each task's lease.

    Called from any of the pass's threads.
    """

    def complete(self, task: claims.ClaimedTask, seconds: float, result: str | None) -> None:
        """`task`'s handler returned after `seconds`, with `result` (JSON text, or None)."""

    def flush(self, *, force: bool) -> None:
        """Write the completions that are due (all if `force`); on an error keep them, raise."""

    def keep(self, completions: Iterable[Completion]) -> None:
        """Write these too, with the next flush (left unwritten by an earlier pass)."""

    def take(self) -> list[Completion]:
        """Take every completion not written yet (a pass ending on a database error)."""
        ...


class BatchCompleter:
    """The `Completer` that buffers completions and writes each flush in one statement.

    A written completion is reported (log line, count, observer); one whose lease was taken
    over is reported through `lease_lost`.
    """

    def __init__(
        self,
        db: PassDatabase,
        leases: HeldLeases,
        counter: ResultCounter,
        observer: PassObserver,
        lease_lost: Callable[[claims.ClaimedTask, str, float | None], None],
    ) -> None:
        self._db = db
        self._leases = leases
        self._counter = counter
        self._observer = observer
        self._lease_lost = lease_lost
        self._lock = threading.Lock()
        self._items: list[Completion] = []  # oldest first

    def complete(self, task: claims.ClaimedTask, seconds: float, result: str | None = None) -> None:
        """Buffer the completion of `task`; a flush writes it."""
        completion = Completion(task, seconds, time.monotonic(), result)
        with self._lock:
            self._items.append(completion)

    def keep(self, completions: Iterable[Completion]) -> None:
        """Buffer `completions`, after those already waiting."""
        with self._lock:
            self._items.extend(completions)

    def take(self, *, force: bool = True) -> list[Completion]:
        """Take every buffered completion; unless `force`, only once the oldest is due."""
        with self._lock:
            if not self._items:
                return []
            if not force and time.monotonic() - self._items[0].at < FLUSH_AFTER_SECONDS:
                return []
            taken, self._items = self._items, []
        return taken

    def flush(self, *, force: bool) -> None:
        """Write buffered completions in one fenced statement: all, or if not `force` those due.

        On an error they go back to the front of the buffer for the next flush, and the
        error propagates.
        """
        done = self.take(force=force)
        if not done:
            return
        tasks = [d.task for d in done]
        # Results only when some handler returned one: else the statement without them.
        results = [d.result for d in done] if any(d.result is not None for d in done) else None
        try:
            lost = self._db.write(lambda conn: claims.complete_tasks(conn, tasks, results))
        except BaseException:
            with self._lock:
                self._items[:0] = done  # they stay oldest
            raise
        self._report(done, {task.id for task in lost} if lost else frozenset())

    def _report(self, done: Sequence[Completion], lost: AbstractSet[uuid.UUID]) -> None:
        """Report written completions; `lost` are the ids whose lease was taken over."""
        self._leases.let_go(item.task.id for item in done)
        info = log.isEnabledFor(logging.INFO)  # below INFO no line's fields are built
        durations: dict[str, list[float]] = {}
        for item in done:
            task = item.task
            if lost and task.id in lost:
                self._lease_lost(task, outcome.Complete.action, item.seconds)
                continue
            if info:
                fields = task_log.task_fields(task, "task.completed", item.seconds)
                log.info(task_log.MSG_COMPLETED, fields, extra=fields)
            durations.setdefault(task.type, []).append(item.seconds)
        self._counter.add(PassResult(completed=sum(map(len, durations.values()))))
        # One report per type and flush: the observer's metric writes are per call.
        for task_type, seconds in durations.items():
            self._observer.completed(task_type, seconds)
