"""A worker child (design §5): claims and runs batches until told to stop.

Forked by `worker.supervisor`. In order, a child:

1. undoes what it inherited: the supervisor's signal handlers go back to default (the
   supervisor calls `reset_inherited_signals` first thing after fork, and closes its wakeup
   pipe, metrics sockets and sibling pipes), then `main` installs the child's own: TERM, INT
   and QUIT set the stop flag; HUP, TTIN and TTOU are the supervisor's business and ignored;
2. boots: starts its `liveness.AliveSignal` thread, builds its own connection pool (the
   supervisor never has one; two connections: a pass's, and its liveness thread's,
   `db.connector.make_pool`), checks that the
   database answers and is migrated, registers its `workers` row (`processing.Holder`),
   which the liveness thread beats from then on, and tells the supervisor on its status
   pipe, `booted` or `error: <reason>` followed by exit status `BOOT_ERROR`;
3. loops: one processing pass; if it claimed anything, the next at once; otherwise it waits
   for a NOTIFY on `settings.notify_channel` or `poll_interval`, whichever comes first.
   NOTIFY is only a hint: a lost listener is reconnected with backoff and polling alone stays
   correct. A transient database error never ends the child: it logs, backs off (0.5 s
   doubling to 10 s) and tries again, so a PostgreSQL restart costs a few seconds, not the
   process. What the interrupted pass could not write (completions, releases of unstarted
   tasks) stays unwritten (`processing.UnwrittenOutcomes`): the next pass writes it before
   it claims, so those tasks neither wait out their leases nor run again. Every statement
   of the child's connections is bounded by `processing.WORKER_STATEMENT_TIMEOUT_MS`;
4. stops when the stop flag is set (the pass starts no other task, finishes the ones in hand
   and releases the rest of its batch) or when its parent is gone (`os.getppid()` changed;
   looked at before a task at most every `ORPHAN_POLL_SECONDS`, a system call saved on
   nearly every task, and at least every `ORPHAN_CHECK_SECONDS` while waiting), makes one
   last attempt to write what it still owes, deletes its `workers` row if it holds no lease
   any more, then exits 0;
5. or exits `HANDLER_STUCK` from its lease keeper's thread when a handler overran its task's
   deadline and the grace (`processing.timeouts`), once the pass has written that task's
   timeout outcome, released the unstarted rest of its batch, and written the outcomes of
   its other running handlers as they returned (or overran too), saying which task on its
   status pipe (`stuck: ...`). It then holds no lease and deletes its `workers` row: the
   supervisor logs it and replaces the child. Only a child that could not write (the
   database down) leaves leases behind, for the sweep.

Fewer round trips and less work per batch (`worker.processing`): each pass holds one
connection of the child's pool; dead workers' leases are swept every few seconds
(`processing.SweepSchedule`), not before every claim; and one lease keeper thread
(`processing.LeaseKeeper`) serves every pass, as do its `WORKER_THREADS - 1` runner threads
(`processing.Runners`), which run handlers beside the main thread.

Every `MAINTENANCE_INTERVAL_SECONDS` a child also tries the retention step
(`db.maintenance`); an advisory lock lets one runner at a time do it, across all hosts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import secrets
import select
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import psycopg
from psycopg_pool import ConnectionPool
from sqlalchemy.exc import DBAPIError

from common import logging as fairq_logging
from db import connector, maintenance
from db import engine as db_engine
from db import errors as db_errors
from db.engine import driver_errors
from worker import backoff, liveness, wakeups
from worker.settings import WorkerSettings

if TYPE_CHECKING:
    from worker import metrics, processing

log = logging.getLogger("fairq.worker.child")

T = TypeVar("T")

# Exit status of a child that could not boot (gunicorn's WORKER_BOOT_ERROR is 3 too).
BOOT_ERROR = 3
# Exit status of a child whose handler overran its task's deadline (`processing.timeouts`):
# the thread in it can be freed only by ending the process.
HANDLER_STUCK = 4
# Lines a child writes on its status pipe.
STATUS_BOOTED = "booted"
STATUS_ERROR = "error:"
STATUS_STUCK = "stuck:"

# application_name of a child's connections (operators and tests find them by it).
APPLICATION_NAME = "fairq-worker"

ORPHAN_CHECK_SECONDS = 1.0
# While busy, the parent is looked up at most this often (the stop flag itself at every call).
ORPHAN_POLL_SECONDS = 0.1
# Backoff after a database error, and between attempts to re-LISTEN.
RETRY_BACKOFF_MIN_SECONDS = 0.5
RETRY_BACKOFF_MAX_SECONDS = 10.0

MAINTENANCE_INTERVAL_SECONDS = 60.0
# One retention run stops after this long, so a large backlog does not stall processing.
MAINTENANCE_BUDGET_SECONDS = 2.0


def new_worker_id() -> str:
    """This process's id as a holder of leases (`locked_by`, `workers.id`): `host:pid:nonce`.

    The nonce tells apart two processes that had the same pid on this host: a dead one's
    row must never pass for the live one's.
    """
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


@dataclass(frozen=True)
class Inherited:
    """What the supervisor hands a freshly forked child.

    `status_fd`: write end of the status pipe (None outside a supervisor);
    `signal_mask`: the mask to restore once the child's own handlers are in place (the
    supervisor blocks its signals around fork); `alive_fd`: write end of the pipe on which
    the child says it is alive (`AliveSignal`).
    """

    parent_pid: int
    status_fd: int | None
    signal_mask: frozenset[signal.Signals]
    alive_fd: int | None = None


def reset_inherited_signals() -> None:
    """Put every Python-level signal handler back to default and drop the wakeup fd."""
    signal.set_wakeup_fd(-1)
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except ValueError:  # pragma: no cover  (signals Python cannot query)
            continue
        if callable(handler):
            signal.signal(sig, signal.SIG_DFL)


def main(settings: WorkerSettings, inherited: Inherited) -> int:
    """Run a child until it is told to stop or orphaned; return its exit status."""
    return Child(settings, inherited).run()


class Child:
    """The state of one child process; `run()` is its whole life after the fork."""

    def __init__(self, settings: WorkerSettings, inherited: Inherited) -> None:
        self.settings = settings
        self.inherited = inherited
        self.worker_id = new_worker_id()
        self._stop = threading.Event()
        self._orphaned = False
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
        self._pool: ConnectionPool[psycopg.Connection[Any]] | None = None
        self._metrics: metrics.TaskMetrics | None = None
        self._unwritten: processing.UnwrittenOutcomes | None = None
        self._sweep_schedule: processing.SweepSchedule | None = None
        self._keeper: processing.LeaseKeeper | None = None
        self._runners: processing.Runners | None = None
        self._holder: processing.Holder | None = None
        self._orphan_check_at = 0.0  # time.monotonic() of the next look at the parent pid
        self._listener = wakeups.Listener(settings.listen_url, settings.notify_channel)
        self._listen_backoff = backoff.Backoff(RETRY_BACKOFF_MIN_SECONDS, RETRY_BACKOFF_MAX_SECONDS)
        self._listen_retry_at = 0.0
        self._next_maintenance = time.monotonic() + random.uniform(0, 10)
        self._alive: liveness.AliveSignal | None = None

    def run(self) -> int:
        """Install signal handlers, boot, loop until stopped; return the exit status."""
        self._install_signal_handlers()
        # After the signal mask is restored: the thread inherits it.
        self._alive = liveness.AliveSignal(
            self.inherited.alive_fd, timeout=self.settings.child_timeout
        )
        try:
            reason = self._boot()
            if reason is not None:
                if self.inherited.status_fd is None:  # else the supervisor logs it
                    log.error("child %d could not boot: %s", os.getpid(), reason)
                self._report(f"{STATUS_ERROR} {reason}")
                return BOOT_ERROR
            self._report(STATUS_BOOTED)
            log.info("child %d ready (worker %s)", os.getpid(), self.worker_id)
            self._loop()
            self._deregister()
            log.info("child %d stopping%s", os.getpid(), " (orphaned)" if self._orphaned else "")
            return 0
        finally:
            self._close()

    # -- setup ----------------------------------------------------------------------------

    def _install_signal_handlers(self) -> None:
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
            signal.signal(sig, self._on_stop_signal)
        # Job-control and hangup signals that reach the whole process group are for the
        # supervisor; their default actions would stop or kill a child mid-task.
        for sig in (signal.SIGHUP, signal.SIGTTIN, signal.SIGTTOU):
            signal.signal(sig, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_SETMASK, self.inherited.signal_mask)

    def _on_stop_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only records: the pass checks the flag before each task (on every runner thread),
        # the wait wakes on the pipe.
        self._stop.set()

    def _boot(self) -> str | None:
        """Prepare everything the loop needs; return why that failed, or None."""
        try:
            # Imported here, after the fork: a module that fails to import is a boot error
            # of this child, reported to the supervisor, rather than a crash.
            from worker import metrics, processing, tasktypes  # noqa: PLC0415

            self._metrics = metrics.TaskMetrics(tasktypes.names())
            self._unwritten = processing.UnwrittenOutcomes()
            self._sweep_schedule = processing.SweepSchedule.for_stale_window(
                self.settings.stale_after
            )
            self._keeper = processing.LeaseKeeper()
            # WORKER_THREADS - 1 threads beside this one: a batch runs that many handlers at
            # once (no more than it has tasks).
            runners = min(self.settings.threads, self.settings.batch_size) - 1
            if runners > 0:
                self._runners = processing.Runners(runners)
        except Exception as exc:
            log.exception("importing the processing code failed")
            return f"cannot import the processing code: {exc!r}"
        self._pool = connector.make_pool(
            self.settings.database_url,
            application_name=APPLICATION_NAME,
            statement_timeout_ms=processing.WORKER_STATEMENT_TIMEOUT_MS,
            transaction_pooling=self.settings.transaction_pooling,
            # Two connections: a pass and its lease keeper share one, the liveness thread's
            # heartbeat has the other, so that it never waits for a pass's statement (README,
            # "The worker supervisor": connections per child). Pinged only after idling
            # (`db.connector.checkout`), not on every pass, a round trip per batch: a busy
            # child uses its connection all the time, and a dead one fails its pass's first
            # statement, which the loop retries on a new connection (tests/test_outage.py).
            min_size=2,
            max_size=2,
        )
        # A database that is restarting (a deploy, a failover) is waited out for
        # `boot_timeout`; one that answers without our tables is a boot error at once.
        deadline = time.monotonic() + self.settings.boot_timeout
        retries = backoff.Backoff(RETRY_BACKOFF_MIN_SECONDS, RETRY_BACKOFF_MAX_SECONDS)
        while True:
            try:
                # A connection of its own, made in this thread: a refused one fails at once,
                # where the pool would wait for its background attempts.
                with (
                    driver_errors("boot"),
                    connector.connect(
                        self.settings.database_url,
                        application_name=APPLICATION_NAME,
                        transaction_pooling=self.settings.transaction_pooling,
                    ) as conn,
                ):
                    # The table the child works on: an unmigrated database is a boot error.
                    conn.execute("SELECT 1 FROM tasks LIMIT 0")
                self._holder = processing.Holder(
                    self.worker_id, host=socket.gethostname(), pid=os.getpid(),
                    write=self._write_committed,
                )  # fmt: skip
                self._holder.register()
                break
            except DBAPIError as exc:
                delay = retries.next()
                if not db_engine.is_transient(exc) or time.monotonic() + delay > deadline:
                    return f"database unreachable or not migrated ({db_errors.brief(exc)})"
                log.warning("database unreachable at boot (%s); retrying in %.1fs",
                            db_errors.brief(exc), delay)  # fmt: skip
                self._wait(delay, listen=False)
                if self.should_stop():
                    return None  # stopping anyway: the loop exits at once, status 0
        assert self._alive is not None
        assert self._holder is not None
        self._alive.start_beating(self._holder.beat, self.settings.effective_heartbeat_interval)
        if not self._listener.enabled:
            log.info("DATABASE_POOL_MODE=transaction and no LISTEN_DATABASE_URL: "
                     "polling every %gs, no wake-ups", self.settings.poll_interval)  # fmt: skip
        try:
            self._listener.connect()
        except psycopg.Error as exc:  # not fatal: polling alone works
            log.warning("cannot LISTEN yet (%s); polling meanwhile", db_errors.brief(exc))
            self._listen_retry_at = time.monotonic() + self._listen_backoff.next()
        return None

    @contextlib.contextmanager
    def _connection(self) -> Iterator[psycopg.Connection[Any]]:
        """A pooled connection of the child, for work outside a pass (its holder's writes,
        retention), in autocommit."""
        assert self._pool is not None
        with driver_errors("connect"):
            conn = connector.checkout(self._pool)
        try:
            yield conn
        finally:
            connector.checkin(self._pool, conn)

    def _write_committed(self, statement: Callable[[psycopg.Connection[Any]], T]) -> T:
        """Run `statement` on a pooled connection of the child, in autocommit (its holder's)."""
        with self._connection() as conn:
            return statement(conn)

    def _deregister(self) -> None:
        """Delete this child's `workers` row if it holds no lease (all written or released)."""
        if self._holder is None or self._unwritten:
            return  # its leases go back when the row is stale
        try:
            self._holder.deregister()
        except (DBAPIError, psycopg.Error) as exc:
            log.warning("could not delete worker %s's row (%s); the sweep will",
                        self.worker_id, db_errors.brief(exc))  # fmt: skip

    def _report(self, line: str) -> None:
        if self.inherited.status_fd is None:
            return
        # OSError: the supervisor is gone; the orphan check will stop us.
        with contextlib.suppress(OSError):
            os.write(self.inherited.status_fd, (line[:1000] + "\n").encode("utf-8", "replace"))

    def _close(self) -> None:
        if self._keeper is not None:
            self._keeper.close()
        if self._runners is not None:
            self._runners.close()
        self._listener.close()
        if self._pool is not None:
            self._pool.close()
        signal.set_wakeup_fd(-1)
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        if self.inherited.status_fd is not None:
            os.close(self.inherited.status_fd)
        if self._alive is not None:  # last: until the process exits, it is not hung
            self._alive.close()

    # -- the loop -------------------------------------------------------------------------

    def should_stop(self) -> bool:
        """The stop flag the processing pass checks before each task: TERM or orphaned.

        Called often (each task, each tick of a wait), from runner threads too: it also marks
        the child's progress.
        """
        if self._alive is not None:
            self._alive.progress()
        if self._stop.is_set():
            return True
        now = time.monotonic()
        if now >= self._orphan_check_at:
            self._orphan_check_at = now + ORPHAN_POLL_SECONDS
            if os.getppid() != self.inherited.parent_pid:
                log.warning("supervisor %d is gone; stopping", self.inherited.parent_pid)
                self._orphaned = True
                self._stop.set()
        return self._stop.is_set()

    def _loop(self) -> None:
        retries = backoff.Backoff(RETRY_BACKOFF_MIN_SECONDS, RETRY_BACKOFF_MAX_SECONDS)
        while not self.should_stop():
            try:
                assert self._alive is not None
                with self._alive.in_pass():
                    claimed = self._process_once()
                retries.reset()
                self._maybe_maintain()
            except (DBAPIError, psycopg.Error) as exc:
                if not db_engine.is_transient(exc):
                    raise
                delay = retries.next()
                log.warning("database error: %s; retrying in %.1fs", db_errors.brief(exc), delay)
                self._wait(delay, listen=False)
                continue
            if claimed == 0:
                self._wait(self.settings.poll_interval, listen=True)
            # Else at once: a batch that claimed anything suggests more is eligible. Not only
            # a full one: a company at its max_in_flight makes a short batch normal while
            # its work remains.
        self._write_unwritten_before_exit()

    def _write_unwritten_before_exit(self) -> None:
        """One last attempt to write what interrupted passes left unwritten; log what remains."""
        from worker import processing  # noqa: PLC0415  (imported by _boot already)

        if not self._unwritten:
            return
        assert self._pool is not None
        try:
            processing.write_unwritten(self._pool, self._unwritten, observer=self._metrics)
        except (DBAPIError, psycopg.Error) as exc:
            log.warning(
                "stopping with %d completions and %d releases unwritten (%s); those tasks "
                "run again once their leases expire",
                self._unwritten.completions, self._unwritten.releases, db_errors.brief(exc),
            )  # fmt: skip

    def _process_once(self) -> int:
        """Run one processing pass; return how many tasks it claimed."""
        from worker import processing  # noqa: PLC0415  (imported by _boot already)

        assert self._pool is not None
        result = processing.run_pass(
            self._pool,
            worker_id=self.worker_id,
            settings=self.settings,
            stop=self.should_stop,
            observer=self._metrics,
            unwritten=self._unwritten,
            sweep_schedule=self._sweep_schedule,
            keeper=self._keeper,
            on_overrun=self._exit_overrun,
            runners=self._runners,
            holder=self._holder,
        )
        return result.claimed

    def _exit_overrun(self, overrun: processing.Overrun) -> NoReturn:
        """Exit: a handler overran its deadline, and the pass wrote what it owed.

        Called from the lease keeper's thread; a thread of ours is still in that handler,
        and only the end of the process frees it. The pass deleted the child's row if it
        holds no lease any more. The supervisor reads why on the status pipe and replaces
        this child.
        """
        task = overrun.task
        reason = (
            f"task {task.id} (type {task.type}) was still running {overrun.ran:.1f}s after "
            f"it started, past its timeout of {overrun.timeout:g}s and the grace"
        )
        log.error("child %d exits: %s", os.getpid(), reason)
        self._report(f"{STATUS_STUCK} {reason}")
        fairq_logging.flush()
        os._exit(HANDLER_STUCK)

    def _wait(self, timeout: float, *, listen: bool) -> None:
        """Sleep up to `timeout`; sooner on a stop signal or, when `listen`, a NOTIFY."""
        deadline = time.monotonic() + timeout
        while not self.should_stop():
            now = time.monotonic()
            relisten = (
                listen
                and self._listener.enabled
                and self._listener.fileno() is None
                and now >= self._listen_retry_at
            )
            if relisten and self._relisten():
                return  # notifications may have been missed meanwhile: look now
            remaining = deadline - now
            if remaining <= 0:
                return
            fds = [self._wake_r]
            listen_fd = self._listener.fileno() if listen else None
            if listen_fd is not None:
                fds.append(listen_fd)
            ready, _, _ = select.select(fds, [], [], min(remaining, ORPHAN_CHECK_SECONDS))
            if self._wake_r in ready:
                self._drain_wakeups()
            if listen_fd is not None and listen_fd in ready:
                try:
                    if self._listener.drain():
                        return
                except psycopg.Error as exc:
                    log.warning(
                        "LISTEN connection lost (%s); polling meanwhile", db_errors.brief(exc)
                    )
                    self._listen_retry_at = time.monotonic() + self._listen_backoff.next()

    def _relisten(self) -> bool:
        try:
            self._listener.connect()
        except psycopg.Error as exc:
            delay = self._listen_backoff.next()
            log.warning("cannot LISTEN (%s); retrying in %.1fs", db_errors.brief(exc), delay)
            self._listen_retry_at = time.monotonic() + delay
            return False
        self._listen_backoff.reset()
        log.info("listening on %s again", self.settings.notify_channel)
        return True

    def _drain_wakeups(self) -> None:
        while True:
            try:
                if not os.read(self._wake_r, 512):
                    return
            except (BlockingIOError, InterruptedError):
                return

    def _maybe_maintain(self) -> None:
        """Run the retention step when it is due (at most `MAINTENANCE_BUDGET_SECONDS`).

        `TASK_RETENTION_DAYS=0` disables retention rather than deleting every finished task
        at once.
        """
        now = time.monotonic()
        if now < self._next_maintenance:
            return
        self._next_maintenance = now + MAINTENANCE_INTERVAL_SECONDS
        if self.settings.retention_days <= 0:
            return
        retention = self.settings.retention_days * 86400.0
        deleted = 0
        while not self.should_stop() and time.monotonic() - now < MAINTENANCE_BUDGET_SECONDS:
            # The retention lock lasts for the transaction: one per batch.
            with self._connection() as conn, driver_errors("retention"), conn.transaction():
                count = maintenance.delete_expired_tasks(conn, retention_seconds=retention)
            if count is None:  # another runner holds the lock
                break
            deleted += count
            if count < maintenance.RETENTION_BATCH_SIZE:
                break
        if deleted:
            log.info("retention: deleted %d tasks finished over %g days ago", deleted,
                     self.settings.retention_days)  # fmt: skip
