"""/workers/process: run one processing pass inside the API process (admin only).

For operations and tests without a running supervisor (design §3). The pass uses the worker
defaults (batch 100, fair across companies), the API's `STALE_AFTER_SECONDS` and the same
handler settings as the worker (`SMTP_URL`, `WEBHOOK_ALLOW_PRIVATE`, ...); it runs in the
request, so the response waits for every claimed task's handler. Its tasks are counted in the
API's `/metrics` under the worker's names (`tasks_claimed_total`, `tasks_completed_total`, ...).
What handlers return is stored as their tasks' `result`, as in a worker.

Timeouts apply as in a worker (`worker.processing.timeouts`), with one difference: a handler
that overruns its deadline and the grace has its task's timeout, the pass's completions and
the release of the rest of the batch written at once, but the request's thread (unlike a
worker child, which exits) stays in that handler, and the response waits until it returns.
"""

from __future__ import annotations

import os
import secrets
import socket

from flask import current_app
from flask.views import MethodView
from marshmallow import Schema, fields

from api import auth, database, metrics
from api import settings as api_settings
from api.parser import Blueprint
from worker import processing
from worker.settings import PassSettings

blp = Blueprint("workers", __name__, url_prefix="/workers", description="Drive the queue by hand.")


class PassResultSchema(Schema):
    """What one processing pass did, in tasks."""

    claimed = fields.Integer(dump_only=True, metadata={"description": "Moved to processing."})
    completed = fields.Integer(dump_only=True, metadata={"description": "Handler succeeded."})
    retried = fields.Integer(
        dump_only=True, metadata={"description": "Failed, scheduled again with backoff."}
    )
    failed = fields.Integer(
        dump_only=True,
        metadata={"description": "Failed for good, including lost-worker poison pills."},
    )
    released = fields.Integer(dump_only=True, metadata={"description": "Handed back unstarted."})
    lease_lost = fields.Integer(
        dump_only=True, metadata={"description": "Finalization refused: lease taken over."}
    )


@blp.route("/process")
class Process(MethodView):
    """One processing pass."""

    @blp.doc(operationId="process_tasks")
    @auth.admin_required
    @blp.response(200, PassResultSchema)
    @blp.error(401, "Missing or invalid admin token.")
    @blp.error(503, "ADMIN_TOKEN is not configured.")
    def post(self) -> processing.PassResult:
        """Claim, run and finalize one batch of tasks in this process (admin only)."""
        settings = api_settings.current()
        return processing.run_pass(
            database.connection(),
            # One holder per request (its `workers` row): concurrent passes of this process
            # must not delete each other's.
            worker_id=f"{socket.gethostname()}:{os.getpid()}:api-{secrets.token_hex(3)}",
            settings=PassSettings(
                stale_after=settings.stale_after_seconds, handler_config=settings.handler_config
            ),
            observer=metrics.task_metrics(current_app),
        )
