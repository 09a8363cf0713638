"""Per-task timeouts (design §4, Timeouts): each attempt's deadline, and stopping a handler at it.

Every attempt runs under its task's `timeout_seconds` (`timeout_of`). The handler is given its
deadline (`TaskContext.deadline`) and the built-in ones end by it themselves (design §6). For
any other, the pass arms a `HandlerTimer` around the call, and its lease keeper's thread,
which wakes every few tens of milliseconds anyway, checks the timer:

1. At the deadline it raises `HandlerTimeout` in the handler's thread, asynchronously
   (`PyThreadState_SetAsyncExc`): the interpreter raises it there at its next check between
   bytecodes, so a pure-Python handler stops at once. On a process's main thread (a worker
   child, `--once`) it also sends that thread `NUDGE_SIGNAL`, so that a blocking system call
   (a sleep, a read without a timeout, a lock) is interrupted and the interpreter gets to
   raise the exception there too. A pass running several handlers at once (`runners`) arms
   one timer per thread; on a runner thread only the exception applies: CPython runs signal
   handlers on the main thread only, and a system call interrupted elsewhere resumes.
2. A handler still running `STOP_GRACE_SECONDS` later cannot be stopped: it is blocked in C
   code that goes on waiting whatever the signals (a native library's lock), or it caught
   the exception and carried on. The pass gives up on it (`ProcessingPass._give_up`): from
   the keeper's thread it writes what it owes, the timed-out task's retry first, and starts
   no other task. Once the pass's other running handlers have returned, a worker child
   exits, to be replaced by its supervisor: a thread blocked in C cannot be freed any other
   way.

C code that blocks holding the GIL stops the keeper's thread too, and with it the child's
sign of life: the supervisor kills that child as hung (`WORKER_CHILD_TIMEOUT_SECONDS`,
design §5), and the next child takes its leases back.

Why not `signal.alarm` alone, as single-threaded programs do: a signal's Python handler runs
on the main thread only, and `POST /workers/process` runs passes in the API's request
threads. Nor a process per task: a fork per noop task would cost more than the task
(docs/decisions/0003). The asynchronous exception has the hazard of any: it may land in a
handler's own cleanup (a `finally` block); that handler's attempt is over anyway.
"""

from __future__ import annotations

import ctypes
import enum
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any, NamedTuple

from db import queue
from worker.errors import HandlerTimeout
from worker.tasktypes.base import DEFAULT_TIMEOUT_SECONDS, TaskType

# After its timeout, how long a handler has to stop once told to, before the pass gives up
# on it: enough for a handler's cleanup (closing a connection), well below the stale window.
STOP_GRACE_SECONDS = 5.0

# Interrupts a system call of the main thread at a timeout. SIGURG, as Go's runtime uses for
# preemption: nothing else sends it (it reports out-of-band socket data only to a process
# that asked for it), and its default action is to ignore it, so a handler that reset its
# disposition cannot be killed by a late nudge.
NUDGE_SIGNAL = signal.SIGURG


def timeout_of(task: queue.ClaimedTask, task_type: TaskType[Any]) -> float:
    """How long an attempt at `task` may run, in seconds.

    Its `timeout_seconds`, or for a task stored before timeouts existed (NULL) its type's
    default for its loaded payload; `DEFAULT_TIMEOUT_SECONDS` when that cannot be computed
    (a payload stored before its schema changed): a default must never fail the task.
    """
    if task.timeout_seconds is not None:
        return task.timeout_seconds
    return _default_timeout(task_type, task.payload)


def _default_timeout(task_type: TaskType[Any], payload: Mapping[str, Any]) -> float:
    try:
        return float(task_type.default_timeout(task_type.load_payload(payload)))
    except Exception:  # see timeout_of: whatever failed, the generic default applies
        return DEFAULT_TIMEOUT_SECONDS


def install_nudge() -> None:
    """Let passes of this process interrupt the main thread's system calls at a timeout.

    Call once from the main thread of a process whose passes run on it (a worker child,
    `--once`). Without it a timeout still stops a handler between bytecodes, not in a
    blocking call; the grace then decides.
    """
    signal.signal(NUDGE_SIGNAL, _nudged)


def _nudged(signum: int, frame: FrameType | None) -> None:
    """Nothing: that it runs is the point.

    The signal interrupted the main thread's blocking call (EINTR); before the call resumes,
    the interpreter runs this function, and on entering it raises the asynchronous exception
    pending for the thread, which leaves the call. With none pending (a late signal), the
    call resumes.
    """


class Running(NamedTuple):
    """The handler the timer watches: its task, timeout (s) and start (`time.monotonic()`)."""

    task: queue.ClaimedTask
    timeout: float
    started: float

    @property
    def deadline(self) -> float:
        """When its timeout is up, in `time.monotonic()` seconds."""
        return self.started + self.timeout


class Ending(enum.Enum):
    """How the timer saw a handler's call end."""

    IN_TIME = "in time"  # the timer did nothing
    STOPPED = "stopped"  # told to stop at its timeout (`HandlerTimeout` raised in it)
    GIVEN_UP = "given up"  # past the grace: the pass gave up on it, its outcome is written


@dataclass(frozen=True)
class Unstoppable:
    """A handler the pass gave up on: still running `ran` seconds after it started, its
    `timeout` long past, uninterruptible. What the pass owed is written (`ProcessingPass`)."""

    task: queue.ClaimedTask
    timeout: float
    ran: float


class HandlerTimer:
    """Stops the handler running in the thread that made it, at its timeout.

    The pass's thread calls `arm` before a handler and `disarm` after it; the lease keeper's
    thread calls `check`. The exception is raised only while a handler is armed: `disarm`
    and `check` exclude each other, and `disarm` takes in an exception not raised yet.
    """

    def __init__(self) -> None:
        self._thread_id = threading.get_ident()
        # A signal only to the main thread, and only with our handler in place: without one,
        # SIGURG is ignored, harmless but useless.
        self._nudge = (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(NUDGE_SIGNAL) is _nudged
        )
        self._lock = threading.Lock()
        # The handler watched: (task, timeout, started, deadline). A plain tuple, built per
        # task on the pass's hot path; `check` makes a `Running` of it when it acts.
        self._running: tuple[queue.ClaimedTask, float, float, float] | None = None
        self._ending = Ending.IN_TIME

    def arm(self, task: queue.ClaimedTask, timeout: float, started: float) -> None:
        """Watch the handler of `task` that this thread is about to call, `started` now."""
        self._ending = Ending.IN_TIME
        # Last: `check` reads it without the lock, and acts only on the handler it names.
        self._running = (task, timeout, started, started + timeout)

    def disarm(self) -> Ending:
        """Stop watching, once the handler's call is over; return how it ended.

        Call it again (it returns the same) where `HandlerTimeout` is caught: the exception
        may have been raised in the first call, before it took effect.
        """
        armed = self._running
        if armed is not None:
            self._running = None
            # In time, no lock needed: `check` raises only after it read this handler armed
            # at a time past its deadline, and this clock is read after the handler was
            # disarmed, so later still. Most handlers end here.
            if time.monotonic() < armed[3]:
                return Ending.IN_TIME
            with self._lock:  # waits for a `check` acting right now
                if self._ending is not Ending.IN_TIME:
                    # Raised already, or pending: let it land here, where it is expected.
                    # Not withdrawn: before 3.13 a withdrawal leaves the interpreter's eval
                    # breaker set for good, which starves other threads under a tracer. Not
                    # `contextlib.suppress`: its `__enter__` is a Python call, where it could land.
                    try:  # noqa: SIM105
                        _take_pending_exception()
                    except HandlerTimeout:
                        pass
        return self._ending

    def check(self, now: float) -> Running | None:
        """From another thread: stop the handler if past its deadline.

        Return it once it is past the grace too, and only that once: the caller gives up on
        it. `now` is `time.monotonic()`.
        """
        armed = self._running
        if armed is None or now < armed[3]:
            return None
        with self._lock:
            if self._running is not armed or self._ending is Ending.GIVEN_UP:
                return None
            if self._ending is Ending.IN_TIME:
                self._ending = Ending.STOPPED
                _set_async_exc(self._thread_id, HandlerTimeout)
                if self._nudge:
                    signal.pthread_kill(self._thread_id, NUDGE_SIGNAL)
                return None
            if now < armed[3] + STOP_GRACE_SECONDS:
                return None
            self._ending = Ending.GIVEN_UP
            return Running(*armed[:3])


def _set_async_exc(thread_id: int, exc: type[BaseException]) -> None:
    """Raise `exc` in thread `thread_id` at its next check between bytecodes."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc))


def _take_pending_exception() -> None:
    """Nothing: entering a Python function is a check, where a pending exception is raised."""
