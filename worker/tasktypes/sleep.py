"""`sleep` {seconds <= 300}: waits; for shutdown, heartbeat and latency tests."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from marshmallow import RAISE, Schema, post_load, validate

from common.fields import JsonNumber
from worker.tasktypes.base import TaskContext, TaskType

MAX_SLEEP_SECONDS = 300
# Added to the sleep for a task's default timeout: a late start of the handler is no timeout.
TIMEOUT_MARGIN_SECONDS = 30


@dataclass(frozen=True)
class Sleep:
    """A sleep task's payload: `seconds` to sleep, 0..300."""

    seconds: float


class SleepPayload(Schema):
    """`seconds`: 0..300, may be fractional; loads a `Sleep`."""

    class Meta:
        unknown = RAISE

    seconds = JsonNumber(
        required=True,
        validate=validate.Range(min=0, max=MAX_SLEEP_SECONDS),
        metadata={"description": "How long to sleep, in seconds (0..300)."},
    )

    @post_load
    def _typed(self, data: dict[str, Any], **_kwargs: Any) -> Sleep:
        return Sleep(**data)


def handle(task: TaskContext[Sleep]) -> None:
    """Sleep for `payload.seconds`, or until the task's timeout if that comes first.

    Raises `TimeoutError` when the timeout cut the sleep short: the attempt is a retryable
    failure, as any that runs into its timeout.
    """
    seconds = task.payload.seconds
    allowed = task.within_timeout(seconds)
    time.sleep(allowed)
    if allowed < seconds:
        raise TimeoutError(f"slept {allowed:.3g} s of {seconds:g} s: the task's timeout came first")


def default_timeout(payload: Sleep) -> int:
    """Its sleep rounded up, plus `TIMEOUT_MARGIN_SECONDS`."""
    return math.ceil(payload.seconds) + TIMEOUT_MARGIN_SECONDS


TASK_TYPE = TaskType(
    name="sleep",
    description="Sleeps for `seconds` (at most 300). Useful to test shutdown and leases.",
    payload_schema=SleepPayload,
    handler=handle,
    default_timeout=default_timeout,
)
