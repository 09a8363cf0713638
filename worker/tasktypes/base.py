"""What a task type is: a payload schema plus a handler (design §6)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from marshmallow import Schema


@dataclass(frozen=True)
class HandlerConfig:
    """Settings handlers need, passed in so handlers never read the environment.

    `smtp_url`: `smtp://host:port` (or `smtps://`, with optional `user:password@`);
    `webhook_allow_private`: allow loopback/private/link-local webhook targets;
    `webhook_timeout`: seconds one webhook call may take in all, connect to last byte;
    `smtp_timeout`: seconds one message may take in all, connect to QUIT.
    """

    smtp_url: str = "smtp://127.0.0.1:1025"
    smtp_from: str = "fairq@localhost"
    webhook_allow_private: bool = False
    webhook_timeout: float = 10.0
    smtp_timeout: float = 30.0


@dataclass(frozen=True)
class TaskContext:
    """One attempt at one task, as a handler sees it.

    `task_id` is the idempotency key for every side effect (design §1.1); `attempt` counts from 1.
    """

    task_id: uuid.UUID
    company_id: uuid.UUID
    type: str
    payload: Mapping[str, Any]
    attempt: int
    max_attempts: int
    config: HandlerConfig = field(default_factory=HandlerConfig)


Handler = Callable[[TaskContext], None]

# A task's timeout when its type says nothing more specific, in seconds.
DEFAULT_TIMEOUT_SECONDS = 60


def _default_timeout(_payload: Mapping[str, Any]) -> int:
    return DEFAULT_TIMEOUT_SECONDS


@dataclass(frozen=True)
class TaskType:
    """A registered task type: `name` as used in the API, its payload schema and its handler.

    `default_timeout`: the `timeout_seconds` of a task created without one, in whole
    seconds, from its (validated) payload: how long the type's work may take plus a margin.
    """

    name: str
    description: str
    payload_schema: type[Schema]
    handler: Handler
    default_timeout: Callable[[Mapping[str, Any]], int] = _default_timeout
