"""One log line per HTTP request, and the log setup of the API process.

The line carries `method`, `route` (the URL rule template, never the raw path; `None` with
the escaped `path` when no route matched), `status`, `duration_ms`, `request_id`, and when
known `company_id` (the authenticated company), `admin` (the admin token was used) and
`task_id` (from the route). Never a body or a query string. With `LOG_FORMAT=json` they are
keys of the JSON object (`common.logging.JsonFormatter`), in text they are in the message.

Request ids: a client's `X-Request-ID` is kept when it is 1..128 visible ASCII characters,
else one is generated; the response echoes it in `X-Request-ID`. Under gunicorn this line
replaces gunicorn's access log, which `deploy/gunicorn.conf.py` turns off by default.
"""

from __future__ import annotations

import logging
import re
import time
import uuid

from flask import Flask, Response, g, request

from api.auth import Principal
from common import logging as fairq_logging

REQUEST_ID_HEADER = "X-Request-ID"
MAX_PATH_CHARS = 200

# Its records skip the caller lookup (neither format shows file or line).
log = fairq_logging.callerless_logger("fairq.api.request")

_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")


def init_app(app: Flask, *, level: str, fmt: str) -> None:
    """Log every request of `app`, and send the `fairq` loggers to stderr as `fmt` at `level`.

    Logging is per process: the last app built in a process decides the format.
    """
    # Flask's app.logger is logging.getLogger("fairq"): replacing its handlers also drops
    # Flask's default handler, so every fairq line has one format.
    fairq_logging.configure(level, fmt, logger="fairq")
    # Registered before the other extensions: first to start the clock, last to stop it.
    app.before_request(_start)
    app.after_request(_finish)


def request_id(header: str | None) -> str:
    """`header` when it is an acceptable request id, else a new random one."""
    if header is not None and _REQUEST_ID.fullmatch(header):
        return header
    return uuid.uuid4().hex


def _start() -> None:
    g.fairq_started = time.perf_counter()
    g.fairq_request_id = request_id(request.headers.get(REQUEST_ID_HEADER))


def _printable(text: str) -> str:
    # A decoded path may hold newlines or other control characters: escape them so the text
    # format stays one line per request and nothing can forge another line.
    return text[:MAX_PATH_CHARS].encode("unicode_escape").decode("ascii")


def _finish(response: Response) -> Response:
    started: float | None = g.get("fairq_started")
    rid: str = g.get("fairq_request_id") or request_id(None)
    response.headers[REQUEST_ID_HEADER] = rid
    level = logging.WARNING if response.status_code >= 500 else logging.INFO
    if not log.isEnabledFor(level):
        return response
    duration_ms = round((time.perf_counter() - started) * 1000, 3) if started else None
    rule = request.url_rule
    fields: dict[str, object] = {
        "event": "http.request",
        "method": request.method,
        "route": rule.rule if rule is not None else None,
        "status": response.status_code,
        "duration_ms": duration_ms,
        "request_id": rid,
    }
    where = rule.rule if rule is not None else _printable(request.path)
    if rule is None:
        fields["path"] = where
    who = ""
    principal: Principal | None = g.get("fairq_principal")
    if principal is not None:
        if principal.is_admin:
            fields["admin"] = True
            who = ", admin"
        else:
            fields["company_id"] = principal.company_id
            who = f", company {principal.company_id}"
    task_id = (request.view_args or {}).get("task_id")
    if isinstance(task_id, uuid.UUID):
        fields["task_id"] = task_id
        who += f", task {task_id}"
    log.log(
        level,
        "%s %s %d in %s ms (request %s%s)",
        request.method, where, response.status_code, duration_ms, rid, who,
        extra=fields,
    )  # fmt: skip
    return response
