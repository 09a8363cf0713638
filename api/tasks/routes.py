"""/companies/{companyId}/tasks and /task-batches: create, read, list, cancel and retry tasks."""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import json
import uuid
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from flask import Response, request, url_for
from flask.views import MethodView
from flask_smorest import abort

from api import auth, database, errors, settings
from api.parser import Blueprint
from api.settings import ApiSettings
from api.tasks.schemas import (
    MAX_BATCH_TASKS,
    IdempotencyHeaderSchema,
    TaskBatchCreateSchema,
    TaskBatchSchema,
    TaskCreateSchema,
    TaskListQuerySchema,
    TaskPageSchema,
    TaskSchema,
)
from api.tasks.task_json import task_response
from db import queue

blp = Blueprint(
    "tasks",
    __name__,
    url_prefix="/companies/<uuid:company_id>",
    description="A company's background tasks.",
)


def request_hash(body: dict[str, Any]) -> str:
    """SHA-256 of the validated create body in canonical JSON (sorted keys, compact, UTF-8).

    The request fingerprint of the IETF Idempotency-Key draft (section 2.2): computed on the
    loaded body, defaults applied, so key order, whitespace, an omitted default (`payload`,
    `max_attempts`, `timeout_seconds`) or another spelling of the same `run_at` instant are
    not a different body.
    """
    run_at = body.get("run_at")
    canonical = json.dumps(
        {
            "type": body["type"],
            "payload": body["payload"],
            "max_attempts": body["max_attempts"],
            "timeout_seconds": body["timeout_seconds"],
            "run_at": run_at.astimezone(dt.UTC).isoformat() if run_at is not None else None,
        },
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


# Response headers of a create, as documented in the OpenAPI document.
_LOCATION = {"description": "The task's URL.", "schema": {"type": "string"}}
_REPLAYED = {
    "description": "Present on a replay: this is the task an earlier create made.",
    "schema": {"type": "string", "enum": ["true"]},
}
# The 429 of a write that would take the company's unfinished tasks past its max_pending.
_BACKLOG_FULL: dict[str, Any] = {
    "schema": errors.ErrorSchema,
    "description": (
        "The company's backlog quota (max_pending) is full: the message gives the quota, the "
        "unfinished tasks and what the request adds. Nothing was stored."
    ),
    "headers": {
        "Retry-After": {
            "description": (
                f"Seconds to wait before trying again ({errors.BACKLOG_RETRY_AFTER_SECONDS}); "
                "room comes back as the company's tasks finish."
            ),
            "schema": {"type": "integer"},
        }
    },
}


@blp.route("/tasks")
class Tasks(MethodView):
    """A company's task collection."""

    @blp.doc(operationId="create_task")
    @auth.company_required()
    @blp.arguments(IdempotencyHeaderSchema(), location="headers")
    @blp.arguments(TaskCreateSchema())
    @blp.response(201, TaskSchema, headers={"Location": _LOCATION})
    @blp.alt_response(
        200,
        schema=TaskSchema,
        description="Replay: same Idempotency-Key and body as an earlier create.",
        headers={"Location": _LOCATION, "Idempotent-Replayed": _REPLAYED},
        success=True,
    )
    @blp.error(400, "Malformed JSON.")
    @blp.error(401, "Missing or invalid token.")
    @blp.error(403, "The admin token cannot act for a company.")
    @blp.error(404, "No such company, or not yours.")
    @blp.error(413, "Body larger than 1 MiB.")
    @blp.error(415, "Body is not JSON.")
    @blp.error(409, "The Idempotency-Key was taken and freed again meanwhile; retry.")
    @blp.alt_response(429, **_BACKLOG_FULL)
    def post(self, headers: dict[str, Any], body: dict[str, Any], company_id: uuid.UUID) -> Any:
        """Create a task (optionally idempotent with an Idempotency-Key header)."""
        key = headers.get("idempotency_key")
        task, created = queue.create_task(
            database.connection(),
            company_id=company_id,
            type=body["type"],
            payload=body["payload"],
            run_at=body.get("run_at"),
            max_attempts=body["max_attempts"],
            timeout_seconds=body["timeout_seconds"],
            idempotency_key=key,
            request_hash=request_hash(body) if key is not None else None,
            notify_channel=settings.current().notify_channel,
        )
        location = url_for("tasks.TaskById", company_id=company_id, task_id=task.id)
        if created:
            return task_response(task), 201, {"Location": location}
        return task_response(task), 200, {"Location": location, "Idempotent-Replayed": "true"}

    @blp.doc(operationId="list_tasks")
    @auth.company_required()
    @blp.arguments(TaskListQuerySchema(), location="query")
    @blp.response(200, TaskPageSchema)
    @blp.error(401, "Missing or invalid token.")
    @blp.error(403, "The admin token cannot act for a company.")
    @blp.error(404, "No such company, or not yours.")
    def get(self, query: dict[str, Any], company_id: uuid.UUID) -> dict[str, Any]:
        """List the company's tasks, newest first, with optional status and type filters."""
        items, has_more = queue.list_tasks(database.connection(), company_id, **query)
        return {
            "items": items,
            "limit": query["limit"],
            "offset": query["offset"],
            "has_more": has_more,
        }


P = ParamSpec("P")
R = TypeVar("R")


def batch_body_limit(view: Callable[P, R]) -> Callable[P, R]:
    """Let the view's request body be `ApiSettings.max_batch_body_bytes` instead of 1 MiB.

    Applied above `@blp.arguments`: the body is read (and a larger one refused with 413) when
    the arguments are parsed. Flask 3.1 reads the limit per request.
    """

    @functools.wraps(view)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        request.max_content_length = settings.current().max_batch_body_bytes
        return view(*args, **kwargs)

    return wrapper


# Why a batch refuses the single create's header: the header would have to stand for every
# item at once, and a batch whose items carry no key of their own cannot be replayed.
BATCH_KEY_HEADER_REFUSED = (
    "not accepted on a batch, which has no key of its own: give each item an "
    "idempotency_key to make retrying the batch safe"
)


def refuse_idempotency_header(view: Callable[P, R]) -> Callable[P, R]:
    """Answer a batch sent with an `Idempotency-Key` header with a 422 naming the header.

    Ignoring it would let a client that retries a batch, believing the header protects it,
    create every task twice. The body is the one of a header's validation error (webargs'
    `{"headers": {"Idempotency-Key": [...]}}`); checked before the body is read.
    """

    @functools.wraps(view)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        if "Idempotency-Key" in request.headers:
            found = {"headers": {"Idempotency-Key": [BATCH_KEY_HEADER_REFUSED]}}
            abort(422, message=errors.validation_message(found), errors=found)
        return view(*args, **kwargs)

    return wrapper


@blp.route("/task-batches")
class TaskBatches(MethodView):
    """A company's tasks created many at once."""

    @blp.doc(operationId="create_task_batch")
    @auth.company_required()
    @batch_body_limit
    @refuse_idempotency_header
    @blp.arguments(TaskBatchCreateSchema())
    @blp.response(
        201,
        TaskBatchSchema,
        description="Created: the tasks in request order, replays (`replayed`) included.",
    )
    @blp.alt_response(
        200,
        schema=TaskBatchSchema,
        description="Every item was a replay: nothing was created.",
        headers={"Idempotent-Replayed": _REPLAYED},
        success=True,
    )
    @blp.error(400, "Malformed JSON.")
    @blp.error(401, "Missing or invalid token.")
    @blp.error(403, "The admin token cannot act for a company.")
    @blp.error(404, "No such company, or not yours.")
    @blp.error(413, f"Body larger than {ApiSettings.max_batch_body_bytes // (1024 * 1024)} MiB.")
    @blp.error(415, "Body is not JSON.")
    @blp.error(
        422,
        "An invalid item (named `tasks[<index>].<field>`), more than "
        f"{MAX_BATCH_TASKS} items, a key already used with another body, more tasks than "
        "the quota itself, or an `Idempotency-Key` header (named `headers.Idempotency-Key`: "
        "a batch has no key of its own; give each item an `idempotency_key`). Nothing was "
        "stored.",
    )
    @blp.error(409, "An item's Idempotency-Key was taken and freed again meanwhile; retry.")
    @blp.alt_response(429, **_BACKLOG_FULL)
    def post(self, body: dict[str, list[dict[str, Any]]], company_id: uuid.UUID) -> Any:
        """Create up to 1,000 tasks in one request, all or nothing (Idempotency-Key per item)."""
        items = [
            queue.NewTask(
                type=item["type"],
                payload=item["payload"],
                run_at=item.get("run_at"),
                max_attempts=item["max_attempts"],
                timeout_seconds=item["timeout_seconds"],
                idempotency_key=item.get("idempotency_key"),
                request_hash=request_hash(item)
                if item.get("idempotency_key") is not None
                else None,
            )
            for item in body["tasks"]
        ]
        # A transaction, unlike the request's autocommit connection: a key whose body differs
        # can surface after the insert (a create that committed meanwhile), and then
        # nothing of the batch may stay.
        with database.transaction() as conn:
            results = queue.create_tasks(
                conn,
                company_id=company_id,
                tasks=items,
                notify_channel=settings.current().notify_channel,
            )
        answer = {
            "items": [{**task._asdict(), "replayed": not created} for task, created in results]
        }
        if any(created for _, created in results):
            return answer, 201
        return answer, 200, {"Idempotent-Replayed": "true"}


@blp.route("/tasks/<uuid:task_id>")
class TaskById(MethodView):
    """One task."""

    @blp.doc(operationId="get_task")
    @auth.company_required()
    @blp.response(200, TaskSchema)
    @blp.error(401, "Missing or invalid token.")
    @blp.error(403, "The admin token cannot act for a company.")
    @blp.error(404, "No such task, or not yours.")
    def get(self, company_id: uuid.UUID, task_id: uuid.UUID) -> Response:
        """Read one task."""
        return task_response(queue.get_task(database.connection(), company_id, task_id))


@blp.route("/tasks/<uuid:task_id>/cancel")
class TaskCancel(MethodView):
    """Cancel a pending task."""

    @blp.doc(operationId="cancel_task")
    @auth.company_required()
    @blp.response(200, TaskSchema)
    @blp.error(401, "Missing or invalid token.")
    @blp.error(403, "The admin token cannot act for a company.")
    @blp.error(404, "No such task, or not yours.")
    @blp.error(409, "The task is not pending.")
    def post(self, company_id: uuid.UUID, task_id: uuid.UUID) -> Any:
        """Cancel a pending task."""
        return queue.cancel_task(database.connection(), company_id, task_id)


@blp.route("/tasks/<uuid:task_id>/retry")
class TaskRetry(MethodView):
    """Run a failed or cancelled task again."""

    @blp.doc(operationId="retry_task")
    @auth.company_required()
    @blp.response(200, TaskSchema)
    @blp.error(401, "Missing or invalid token.")
    @blp.error(403, "The admin token cannot act for a company.")
    @blp.error(404, "No such task, or not yours.")
    @blp.error(409, "The task is not failed or cancelled.")
    @blp.alt_response(429, **_BACKLOG_FULL)
    def post(self, company_id: uuid.UUID, task_id: uuid.UUID) -> Any:
        """Retry a failed or cancelled task now, with its attempts reset."""
        return queue.retry_task(database.connection(), company_id, task_id)
