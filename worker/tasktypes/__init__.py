"""The registry of task types: name -> payload schema and handler (design §6).

Adding a type: write a module here exposing `TASK_TYPE`, then list it in `_MODULES`.
"""

from __future__ import annotations

from typing import Any

from worker.tasktypes import noop, send_email, sleep, webhook
from worker.tasktypes.base import HandlerConfig, TaskContext, TaskType

__all__ = ["REGISTRY", "HandlerConfig", "TaskContext", "TaskType", "get", "names"]

_MODULES = (noop, sleep, send_email, webhook)

REGISTRY: dict[str, TaskType[Any]] = {m.TASK_TYPE.name: m.TASK_TYPE for m in _MODULES}


def get(name: str) -> TaskType[Any] | None:
    """The task type called `name`, or None when no such type is registered."""
    return REGISTRY.get(name)


def names() -> list[str]:
    """Registered type names, sorted (for error messages and `GET /task-types`)."""
    return sorted(REGISTRY)
