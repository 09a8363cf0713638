"""What a task type is: a payload schema plus a handler (design §6)."""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeAlias, cast

from marshmallow import Schema
from typing_extensions import TypeVar

from common.environment import env_bool, env_float, env_str
from db.models import DEFAULT_TIMEOUT_SECONDS

# A task type's payload as its handler receives it: what its payload schema loads. Any
# when not given (`TaskContext` alone), as for a handler written for any payload.
P = TypeVar("P", default=Any)


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

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> HandlerConfig:
        """`SMTP_URL`, `SMTP_FROM`, `WEBHOOK_*` from `env`; unset ones take the defaults above.

        The worker and the API, whose `POST /workers/process` runs the same handlers, both
        read them here. Raises `common.environment.SettingsError` naming the variable.
        """
        default = cls()
        return cls(
            smtp_url=env_str(env, "SMTP_URL", default.smtp_url),
            smtp_from=env_str(env, "SMTP_FROM", default.smtp_from),
            webhook_allow_private=env_bool(
                env, "WEBHOOK_ALLOW_PRIVATE", default.webhook_allow_private
            ),
            webhook_timeout=env_float(
                env, "WEBHOOK_TIMEOUT_SECONDS", default.webhook_timeout, minimum=0.1, maximum=300
            ),
        )


@dataclass(frozen=True)
class TaskContext(Generic[P]):
    """One attempt at one task, as a handler sees it.

    `task_id` is the idempotency key for every side effect (design §1.1); `attempt` counts from 1.
    `timeout` is how long this attempt may run, in seconds (the task's `timeout_seconds`, or
    its type's default), and `deadline` when that is up, in `time.monotonic()` seconds; None
    when the handler is called without one (tests). A handler ends by its deadline: one that
    waits bounds each wait by `within_timeout` and fails cleanly there (a timeout). One still
    running `worker.processing.timeouts.OVERRUN_GRACE_SECONDS` past it has overrun: its
    attempt times out and its worker process is replaced, which is the only way it ends.
    `payload` is the stored payload as the type's schema loads it (`TaskType.load_payload`).
    """

    task_id: uuid.UUID
    company_id: uuid.UUID
    type: str
    payload: P
    attempt: int
    max_attempts: int
    config: HandlerConfig = field(default_factory=HandlerConfig)
    timeout: float | None = None
    deadline: float | None = None

    def remaining(self) -> float | None:
        """Seconds left before the deadline (0 once passed), or None without a deadline."""
        if self.deadline is None:
            return None
        return max(self.deadline - time.monotonic(), 0.0)

    def within_timeout(self, seconds: float) -> float:
        """`seconds`, or the time left before the deadline if that is shorter (never below 0).

        For a step with a limit of its own (a webhook call's `WEBHOOK_TIMEOUT_SECONDS`): it
        then ends by the task's deadline too.
        """
        remaining = self.remaining()
        return seconds if remaining is None else min(seconds, remaining)


# What a handler returns: a JSON value, stored as the task's `result` (None: no result). At
# most `worker.processing.task_result.MAX_RESULT_BYTES` of compact UTF-8 JSON; a value that
# cannot be stored fails its task. Mappings and sequences of any kind are written as JSON
# objects and arrays.
JsonValue: TypeAlias = (
    bool | int | float | str | Sequence["JsonValue"] | Mapping[str, "JsonValue"] | None
)

Handler = Callable[[TaskContext[Any]], JsonValue]


def _default_timeout(_payload: object) -> int:
    return DEFAULT_TIMEOUT_SECONDS


@functools.cache
def _schema(schema: type[Schema]) -> Schema:
    # One instance per payload schema, built once: a marshmallow schema's construction copies
    # its fields and costs more than loading a small payload. Loading keeps no state.
    return schema()


@dataclass(frozen=True)
class TaskType(Generic[P]):
    """A registered task type: `name` as used in the API, its payload schema and its handler.

    `payload_schema` loads a stored payload (a JSON object) into the `P` the handler gets
    as `context.payload`, or raises `marshmallow.ValidationError`; the API validates a
    create's payload with it (and stores the JSON object as sent).

    `handler(context)` runs one attempt and returns its result (a `JsonValue`, None for
    none); it raises `PermanentTaskError` for a failure no retry can fix, any other
    exception for one that may pass later.

    `default_timeout`: the `timeout_seconds` of a task created without one, in whole
    seconds, from its loaded payload: how long the type's work may take plus a margin.
    """

    name: str
    description: str
    payload_schema: type[Schema]
    handler: Callable[[TaskContext[P]], JsonValue]
    default_timeout: Callable[[P], int] = _default_timeout

    def load_payload(self, stored: Mapping[str, Any]) -> P:
        """`stored` (a payload as JSON) loaded by `payload_schema`: what the handler gets.

        Raises `marshmallow.ValidationError` naming the fields that do not load.
        """
        return cast(P, _schema(self.payload_schema).load(stored))
