"""`noop` {}: does nothing; for operations checks and throughput benchmarks."""

from __future__ import annotations

from marshmallow import RAISE, Schema

from worker.tasktypes.base import TaskContext, TaskType


class NoopPayload(Schema):
    """An empty object."""

    class Meta:
        unknown = RAISE


def handle(task: TaskContext) -> None:
    """Succeed at once."""


TASK_TYPE = TaskType(
    name="noop",
    description="Does nothing. Useful to check the pipeline and to benchmark it.",
    payload_schema=NoopPayload,
    handler=handle,
)
