"""One processing pass: take back expired leases, claim a batch, run each task, finalize it.

Used by worker children (`worker.child`), by `python -m worker --once` and by
`POST /workers/process`. The claim and every finalization are short transactions of their
own; handlers run holding no transaction and no row lock (STYLE "Database"; procrastinate
`fetch_job` / `finish_job`).

While the batch runs, a lease keeper thread (`LeaseKeeper`, its own session) refreshes the
leases the pass still holds every `heartbeat_interval` (design §4 Heartbeat), so a long task
is never reclaimed while its worker is alive, and writes completions in batches: one fenced
`UPDATE ... FROM unnest(...)` for all completions older than `COMPLETION_FLUSH_SECONDS`,
instead of one commit per task. The pass writes the rest when its batch ends. Every database
call of the pass is serialized by one lock, so a session factory bound to a single connection
(tests, and the pass's own connection below) is safe too.

For a caller that runs pass after pass (a worker child; docs/decisions/0003):

- given an engine, a pass holds one connection from start to end and runs every
  single-statement write (sweep, heartbeat, completion, failure, retry, release) in
  autocommit; only the claim, several statements under one advisory lock, runs in a
  transaction;
- a `SweepSchedule` sweeps expired leases every few seconds instead of before every claim;
- a `LeaseKeeper` given by the caller serves every pass, instead of a thread per pass.

A pass that ends on a database error still owes the database the completions it could not
write and the release of the tasks it never started. Dropped, those tasks would wait out
their lease and run again. A caller that passes an `Owed` keeps them instead: the next pass
given the same object writes them (fenced, so writing twice is harmless) before it claims
anything; `write_owed` tries on its own. Their log lines and observer counts come when they
are written, once.

Metrics stay out of this module: the caller passes a `PassObserver` (the worker's
Prometheus counters implement it); the default observes nothing. Completions are reported once
per written batch and task type, not once per task.

Logs: one line per task transition (completed, retried, failed, released, lease lost) and one
per claim, each with `extra` fields (`event`, `task_id`, `company_id`, `type`, `attempt`,
`duration_ms`) that the JSON format writes as keys. Never the payload, nor a handler's error
message, which may quote it (a webhook URL, a recipient): logs name the exception class, and
the message is in the task's `last_error`. The pass runs inside `worker.logging.batched()`, so
its INFO lines cost one write per pass (or per `worker.logging.MAX_HOLD_SECONDS` for slow
tasks) instead of one per task; below INFO a completed or released task builds no log fields.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from db import engine as db_engine
from db import queue
from worker import backoff, tasktypes
from worker import logging as worker_logging
from worker.errors import PermanentTaskError
from worker.tasktypes.base import HandlerConfig, TaskContext

log = logging.getLogger("fairq.worker.processing")

T = TypeVar("T")

# A completion waits at most about this long (plus one keeper tick) before it is written:
# batching cuts commits per task, waiting longer would only delay the caller's visibility.
COMPLETION_FLUSH_SECONDS = 0.1
# How often the lease keeper wakes to look for due heartbeats and completions.
KEEPER_TICK_SECONDS = 0.05
# While the database is down the keeper retries every tick: one warning per this many seconds.
KEEPER_WARN_SECONDS = 5.0
# A worker child sweeps expired leases at most this often (and at least every tenth of the
# stale window): a lease is taken over this much later at worst, against a round trip saved
# on nearly every claim.
SWEEP_INTERVAL_SECONDS = 5.0
# Expired leases taken back per sweep at most, so a mass crash costs each pass a slice.
SWEEP_LIMIT = 1000
# statement_timeout of a worker process's engine (children, `--once`; `db.engine.make_engine`),
# lock waits included: far above a normal claim's wait for the claimers' advisory lock, far
# below the minutes a call can hang on a dead network. The API's pass runs on the API's
# engine, without one.
WORKER_STATEMENT_TIMEOUT_MS = 30_000


class PassSettings(Protocol):
    """What a pass needs to know; `worker.settings.WorkerSettings` satisfies it."""

    @property
    def batch_size(self) -> int:
        """Most tasks claimed per pass."""
        ...

    @property
    def stale_after(self) -> float:
        """Seconds without a heartbeat after which a lease may be taken over."""
        ...

    @property
    def effective_heartbeat_interval(self) -> float:
        """Seconds between lease refreshes; must be well below `stale_after`."""
        ...

    @property
    def handler_config(self) -> HandlerConfig:
        """Settings handed to handlers."""
        ...


@dataclass(frozen=True)
class PassDefaults:
    """`PassSettings` with the worker's defaults, for callers without `WorkerSettings`."""

    batch_size: int = 100
    stale_after: float = 300.0
    heartbeat_interval: float | None = None
    handler_config: HandlerConfig = field(default_factory=HandlerConfig)

    @property
    def effective_heartbeat_interval(self) -> float:
        """`heartbeat_interval`, else `stale_after / 5` (design §4)."""
        return self.heartbeat_interval or self.stale_after / 5


class PassObserver(Protocol):
    """Receives what a pass did, for metrics (design §7). Methods must not raise."""

    def claimed(self, n: int) -> None:
        """`n` tasks were claimed."""

    def claim_seconds(self, seconds: float) -> None:
        """The claim transaction took `seconds`."""

    def completed(self, task_type: str, seconds: Sequence[float]) -> None:
        """`len(seconds)` tasks of `task_type` completed; each handler ran that long."""

    def retried(self, task_type: str, seconds: float | None = None) -> None:
        """An attempt failed and the task was scheduled again."""

    def failed(self, task_type: str, seconds: float | None = None) -> None:
        """A task failed for good (`seconds` None when no handler ran)."""

    def released(self, n: int) -> None:
        """`n` claimed tasks were handed back unstarted."""

    def lease_lost(self, n: int = 1) -> None:
        """`n` fenced statements matched nothing: the lease had been taken over."""


class NoopObserver:
    """A `PassObserver` that records nothing."""

    def claimed(self, n: int) -> None:
        """Ignore."""

    def claim_seconds(self, seconds: float) -> None:
        """Ignore."""

    def completed(self, task_type: str, seconds: Sequence[float]) -> None:
        """Ignore."""

    def retried(self, task_type: str, seconds: float | None = None) -> None:
        """Ignore."""

    def failed(self, task_type: str, seconds: float | None = None) -> None:
        """Ignore."""

    def released(self, n: int) -> None:
        """Ignore."""

    def lease_lost(self, n: int = 1) -> None:
        """Ignore."""


@dataclass(frozen=True)
class PassResult:
    """What one pass did; the body of `POST /workers/process`.

    `failed` includes poison pills the sweep failed before the claim; `lease_lost` counts
    tasks whose finalization (or start) found the lease taken over.
    """

    claimed: int = 0
    completed: int = 0
    retried: int = 0
    failed: int = 0
    released: int = 0
    lease_lost: int = 0


SessionSource = Callable[[], Session] | Engine
StopFlag = threading.Event | Callable[[], bool] | None


class _Done(NamedTuple):
    task: queue.ClaimedTask
    lease: queue.Lease
    seconds: float
    at: float  # time.monotonic() when the handler returned


class SweepSchedule:
    """When the lease-expiry sweep is next due, for a caller that runs pass after pass.

    Without one a pass sweeps before it claims, every time (`POST /workers/process`, tests).
    A worker child sweeps every `interval` seconds instead: a lease that expired is taken
    over that much later at worst, and a pass that does not sweep saves a round trip.
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


class Owed:
    """What passes that ended on a database error still owe the database.

    Completions not yet written (with their handler durations) and unstarted tasks not yet
    released. Not thread-safe: one caller (a worker child's loop) hands the same object to
    each of its passes in turn.
    """

    def __init__(self) -> None:
        self._completions: list[_Done] = []
        self._releases: list[queue.ClaimedTask] = []

    @property
    def completions(self) -> int:
        """Tasks that ran to success whose completion is not written yet."""
        return len(self._completions)

    @property
    def releases(self) -> int:
        """Claimed tasks that never started and are not handed back yet."""
        return len(self._releases)

    def __bool__(self) -> bool:
        return bool(self._completions or self._releases)

    def _take(self) -> tuple[list[_Done], list[queue.ClaimedTask]]:
        taken = self._completions, self._releases
        self._completions, self._releases = [], []
        return taken

    def _add(self, completions: Sequence[_Done], releases: Sequence[queue.ClaimedTask]) -> None:
        self._completions.extend(completions)
        self._releases.extend(releases)


def process_batch(
    sessions: SessionSource,
    *,
    worker_id: str,
    settings: PassSettings | None = None,
    stop: StopFlag = None,
    observer: PassObserver | None = None,
    rng: random.Random | None = None,
    owed: Owed | None = None,
    sweep: SweepSchedule | None = None,
    keeper: LeaseKeeper | None = None,
) -> PassResult:
    """Run one pass: sweep, claim up to `settings.batch_size` tasks, run and finalize each.

    `sessions` is a session factory, or an engine: then the pass holds one of its connections
    throughout and writes single statements in autocommit (see the module docstring).
    `worker_id` is stored in `locked_by` (`host:pid`). The sweep runs when `sweep` says it
    is due, or every pass without one. `stop` is checked before the claim and before each task:
    once set, the unstarted rest of the batch is released (design §4 Release) and the pass
    returns. A handler's `Exception` never escapes: `PermanentTaskError`, an unknown type or
    a last attempt fails the task, anything else retries it after `worker.backoff.delay`.
    A `BaseException` (KeyboardInterrupt, SystemExit) propagates after the pass writes its
    completions and releases the unstarted rest; the interrupted task is left to lease
    expiry.

    Database errors propagate, after one more attempt to write the completions and releases
    the pass owes. What that attempt could not write goes into `owed`, if given (else it is
    left to lease expiry, and logged); a pass given a non-empty `owed` writes it first and
    raises, claiming nothing, while the database still fails. The result counts what the
    pass wrote, owed work included.

    `keeper` is a lease keeper to attach the pass to; without one the pass starts its own.
    """
    with worker_logging.batched(), _pass_sessions(sessions) as (factory, connection):
        return _Pass(
            factory,
            worker_id=worker_id,
            settings=settings or PassDefaults(),
            stop=_stop_predicate(stop),
            observer=observer or NoopObserver(),
            rng=rng,
            owed=owed,
            connection=connection,
            sweep=sweep,
            keeper=keeper,
        ).run()


def write_owed(
    sessions: SessionSource, owed: Owed, *, observer: PassObserver | None = None
) -> PassResult:
    """Write what `owed` holds (completions, releases), claiming nothing; return the counts.

    For a caller's last attempt (a stopping child, `--once`). A database error propagates;
    what is still unwritten stays in `owed`.
    """
    if not owed:
        return PassResult()
    with worker_logging.batched(), _pass_sessions(sessions) as (factory, connection):
        state = _Pass(
            factory,
            worker_id="",
            settings=PassDefaults(),
            stop=lambda: True,
            observer=observer or NoopObserver(),
            rng=None,
            owed=owed,
            connection=connection,
        )
        with factory() as session:
            state.write_owed(session)
        return state.tally.result()


@contextlib.contextmanager
def _pass_sessions(
    sessions: SessionSource,
) -> Iterator[tuple[Callable[[], Session], Connection | None]]:
    """The pass's session factory, and the connection its sessions share if it holds one."""
    if not isinstance(sessions, Engine):
        yield sessions, None
        return
    # One checkout for the whole pass. Returned to the pool at the end, where SQLAlchemy
    # resets the isolation level the pass changed.
    with sessions.connect() as connection:
        yield lambda: Session(bind=connection, expire_on_commit=False), connection


def _stop_predicate(stop: StopFlag) -> Callable[[], bool]:
    if stop is None:
        return lambda: False
    if isinstance(stop, threading.Event):
        return stop.is_set
    return stop


@dataclass
class _Tally:
    claimed: int = 0
    completed: int = 0
    retried: int = 0
    failed: int = 0
    released: int = 0
    lease_lost: int = 0

    def result(self) -> PassResult:
        return PassResult(
            self.claimed, self.completed, self.retried, self.failed, self.released, self.lease_lost
        )


def _describe_error(exc: BaseException) -> str:
    message = str(exc)
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def _task_fields(
    task: queue.ClaimedTask | queue.ExpiredLease, event: str, seconds: float | None, **more: object
) -> dict[str, object]:
    """The fields of a task transition's log line; `duration_ms` is None when no handler ran.

    Passed both as `extra` (keys of the JSON line) and as the message's %-mapping, so each
    id is turned into text once per line.
    """
    return {
        "event": event,
        "task_id": str(task.id),
        "company_id": str(task.company_id),
        "type": task.type,
        "attempt": task.attempts,
        "duration_ms": None if seconds is None else round(seconds * 1000, 3),
        **more,
    }


# Messages of the task transition lines, %-formatted with `_task_fields` (plus extras).
_TASK = "task %(task_id)s (company %(company_id)s, type %(type)s)"
MSG_COMPLETED = _TASK + " completed on attempt %(attempt)d in %(duration_ms).1f ms"
MSG_RETRIED = (
    _TASK + " attempt %(attempt)d/%(max_attempts)d failed after %(ran)s (%(error_type)s), "
    "retry in %(retry_in_s).1fs"
)
MSG_FAILED = (
    _TASK + " failed on attempt %(attempt)d/%(max_attempts)d after %(ran)s (%(error_type)s)"
)
MSG_WORKER_LOST = (
    _TASK + " failed: worker lost on each of %(attempt)d attempts (last holder %(locked_by)s)"
)
MSG_LEASE_EXPIRED = (
    _TASK + " attempt %(attempt)d: lease expired (holder %(locked_by)s stopped), requeued"
)
MSG_RELEASED = _TASK + " released unstarted, attempt %(attempt)d handed back"
MSG_LEASE_LOST = _TASK + " attempt %(attempt)d: lease lost, %(action)s changed nothing"


def _ms(seconds: float | None) -> str:
    return "no run" if seconds is None else f"{seconds * 1000:.1f} ms"


def _code_traceback(exc: BaseException) -> str:
    """Where `exc` and its causes were raised, without their messages (which may quote data)."""
    parts: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        frames = "".join(traceback.format_tb(current.__traceback__))
        parts.append(f"{frames}{type(current).__module__}.{type(current).__qualname__}")
        current = current.__cause__ or (
            None if current.__suppress_context__ else current.__context__
        )
    return "\n-- raised while handling --\n".join(parts)


class _Pass:
    """The state of one pass, shared by the main thread and the lease keeper."""

    def __init__(
        self,
        factory: Callable[[], Session],
        *,
        worker_id: str,
        settings: PassSettings,
        stop: Callable[[], bool],
        observer: PassObserver,
        rng: random.Random | None,
        owed: Owed | None = None,
        connection: Connection | None = None,
        sweep: SweepSchedule | None = None,
        keeper: LeaseKeeper | None = None,
    ) -> None:
        heartbeat_interval = settings.effective_heartbeat_interval
        if not 0 < heartbeat_interval < settings.stale_after:
            raise ValueError(
                f"heartbeat interval {heartbeat_interval}s must be positive and below "
                f"stale_after {settings.stale_after}s, or leases expire while tasks run"
            )
        self.factory = factory
        self.worker_id = worker_id
        self.settings = settings
        self.stop = stop
        self.observer = observer
        self.rng = rng
        self.owed = owed
        self.sweep = sweep
        self.keeper = keeper
        self.heartbeat_interval = heartbeat_interval
        self.tally = _Tally()
        # The connection every session of the pass shares, when the pass holds one: single
        # statements then run in autocommit, switched off for the claim's transaction.
        self._connection = connection
        self._autocommit = False
        # _db serializes database use between the two threads; _state guards what follows.
        self._db = threading.Lock()
        self._state = threading.Lock()
        self._held: dict[uuid.UUID, queue.Lease] = {}
        self._lost: set[uuid.UUID] = set()
        self._done: list[_Done] = []
        # Held tasks whose handler has not started: released if the pass ends early. Only
        # the main thread uses it.
        self._unstarted: dict[uuid.UUID, queue.ClaimedTask] = {}
        self._confirmed_at = 0.0  # time.monotonic() when every held lease was last confirmed

    # -- the main thread ------------------------------------------------------------------

    def run(self) -> PassResult:
        with self.factory() as session:
            # Before the claim: a task whose completion is owed is never claimed again here.
            self.write_owed(session)
            if self.sweep is None or self.sweep.due():
                self._sweep(session)
            if self.stop():
                return self.tally.result()
            batch = self._claim(session)
            if not batch:
                return self.tally.result()
            keeper = self.keeper or LeaseKeeper()
            keeper.attach(self)
            try:
                self._run_batch(session, batch)
            except BaseException:
                self._detach(keeper)
                # The error in flight matters more than a second one from the database.
                with contextlib.suppress(Exception):
                    self._hand_back(session)
                raise
            self._detach(keeper)
            self._hand_back(session)
        return self.tally.result()

    def _detach(self, keeper: LeaseKeeper) -> None:
        keeper.detach()
        if keeper is not self.keeper:  # started for this pass
            keeper.close()

    def write_owed(self, session: Session) -> None:
        """Write what earlier passes owe (`self.owed`); raise, keeping it owed, on failure."""
        if not self.owed:
            return
        completions, releases = self.owed._take()
        with self._state:
            self._held.update((d.task.id, d.lease) for d in completions)
            self._held.update((t.id, t.lease) for t in releases)
            self._done.extend(completions)
        self._unstarted.update((t.id, t) for t in releases)
        log.info(
            "writing %d completions and %d releases owed since a database error",
            len(completions), len(releases),
            extra={"event": "tasks.owed", "completions": len(completions),
                   "releases": len(releases)},
        )  # fmt: skip
        self._hand_back(session)

    def _hand_back(self, session: Session) -> None:
        """Write every pending completion and release every unstarted task.

        On a database error what is still unwritten goes to `self.owed` (or, without one,
        is left to lease expiry) and the error propagates.
        """
        try:
            self.flush_completions(session, force=True)
            self._release(session, list(self._unstarted.values()))
        except BaseException as exc:
            with self._state:
                done, self._done = self._done, []
                unstarted = [t for t in self._unstarted.values() if t.id in self._held]
            self._unstarted.clear()
            if done or unstarted:
                self._keep_owed(done, unstarted, exc)
            raise

    def _keep_owed(
        self, done: list[_Done], unstarted: list[queue.ClaimedTask], exc: BaseException
    ) -> None:
        if self.owed is not None:
            self.owed._add(done, unstarted)
            log.warning(
                "database error (%s): %d completions and %d releases kept for the next pass",
                type(exc).__name__, len(done), len(unstarted),
                extra={"event": "tasks.owed_kept", "completions": len(done),
                       "releases": len(unstarted)},
            )  # fmt: skip
            return
        log.warning(
            "database error (%s): %d completions and %d releases not written; those tasks run "
            "again once their leases expire",
            type(exc).__name__, len(done), len(unstarted),
            extra={"event": "tasks.owed_dropped", "completions": len(done),
                   "releases": len(unstarted)},
        )  # fmt: skip

    def _sweep(self, session: Session) -> None:
        expired = self._write(
            session,
            lambda: queue.expire_leases(
                session, stale_after=self.settings.stale_after, limit=SWEEP_LIMIT
            ),
        )
        # A full sweep may have left more behind (a mass crash): sweep again next pass.
        if self.sweep is not None and len(expired) < SWEEP_LIMIT:
            self.sweep.swept()
        for task in expired:
            if not task.failed:
                fields = _task_fields(task, "task.requeued", None, locked_by=task.locked_by)
                log.warning(MSG_LEASE_EXPIRED, fields, extra=fields)
                continue
            fields = _task_fields(
                task, "task.failed", None, error_type="WorkerLost", locked_by=task.locked_by
            )
            log.warning(MSG_WORKER_LOST, fields, extra=fields)
            self.tally.failed += 1
            self.observer.failed(task.type)

    def _claim(self, session: Session) -> list[queue.ClaimedTask]:
        # Taken before the statement: the leases' locked_at (its statement_timestamp()) is no
        # earlier.
        leased_at = time.monotonic()
        started = time.perf_counter()
        # The commit right after the claim releases its advisory lock: next claimer, go.
        batch = self._write(
            session,
            lambda: queue.claim(
                session, worker_id=self.worker_id, batch_size=self.settings.batch_size
            ),
            transaction=True,
        )
        seconds = time.perf_counter() - started
        self.observer.claim_seconds(seconds)
        self.observer.claimed(len(batch))
        self.tally.claimed = len(batch)
        self._confirmed_at = leased_at
        with self._state:
            self._held = {task.id: task.lease for task in batch}
        if batch:
            log.info(
                "claimed %d tasks in %.1f ms", len(batch), seconds * 1000,
                extra={"event": "tasks.claimed", "count": len(batch),
                       "duration_ms": round(seconds * 1000, 3)},
            )  # fmt: skip
        return batch

    def _run_batch(self, session: Session, batch: Sequence[queue.ClaimedTask]) -> None:
        """Run the batch's tasks in order until done or stopped.

        Whatever ends it (the stop flag; KeyboardInterrupt or SystemExit in a handler; a
        database error, also one before a task's handler started), `run` then writes the
        completions and releases exactly the tasks whose handler never started. A task
        whose handler started and did not finish stays processing: lease expiry recovers it.
        """
        self._unstarted = {task.id: task for task in batch}
        with self._state:
            leases = [self._held[task.id] for task in batch]  # the claim's, made once
        for task, lease in zip(batch, leases, strict=True):
            if self.stop():
                return
            self._confirm_leases(session)
            if self._lost and self._is_lost(task):  # (a set's truth value needs no lock)
                continue
            self._run_one(session, task, lease)

    def _confirm_leases(self, session: Session) -> None:
        # The keeper refreshes leases in the background; if it has fallen behind (database
        # hiccup), find out which leases are still ours before starting anything, or a task
        # another worker took over could run twice at once (design §1.2).
        if time.monotonic() - self._confirmed_at > self.settings.stale_after / 2:
            self.heartbeat(session)

    def _is_lost(self, task: queue.ClaimedTask) -> bool:
        with self._state:
            if task.id not in self._lost:
                return False
            self._lost.discard(task.id)
            self._held.pop(task.id, None)
        self._unstarted.pop(task.id, None)
        self._report_lease_lost(task, "start")
        return True

    def _run_one(self, session: Session, task: queue.ClaimedTask, lease: queue.Lease) -> None:
        task_type = tasktypes.get(task.type)
        if task_type is None:
            error = f"unknown task type {task.type!r} (registered: {', '.join(tasktypes.names())})"
            # Still unstarted while the write may fail: then it is released, not stranded.
            self._fail(session, task, error, error_type="UnknownTaskType", seconds=None)
            self._unstarted.pop(task.id, None)
            return
        context = TaskContext(
            task_id=task.id,
            company_id=task.company_id,
            type=task.type,
            payload=task.payload,
            attempt=task.attempts,
            max_attempts=task.max_attempts,
            config=self.settings.handler_config,
        )
        # From here on the task may have side effects: never released, whatever happens.
        self._unstarted.pop(task.id, None)
        started = time.perf_counter()
        try:
            task_type.handler(context)
        except PermanentTaskError as exc:
            seconds = time.perf_counter() - started
            self._fail(
                session, task, _describe_error(exc),
                error_type=type(exc).__name__, seconds=seconds, exc=exc,
            )  # fmt: skip
        except Exception as exc:
            seconds = time.perf_counter() - started
            if task.attempts >= task.max_attempts:
                error = f"gave up after {task.attempts} attempts: {_describe_error(exc)}"
                self._fail(
                    session, task, error, error_type=type(exc).__name__, seconds=seconds, exc=exc
                )
            else:
                self._retry(session, task, exc, seconds)
        else:
            seconds = time.perf_counter() - started
            with self._state:
                self._done.append(_Done(task, lease, seconds, time.monotonic()))

    def _fail(
        self,
        session: Session,
        task: queue.ClaimedTask,
        error: str,
        *,
        error_type: str,
        seconds: float | None,
        exc: BaseException | None = None,
    ) -> None:
        held = self._write(
            session, lambda: queue.fail_task(session, task.id, task.lease_token, error=error)
        )
        self._forget(task)
        if not held:
            self._report_lease_lost(task, "fail", seconds)
            return
        # `error` goes to last_error only: a handler's message may quote the payload.
        fields = _task_fields(task, "task.failed", seconds, error_type=error_type)
        log.warning(
            MSG_FAILED, {**fields, "max_attempts": task.max_attempts, "ran": _ms(seconds)},
            extra=fields,
        )  # fmt: skip
        if exc is not None:
            self._debug_traceback(task, exc)
        self.tally.failed += 1
        self.observer.failed(task.type, seconds)

    def _retry(
        self, session: Session, task: queue.ClaimedTask, exc: Exception, seconds: float
    ) -> None:
        delay = backoff.delay(task.attempts, rng=self.rng)
        error = _describe_error(exc)
        held = self._write(
            session,
            lambda: queue.schedule_retry(
                session, task.id, task.lease_token, delay_seconds=delay, error=error
            ),
        )
        self._forget(task)
        if not held:
            self._report_lease_lost(task, "retry", seconds)
            return
        fields = _task_fields(
            task, "task.retried", seconds, error_type=type(exc).__name__, retry_in_s=round(delay, 3)
        )
        log.warning(
            MSG_RETRIED, {**fields, "max_attempts": task.max_attempts, "ran": _ms(seconds)},
            extra=fields,
        )  # fmt: skip
        self._debug_traceback(task, exc)
        self.tally.retried += 1
        self.observer.retried(task.type, seconds)

    def _release(self, session: Session, tasks: Sequence[queue.ClaimedTask]) -> None:
        with self._state:
            # A lease the keeper already saw taken over is not ours to release: count it.
            lost = [t for t in tasks if t.id in self._held and t.id in self._lost]
            for task in lost:
                self._lost.discard(task.id)
                self._held.pop(task.id, None)
            mine = [t for t in tasks if t.id in self._held]
        for task in lost:
            self._unstarted.pop(task.id, None)
            self._report_lease_lost(task, "release")
        if not mine:
            return
        released = self._write(
            session, lambda: queue.release_tasks(session, [t.lease for t in mine])
        )
        for task in tasks:
            self._forget(task)
            self._unstarted.pop(task.id, None)
        self.tally.released += len(released)
        self.observer.released(len(released))
        info = log.isEnabledFor(logging.INFO)
        for task in mine:
            if task.id not in released:
                self._report_lease_lost(task, "release")
                continue
            if info:
                fields = _task_fields(task, "task.released", None)
                log.info(MSG_RELEASED, fields, extra=fields)

    def _forget(self, task: queue.ClaimedTask) -> None:
        with self._state:
            self._held.pop(task.id, None)

    def _report_lease_lost(
        self, task: queue.ClaimedTask, action: str, seconds: float | None = None
    ) -> None:
        fields = _task_fields(task, "task.lease_lost", seconds, action=action)
        log.warning(MSG_LEASE_LOST, fields, extra=fields)
        self._count_lease_lost()

    def _debug_traceback(self, task: queue.ClaimedTask, exc: BaseException) -> None:
        # Helps with handler bugs; names code only (exception messages may quote the payload).
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "traceback of task %s:\n%s", task.id, _code_traceback(exc),
                extra={"event": "task.traceback", "task_id": str(task.id)},
            )  # fmt: skip

    def _count_lease_lost(self) -> None:
        with self._state:
            self.tally.lease_lost += 1
        self.observer.lease_lost()

    # -- shared with the lease keeper -----------------------------------------------------

    def _write(
        self, session: Session, statement: Callable[[], T], *, transaction: bool = False
    ) -> T:
        """Run `statement` in a transaction of its own on `session`, one thread at a time.

        On the pass's own connection, a single-statement write (not `transaction`) runs in
        autocommit instead: the same atomicity, two round trips (BEGIN, COMMIT) fewer.
        """
        with self._db:
            try:
                self._set_autocommit(not transaction)
                result = statement()
                session.commit()
            except DBAPIError as exc:
                session.rollback()
                if transaction or self._connection is None or not db_engine.is_transient(exc):
                    raise
                # The pass's held connection may have died while a handler ran (a restart,
                # a failover, an idle timeout): its first use after that fails, and the pool
                # ping of a fresh checkout never ran. Once more on a new connection; the
                # statement is fenced, so a write that did commit changes nothing twice.
                log.info("database connection lost (%s); writing once more", type(exc).__name__)
                self._autocommit = False
                self._set_autocommit(True)
                result = statement()
                session.commit()
            except BaseException:
                session.rollback()
                raise
        return result

    def _set_autocommit(self, autocommit: bool) -> None:
        # Only between transactions (`_write` commits or rolls back every one), so switching
        # is a client-side setting of the driver, no round trip.
        if self._connection is None or self._autocommit == autocommit:
            return
        level = "AUTOCOMMIT" if autocommit else self._connection.default_isolation_level
        self._connection.execution_options(isolation_level=level)
        self._autocommit = autocommit

    def flush_completions(self, session: Session, *, force: bool) -> None:
        """Write pending completions in one fenced statement (all, or those due if not force)."""
        with self._state:
            if not self._done:
                return
            if not force and time.monotonic() - self._done[0].at < COMPLETION_FLUSH_SECONDS:
                return
            done, self._done = self._done, []
        try:
            completed = self._write(
                session, lambda: queue.complete_tasks(session, [d.lease for d in done])
            )
        except BaseException:
            with self._state:
                self._done[:0] = done  # keep them for the next flush
            raise
        self._completions_written(done, completed)

    def _completions_written(self, done: Sequence[_Done], completed: set[uuid.UUID]) -> None:
        """Account for written completions: `completed` are the ids that matched."""
        with self._state:
            for item in done:
                self._held.pop(item.task.id, None)
        info = log.isEnabledFor(logging.INFO)
        durations: dict[str, list[float]] = {}
        for item in done:
            task = item.task
            if task.id not in completed:
                self._report_lease_lost(task, "complete", item.seconds)
                continue
            if info:
                fields = _task_fields(task, "task.completed", item.seconds)
                log.info(MSG_COMPLETED, fields, extra=fields)
            durations.setdefault(task.type, []).append(item.seconds)
        with self._state:
            self.tally.completed += sum(map(len, durations.values()))
        # One report per type and written batch: the observer's metric writes are per call.
        for task_type, seconds in durations.items():
            self.observer.completed(task_type, seconds)

    def heartbeat(self, session: Session) -> None:
        """Refresh every held lease; remember the ones found taken over."""
        with self._state:
            leases = list(self._held.values())
        if not leases:
            return
        leased_at = time.monotonic()
        refreshed = self._write(session, lambda: queue.heartbeat(session, leases))
        self._confirmed_at = leased_at
        lost = {lease.task_id for lease in leases} - refreshed
        if lost:
            log.warning(
                "%d of %d leases were taken over before their heartbeat", len(lost), len(leases)
            )
            with self._state:
                # Still held means not finalized meanwhile: really lost, not just done.
                self._lost |= {task_id for task_id in lost if task_id in self._held}


class LeaseKeeper:
    """A thread that heartbeats the attached pass's leases and flushes its due completions.

    A worker child keeps one for its life: starting and joining a thread for every pass cost
    more than a batch of noop handlers. A pass given none starts its own. One pass is
    attached at a time. The thread wakes every `KEEPER_TICK_SECONDS` (or heartbeat interval,
    if shorter), attached or not: `attach` then need not wake it, a thread switch per pass.
    """

    def __init__(self) -> None:
        # Guards everything below; held by the thread while it works for a pass, so
        # `detach` waits for the database call in flight, if any.
        self._lock = threading.Condition()
        self._owner: _Pass | None = None
        self._session: Session | None = None
        self._next_beat = 0.0
        self._closed = False
        self._quiet_until = 0.0  # time.monotonic() before which transient errors are counted
        self._suppressed = 0
        self._thread = threading.Thread(target=self._run, name="fairq-lease-keeper", daemon=True)
        self._thread.start()

    def attach(self, owner: _Pass) -> None:
        """Keep `owner`'s leases from now on (from the thread's next tick)."""
        with self._lock:
            self._owner = owner
            self._next_beat = time.monotonic() + owner.heartbeat_interval
            # A heartbeat interval shorter than the tick (tests) must not wait a whole tick.
            if owner.heartbeat_interval < KEEPER_TICK_SECONDS:
                self._lock.notify()

    def detach(self) -> None:
        """Stop working for the attached pass; return once no call for it is in flight."""
        with self._lock:
            self._owner = None
            if self._session is not None:
                self._session.close()
                self._session = None

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
                tick = KEEPER_TICK_SECONDS if owner is None else owner.heartbeat_interval
                self._lock.wait(min(KEEPER_TICK_SECONDS, tick))
                owner = self._owner
                if owner is not None and not self._closed:
                    self._tick(owner)

    def _tick(self, owner: _Pass) -> None:
        # Whatever fails, the thread goes on: it serves every later pass of the child too.
        try:
            if self._session is None:
                self._session = owner.factory()
            if time.monotonic() >= self._next_beat:
                self._next_beat = time.monotonic() + owner.heartbeat_interval
                owner.heartbeat(self._session)
            owner.flush_completions(self._session, force=False)
            # Lines of a batch of slow tasks must not wait for the end of the pass.
            worker_logging.write_due()
        except Exception as exc:
            # A failed beat or flush is retried next tick; the main thread's final flush
            # reports what still fails.
            self._log_failure(exc)

    def _log_failure(self, exc: Exception) -> None:
        """Log a failed database call: a bug with its traceback, an outage rate-limited.

        While the database is down every tick fails the same way; one line per
        `KEEPER_WARN_SECONDS`, counting the failures it stands for, says as much.
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
            type(exc).__name__, KEEPER_TICK_SECONDS, self._suppressed,
            extra={"event": "keeper.db_error", "suppressed": self._suppressed},
        )  # fmt: skip
        self._quiet_until = now + KEEPER_WARN_SECONDS
        self._suppressed = 0
