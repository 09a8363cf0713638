"""Finalizing a pass's tasks: write each outcome fenced by its lease, then report it once.

A report is a log line (`task_log`), a count in the pass's result and a call to its observer.
A fenced write that matches nothing reports the task's lease as lost instead (design §1.2).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence

from db import queue
from worker.processing import outcome, task_log
from worker.processing.completion_buffer import Completion, CompletionBuffer
from worker.processing.database import PassDatabase
from worker.processing.held_leases import HeldLeases
from worker.processing.observer import PassObserver
from worker.processing.result import PassResult, ResultCounter
from worker.processing.task_log import log


class Finalizer:
    """Writes and reports the outcomes of one pass's tasks.

    Used by the pass, and by its lease keeper for the completions that are due.
    """

    def __init__(
        self,
        db: PassDatabase,
        leases: HeldLeases,
        counter: ResultCounter,
        observer: PassObserver,
    ) -> None:
        self.db = db
        self.leases = leases
        self.counter = counter
        self.observer = observer
        self.completions = CompletionBuffer()

    def complete(
        self,
        task: queue.ClaimedTask,
        lease: queue.Lease,
        seconds: float,
        result: str | None = None,
    ) -> None:
        """Buffer the completion of `task`, whose handler ran `seconds`; a flush writes it.

        `result` is what the handler returned, as JSON text (`task_result.encode`), or None.
        """
        self.completions.append(Completion(task, lease, seconds, time.monotonic(), result))

    def settle(
        self,
        task: queue.ClaimedTask,
        decision: outcome.Retry | outcome.Fail,
        *,
        seconds: float | None,
        exc: BaseException | None = None,
    ) -> None:
        """Write a retry or a failure of `task`, fenced, and report it.

        `seconds` is how long the handler ran (None: it never did); `exc`, what it raised.
        """
        if isinstance(decision, outcome.Retry):
            retry = decision
            matched = self.db.write(
                lambda conn: queue.schedule_retry(
                    conn,
                    task.id,
                    task.lease_token,
                    delay_seconds=retry.delay,
                    error=retry.error,
                ),
            )
        else:
            error = decision.error
            matched = self.db.write(
                lambda conn: queue.fail_task(
                    conn,
                    task.id,
                    task.lease_token,
                    error=error,
                ),
            )
        self.leases.let_go([task.id])
        match outcome.written(decision, matched=matched):
            case outcome.LeaseLost(action=action):
                self.lease_lost(task, action, seconds)
                return
            case outcome.Retry(delay=delay, error_type=error_type):
                message = task_log.MSG_RETRIED
                fields = task_log.task_fields(
                    task, "task.retried", seconds, error_type=error_type, retry_in_s=round(delay, 3)
                )
                count, observe = PassResult(retried=1), self.observer.retried
            case outcome.Fail(error_type=error_type):
                message = task_log.MSG_FAILED
                fields = task_log.task_fields(task, "task.failed", seconds, error_type=error_type)
                count, observe = PassResult(failed=1), self.observer.failed
        mapping = {**fields, "max_attempts": task.max_attempts, "ran": task_log.ran(seconds)}
        log.warning(message, mapping, extra=fields)
        if exc is not None:
            task_log.log_traceback(task, exc)
        self.counter.add(count)
        observe(task.type, seconds)

    def flush_completions(self, *, force: bool) -> None:
        """Write buffered completions in one fenced statement: all, or if not `force` those due.

        On an error they stay buffered for the next flush, and the error propagates.
        """
        done = self.completions.take(force=force)
        if not done:
            return
        leases = [d.lease for d in done]
        # Results only when some handler returned one: else the statement without them.
        results = [d.result for d in done] if any(d.result is not None for d in done) else None
        try:
            completed = self.db.write(
                lambda conn: queue.complete_tasks(conn, leases, results),
            )
        except BaseException:
            self.completions.put_back(done)
            raise
        self._report_completions(done, completed)

    def _report_completions(self, done: Sequence[Completion], completed: set[uuid.UUID]) -> None:
        """Report written completions; `completed` are the ids whose lease matched."""
        self.leases.let_go(item.task.id for item in done)
        info = log.isEnabledFor(logging.INFO)  # below INFO no line's fields are built
        durations: dict[str, list[float]] = {}
        for item in done:
            task = item.task
            if task.id not in completed:
                self.lease_lost(task, outcome.Complete.action, item.seconds)
                continue
            if info:
                fields = task_log.task_fields(task, "task.completed", item.seconds)
                log.info(task_log.MSG_COMPLETED, fields, extra=fields)
            durations.setdefault(task.type, []).append(item.seconds)
        self.counter.add(PassResult(completed=sum(map(len, durations.values()))))
        # One report per type and flush: the observer's metric writes are per call.
        for task_type, seconds in durations.items():
            self.observer.completed(task_type, seconds)

    def release(self, tasks: Sequence[queue.ClaimedTask]) -> None:
        """Hand back `tasks`, whose handlers never started, with their attempt (design §4).

        A lease the lease keeper already found taken over is not ours to release: it is
        reported lost.
        """
        lost, mine = self.leases.split_lost(tasks)
        for task in lost:
            self.lease_lost(task, "release")
        if not mine:
            return
        released = self.db.write(
            lambda conn: queue.release_tasks(conn, [t.lease for t in mine]),
        )
        self.leases.let_go(task.id for task in mine)
        self.counter.add(PassResult(released=len(released)))
        self.observer.released(len(released))
        info = log.isEnabledFor(logging.INFO)
        for task in mine:
            if task.id not in released:
                self.lease_lost(task, "release")
            elif info:
                fields = task_log.task_fields(task, "task.released", None)
                log.info(task_log.MSG_RELEASED, fields, extra=fields)

    def lease_lost(
        self, task: queue.ClaimedTask, action: str, seconds: float | None = None
    ) -> None:
        """Report that `action` on `task` found its lease taken over."""
        fields = task_log.task_fields(task, "task.lease_lost", seconds, action=action)
        log.warning(task_log.MSG_LEASE_LOST, fields, extra=fields)
        self.counter.add(PassResult(lease_lost=1))
        self.observer.lease_lost()
