"""`noop` {}: does nothing; for operations checks and throughput benchmarks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from marshmallow import RAISE, Schema, post_load

from worker.tasktypes.base import TaskContext, TaskType


@dataclass(frozen=True)
class Noop:
    """A noop task's payload: nothing."""


class NoopPayload(Schema):
    """An empty object; loads a `Noop`."""

    class Meta:
        unknown = RAISE

    @post_load
    def _typed(self, _data: dict[str, Any], **_kwargs: Any) -> Noop:
        return Noop()


def handle(task: TaskContext[Noop]) -> None:
    """Succeed at once."""


TASK_TYPE = TaskType(
    name="noop",
    description="Does nothing. Useful to check the pipeline and to benchmark it.",
    payload_schema=NoopPayload,
    handler=handle,
)
