"""The one translation point from domain and driver errors to flask-smorest's error body.

Every error response has the shape `{"code", "status", "message", "errors"?}` (design §3).
"""

from __future__ import annotations

import re
from typing import Any

from flask import Flask, current_app, request
from flask_smorest import Api
from marshmallow import Schema, fields
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, InterfaceError, OperationalError
from werkzeug.exceptions import HTTPException, MethodNotAllowed, NotFound
from werkzeug.routing import Map, Rule
from werkzeug.routing.converters import UUIDConverter

from db import errors as db_errors
from db import models

# Constraint name -> (status, message) when a constraint, not validation, refused a write.
_CONSTRAINT_STATUS: dict[str, tuple[int, str]] = {
    models.UQ_TASK_IDEMPOTENCY_KEY: (409, "a task with this Idempotency-Key is being created"),
    models.FK_TASK_COMPANY: (404, "company not found"),
    models.CK_TASK_STATUS: (422, "invalid task status"),
    models.CK_TASK_MAX_ATTEMPTS: (422, "max_attempts is out of range"),
    models.CK_TASK_PAYLOAD_OBJECT: (422, "payload must be a JSON object"),
}

# Constraint name -> (request field, why) for CHECKs that back a field's validation: a 422
# naming the field, in the shape of a validation error, should a write ever get past it.
_CONSTRAINT_FIELD: dict[str, tuple[str, str]] = {
    models.CK_COMPANY_WEIGHT: (
        "weight",
        f"Must be greater than or equal to {models.MIN_WEIGHT} "
        f"and less than or equal to {models.MAX_WEIGHT}.",
    ),
    models.CK_COMPANY_MAX_IN_FLIGHT: (
        "max_in_flight",
        f"Must be greater than or equal to {models.MIN_IN_FLIGHT} "
        f"and less than or equal to {models.MAX_IN_FLIGHT}.",
    ),
    models.CK_COMPANY_MAX_PENDING: (
        "max_pending",
        f"Must be greater than or equal to {models.MIN_PENDING} "
        f"and less than or equal to {models.MAX_PENDING}.",
    ),
}

# A path parameter of a route, `<uuid:name>` in its rule.
_UUID_PARAMETER = re.compile(r"<uuid:(\w+)>")
# The app's routes with their `uuid` segments as plain strings (`_malformed_path_ids`).
_LOOSE_ROUTES = "fairq.loose_routes"
NOT_A_UUID = "Not a valid UUID."
_ROUTE_UUID = re.compile(UUIDConverter.regex)

# status -> (domain error type) for the errors `db` raises on purpose.
_DOMAIN_STATUS: tuple[tuple[type[db_errors.DomainError], int], ...] = (
    (db_errors.NotFound, 404),
    (db_errors.Conflict, 409),
    (db_errors.IdempotencyKeyReused, 422),
)

# Retry-After of a 429 for the backlog quota, in seconds. Room comes back only as the
# company's tasks finish, at its workers' pace: seconds, not milliseconds. A refused create
# still costs the database its rows (inserted, then rolled back by the quota's trigger), so
# producers told to come back at once would load it most exactly when it is behind. 5 s
# frees hundreds to thousands of slots at common drain rates and bounds a blocked producer's
# attempts to one per client every 5 s (the 503 of an outage says 1 s: that one is short).
BACKLOG_RETRY_AFTER_SECONDS = 5
# The quota trigger's DETAIL (migration 0006); `unfinished` is the count before the statement.
_BACKLOG_DETAIL = re.compile(r"max_pending=(\d+) unfinished=(\d+) adding=(\d+)")


class ErrorSchema(Schema):
    """The body of every error response (design §3); `Error` in the OpenAPI document."""

    code = fields.Integer(required=True, metadata={"description": "The HTTP status code."})
    status = fields.String(
        required=True, metadata={"description": "The status's reason phrase, e.g. `Not Found`."}
    )
    message = fields.String(
        required=True, metadata={"description": "What went wrong, naming the field if one did."}
    )
    errors = fields.Dict(
        metadata={
            "description": "The inputs at fault, location -> field -> messages, e.g. "
            '`{"json": {"type": ["Unknown task type."]}}`: every invalid field of a '
            "validation error (422); the `Authorization` header of a 401, and of the 403 "
            "of the admin token on a company's tasks "
            '(`{"headers": {"Authorization": [...]}}`); the key of an Idempotency-Key '
            "conflict (409 or 422): `headers.Idempotency-Key` on a single create, "
            "`json.tasks[<index>].idempotency_key` on a batch; `json.tasks` of a batch larger "
            "than the company's max_pending (422); the `Content-Type` header of a 415; a "
            "path parameter that is not "
            'a UUID on a 404 (`{"path": {"task_id": ["Not a valid UUID."]}}`). Absent when '
            "no one input is at fault (another 404, a 429, a 503)."
        }
    )


class FairqApi(Api):  # type: ignore[misc]  # flask-smorest ships no type hints
    """flask-smorest's Api whose error bodies always carry a `message`."""

    ERROR_SCHEMA = ErrorSchema

    def _register_pagination_header(self) -> None:
        # flask-smorest's pagination is not used (list endpoints page by limit/offset in the
        # body): its header would publish an unused `PaginationMetadata` component.
        return

    def handle_http_exception(self, error: HTTPException) -> tuple[dict[str, Any], int, Any]:
        """Like flask-smorest's handler, plus a message for errors raised without one."""
        payload, code, headers = super().handle_http_exception(error)
        # flask-smorest drops the headers werkzeug sets on its errors, some of them required:
        # `Allow` on a 405 (RFC 9110 section 15.5.6), `WWW-Authenticate`, `Retry-After`.
        for name, value in error.get_headers():
            if name.lower() != "content-type":
                headers.setdefault(name, value)
        if code == 404 and request.url_rule is None and "errors" not in payload:
            # No route matched; maybe one would, but for an id that is not a UUID.
            malformed = _malformed_path_ids(request.path, request.method)
            if malformed:
                payload["errors"] = {"path": {name: [NOT_A_UUID] for name in malformed}}
                payload["message"] = validation_message(payload["errors"])
        if "message" not in payload and code == 413:
            # werkzeug's own 413 (Content-Length over the limit) says nothing about the limit.
            # The request's own: a route may set a larger one (the task batch).
            limit = request.max_content_length
            payload["message"] = f"the request body must be at most {limit} bytes"
        if "message" not in payload and isinstance(payload.get("errors"), dict):
            # webargs' 422 carries only `errors`; say which fields in the message too.
            payload["message"] = validation_message(payload["errors"])
        if "message" not in payload and error.description:
            payload["message"] = error.description
        if code == 500:
            # Never leak internals; the traceback is in the server log.
            payload["message"] = "internal server error"
        return payload, code, headers


def header_fault(header: str, message: str) -> dict[str, Any]:
    """The `errors` of an answer whose input at fault is the request's `header`.

    Named as a 422 names a header: `{"headers": {header: [message]}}`, for the 401 and 403
    of a token and the 415 of a body's type.
    """
    return {"headers": {header: [message]}}


def _malformed_path_ids(path: str, method: str) -> list[str]:
    """The path parameters that are not UUIDs, if `path` names a route but for them.

    Matched against the app's routes with each `<uuid:...>` segment taken as any string:
    `/companies/nope/tasks` names `company_id`. Empty when no route would match either.
    """
    loose: Map | None = current_app.extensions.get(_LOOSE_ROUTES)
    if loose is None:
        # Each loose rule's endpoint is the names of its uuid parameters: what a match checks.
        loose = Map(
            [
                Rule(_UUID_PARAMETER.sub(r"<\1>", r.rule), endpoint=names, methods=r.methods)
                for r in current_app.url_map.iter_rules()
                if (names := tuple(_UUID_PARAMETER.findall(r.rule)))
            ]
        )
        current_app.extensions[_LOOSE_ROUTES] = loose
    try:
        names, values = loose.bind("").match(path, method)
    except (NotFound, MethodNotAllowed):
        return []
    # The routes' own rule (werkzeug's converter), not `uuid.UUID`, which also takes braces,
    # a `urn:uuid:` prefix or no hyphens that the routes refuse.
    return [name for name in names if not _ROUTE_UUID.fullmatch(str(values[name]))]


def _field_errors(errors: Any, path: str = "") -> list[tuple[str, str]]:
    """(`location.field.subfield`, first message) for each invalid field of a webargs error."""
    if not isinstance(errors, dict):
        first = errors[0] if isinstance(errors, list) and errors else errors
        return [(path, str(first))]
    found: list[tuple[str, str]] = []
    for key, value in errors.items():
        # `_schema` is an error about the object itself, not one of its fields.
        name = path if key == "_schema" else f"{path}.{key}" if path else str(key)
        found.extend(_field_errors(value, name))
    return found


def idempotency_key_errors(
    error: db_errors.IdempotencyKeyReused | db_errors.IdempotencyKeyInFlux,
) -> dict[str, Any]:
    """The `errors` of an Idempotency-Key conflict: the key, named as a 422 names a field.

    The header of a single create, or the item's field of a batch (`error.item`).
    """
    if error.item is None:
        return {"headers": {"Idempotency-Key": [str(error)]}}
    return {"json": {f"tasks[{error.item}].idempotency_key": [str(error)]}}


def validation_message(errors: dict[str, Any]) -> str:
    """A one-line summary naming the invalid fields, e.g. `invalid query.limit: Not a valid...`.

    Field names can come from the client (unknown fields), so each part is cut short.
    """
    fields = _field_errors(errors)
    shown = "; ".join(f"{path[:100]}: {why[:200]}" for path, why in fields[:3])
    more = f" (and {len(fields) - 3} more)" if len(fields) > 3 else ""
    return f"invalid {shown}{more}"


def error_body(code: int, status: str, message: str, **extra: Any) -> dict[str, Any]:
    """Build the error body by hand (used where no exception is raised, e.g. readiness)."""
    return {"code": code, "status": status, "message": message, **extra}


def _status_name(code: int) -> str:
    from http import HTTPStatus  # noqa: PLC0415  (only needed on the error path)

    return HTTPStatus(code).phrase


def backlog_quota_answer(detail: str | None) -> tuple[dict[str, Any], int, dict[str, str]]:
    """The answer to a write the backlog quota refused (SQLSTATE `FQ429`), from its DETAIL.

    429 with `Retry-After: BACKLOG_RETRY_AFTER_SECONDS` and a message giving the quota, the
    backlog and what the request would have added; 422 instead when the request alone adds
    more than the quota (a batch larger than `max_pending`): retrying it can never succeed.
    Nothing of the refused statement was stored either way.
    """
    found = _BACKLOG_DETAIL.search(detail or "")
    if found is None:
        # Only the trigger of migration 0006 raises FQ429, always with a DETAIL: a fallback.
        body = error_body(429, _status_name(429), "backlog quota exceeded: retry later")
        return body, 429, {"Retry-After": str(BACKLOG_RETRY_AFTER_SECONDS)}
    max_pending, unfinished, adding = (int(value) for value in found.groups())
    if adding > max_pending:
        message = (
            f"backlog quota exceeded: this request adds {adding} tasks, more than the "
            f"company's max_pending of {max_pending}; it can never fit, send at most "
            f"{max_pending} at a time"
        )
        body = error_body(422, _status_name(422), message)
        # Only a batch adds more than one task, so its list is the input at fault.
        body["errors"] = {"json": {"tasks": [message]}}
        return body, 422, {}
    message = (
        f"backlog quota exceeded: {unfinished} unfinished tasks (pending or processing) of at "
        f"most {max_pending} (max_pending), and this request adds {adding}; retry when tasks "
        "have finished"
    )
    body = error_body(429, _status_name(429), message)
    return body, 429, {"Retry-After": str(BACKLOG_RETRY_AFTER_SECONDS)}


def register(app: Flask) -> None:
    """Register handlers for domain errors and for driver errors that escape a view."""

    def handle_domain(error: db_errors.DomainError) -> tuple[dict[str, Any], int]:
        for kind, code in _DOMAIN_STATUS:
            if isinstance(error, kind):
                body = error_body(code, _status_name(code), str(error))
                if isinstance(
                    error, db_errors.IdempotencyKeyReused | db_errors.IdempotencyKeyInFlux
                ):
                    body["errors"] = idempotency_key_errors(error)
                return body, code
        return error_body(500, _status_name(500), "internal server error"), 500

    def handle_integrity(error: IntegrityError) -> tuple[dict[str, Any], int]:
        # Constraints are checked by the schemas first; reaching one here means a race or a
        # gap in validation: the client's request, not a server fault. Named by constraint.
        app.logger.warning("integrity error reached the API boundary: %s", db_errors.brief(error))
        constraint = getattr(getattr(error.orig, "diag", None), "constraint_name", None)
        if constraint in _CONSTRAINT_FIELD:
            field, why = _CONSTRAINT_FIELD[constraint]
            errors = {"json": {field: [why]}}
            body = error_body(422, _status_name(422), validation_message(errors), errors=errors)
            return body, 422
        code, message = _CONSTRAINT_STATUS.get(
            constraint or "", (409, "the request conflicts with stored data")
        )
        return error_body(code, _status_name(code), message), code

    def handle_dbapi(
        error: DBAPIError,
    ) -> tuple[dict[str, Any], int] | tuple[dict[str, Any], int, dict[str, str]]:
        if getattr(error.orig, "sqlstate", None) == models.BACKLOG_QUOTA_SQLSTATE:
            # Before the OperationalError case: psycopg classes an unknown SQLSTATE class
            # ("FQ") as OperationalError, but this is the client's quota, not an outage.
            diag = getattr(error.orig, "diag", None)
            return backlog_quota_answer(getattr(diag, "message_detail", None))
        if isinstance(error, OperationalError | InterfaceError):
            # Connection lost, server restarting, timeouts: the client may simply retry.
            app.logger.error("database unavailable: %s", db_errors.brief(error))
            return (
                error_body(503, _status_name(503), "the database is unavailable, try again"),
                503,
                {"Retry-After": "1"},
            )
        if isinstance(error, DataError):
            # A value PostgreSQL refused that validation let through: the request's fault.
            app.logger.warning("database refused a value: %s", db_errors.brief(error))
            return error_body(422, _status_name(422), "a value was refused by the database"), 422
        # ProgrammingError and the like are our bugs: a 500, loudly, not a retry loop.
        app.logger.error("database error: %s", db_errors.brief(error))
        return error_body(500, _status_name(500), "internal server error"), 500

    app.register_error_handler(db_errors.DomainError, handle_domain)
    app.register_error_handler(IntegrityError, handle_integrity)
    app.register_error_handler(DBAPIError, handle_dbapi)
