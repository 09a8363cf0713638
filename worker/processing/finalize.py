"""Finalizing a pass's tasks that did not complete: write each retry, failure or release fenced
by its lease, then report it once (completions: `completer`).

A report is a log line (`task_log`), a count in the pass's result and a call to its observer.
A fenced write that matches nothing reports the task's lease as lost instead (design §1.2).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from db import claims
from worker.processing import outcome, task_log
from worker.processing.database import PassDatabase
from worker.processing.held_leases import HeldLeases
from worker.processing.observer import PassObserver
from worker.processing.result import PassResult, ResultCounter
from worker.processing.task_log import log


class Finalizer:
    """Writes and reports the retries, failures and releases of one pass's tasks."""

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

    def settle(
        self,
        task: claims.ClaimedTask,
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
                lambda conn: claims.schedule_retry(
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
                lambda conn: claims.fail_task(
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

    def release(self, tasks: Sequence[claims.ClaimedTask]) -> None:
        """Hand back `tasks`, whose handlers never started, with their attempt (design §4).

        Fenced: a task whose lease was taken back is reported lost.
        """
        mine = list(tasks)
        if not mine:
            return
        lost = {task.id for task in self.db.write(lambda conn: claims.release_tasks(conn, mine))}
        self.leases.let_go(task.id for task in mine)
        self.counter.add(PassResult(released=len(mine) - len(lost)))
        self.observer.released(len(mine) - len(lost))
        info = log.isEnabledFor(logging.INFO)
        for task in mine:
            if task.id in lost:
                self.lease_lost(task, "release")
            elif info:
                fields = task_log.task_fields(task, "task.released", None)
                log.info(task_log.MSG_RELEASED, fields, extra=fields)

    def lease_lost(
        self, task: claims.ClaimedTask, action: str, seconds: float | None = None
    ) -> None:
        """Report that `action` on `task` found its lease taken over."""
        fields = task_log.task_fields(task, "task.lease_lost", seconds, action=action)
        log.warning(task_log.MSG_LEASE_LOST, fields, extra=fields)
        self.counter.add(PassResult(lease_lost=1))
        self.observer.lease_lost()
