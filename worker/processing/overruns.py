"""The overrun watch: which of a pass's handlers overran, and what the pass writes then.

Each thread running a pass's handlers has a `Hand`: the call it is in and the task it holds.
Every tick the lease keeper's thread asks the pass's `OverrunWatch` to look at them: for a
handler still running `timeouts.OVERRUN_GRACE_SECONDS` past its deadline it writes the task's
timeout outcome, the buffered completions and the release of the unstarted tasks, and once
no other handler runs it tells `on_overrun` (a worker child exits there: `timeouts`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from db import claims
from worker.processing import outcome, task_log, timeouts
from worker.processing.completer import Completer
from worker.processing.database import PassDatabase
from worker.processing.finalize import Finalizer
from worker.processing.held_leases import HeldLeases
from worker.processing.holder import Holder
from worker.processing.task_log import log

# Told of a handler that overran its deadline (`timeouts`), once what the pass owed is written.
OnOverrun = Callable[[timeouts.Overrun], None]


class OverranPass(Protocol):
    """What the watch needs of the pass it watches (`one_pass.ProcessingPass`)."""

    db: PassDatabase
    holder: Holder | None
    leases: HeldLeases
    finalizer: Finalizer
    completer: Completer

    def take_unstarted(self) -> list[claims.ClaimedTask]:
        """Take every task not started yet, and let no task start from now on."""
        ...

    def put_back_unstarted(self, tasks: Iterable[claims.ClaimedTask]) -> None:
        """Make `tasks`, taken by `take_unstarted`, unstarted again."""

    def backoff(self, attempt: int) -> float:
        """Seconds before the retry after failed attempt number `attempt`."""
        ...


class Hand:
    """One thread running a pass's handlers: the call it is in and the task it holds, if any.

    `busy` and `running` are written by its own thread, read by the lease keeper (single
    attribute stores, no lock); `overran` is set by the keeper under `lock`, which the hand's
    thread takes only when its handler returned past the grace (`returned`).
    """

    __slots__ = ("busy", "lock", "overran", "running")

    def __init__(self) -> None:
        self.busy = False  # holds a task whose handler started, or is about to
        # The handler's call while in it: (task, timeout, started, overrun_at), a plain tuple
        # built per task on the hot path; the keeper makes a `timeouts.Running` of it.
        self.running: tuple[claims.ClaimedTask, float, float, float] | None = None
        self.overran = False  # its handler overran: the keeper wrote its outcome
        self.lock = threading.Lock()

    def returned(self, overrun_at: float) -> bool:
        """Leave the handler's call; tell whether it overran (its outcome written already).

        No lock in time (before `overrun_at`), where most handlers return: the keeper acts on
        a call only if it read it running at a time past `overrun_at`, and this clock is read
        after the call was cleared, so later still.
        """
        self.running = None
        if time.monotonic() < overrun_at:
            return False
        with self.lock:  # waits for a keeper deciding right now
            return self.overran


class OverrunWatch:
    """The hands of one pass, watched from its lease keeper's thread (`write`)."""

    def __init__(self, watched: OverranPass, on_overrun: OnOverrun | None) -> None:
        self._pass = watched
        self.on_overrun = on_overrun
        # One per thread running handlers, added as each starts (`hand`); replaced whole
        # under `_hands_lock`, so the keeper reads it without one.
        self._hands: tuple[Hand, ...] = ()
        self._hands_lock = threading.Lock()
        # Handlers that overran, their outcomes written; `on_overrun` is told of the first
        # once no other handler runs (then `_reported`).
        self._overruns: list[timeouts.Overrun] = []
        self._reported = False
        # Set once `_write_overrun` has written what the pass owed: the pass then ends.
        self._written = threading.Event()

    def hand(self) -> Hand:
        """A new hand, watched from now on, for the calling thread."""
        hand = Hand()
        with self._hands_lock:
            self._hands = (*self._hands, hand)
        return hand

    def wait_written(self) -> None:
        """Return once what the pass owed after an overrun is written (or could not be)."""
        self._written.wait()

    def write(self) -> None:
        """Write the timeout outcome of each handler past its deadline and the grace."""
        now = time.monotonic()  # read before `running`: see `Hand.returned`
        for hand in self._hands:
            armed = hand.running
            if armed is None or now < armed[3] or hand.overran:
                continue
            with hand.lock:
                if hand.running is not armed:
                    continue  # it returned meanwhile: its own thread writes its outcome
                hand.overran = True
            self._write_overrun(timeouts.Running(*armed[:3]))
        if self._overruns and not self._reported:
            self._report_overrun()

    def _write_overrun(self, running: timeouts.Running) -> None:
        """Write what the pass owes, a handler past its deadline and the grace still running.

        In the lease keeper's thread; that handler's thread is in it, or skips its outcome
        once it returns (`Hand.returned`). No handler starts from now on. The task's timeout
        outcome (retry or failure, fenced, its attempt counted), every buffered completion,
        and the release of the tasks not started are written now, not left to the sweep: a
        worker child is about to exit, once the other running handlers are done
        (`_report_overrun`).
        """
        watched = self._pass
        task = running.task
        ran = time.monotonic() - running.started
        unstarted = watched.take_unstarted()
        try:
            fields = task_log.task_fields(
                task, "task.overrun", ran, timeout_s=running.timeout,
                grace_s=timeouts.OVERRUN_GRACE_SECONDS,
            )  # fmt: skip
            log.error(task_log.MSG_OVERRUN, fields, extra=fields)
            decision = outcome.timed_out(
                timeout=running.timeout,
                ran=ran,
                detail=f"overran: still running {timeouts.OVERRUN_GRACE_SECONDS:g} s past it",
                attempt=task.attempts,
                max_attempts=task.max_attempts,
                backoff=watched.backoff,
            )
            watched.finalizer.settle(task, decision, seconds=ran)
            watched.completer.flush(force=True)
            watched.finalizer.release(unstarted)
            unstarted = []
        except Exception as exc:
            # Left for the pass's thread, should the handler return (completions stay
            # buffered); else the sweep takes the holder's leases back once its row is stale.
            watched.put_back_unstarted(unstarted)
            log.warning(
                "could not write what the pass owes after task %s overran (%s); those "
                "tasks go back to the queue when their leases are taken back",
                task.id, type(exc).__name__,
                extra={"event": "tasks.owed_dropped", "task_id": str(task.id)},
            )  # fmt: skip
        finally:
            self._overruns.append(timeouts.Overrun(task, running.timeout, ran))
            self._written.set()
        self._report_overrun()

    def _report_overrun(self) -> None:
        """Tell `on_overrun` of the first handler that overran, once no other one runs.

        In the lease keeper's thread, which meanwhile goes on watching the other handlers'
        deadlines: a worker child exits there, and a task still running would be taken back
        and run again. The completions written first are theirs.
        """
        if any(hand.busy and not hand.overran for hand in self._hands):
            return
        self._reported = True
        watched = self._pass
        first = self._overruns[0]
        try:
            watched.completer.flush(force=True)
            if not watched.leases and watched.holder is not None:
                # Every lease of the batch written or released: the holder has none left,
                # and the process that exits next need not wait for the sweep.
                watched.holder.deregister(write=watched.db.write)
        except Exception as exc:
            log.warning(
                "could not write the last completions of the pass whose task %s overran "
                "(%s); those tasks run again once their leases are taken back",
                first.task.id, type(exc).__name__,
                extra={"event": "tasks.owed_dropped", "task_id": str(first.task.id)},
            )  # fmt: skip
        if self.on_overrun is not None:
            self.on_overrun(first)
