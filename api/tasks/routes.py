"""/companies/{companyId}/tasks: create, read, list, cancel and retry a company's tasks."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import uuid
from typing import Any

from flask import current_app, url_for
from flask.views import MethodView

from api import auth, database
from api.parser import Blueprint
from api.tasks.schemas import (
    IdempotencyHeaderSchema,
    TaskCreateSchema,
    TaskListQuerySchema,
    TaskPageSchema,
    TaskSchema,
)
from db import queue

blp = Blueprint(
    "tasks",
    __name__,
    url_prefix="/companies/<uuid:company_id>/tasks",
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


@blp.route("")
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
    def post(self, headers: dict[str, Any], body: dict[str, Any], company_id: uuid.UUID) -> Any:
        """Create a task (optionally idempotent with an Idempotency-Key header)."""
        key = headers.get("idempotency_key")
        session = database.session()
        task, created = queue.create_task(
            session,
            company_id=company_id,
            type=body["type"],
            payload=body["payload"],
            run_at=body.get("run_at"),
            max_attempts=body["max_attempts"],
            timeout_seconds=body["timeout_seconds"],
            idempotency_key=key,
            request_hash=request_hash(body) if key is not None else None,
            notify_channel=current_app.config["FAIRQ_SETTINGS"].notify_channel,
        )
        session.commit()
        location = url_for("tasks.TaskById", company_id=company_id, task_id=task.id)
        if created:
            return task, 201, {"Location": location}
        return task, 200, {"Location": location, "Idempotent-Replayed": "true"}

    @blp.doc(operationId="list_tasks")
    @auth.company_required()
    @blp.arguments(TaskListQuerySchema(), location="query")
    @blp.response(200, TaskPageSchema)
    @blp.error(401, "Missing or invalid token.")
    @blp.error(403, "The admin token cannot act for a company.")
    @blp.error(404, "No such company, or not yours.")
    def get(self, query: dict[str, Any], company_id: uuid.UUID) -> dict[str, Any]:
        """List the company's tasks, newest first, with optional status and type filters."""
        items, has_more = queue.list_tasks(database.session(), company_id, **query)
        return {
            "items": items,
            "limit": query["limit"],
            "offset": query["offset"],
            "has_more": has_more,
        }


@blp.route("/<uuid:task_id>")
class TaskById(MethodView):
    """One task."""

    @blp.doc(operationId="get_task")
    @auth.company_required()
    @blp.response(200, TaskSchema)
    @blp.error(401, "Missing or invalid token.")
    @blp.error(403, "The admin token cannot act for a company.")
    @blp.error(404, "No such task, or not yours.")
    def get(self, company_id: uuid.UUID, task_id: uuid.UUID) -> Any:
        """Read one task."""
        return queue.get_task(database.session(), company_id, task_id)


@blp.route("/<uuid:task_id>/cancel")
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
        session = database.session()
        task = queue.cancel_task(session, company_id, task_id)
        session.commit()
        return task


@blp.route("/<uuid:task_id>/retry")
class TaskRetry(MethodView):
    """Run a failed or cancelled task again."""

    @blp.doc(operationId="retry_task")
    @auth.company_required()
    @blp.response(200, TaskSchema)
    @blp.error(401, "Missing or invalid token.")
    @blp.error(403, "The admin token cannot act for a company.")
    @blp.error(404, "No such task, or not yours.")
    @blp.error(409, "The task is not failed or cancelled.")
    def post(self, company_id: uuid.UUID, task_id: uuid.UUID) -> Any:
        """Retry a failed or cancelled task now, with its attempts reset."""
        session = database.session()
        task = queue.retry_task(session, company_id, task_id)
        session.commit()
        return task
