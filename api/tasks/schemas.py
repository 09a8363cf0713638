"""Request and response schemas of /companies/{companyId}/tasks (design §3)."""

from __future__ import annotations

import datetime as dt
import functools
import json
from typing import Any

from marshmallow import (
    RAISE,
    Schema,
    ValidationError,
    fields,
    post_load,
    validate,
    validates,
    validates_schema,
)

from api import validators
from db.models import MAX_ATTEMPTS_LIMIT, MAX_TIMEOUT_SECONDS, MIN_TIMEOUT_SECONDS, TaskStatus
from worker import tasktypes

MAX_PAYLOAD_BYTES = 64 * 1024
MAX_PAYLOAD_DEPTH = 32
IDEMPOTENCY_KEY_MAX = 255
# psycopg reads timestamptz back as a Python datetime (years 1..9999) in the session's time
# zone: a run_at near either end is stored, then fails to load (a 5xx). Earlier means "now".
RUN_AT_MIN = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
RUN_AT_MAX = dt.datetime(9999, 1, 1, tzinfo=dt.UTC)


def check_payload_limits(payload: Any) -> None:
    """Reject what jsonb or our limits refuse, with a message saying which limit.

    A JSON object at most `MAX_PAYLOAD_BYTES` serialized (compact UTF-8), nested at most
    `MAX_PAYLOAD_DEPTH` deep (the top object is depth 1), with no U+0000 in any key or string
    (PostgreSQL jsonb cannot store it). Raises `ValidationError`.
    """
    if not isinstance(payload, dict):
        raise ValidationError("must be a JSON object")
    # Iterative walk: the depth check must not itself recurse on hostile input.
    stack: list[tuple[Any, int]] = [(payload, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            if depth > MAX_PAYLOAD_DEPTH:
                raise ValidationError(f"must be nested at most {MAX_PAYLOAD_DEPTH} levels deep")
            for key, value in node.items():
                if "\x00" in key:
                    raise ValidationError("must not contain the NUL character (\\u0000)")
                stack.append((value, depth + 1))
        elif isinstance(node, list):
            if depth > MAX_PAYLOAD_DEPTH:
                raise ValidationError(f"must be nested at most {MAX_PAYLOAD_DEPTH} levels deep")
            stack.extend((value, depth + 1) for value in node)
        elif isinstance(node, str) and "\x00" in node:
            raise ValidationError("must not contain the NUL character (\\u0000)")
    size = len(json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode())
    if size > MAX_PAYLOAD_BYTES:
        raise ValidationError(
            f"must be at most {MAX_PAYLOAD_BYTES} bytes serialized, got {size} bytes"
        )


@functools.cache
def _instance_of(schema: type[Schema]) -> Schema:
    # One instance per payload schema, built once: a marshmallow schema's construction copies
    # its fields and costs more than validating a small payload. Validation keeps no state.
    return schema()


class TaskCreateSchema(Schema):
    """Body of POST /companies/{companyId}/tasks."""

    class Meta:
        unknown = RAISE

    type = fields.String(
        required=True,
        validate=validate.Length(min=1, max=100),
        metadata={"description": "A registered task type (see GET /task-types)."},
    )
    payload = fields.Dict(
        load_default=dict,
        metadata={
            "description": (
                "JSON object validated by the type's schema; at most 64 KiB, "
                "32 levels deep, no \\u0000."
            )
        },
    )
    run_at = fields.AwareDateTime(
        validate=validate.Range(min=RUN_AT_MIN, max=RUN_AT_MAX, max_inclusive=False),
        metadata={
            "description": (
                "Earliest start, ISO 8601 with an offset, from 1970 to before 9999. Default: now."
            )
        },
    )
    max_attempts = fields.Integer(
        strict=True,
        load_default=5,
        validate=validate.Range(min=1, max=MAX_ATTEMPTS_LIMIT),
        metadata={"description": f"Attempts before the task fails, 1..{MAX_ATTEMPTS_LIMIT}."},
    )
    timeout_seconds = fields.Integer(
        strict=True,
        validate=validate.Range(min=MIN_TIMEOUT_SECONDS, max=MAX_TIMEOUT_SECONDS),
        metadata={
            "description": (
                f"How long one attempt may run, in seconds, {MIN_TIMEOUT_SECONDS}.."
                f"{MAX_TIMEOUT_SECONDS}; a longer one is stopped and retried. Default: the "
                "type's own, how long its work may take plus a margin."
            )
        },
    )

    @validates("type")
    def _known_type(self, value: str, **_kwargs: Any) -> None:
        if tasktypes.get(value) is None:
            known = ", ".join(tasktypes.names())
            raise ValidationError(f"unknown task type {value[:100]!r}; known types: {known}")

    @validates_schema(skip_on_field_errors=True)
    def _payload_matches_type(self, data: dict[str, Any], **_kwargs: Any) -> None:
        payload = data.get("payload", {})
        try:
            check_payload_limits(payload)
        except ValidationError as exc:
            raise ValidationError(exc.messages, field_name="payload") from None
        task_type = tasktypes.get(data["type"])
        assert task_type is not None  # checked by _known_type
        errors = _instance_of(task_type.payload_schema).validate(payload)
        if errors:
            raise ValidationError(errors, field_name="payload")

    @post_load
    def _default_timeout(self, data: dict[str, Any], **_kwargs: Any) -> dict[str, Any]:
        if data.get("timeout_seconds") is None:
            task_type = tasktypes.get(data["type"])
            assert task_type is not None  # validated
            data["timeout_seconds"] = task_type.default_timeout(data["payload"])
        return data


class IdempotencyHeaderSchema(Schema):
    """The optional `Idempotency-Key` request header (IETF Idempotency-Key draft, section 2)."""

    idempotency_key = fields.String(
        data_key="Idempotency-Key",
        validate=[
            validate.Length(min=1, max=IDEMPOTENCY_KEY_MAX),
            validators.FullMatch(
                r"[\x21-\x7e]+",
                error="must be 1..255 visible ASCII characters (no spaces or control characters)",
            ),
        ],
        metadata={
            "description": "Makes the create safe to retry: same key and body replay the task."
        },
    )


class TaskSchema(Schema):
    """A task as returned by the API."""

    id = fields.UUID(dump_only=True)
    company_id = fields.UUID(dump_only=True)
    type = fields.String(dump_only=True)
    payload = fields.Dict(dump_only=True)
    status = fields.String(dump_only=True, metadata={"enum": [s.value for s in TaskStatus]})
    attempts = fields.Integer(dump_only=True)
    max_attempts = fields.Integer(dump_only=True)
    timeout_seconds = fields.Integer(
        dump_only=True,
        allow_none=True,
        metadata={"description": "How long one attempt may run, in seconds."},
    )
    run_after = fields.AwareDateTime(dump_only=True)
    idempotency_key = fields.String(dump_only=True, allow_none=True)
    last_error = fields.String(dump_only=True, allow_none=True)
    created_at = fields.AwareDateTime(dump_only=True)
    updated_at = fields.AwareDateTime(dump_only=True)
    started_at = fields.AwareDateTime(dump_only=True, allow_none=True)
    finished_at = fields.AwareDateTime(dump_only=True, allow_none=True)
    result = fields.Raw(
        dump_only=True,
        allow_none=True,
        metadata={"description": "What the handler returned (any JSON value), once completed."},
    )


class TaskListQuerySchema(Schema):
    """Query string of GET /companies/{companyId}/tasks."""

    status = fields.String(validate=validate.OneOf([s.value for s in TaskStatus]))
    type = fields.String(validate=[validate.Length(min=1, max=100), validators.NO_NUL])
    limit = validators.QueryInteger(load_default=20, validate=validate.Range(min=1, max=100))
    offset = validators.QueryInteger(load_default=0, validate=validate.Range(min=0, max=100_000))


class TaskPageSchema(Schema):
    """One page of tasks, newest first."""

    items = fields.List(fields.Nested(TaskSchema), dump_only=True)
    limit = fields.Integer(dump_only=True)
    offset = fields.Integer(dump_only=True)
    has_more = fields.Boolean(dump_only=True)
