"""Errors a task handler raises to steer what happens to its task."""

from __future__ import annotations


class PermanentTaskError(Exception):
    """The task can never succeed (bad address, 4xx from a webhook): fail it without retrying.

    Any other exception from a handler is treated as transient and retried with backoff
    until `max_attempts` (design §4, Fail).
    """
