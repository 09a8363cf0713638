"""Operational endpoints: liveness, readiness and the task-type catalogue."""

from __future__ import annotations

from typing import Any

from flask import current_app
from flask.views import MethodView
from marshmallow import Schema, fields
from sqlalchemy.exc import SQLAlchemyError

from api import database, settings
from api.parser import Blueprint
from db import statistics
from db.engine import driver_errors
from worker import tasktypes

# Probes answer whatever query string a load balancer adds.
blp = Blueprint(
    "system", __name__, description="Health, readiness and task types.", strict_query=False
)


class HealthSchema(Schema):
    """Liveness answer."""

    status = fields.String(dump_only=True)


class ReadySchema(Schema):
    """Readiness answer: overall status and the database check."""

    status = fields.String(dump_only=True, metadata={"enum": ["ok", "unavailable"]})
    database = fields.String(dump_only=True)


class TaskTypeSchema(Schema):
    """A registered task type and the JSON schema of its payload."""

    name = fields.String(dump_only=True)
    description = fields.String(dump_only=True)
    payload_schema = fields.Dict(dump_only=True)


@blp.route("/health")
class Health(MethodView):
    """Liveness."""

    @blp.doc(operationId="get_health")
    @blp.doc(security=[])  # public: overrides the spec-wide bearer requirement
    @blp.response(200, HealthSchema)
    def get(self) -> dict[str, str]:
        """Liveness: the process answers. Never touches the database."""
        return {"status": "ok"}


@blp.route("/ready")
class Ready(MethodView):
    """Readiness."""

    @blp.doc(operationId="get_readiness")
    @blp.doc(security=[])  # public: overrides the spec-wide bearer requirement
    @blp.response(200, ReadySchema)
    @blp.alt_response(503, schema=ReadySchema, description="The database is unreachable.")
    def get(self) -> Any:
        """Readiness: `SELECT 1` against the database within a short statement timeout."""
        timeout_ms = settings.current().ready_timeout_ms
        try:
            # A fresh connection with a short connect timeout: a hung server is a 503 in
            # about two seconds, not after the views' five-second connect timeout.
            with database.probe() as conn, driver_errors("ready"), conn.transaction():
                statistics.limit_statement_time(conn, timeout_ms)
                conn.execute("SELECT 1")
        except SQLAlchemyError as exc:
            current_app.logger.warning("readiness check failed: %s", exc.__class__.__name__)
            return {"status": "unavailable", "database": "unreachable"}, 503
        return {"status": "ok", "database": "ok"}


def payload_json_schema(schema: type[Schema]) -> dict[str, Any]:
    """The JSON schema (OpenAPI 3 flavour) of a marshmallow payload schema."""
    from apispec import APISpec  # noqa: PLC0415  (only this endpoint converts schemas)
    from apispec.ext.marshmallow import MarshmallowPlugin  # noqa: PLC0415

    plugin = MarshmallowPlugin()
    APISpec("payload", "1", "3.0.3", plugins=[plugin])
    assert plugin.converter is not None
    converted: dict[str, Any] = plugin.converter.schema2jsonschema(schema)  # type: ignore[no-untyped-call]
    return converted


@blp.route("/task-types")
class TaskTypes(MethodView):
    """The task-type catalogue."""

    @blp.doc(operationId="list_task_types")
    @blp.doc(security=[])  # public: overrides the spec-wide bearer requirement
    @blp.response(200, TaskTypeSchema(many=True))
    def get(self) -> list[dict[str, Any]]:
        """List the registered task types with the JSON schema of each payload."""
        return [
            {
                "name": t.name,
                "description": t.description,
                "payload_schema": payload_json_schema(t.payload_schema),
            }
            for t in (tasktypes.REGISTRY[name] for name in tasktypes.names())
        ]
