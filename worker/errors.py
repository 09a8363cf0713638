"""Errors a task handler raises to steer what happens to its task."""

from __future__ import annotations


class PermanentTaskError(Exception):
    """The task can never succeed (bad address, 4xx from a webhook): fail it without retrying.

    Any other exception from a handler is treated as transient and retried with backoff
    until `max_attempts` (design §4, Fail).
    """


class HandlerTimeout(BaseException):
    """Raised inside a handler still running at its task's timeout, to stop it (design §6).

    The pass raises it asynchronously in the handler's thread (`worker.processing.timeouts`);
    the attempt counts as a retryable failure. A `BaseException`, like `KeyboardInterrupt`,
    so that a handler's `except Exception` does not swallow it: a handler that catches it
    anyway must re-raise it, or its worker process is replaced once the grace has passed.
    """
