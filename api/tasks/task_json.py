"""The one exception to marshmallow serving the API's answers: one task's JSON, by hand.

Every other answer is its response schema's dump (flask-smorest's `@blp.response`). A create
and a read answer one task, `TaskSchema`'s fields from a `db.queue.TaskRecord`; here the
fields are written out instead of walked by marshmallow, whose dump of one task costs about
twice as much (35-70 us more per create), the largest of the framework costs on the create's
path: decision 0005, "Follow-up: libraries on their documented paths", for the runs.
`tests/test_api_tasks.py` checks that both give the same for any task.
"""

from __future__ import annotations

import datetime as dt

from flask import Response, jsonify

from db.queue import TaskRecord


def _instant(value: dt.datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def task_response(task: TaskRecord) -> Response:
    """`jsonify(TaskSchema().dump(task))`: the JSON answer of one task, status 200.

    flask-smorest passes a `Response` through as it is (the view's status and headers still
    applied), so the view's `@blp.response(..., TaskSchema)` documents it.
    """
    return jsonify(
        {
            "id": str(task.id),
            "company_id": str(task.company_id),
            "type": task.type,
            "payload": task.payload,
            "status": task.status,
            "attempts": task.attempts,
            "max_attempts": task.max_attempts,
            "timeout_seconds": task.timeout_seconds,
            "run_after": task.run_after.isoformat(),
            "idempotency_key": task.idempotency_key,
            "last_error": task.last_error,
            "created_at": task.created_at.isoformat(),
            "updated_at": task.updated_at.isoformat(),
            "started_at": _instant(task.started_at),
            "finished_at": _instant(task.finished_at),
            "result": task.result,
        }
    )
