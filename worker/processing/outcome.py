"""What becomes of a task after its attempt: complete, retry later, fail, or lease lost.

Pure: no database, no clock and no randomness of its own (the backoff rule is passed in), so
each rule is tested on its own (`tests/test_outcome.py`). The pass writes a decision fenced by
the task's lease token; `written` turns one whose write matched nothing into `LeaseLost`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ClassVar, TypeVar

from worker.errors import PermanentTaskError


@dataclass(frozen=True)
class Complete:
    """The handler returned: the task is done."""

    action: ClassVar[str] = "complete"


@dataclass(frozen=True)
class Retry:
    """The attempt failed and attempts remain: pending again once `delay` seconds have passed.

    `error` goes to the task's `last_error`; logs name only `error_type`, since a handler's
    message may quote the payload.
    """

    delay: float
    error: str
    error_type: str
    action: ClassVar[str] = "retry"


@dataclass(frozen=True)
class Fail:
    """Failed for good: a permanent error, an unknown task type, or the last attempt."""

    error: str
    error_type: str
    action: ClassVar[str] = "fail"


@dataclass(frozen=True)
class LeaseLost:
    """The fenced write of `action` matched nothing: another worker holds the task now."""

    action: str


Decision = Complete | Retry | Fail
_COMPLETE = Complete()  # every returned handler's decision: made once, not once per task
D = TypeVar("D", bound=Decision)


def decide(
    raised: Exception | None,
    *,
    attempt: int,
    max_attempts: int,
    backoff: Callable[[int], float],
) -> Decision:
    """Decide a task's fate from what its handler raised (None: it returned).

    `attempt` counts this attempt from 1. `PermanentTaskError` fails the task at once; any
    other exception fails it on its last attempt and otherwise retries it after
    `backoff(attempt)` seconds (called only then).
    """
    if raised is None:
        return _COMPLETE
    error_type = type(raised).__name__
    if isinstance(raised, PermanentTaskError):
        return Fail(describe_error(raised), error_type)
    if attempt >= max_attempts:
        return Fail(f"gave up after {attempt} attempts: {describe_error(raised)}", error_type)
    return Retry(backoff(attempt), describe_error(raised), error_type)


# `error_type` of a timed-out attempt in the pass's log lines.
TIMED_OUT = "TaskTimeout"


def timed_out(
    *,
    timeout: float,
    ran: float,
    detail: str,
    attempt: int,
    max_attempts: int,
    backoff: Callable[[int], float],
) -> Retry | Fail:
    """Decide the fate of a task whose handler was still running at its `timeout` (seconds).

    A retryable failure, whatever the handler raised on its way out: a slow peer or a busy
    host may be quicker next time, and a handler that is always too slow fails once its
    attempts are used up, as any failure does. `last_error` says it timed out, after how long
    (`ran`, seconds) against which timeout, then `detail`: how it ended.
    """
    error = f"timed out after {ran:.2f} s (timeout {timeout:g} s): {detail}"
    if attempt >= max_attempts:
        return Fail(f"gave up after {attempt} attempts: {error}", TIMED_OUT)
    return Retry(backoff(attempt), error, TIMED_OUT)


def unstorable_result(why: str) -> Fail:
    """Fail a task whose handler returned a result `tasks.result` cannot store (`why`).

    For good, not retried: the handler did its work (a retry would do it again: send the
    email twice) and would most likely return the same result again; the handler is at
    fault, and once it is fixed the task can be retried through the API.
    """
    return Fail(f"the handler returned a result that cannot be stored: {why}", "UnstorableResult")


def unknown_type(task_type: str, registered: Iterable[str]) -> Fail:
    """Fail a task whose type no handler is registered for: no later attempt would find one."""
    error = f"unknown task type {task_type!r} (registered: {', '.join(registered)})"
    return Fail(error, "UnknownTaskType")


def written(decision: D, *, matched: bool) -> D | LeaseLost:
    """`decision` once its fenced write ran: itself if it matched the lease, else `LeaseLost`."""
    return decision if matched else LeaseLost(decision.action)


def describe_error(exc: BaseException) -> str:
    """`Type: message`, or only `Type` when the message is empty (the task's `last_error`)."""
    message = str(exc)
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__
