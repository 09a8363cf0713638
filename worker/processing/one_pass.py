"""One pass: write what earlier passes left unwritten, sweep, claim a batch, run it, finalize it.

`run_pass` is the entry point; `ProcessingPass` holds the steps and the state of one pass,
which its lease keeper thread works on too (heartbeats, due completions).
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
import uuid
from collections.abc import Callable, Sequence

from sqlalchemy.orm import Session

from db import queue
from worker import backoff, tasktypes
from worker import logging as worker_logging
from worker.errors import HandlerTimeout, PermanentTaskError
from worker.processing import database, outcome, sweep, task_log, task_result, timeouts
from worker.processing.completion_buffer import Completion
from worker.processing.database import PassDatabase, SessionSource
from worker.processing.finalize import Finalizer
from worker.processing.held_leases import HeldLeases
from worker.processing.lease_keeper import LeaseKeeper
from worker.processing.observer import NoopObserver, PassObserver
from worker.processing.result import PassResult, ResultCounter
from worker.processing.sweep import SweepSchedule
from worker.processing.task_log import log
from worker.processing.timeouts import Ending
from worker.processing.unwritten import UnwrittenOutcomes
from worker.settings import PassSettings
from worker.tasktypes.base import JsonValue, TaskContext

StopFlag = threading.Event | Callable[[], bool] | None
# Told of a handler the pass gave up on (`timeouts`), once its outcome is written.
OnUnstoppable = Callable[[timeouts.Unstoppable], None]


def run_pass(
    sessions: SessionSource,
    *,
    worker_id: str,
    settings: PassSettings | None = None,
    stop: StopFlag = None,
    observer: PassObserver | None = None,
    rng: random.Random | None = None,
    unwritten: UnwrittenOutcomes | None = None,
    sweep_schedule: SweepSchedule | None = None,
    keeper: LeaseKeeper | None = None,
    on_unstoppable: OnUnstoppable | None = None,
) -> PassResult:
    """Run one pass: sweep, claim up to `settings.batch_size` tasks, run and finalize each.

    `sessions` is a session factory, or an engine: then the pass holds one of its connections
    throughout and writes single statements in autocommit (`database`). `worker_id` is stored
    in `locked_by` (`host:pid`). The sweep runs when `sweep_schedule` says it is due, or every
    pass without one. `stop` is checked before the claim and before each task: once set, the
    unstarted rest of the batch is released (design §4 Release) and the pass returns. A
    handler's `Exception` never escapes: `outcome.decide` completes, retries or fails the
    task. A `BaseException` (KeyboardInterrupt, SystemExit) propagates after the pass writes
    its completions and releases the unstarted rest; the interrupted task is left to lease
    expiry. A handler's return value is stored as its task's result (`task_result`).

    Each handler runs under its task's timeout (`timeouts`): one still running at it is
    stopped, and the attempt is a retryable failure. One that cannot be stopped within the
    grace is given up on: from the lease keeper's thread the pass writes its retry, the
    buffered completions and the release of the unstarted rest, calls `on_unstoppable` (a
    worker child exits there) and ends once the handler returns, if ever.

    Database errors propagate, after one more attempt to write the completions and releases
    the pass has not written yet. What that attempt could not write goes into `unwritten`, if
    given (else it is left to lease expiry, and logged); a pass given a non-empty `unwritten`
    writes it first and raises, claiming nothing, while the database still fails. The result
    counts what the pass wrote, earlier passes' outcomes included.

    `keeper` is a lease keeper to attach the pass to; without one the pass starts its own.
    """
    with worker_logging.batched(), database.opened(sessions) as db:
        return ProcessingPass(
            db,
            worker_id=worker_id,
            settings=settings or PassSettings(),
            stop=_stop_predicate(stop),
            observer=observer or NoopObserver(),
            rng=rng,
            unwritten=unwritten,
            sweep_schedule=sweep_schedule,
            keeper=keeper,
            on_unstoppable=on_unstoppable,
        ).run()


def write_unwritten(
    sessions: SessionSource, unwritten: UnwrittenOutcomes, *, observer: PassObserver | None = None
) -> PassResult:
    """Write what `unwritten` holds (completions, releases), claiming nothing; return the counts.

    For a caller's last attempt (a stopping child, `--once`). A database error propagates;
    what is still unwritten stays in `unwritten`.
    """
    if not unwritten:
        return PassResult()
    with worker_logging.batched(), database.opened(sessions) as db:
        state = ProcessingPass(
            db,
            worker_id="",
            settings=PassSettings(),
            stop=lambda: True,
            observer=observer or NoopObserver(),
            rng=None,
            unwritten=unwritten,
        )
        with db.session() as session:
            state.write_unwritten(session)
        return state.counter.result()


def _stop_predicate(stop: StopFlag) -> Callable[[], bool]:
    if stop is None:
        return lambda: False
    if isinstance(stop, threading.Event):
        return stop.is_set
    return stop


class ProcessingPass:
    """The steps and state of one pass; its lease keeper calls the `KeptPass` methods."""

    def __init__(
        self,
        db: PassDatabase,
        *,
        worker_id: str,
        settings: PassSettings,
        stop: Callable[[], bool],
        observer: PassObserver,
        rng: random.Random | None,
        unwritten: UnwrittenOutcomes | None = None,
        sweep_schedule: SweepSchedule | None = None,
        keeper: LeaseKeeper | None = None,
        on_unstoppable: OnUnstoppable | None = None,
    ) -> None:
        heartbeat_interval = settings.effective_heartbeat_interval
        if not 0 < heartbeat_interval < settings.stale_after:
            raise ValueError(
                f"heartbeat interval {heartbeat_interval}s must be positive and below "
                f"stale_after {settings.stale_after}s, or leases expire while tasks run"
            )
        self.heartbeat_interval = heartbeat_interval
        self.db = db
        self.worker_id = worker_id
        self.settings = settings
        self.stop = stop
        self.observer = observer
        self.rng = rng
        self.unwritten = unwritten
        self.sweep_schedule = sweep_schedule
        self.keeper = keeper
        self.counter = ResultCounter()
        self.leases = HeldLeases()
        self.finalizer = Finalizer(db, self.leases, self.counter, observer)
        # Held tasks whose handler has not started: released if the pass ends early. Only
        # the pass's own thread uses it, but for `_give_up`, while that thread is in a handler.
        self._unstarted: dict[uuid.UUID, queue.ClaimedTask] = {}
        # Made here, in the thread that runs the handlers: the thread it stops.
        self.timer = timeouts.HandlerTimer()
        self.on_unstoppable = on_unstoppable
        # Set once `_give_up` has written what the pass owed: the pass then ends.
        self._given_up = threading.Event()

    # -- for the lease keeper (`lease_keeper.KeptPass`) -----------------------------------

    def new_session(self) -> Session:
        """A session of the pass's database."""
        return self.db.session()

    def heartbeat(self, session: Session) -> None:
        """Refresh every held lease; remember the ones found taken over."""
        self.leases.heartbeat(self.db, session)

    def flush_due_completions(self, session: Session) -> None:
        """Write the completions that have waited long enough."""
        self.finalizer.flush_completions(session, force=False)

    def stop_overdue_handler(self, session: Session) -> None:
        """Stop the handler running past its timeout; give up on it after the grace."""
        overdue = self.timer.check(time.monotonic())
        if overdue is not None:
            self._give_up(session, overdue)

    def _give_up(self, session: Session, running: timeouts.Running) -> None:
        """Write what the pass owes, a handler it cannot stop still running; then say so.

        In the lease keeper's thread; the pass's thread is in that handler (or waits for
        this to end, `Ending.GIVEN_UP`), so it touches nothing here. The task's retry (or
        failure), every buffered completion, and the release of the tasks not started are
        written now, not left to the lease's expiry: a worker child is about to exit.
        """
        task = running.task
        ran = time.monotonic() - running.started
        unstarted: list[queue.ClaimedTask] = []
        try:
            fields = task_log.task_fields(
                task, "task.unstoppable", ran, timeout_s=running.timeout,
                grace_s=timeouts.STOP_GRACE_SECONDS,
            )  # fmt: skip
            log.error(task_log.MSG_UNSTOPPABLE, fields, extra=fields)
            decision = outcome.timed_out(
                timeout=running.timeout,
                ran=ran,
                detail=(
                    f"could not be stopped within {timeouts.STOP_GRACE_SECONDS:g} s (blocked "
                    "outside Python, or HandlerTimeout caught); given up"
                ),
                attempt=task.attempts,
                max_attempts=task.max_attempts,
                backoff=self._backoff,
            )
            unstarted, self._unstarted = list(self._unstarted.values()), {}
            self.finalizer.settle(session, task, decision, seconds=ran)
            self.finalizer.flush_completions(session, force=True)
            self.finalizer.release(session, unstarted)
            unstarted = []
        except Exception as exc:
            # Left for the pass's thread, should the handler return (completions stay
            # buffered); else the holder's leases are taken back by the supervisor (a child
            # that exits) or expire.
            self._unstarted.update((t.id, t) for t in unstarted)
            log.warning(
                "could not write what the pass owes after giving up on task %s (%s); those "
                "tasks go back to the queue when their leases are taken back",
                task.id, type(exc).__name__,
                extra={"event": "tasks.owed_dropped", "task_id": str(task.id)},
            )  # fmt: skip
        finally:
            self._given_up.set()
        if self.on_unstoppable is not None:
            self.on_unstoppable(timeouts.Unstoppable(task, running.timeout, ran))

    # -- the pass's own thread ------------------------------------------------------------

    def run(self) -> PassResult:
        """Run the pass; return what it did."""
        with self.db.session() as session:
            # Before the claim: a task whose completion is unwritten is never claimed again.
            self.write_unwritten(session)
            if self.sweep_schedule is None or self.sweep_schedule.due():
                sweep.sweep_expired_leases(
                    self.db, session,
                    stale_after=self.settings.stale_after, schedule=self.sweep_schedule,
                    counter=self.counter, observer=self.observer,
                )  # fmt: skip
            if self.stop():
                return self.counter.result()
            batch, leases = self._claim(session)
            if not batch:
                return self.counter.result()
            keeper = self.keeper or LeaseKeeper()
            keeper.attach(self)
            try:
                self._run_batch(session, batch, leases)
            except BaseException:
                self._detach(keeper)
                # The error in flight matters more than a second one from the database.
                with contextlib.suppress(Exception):
                    self._finish(session)
                raise
            self._detach(keeper)
            self._finish(session)
        return self.counter.result()

    def _detach(self, keeper: LeaseKeeper) -> None:
        keeper.detach()
        if keeper is not self.keeper:  # started for this pass
            keeper.close()

    def write_unwritten(self, session: Session) -> None:
        """Write what earlier passes left unwritten; raise, keeping it, on failure."""
        if not self.unwritten:
            return
        completions, releases = self.unwritten.take()
        self.leases.hold(c.lease for c in completions)
        self.leases.hold(t.lease for t in releases)
        self.finalizer.completions.extend(completions)
        self._unstarted.update((t.id, t) for t in releases)
        log.info(
            "writing %d completions and %d releases left unwritten by a database error",
            len(completions), len(releases),
            extra={"event": "tasks.owed", "completions": len(completions),
                   "releases": len(releases)},
        )  # fmt: skip
        self._finish(session)

    def _finish(self, session: Session) -> None:
        """Write every buffered completion and release every unstarted task.

        On a database error what is still unwritten goes to `self.unwritten` (or, without
        one, is left to lease expiry) and the error propagates.
        """
        try:
            self.finalizer.flush_completions(session, force=True)
            self.finalizer.release(session, list(self._unstarted.values()))
            self._unstarted.clear()
        except BaseException as exc:
            completions = self.finalizer.completions.take()
            unstarted = [t for t in self._unstarted.values() if self.leases.holds(t.id)]
            self._unstarted.clear()
            if completions or unstarted:
                self._keep_unwritten(completions, unstarted, exc)
            raise

    def _keep_unwritten(
        self, completions: list[Completion], unstarted: list[queue.ClaimedTask], exc: BaseException
    ) -> None:
        counts = {"completions": len(completions), "releases": len(unstarted)}
        if self.unwritten is not None:
            self.unwritten.keep(completions, unstarted)
            log.warning(
                "database error (%s): %d completions and %d releases kept for the next pass",
                type(exc).__name__, len(completions), len(unstarted),
                extra={"event": "tasks.owed_kept", **counts},
            )  # fmt: skip
            return
        log.warning(
            "database error (%s): %d completions and %d releases not written; those tasks run "
            "again once their leases expire",
            type(exc).__name__, len(completions), len(unstarted),
            extra={"event": "tasks.owed_dropped", **counts},
        )  # fmt: skip

    def _claim(self, session: Session) -> tuple[list[queue.ClaimedTask], list[queue.Lease]]:
        """Claim a batch and hold its leases; return the batch and its leases, in order."""
        # Taken before the statement: the leases' locked_at (its statement_timestamp()) is no
        # earlier.
        leased_at = time.monotonic()
        started = time.perf_counter()
        # The claim commits right after its last statement, releasing its advisory lock
        # (next claimer, go) before it decodes the batch; write's own commit is then empty.
        batch = self.db.write(
            session,
            lambda: queue.claim(
                session,
                worker_id=self.worker_id,
                batch_size=self.settings.batch_size,
                commit=session.commit,
            ),
            transaction=True,
        )
        seconds = time.perf_counter() - started
        self.observer.claim_seconds(seconds)
        self.observer.claimed(len(batch))
        self.counter.add(PassResult(claimed=len(batch)))
        leases = [task.lease for task in batch]  # made once: held, then completed under
        self.leases.hold(leases)
        self.leases.confirmed_at = leased_at
        if batch:
            log.info(
                "claimed %d tasks in %.1f ms", len(batch), seconds * 1000,
                extra={"event": "tasks.claimed", "count": len(batch),
                       "duration_ms": round(seconds * 1000, 3)},
            )  # fmt: skip
        return batch, leases

    def _run_batch(
        self, session: Session, batch: Sequence[queue.ClaimedTask], leases: Sequence[queue.Lease]
    ) -> None:
        """Run the batch's tasks in order until done or stopped.

        Whatever ends it (the stop flag; KeyboardInterrupt or SystemExit in a handler; a
        database error, also one before a task's handler started), `run` then writes the
        completions and releases exactly the tasks whose handler never started. A task
        whose handler started and did not finish stays processing: lease expiry recovers it.
        """
        self._unstarted = {task.id: task for task in batch}
        for task, lease in zip(batch, leases, strict=True):
            if self.stop() or self._given_up.is_set():
                return
            self._confirm_leases(session)
            if self.leases.any_lost and self.leases.take_lost(task.id):
                self._unstarted.pop(task.id, None)
                self.finalizer.lease_lost(task, "start")
                continue
            self._run_one(session, task, lease)

    def _confirm_leases(self, session: Session) -> None:
        # The keeper refreshes leases in the background; if it has fallen behind (database
        # hiccup), find out which leases are still ours before starting anything, or a task
        # another worker took over could run twice at once (design §1.2).
        if time.monotonic() - self.leases.confirmed_at > self.settings.stale_after / 2:
            self.heartbeat(session)

    def _run_one(self, session: Session, task: queue.ClaimedTask, lease: queue.Lease) -> None:
        task_type = tasktypes.get(task.type)
        if task_type is None:
            failed = outcome.unknown_type(task.type, tasktypes.names())
            # Still unstarted while the write may fail: then it is released, not stranded.
            self.finalizer.settle(session, task, failed, seconds=None)
            self._unstarted.pop(task.id, None)
            return
        timeout = timeouts.timeout_of(task, task_type)
        started = time.monotonic()
        context = TaskContext(
            task_id=task.id,
            company_id=task.company_id,
            type=task.type,
            payload=task.payload,
            attempt=task.attempts,
            max_attempts=task.max_attempts,
            config=self.settings.handler_config,
            timeout=timeout,
            deadline=started + timeout,
        )
        # From here on the task may have side effects: never released, whatever happens.
        self._unstarted.pop(task.id, None)
        timer = self.timer
        timer.arm(task, timeout, started)
        returned: JsonValue = None
        raised: BaseException | None = None
        try:
            try:
                returned = task_type.handler(context)
            finally:
                ending = timer.disarm()
        except HandlerTimeout as exc:
            # The timer's, raised maybe as the handler returned, before `disarm` took effect.
            ending = timer.disarm()
            raised = exc
        except Exception as exc:
            raised = exc
        seconds = time.monotonic() - started
        if raised is None and ending is Ending.IN_TIME:  # the common case, first
            if returned is None:
                self.finalizer.complete(task, lease, seconds)
            else:
                self._complete_with_result(session, task, lease, returned, seconds)
            return
        self._finalize_failure(
            session, timeouts.Running(task, timeout, started),
            ending=ending, raised=raised, seconds=seconds,
        )  # fmt: skip

    def _complete_with_result(
        self,
        session: Session,
        task: queue.ClaimedTask,
        lease: queue.Lease,
        returned: JsonValue,
        seconds: float,
    ) -> None:
        try:
            result = task_result.encode(returned)
        except task_result.UnstorableResult as exc:
            self.finalizer.settle(
                session, task, outcome.unstorable_result(str(exc)), seconds=seconds
            )
            return
        self.finalizer.complete(task, lease, seconds, result)

    def _finalize_failure(
        self,
        session: Session,
        running: timeouts.Running,
        *,
        ending: Ending,
        raised: BaseException | None,
        seconds: float,
    ) -> None:
        """Finalize an attempt that raised or ran into its timeout (`ending`)."""
        if ending is Ending.GIVEN_UP:
            # The lease keeper wrote this task's outcome and what else the pass owed: stop.
            self._given_up.wait()
            return
        task = running.task
        # Timed out: stopped by the timer, or failed at its deadline (a handler that honours
        # it ends there with an error of its own). A permanent error is the handler's verdict,
        # also when the timer fired as it was raised (its exception then landed in `disarm`).
        if not isinstance(raised, PermanentTaskError) and (
            ending is Ending.STOPPED
            or isinstance(raised, HandlerTimeout)
            or (raised is not None and time.monotonic() >= running.deadline)
        ):
            if raised is None or isinstance(raised, HandlerTimeout):
                detail = "stopped" if raised is not None else "stopped (the handler carried on)"
            else:
                detail = outcome.describe_error(raised)
            decision: outcome.Retry | outcome.Fail = outcome.timed_out(
                timeout=running.timeout,
                ran=seconds,
                detail=detail,
                attempt=task.attempts,
                max_attempts=task.max_attempts,
                backoff=self._backoff,
            )
            self.finalizer.settle(session, task, decision, seconds=seconds, exc=raised)
            return
        assert isinstance(raised, Exception)  # else it was in time and raised nothing
        failed = outcome.decide(
            raised, attempt=task.attempts, max_attempts=task.max_attempts, backoff=self._backoff
        )
        assert not isinstance(failed, outcome.Complete)
        self.finalizer.settle(session, task, failed, seconds=seconds, exc=raised)

    def _backoff(self, attempt: int) -> float:
        return backoff.delay(attempt, rng=self.rng)
