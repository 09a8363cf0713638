"""Request and response schemas of /companies/{companyId}/tasks and /task-batches (design §3)."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any, NoReturn

from marshmallow import (
    RAISE,
    Schema,
    ValidationError,
    fields,
    post_load,
    pre_load,
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
    (PostgreSQL jsonb cannot store it). Raises `ValidationError`: for a NUL, its messages name
    where in the payload the first one is (`{"url": [...]}`, `{"items": {3: [...]}}`, as
    marshmallow nests field errors); depth and size, for the payload as a whole.
    """
    if not isinstance(payload, dict):
        raise ValidationError("must be a JSON object")
    # Iterative walk: the depth check must not itself recurse on hostile input.
    stack: list[tuple[Any, int, tuple[str | int, ...]]] = [(payload, 1, ())]
    while stack:
        node, depth, path = stack.pop()
        if isinstance(node, dict):
            if depth > MAX_PAYLOAD_DEPTH:
                raise ValidationError(f"must be nested at most {MAX_PAYLOAD_DEPTH} levels deep")
            for key, value in node.items():
                if "\x00" in key:
                    _refuse((*path, key), "must not contain the NUL character (\\u0000)")
                stack.append((value, depth + 1, (*path, key)))
        elif isinstance(node, list):
            if depth > MAX_PAYLOAD_DEPTH:
                raise ValidationError(f"must be nested at most {MAX_PAYLOAD_DEPTH} levels deep")
            stack.extend((value, depth + 1, (*path, i)) for i, value in enumerate(node))
        elif isinstance(node, str) and "\x00" in node:
            _refuse(path, "must not contain the NUL character (\\u0000)")
    size = len(json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode())
    if size > MAX_PAYLOAD_BYTES:
        raise ValidationError(
            f"must be at most {MAX_PAYLOAD_BYTES} bytes serialized, got {size} bytes"
        )


def _refuse(path: tuple[str | int, ...], message: str) -> NoReturn:
    """Raise `message` at `path` in the payload, nested as marshmallow nests field errors."""
    messages: Any = [message]
    for step in reversed(path):
        messages = {step: messages}
    raise ValidationError(messages)


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

    # Not skipped on other fields' errors, so that one answer names every invalid field, and
    # so that a batch (many items loaded at once, where skipping would stop at any item's
    # error) checks each item's payload.
    @validates_schema(skip_on_field_errors=False)
    def _payload_matches_type(self, data: dict[str, Any], **_kwargs: Any) -> None:
        if "type" not in data or "payload" not in data:
            return  # an unknown type, or a payload that is not an object: already refused
        payload = data["payload"]
        try:
            check_payload_limits(payload)
        except ValidationError as exc:
            raise ValidationError(exc.messages, field_name="payload") from None
        task_type = tasktypes.get(data["type"])
        assert task_type is not None  # checked by _known_type
        try:
            task_type.load_payload(payload)
        except ValidationError as exc:
            raise ValidationError(exc.messages, field_name="payload") from None

    @post_load
    def _default_timeout(self, data: dict[str, Any], **_kwargs: Any) -> dict[str, Any]:
        if data.get("timeout_seconds") is None:
            task_type = tasktypes.get(data["type"])
            assert task_type is not None  # validated
            # The payload as its handler will get it; stored as sent.
            data["timeout_seconds"] = task_type.default_timeout(
                task_type.load_payload(data["payload"])
            )
        return data


def _idempotency_key_rules(no_key: str) -> list[validate.Validator]:
    """What an Idempotency-Key may be, as a header or as a batch item's field.

    One message per rule broken, so an empty key is told its length only, not also its
    characters; `no_key` says how to send none.
    """
    return [
        validate.Length(
            min=1,
            max=IDEMPOTENCY_KEY_MAX,
            error=f"must be 1..{IDEMPOTENCY_KEY_MAX} characters long; {no_key} for no key",
        ),
        validators.FullMatch(
            r"[\x21-\x7e]*",
            error="must be visible ASCII characters only (no spaces or control characters)",
        ),
    ]


class IdempotencyHeaderSchema(Schema):
    """The optional `Idempotency-Key` request header (IETF Idempotency-Key draft, section 2)."""

    idempotency_key = fields.String(
        data_key="Idempotency-Key",
        validate=_idempotency_key_rules("leave the header out"),
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


# The most tasks one batch may carry (POST /companies/{companyId}/task-batches).
MAX_BATCH_TASKS = 1000


class TaskBatchItemSchema(TaskCreateSchema):
    """One task of a batch: the single create's body plus its own optional Idempotency-Key."""

    idempotency_key = fields.String(
        allow_none=True,
        validate=_idempotency_key_rules("send null or leave it out"),
        metadata={
            "description": (
                "As the single create's Idempotency-Key header: the same key and body replay "
                "the task (`replayed`), another body makes the whole batch a 422. Two items "
                "with one key are one task (the second replays the first) if their bodies "
                "agree, else a 422. Absent or null: no key."
            )
        },
    )


class TaskBatchCreateSchema(Schema):
    """Body of POST /companies/{companyId}/task-batches.

    An invalid item's errors are the single create's, under `tasks[<index>].<field>` (index
    from 0), e.g. `{"tasks[3].payload": {"seconds": ["..."]}}`: one flat key per item field.
    """

    class Meta:
        unknown = RAISE

    # Nested with many, not a List of Nested: one load of the whole list, about a quarter
    # faster on a thousand items.
    tasks = fields.Nested(
        TaskBatchItemSchema(),
        many=True,
        required=True,
        validate=validate.Length(min=1, max=MAX_BATCH_TASKS),
        metadata={
            "description": (
                f"1..{MAX_BATCH_TASKS} tasks, created all or nothing, in this order "
                "(which is also the order they are claimed in)."
            )
        },
    )

    @pre_load
    def _at_most_max_items(self, data: Any, **_kwargs: Any) -> Any:
        # Counted before any item is validated: a body at its size limit can hold hundreds
        # of thousands of minimal items, each costing tens of microseconds to validate.
        tasks = data.get("tasks") if isinstance(data, dict) else None
        if isinstance(tasks, list) and len(tasks) > MAX_BATCH_TASKS:
            raise ValidationError(
                f"must have at most {MAX_BATCH_TASKS} items, got {len(tasks)}: split the batch",
                field_name="tasks",
            )
        return data

    def handle_error(self, error: ValidationError, data: Any, *, many: bool, **kwargs: Any) -> None:
        """Name each invalid item's field `tasks[<index>].<field>`, items in order."""
        messages = error.messages
        if not isinstance(messages, dict) or not isinstance(messages.get("tasks"), dict):
            return
        flat: dict[str, Any] = {key: value for key, value in messages.items() if key != "tasks"}
        by_index = messages["tasks"]
        if "_schema" in by_index:
            flat["tasks"] = by_index["_schema"]  # not a list at all
        for index in sorted(key for key in by_index if isinstance(key, int)):
            item_errors = by_index[index]
            if not isinstance(item_errors, dict):
                flat[f"tasks[{index}]"] = item_errors
                continue
            for field, why in item_errors.items():
                # `_schema`: the item itself is wrong (not a JSON object).
                flat[f"tasks[{index}]" if field == "_schema" else f"tasks[{index}].{field}"] = why
        raise ValidationError(flat) from error


class BatchTaskSchema(TaskSchema):
    """A task of a batch's answer: the task as returned by the API, and whether it was there."""

    replayed = fields.Boolean(
        dump_only=True,
        metadata={
            "description": (
                "True when the item's key was already used with the same body (or by an "
                "earlier item): this is that task as it is now, and nothing was created."
            )
        },
    )


class TaskBatchSchema(Schema):
    """The tasks of a batch, in request order."""

    items = fields.List(fields.Nested(BatchTaskSchema), dump_only=True)
