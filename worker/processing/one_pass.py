"""One pass: write what earlier passes left unwritten, sweep, claim a batch, run it, finalize it.

`run_pass` is the entry point; `ProcessingPass` holds the steps and the state of one pass,
which its lease keeper thread works on too (heartbeats, due completions, pauses, and the
handlers' deadlines through the pass's `overruns.OverrunWatch`), and so do its runner threads
when it runs several handlers at once (`runners`).
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from marshmallow import ValidationError

from common import logging as fairq_logging
from db import claims
from worker import backoff, tasktypes
from worker.errors import PermanentTaskError
from worker.processing import database, outcome, overruns, sweep, task_result, timeouts
from worker.processing.completer import BatchCompleter, Completer, Completion
from worker.processing.database import ConnectionSource, PassDatabase
from worker.processing.finalize import Finalizer
from worker.processing.held_leases import HeldLeases
from worker.processing.holder import Holder
from worker.processing.lease_keeper import LeaseKeeper
from worker.processing.observer import NoopObserver, PassObserver
from worker.processing.pauses import BatchPauses
from worker.processing.result import PassResult, ResultCounter
from worker.processing.runners import Runners
from worker.processing.sweep import SweepSchedule
from worker.processing.task_log import log
from worker.processing.unwritten import UnwrittenOutcomes
from worker.settings import PassSettings
from worker.tasktypes.base import JsonValue, TaskContext, TaskType

StopFlag = threading.Event | Callable[[], bool] | None
# The batch's tasks not taken by a runner yet, in claim order.
_Batch = Iterator[claims.ClaimedTask]


def run_pass(
    source: ConnectionSource,
    *,
    worker_id: str,
    settings: PassSettings | None = None,
    stop: StopFlag = None,
    observer: PassObserver | None = None,
    rng: random.Random | None = None,
    unwritten: UnwrittenOutcomes | None = None,
    sweep_schedule: SweepSchedule | None = None,
    keeper: LeaseKeeper | None = None,
    on_overrun: overruns.OnOverrun | None = None,
    runners: Runners | None = None,
    holder: Holder | None = None,
) -> PassResult:
    """Run one pass: sweep, claim up to `settings.batch_size` tasks, run and finalize each.

    `source` is a pool, whose connection the pass holds throughout, or a connection (the
    API's); the pass writes single statements on it, in autocommit (`database`). `worker_id`
    is stored in `locked_by` (`host:pid:nonce`). The sweep runs when `sweep_schedule` says it
    is due, or every pass without one. `stop` is checked before the claim and before each
    task: once set, no task starts, the running ones finish, the unstarted rest of the batch
    is released (design §4 Release) and the pass returns. A handler's `Exception` never escapes:
    `outcome.decide` completes, retries or fails the task. A `BaseException`
    (KeyboardInterrupt, SystemExit) propagates once the running handlers returned, after
    the pass writes its completions and releases the unstarted rest; the interrupted task
    is left to lease expiry. A handler's return value is stored as its task's result
    (`task_result`).

    Up to `settings.threads` handlers run at once: this thread and runner threads (`runners`,
    else started for the pass) each take the batch's next task in claim order. With 1, this
    thread runs every task, one after the other.

    Each handler runs under its task's deadline (`timeouts`), which it is given: one that
    fails at it has timed out, a retryable failure. One still running `OVERRUN_GRACE_SECONDS`
    past it has overrun: from the lease keeper's thread the pass writes its timeout outcome,
    the buffered completions and the release of the unstarted rest, and starts no other
    task; once its other running handlers have returned (their outcomes written) or overrun
    too, it calls `on_overrun` (a worker child exits there, `--once` too), and it ends once
    the handler returns, if ever.

    Database errors propagate, after one more attempt to write the completions and releases
    the pass has not written yet. What that attempt could not write goes into `unwritten`, if
    given (else it is left to lease expiry, and logged); a pass given a non-empty `unwritten`
    writes it first and raises, claiming nothing, while the database still fails. The result
    counts what the pass wrote, earlier passes' outcomes included.

    `keeper` is a lease keeper to attach the pass to; without one the pass starts its own.
    `runners`: runner threads to use (at most `settings.threads - 1` of them are).

    `holder`: the registered worker `worker_id` names, kept alive by its caller (a worker
    child's liveness thread beats it). Without one, a pass that claimed anything registers
    `worker_id` itself (`workers` row), its lease keeper beats it every
    `settings.effective_heartbeat_interval`, and the pass deletes the row at its end.
    """
    with fairq_logging.batched(), database.opened(source) as db:
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
            on_overrun=on_overrun,
            runners=runners,
            holder=holder,
        ).run()


def write_unwritten(
    source: ConnectionSource, unwritten: UnwrittenOutcomes, *, observer: PassObserver | None = None
) -> PassResult:
    """Write what `unwritten` holds (completions, releases), claiming nothing; return the counts.

    For a caller's last attempt (a stopping child, `--once`). A database error propagates;
    what is still unwritten stays in `unwritten`.
    """
    if not unwritten:
        return PassResult()
    with fairq_logging.batched(), database.opened(source) as db:
        state = ProcessingPass(
            db,
            worker_id="",
            settings=PassSettings(),
            stop=lambda: True,
            observer=observer or NoopObserver(),
            rng=None,
            unwritten=unwritten,
        )
        state.write_unwritten()
        return state.counter.result()


def _stop_predicate(stop: StopFlag) -> Callable[[], bool]:
    if stop is None:
        return lambda: False
    if isinstance(stop, threading.Event):
        return stop.is_set
    return stop


class ProcessingPass:
    """The steps and state of one pass.

    Its lease keeper calls the `lease_keeper.KeptPass` methods, and its overrun watch the
    `overruns.OverranPass` ones.
    """

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
        on_overrun: overruns.OnOverrun | None = None,
        runners: Runners | None = None,
        holder: Holder | None = None,
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
        self.runners = runners
        # The pass's own holder when it was given none (made once it claimed something),
        # beaten by its lease keeper; a given one is beaten by whoever gave it.
        self.holder = holder
        self._own_holder = False
        self._generation = 0  # the holder's generation when the batch was claimed
        self.counter = ResultCounter()
        self.leases = HeldLeases()
        self.pauses = BatchPauses()
        self.finalizer = Finalizer(db, self.leases, self.counter, observer)
        self.completer: Completer = BatchCompleter(
            db, self.leases, self.counter, observer, self.finalizer.lease_lost
        )
        # Held tasks whose handler has not started: released if the pass ends early. Shared
        # by the runners, the overrun watch (the keeper's thread) and `_finish`: a task
        # belongs to whoever pops it from here (`dict.pop` and `popitem` are atomic under the
        # GIL). No lock per task: an uncontended one costs a few percent of a noop task.
        self._unstarted: dict[uuid.UUID, claims.ClaimedTask] = {}
        # Once set, no handler starts: the pass is stopping, failing or one overran.
        self._closed = False
        # The hands of the threads running handlers, watched for overruns by the keeper.
        self.overrun_watch = overruns.OverrunWatch(self, on_overrun)

    # -- for the lease keeper (`lease_keeper.KeptPass`) -----------------------------------

    def heartbeat(self) -> None:
        """Beat the pass's own holder (a given holder is beaten by its owner)."""
        if self._own_holder and self.holder is not None:
            self.holder.beat()

    def flush_due_completions(self) -> None:
        """Write the completions that have waited long enough."""
        self.completer.flush(force=False)

    def refresh_pauses(self) -> None:
        """Read again which of the batch's companies are paused, once the last read ages;
        hand back the unstarted tasks of those that are."""
        self.pauses.refresh(self.db)
        self._hand_back_paused()

    def _hand_back_paused(self) -> None:
        """Release, attempt not counted, the unstarted tasks of the companies seen paused.

        From any thread: a task popped here is never started by a runner, which pops it
        before it starts it. On a database error they stay unstarted for `_finish`.
        """
        paused = self.pauses.seen_paused
        if not paused:
            return
        # list() of a dict's values runs no Python code: atomic under the GIL.
        candidates = [t for t in list(self._unstarted.values()) if t.company_id in paused]
        taken = [t for t in candidates if self._unstarted.pop(t.id, None) is not None]
        if not taken:
            return
        try:
            self.finalizer.release(taken)
        except BaseException:
            self.put_back_unstarted(taken)
            raise

    def write_overruns(self) -> None:
        """Write the timeout outcome of each handler past its deadline and the grace."""
        self.overrun_watch.write()

    # -- for the overrun watch (`overruns.OverranPass`) -----------------------------------

    def take_unstarted(self) -> list[claims.ClaimedTask]:
        """Take every task not started yet, and let no task start from now on.

        From any thread: a task popped here is never started by a runner, which pops it
        before it starts it.
        """
        self._closed = True
        taken: list[claims.ClaimedTask] = []
        while True:
            try:
                taken.append(self._unstarted.popitem()[1])
            except KeyError:
                taken.reverse()  # popitem takes the last first: back in claim order
                return taken

    def put_back_unstarted(self, tasks: Iterable[claims.ClaimedTask]) -> None:
        """Make `tasks`, taken by `take_unstarted`, unstarted again."""
        self._unstarted.update((t.id, t) for t in tasks)

    def backoff(self, attempt: int) -> float:
        """Seconds before the retry after failed attempt number `attempt`."""
        return backoff.delay(attempt, rng=self.rng)

    # -- the pass's own thread ------------------------------------------------------------

    def run(self) -> PassResult:
        """Run the pass; return what it did."""
        # Before the claim: a task whose completion is unwritten is never claimed again.
        self.write_unwritten()
        if self.sweep_schedule is None or self.sweep_schedule.due():
            sweep.sweep_dead_workers(
                self.db,
                stale_after=self.settings.stale_after, schedule=self.sweep_schedule,
                counter=self.counter, observer=self.observer,
            )  # fmt: skip
        if self.stop():
            return self.counter.result()
        batch = self._claim()
        if not batch:
            return self.counter.result()
        if self.holder is None:
            self._register_own_holder()
        keeper = self.keeper or LeaseKeeper()
        keeper.attach(self)
        try:
            self._run_batch(batch)
        except BaseException:
            self._detach(keeper)
            # The error in flight matters more than a second one from the database.
            with contextlib.suppress(Exception):
                self._finish()
                self._deregister_own_holder()
            raise
        self._detach(keeper)
        self._finish()
        self._deregister_own_holder()
        return self.counter.result()

    def _register_own_holder(self) -> None:
        # After the claim: a sweep finds its leases with no holder row, but younger than the
        # stale window, and leaves them.
        self.holder = Holder(
            self.worker_id, host=socket.gethostname(), pid=os.getpid(), write=self.db.write
        )
        self._own_holder = True
        self.holder.register()
        self._generation = self.holder.generation

    def _deregister_own_holder(self) -> None:
        # Not when something stays unwritten: those leases are still held, and the sweep
        # takes them back once the row is stale.
        if self._own_holder and self.holder is not None and not self.unwritten:
            self.holder.deregister()

    def _detach(self, keeper: LeaseKeeper) -> None:
        keeper.detach()
        if keeper is not self.keeper:  # started for this pass
            keeper.close()

    def write_unwritten(self) -> None:
        """Write what earlier passes left unwritten; raise, keeping it, on failure."""
        if not self.unwritten:
            return
        completions, releases = self.unwritten.take()
        self.leases.hold(c.task for c in completions)
        self.leases.hold(releases)
        self.completer.keep(completions)
        self._unstarted.update((t.id, t) for t in releases)
        log.info(
            "writing %d completions and %d releases left unwritten by a database error",
            len(completions), len(releases),
            extra={"event": "tasks.owed", "completions": len(completions),
                   "releases": len(releases)},
        )  # fmt: skip
        self._finish()

    def _finish(self) -> None:
        """Write every buffered completion and release every unstarted task.

        No handler starts after it. On a database error what is still unwritten goes to
        `self.unwritten` (or, without one, is left to lease expiry) and the error propagates.
        """
        unstarted = self.take_unstarted()
        try:
            self.completer.flush(force=True)
            self.finalizer.release(unstarted)
        except BaseException as exc:
            completions = self.completer.take()
            unstarted = [t for t in unstarted if self.leases.holds(t.id)]
            if completions or unstarted:
                self._keep_unwritten(completions, unstarted, exc)
            raise

    def _keep_unwritten(
        self, completions: list[Completion], unstarted: list[claims.ClaimedTask], exc: BaseException
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

    def _claim(self) -> list[claims.ClaimedTask]:
        """Claim a batch and hold its leases; return it, in claim order."""
        # Taken before the statement: the leases' locked_at (its statement_timestamp()) is no
        # earlier.
        leased_at = time.monotonic()
        started = time.perf_counter()
        # One statement in autocommit: one round trip, committed when it returns. Not
        # written again on a lost connection: a claim that did commit would leave its batch
        # to lease expiry and claim another.
        batch = self.db.write(
            lambda conn: claims.claim(
                conn, worker_id=self.worker_id, batch_size=self.settings.batch_size
            ),
            retry=False,
        )
        seconds = time.perf_counter() - started
        self.observer.claim_seconds(seconds)
        self.observer.claimed(len(batch))
        self.counter.add(PassResult(claimed=len(batch)))
        self.leases.hold(batch)
        if self.holder is not None:
            self._generation = self.holder.generation
        self.pauses.claimed((task.company_id for task in batch), leased_at)
        if batch:
            log.info(
                "claimed %d tasks in %.1f ms", len(batch), seconds * 1000,
                extra={"event": "tasks.claimed", "count": len(batch),
                       "duration_ms": round(seconds * 1000, 3)},
            )  # fmt: skip
        return batch

    def _run_batch(self, batch: Sequence[claims.ClaimedTask]) -> None:
        """Run the batch's tasks in claim order, up to `settings.threads` at once.

        Until every task ran or the pass stops. Whatever ends it (the stop flag;
        KeyboardInterrupt or SystemExit in a handler; a database error, also one before a
        task's handler started), no handler starts after it, the running ones finish, and
        `run` then writes the completions and releases exactly the tasks whose handler
        never started. A task whose handler started and did not finish stays processing:
        lease expiry recovers it.
        """
        self._unstarted = {task.id: task for task in batch}
        self._closed = False
        tasks: _Batch = iter(batch)
        helpers = min(self.settings.threads, len(batch)) - 1
        if self.runners is not None:
            helpers = min(helpers, self.runners.size)
        if helpers <= 0:
            self._run_tasks(tasks)
            return
        runners = self.runners or Runners(helpers)
        try:
            runners.run(lambda: self._run_tasks(tasks), lambda: self._help(tasks), helpers)
        finally:
            if runners is not self.runners:  # started for this pass
                runners.close()

    def _help(self, tasks: _Batch) -> None:
        """`_run_tasks` on a runner thread."""
        self._run_tasks(tasks)

    def _run_tasks(self, tasks: _Batch) -> None:
        """Take the batch's next task and run it, until none is left or no task may start.

        On the calling thread; `tasks` is shared with the pass's other runners, if any (a
        zip of lists: taking its next item runs no Python code, so it is atomic under the
        GIL). An error here (a database error, a handler's BaseException) closes the pass:
        the other runners finish their handlers and start none.
        """
        hand = self.overrun_watch.hand()
        try:
            for task in tasks:
                if self._closed or self.stop():
                    return  # the task taken stays unstarted: `run` releases it
                if not self._still_alive():
                    # Declared dead by a sweep: every lease of the batch was taken back, or
                    # is about to be. The tasks stay unstarted: `run` hands back (fenced)
                    # those still ours, and reports the others lost.
                    self._closed = True
                    return
                if self.pauses.paused(task.company_id, self.db):
                    self._hand_back_paused()  # its company was paused since the claim
                    continue
                task_type = tasktypes.get(task.type)
                if task_type is None:
                    self._fail_unknown_type(task)
                    continue
                # Busy before the task is ours: the overrun watch, which reads it after taking
                # every unstarted task, then counts this one as running if it may be.
                hand.busy = True
                try:
                    if self._unstarted.pop(task.id, None) is None:
                        return  # handed back after an overrun meanwhile
                    # From here on the task may have side effects: never released.
                    self._run_one(task, task_type, hand)
                finally:
                    hand.busy = False
        except BaseException:
            self._closed = True
            raise

    def _fail_unknown_type(self, task: claims.ClaimedTask) -> None:
        """Fail `task`, of a type no handler is registered for, unless handed back already."""
        if self._unstarted.pop(task.id, None) is None:
            return  # handed back after an overrun meanwhile
        failed = outcome.unknown_type(task.type, tasktypes.names())
        try:
            self.finalizer.settle(task, failed, seconds=None)
        except BaseException:
            # Still unstarted while the write may fail: then it is released, not stranded.
            self._unstarted[task.id] = task
            raise

    def _still_alive(self) -> bool:
        """Whether the batch's leases are still ours: the holder's row not swept since the claim.

        Its heartbeat runs in the background; if it has fallen behind (a database hiccup,
        a stalled liveness thread), beat now before starting anything, or a task another
        worker took over could run twice at once (design §1.2).
        """
        holder = self.holder
        if holder is None:
            return True
        if time.monotonic() - holder.confirmed_at > self.settings.stale_after / 2:
            holder.beat()
        return holder.generation == self._generation

    def _run_one(self, task: claims.ClaimedTask, task_type: TaskType, hand: overruns.Hand) -> None:
        timeout = task.timeout_seconds
        started = time.monotonic()
        armed = (task, timeout, started, started + timeout + timeouts.OVERRUN_GRACE_SECONDS)
        hand.running = armed
        returned: JsonValue = None
        raised: Exception | None = None
        try:
            context = TaskContext(
                task_id=task.id,
                company_id=task.company_id,
                type=task.type,
                payload=_load_payload(task, task_type),
                attempt=task.attempts,
                max_attempts=task.max_attempts,
                config=self.settings.handler_config,
                timeout=timeout,
                deadline=started + timeout,
            )
            returned = task_type.handler(context)
        except Exception as exc:
            raised = exc
        finally:
            overran = hand.returned(armed[3])
        if overran:
            # The lease keeper wrote this task's outcome and what else the pass owed: stop.
            self.overrun_watch.wait_written()
            return
        seconds = time.monotonic() - started
        if raised is None:  # the common case, first
            if returned is None:
                self.completer.complete(task, seconds, None)
            else:
                self._complete_with_result(task, returned, seconds)
            return
        self._finalize_failure(
            timeouts.Running(task, timeout, started), raised=raised, seconds=seconds
        )

    def _complete_with_result(
        self, task: claims.ClaimedTask, returned: JsonValue, seconds: float
    ) -> None:
        try:
            result = task_result.encode(returned)
        except task_result.UnstorableResult as exc:
            self.finalizer.settle(task, outcome.unstorable_result(str(exc)), seconds=seconds)
            return
        self.completer.complete(task, seconds, result)

    def _finalize_failure(
        self,
        running: timeouts.Running,
        *,
        raised: Exception,
        seconds: float,
    ) -> None:
        """Finalize an attempt that raised: timed out if at or past its deadline."""
        task = running.task
        # A handler that honours its deadline ends there with an error of its own (`sleep`'s
        # TimeoutError, a webhook's shut socket). A permanent error is the handler's verdict.
        if not isinstance(raised, PermanentTaskError) and time.monotonic() >= running.deadline:
            decision: outcome.Retry | outcome.Fail = outcome.timed_out(
                timeout=running.timeout,
                ran=seconds,
                detail=outcome.describe_error(raised),
                attempt=task.attempts,
                max_attempts=task.max_attempts,
                backoff=self.backoff,
            )
            self.finalizer.settle(task, decision, seconds=seconds, exc=raised)
            return
        failed = outcome.decide(
            raised, attempt=task.attempts, max_attempts=task.max_attempts, backoff=self.backoff
        )
        assert not isinstance(failed, outcome.Complete)
        self.finalizer.settle(task, failed, seconds=seconds, exc=raised)


def _load_payload(task: claims.ClaimedTask, task_type: TaskType[Any]) -> Any:
    """`task`'s payload as its handler receives it (`TaskType.load_payload`).

    Raises `PermanentTaskError` naming the fields (never their values: a payload is not
    logged) when the stored payload does not load, e.g. stored before its schema changed:
    no retry changes a stored payload.
    """
    try:
        return task_type.load_payload(task.payload)
    except ValidationError as exc:
        fields = exc.messages if isinstance(exc.messages, dict) else {}
        invalid = ", ".join(sorted(map(str, fields))) or "the payload"
        raise PermanentTaskError(
            f"the stored payload does not load as a {task.type} payload: invalid {invalid}"
        ) from None
