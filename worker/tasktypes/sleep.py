"""`sleep` {seconds <= 300}: waits; for shutdown, heartbeat and latency tests."""

from __future__ import annotations

import time

from marshmallow import RAISE, Schema, validate

from worker.tasktypes.base import TaskContext, TaskType
from worker.tasktypes.fields import JsonNumber

MAX_SLEEP_SECONDS = 300


class SleepPayload(Schema):
    """`seconds`: 0..300, may be fractional."""

    class Meta:
        unknown = RAISE

    seconds = JsonNumber(
        required=True,
        validate=validate.Range(min=0, max=MAX_SLEEP_SECONDS),
        metadata={"description": "How long to sleep, in seconds (0..300)."},
    )


def handle(task: TaskContext) -> None:
    """Sleep for `payload.seconds`."""
    time.sleep(float(task.payload["seconds"]))


TASK_TYPE = TaskType(
    name="sleep",
    description="Sleeps for `seconds` (at most 300). Useful to test shutdown and leases.",
    payload_schema=SleepPayload,
    handler=handle,
)
