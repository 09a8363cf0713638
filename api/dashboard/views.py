"""The dashboard's pages and actions (issue 14). Thin views, as the API's: arguments in, `db`
calls, a template out; an action is one `db` call, then a redirect (POST/redirect/GET). The
company keys views are `api.dashboard.keys`, on this module's blueprint.

Every page reads in one transaction of its own under the statistics statement timeout
(`STATS_TIMEOUT_MS`): a read that runs past it is a 503 saying so, never a request holding a
connection for long. Errors are raised as in the API (`flask_smorest.abort`, `db.errors`,
driver errors), translated by `api.errors` into its JSON body, and shown as an HTML page by
`after_dashboard_request` to a client that prefers HTML: one translation point for both.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hmac
import json
import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import psycopg
from flask import (
    Blueprint,
    Response,
    current_app,
    flash,
    g,
    redirect,
    render_template,
    request,
    session,
    url_for,
)
from flask.typing import ResponseReturnValue
from flask_smorest import abort
from flask_wtf.csrf import generate_csrf
from marshmallow import EXCLUDE, Schema, ValidationError

from api import auth, database, errors, throttle
from api import settings as api_settings
from api.dashboard import URL_PREFIX, csrf
from api.dashboard.forms import (
    MAX_OFFSET,
    CompanyListQuery,
    CompanyTasksQuery,
    KeyIssueForm,
    KeyRotateForm,
    LimitsForm,
    LoginForm,
)
from api.parser import REPEATED_PARAMETER
from api.settings import ApiSettings
from db import (
    api_keys,
    companies,
    dashboard,
    queue,
    queue_health,
    statistics,
    tenant_stats,
    workers,
)
from db.models import TaskStatus
from worker import tasktypes

log = logging.getLogger("fairq.api.dashboard")

blp = Blueprint("dashboard", __name__, template_folder="templates", static_folder="static")

# Session keys: the login, and when it ends (seconds since the epoch, absolute).
LOGGED_IN = "admin"
LOGIN_EXPIRES = "expires_at"
# Rows per page of the companies listing and of a company's tasks.
PAGE_SIZE = 50
# Companies in each of the overview's rankings, and failed tasks on a company's page.
LEADERS = 10
RECENT_FAILURES = 10
# How often the overview reloads its figures (dashboard.js), in seconds.
REFRESH_SECONDS = 5
# Seconds a client is asked to wait after a statistics timeout.
RETRY_AFTER_SECONDS = 5

# Scripts, styles, images and fetches from this origin only: no inline script or style, no
# plugin, no framing, forms posting only here (issue 14, item 3).
CONTENT_SECURITY_POLICY = "; ".join(
    (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",
        "connect-src 'self'",
        "form-action 'self'",
        "frame-ancestors 'none'",
        "base-uri 'none'",
    )
)

_PUBLIC_ENDPOINTS = frozenset({"dashboard.login_form", "dashboard.login", "dashboard.static"})


def _settings() -> ApiSettings:
    return api_settings.current()


# ---------------------------------------------------------------------------------------------
# The session, the guard of every request, the headers of every answer
# ---------------------------------------------------------------------------------------------


def logged_in() -> bool:
    """Whether this request's session is a login that has not expired.

    An expired one is cleared, so its cookie is deleted with this answer.
    """
    expires = session.get(LOGIN_EXPIRES)
    if session.get(LOGGED_IN) is not True or not isinstance(expires, int | float):
        return False
    if time.time() >= expires:
        session.clear()
        return False
    return True


def _here() -> str:
    """This request's path and query, to come back to after the login."""
    return request.full_path.rstrip("?")


def safe_next(value: str | None) -> str | None:
    """`value` if it is a path of the dashboard on this server, else None (no open redirect)."""
    if not value or value.startswith("//") or "\\" in value:
        return None
    if any(ord(char) < 0x20 or ord(char) == 0x7F for char in value):
        return None
    parts = urlsplit(value)
    if parts.scheme or parts.netloc:
        return None
    if parts.path != URL_PREFIX and not parts.path.startswith(URL_PREFIX + "/"):
        return None
    return value


@blp.before_request
def _guard() -> ResponseReturnValue | None:
    """Refuse what may not reach a view: no admin token configured, a POST without a valid
    CSRF token (400), a page without a login (to the login form) or an action without one
    (401)."""
    if request.endpoint == "dashboard.static":
        return None
    if _settings().admin_token is None:
        abort(503, message="the dashboard is disabled: ADMIN_TOKEN is not configured")
    # Raises flask_wtf.csrf.CSRFError (400) on a POST whose token is missing or wrong.
    csrf.protect()
    if request.endpoint in _PUBLIC_ENDPOINTS:
        return None
    if not logged_in():
        if request.method == "GET":
            return redirect(url_for(".login_form", next=_here()), 303)
        abort(401, message="log in to the dashboard first: no session, or it has expired")
    # The request's log line says the admin acted (api.logging).
    g.fairq_principal = auth.Principal(company_id=None)
    return None


@blp.context_processor
def _template_context() -> dict[str, Any]:
    return {"logged_in": logged_in(), "here": _here()}


def wants_html() -> bool:
    """Whether the client prefers HTML to JSON (a browser; also `*/*`, as curl sends)."""
    best = request.accept_mimetypes.best_match(["text/html", "application/json"])
    return best != "application/json"


def after_dashboard_request(response: Response) -> Response:
    """Give every answer under `/dashboard` its security headers, and an error page.

    Errors are answered by `api.errors` in the API's JSON body (one translation point); a
    client that prefers HTML gets that status, message and those headers as a page.
    """
    path = request.path
    if path != URL_PREFIX and not path.startswith(URL_PREFIX + "/"):
        return response
    response.headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
    response.headers["X-Frame-Options"] = "DENY"
    response.headers["X-Content-Type-Options"] = "nosniff"
    # Same origin only: Flask-WTF checks the Referer of an HTTPS POST against the host.
    response.headers["Referrer-Policy"] = "same-origin"
    if request.endpoint != "dashboard.static":
        # Tenants' data: kept by no cache, shown again by no back button after the logout.
        response.headers["Cache-Control"] = "no-store"
    if response.status_code >= 400 and response.mimetype == "application/json" and wants_html():
        body = response.get_json(silent=True)
        if isinstance(body, dict) and isinstance(body.get("message"), str):
            page = render_template(
                "dashboard/error.html",
                code=response.status_code,
                status=body.get("status", ""),
                message=body["message"],
                logged_in=logged_in(),
            )
            response.set_data(page)
            response.mimetype = "text/html"
    return response


@contextlib.contextmanager
def reading() -> Iterator[psycopg.Connection[Any]]:
    """The request's connection in a transaction, each statement under `STATS_TIMEOUT_MS`.

    A statement cancelled by the timeout is a 503 with `Retry-After`.
    """
    timeout_ms = _settings().stats_timeout_ms
    with database.transaction() as reader:
        try:
            with tenant_stats.time_limit(reader, timeout_ms):
                yield reader
        except tenant_stats.StatisticsTimeout:
            log.warning("dashboard query cancelled after %s ms", timeout_ms)
            abort(
                503,
                message=f"the database took longer than {timeout_ms} ms (STATS_TIMEOUT_MS) to "
                "answer this page; try again in a few seconds",
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            )


def _query(schema: Schema) -> dict[str, Any]:
    """The query string loaded by `schema`: 422 naming each bad or repeated parameter.

    An empty value is an absent one (a filter form's "all"); unknown parameters are ignored,
    as by the API.
    """
    problems: dict[str, Any] = {
        name: [REPEATED_PARAMETER] for name in schema.fields if len(request.args.getlist(name)) > 1
    }
    raw = {name: request.args[name] for name in schema.fields if request.args.get(name)}
    loaded: dict[str, Any] = {}
    try:
        loaded = schema.load(raw, unknown=EXCLUDE)
    except ValidationError as exc:
        messages = exc.messages if isinstance(exc.messages, dict) else {"_schema": exc.messages}
        problems = {**messages, **problems}
    if problems:
        found = {"query": problems}
        abort(422, message=errors.validation_message(found), errors=found)
    return loaded


def back(default: str) -> ResponseReturnValue:
    """After an action: back to the page it was sent from (`next`), else to `default`."""
    return redirect(safe_next(request.form.get("next")) or default, 303)


# ---------------------------------------------------------------------------------------------
# Login and logout
# ---------------------------------------------------------------------------------------------


@blp.get("/login")
def login_form() -> ResponseReturnValue:
    """The login form (or the overview, for a session already logged in)."""
    if logged_in():
        return redirect(url_for(".overview"), 303)
    form = LoginForm(next=safe_next(request.args.get("next")) or "")
    return render_template("dashboard/login.html", form=form)


@blp.post("/login")
def login() -> ResponseReturnValue:
    """Exchange the admin token for a session; 422 without a token, 401 with a wrong one, 429
    with `Retry-After` while the client's address is throttled (`api.throttle`)."""
    form = LoginForm()
    if not form.validate():
        return render_template("dashboard/login.html", form=form), 422
    wait = throttle.retry_after()
    if wait is not None:
        # Before the comparison: a right guess is not told from a wrong one meanwhile.
        throttle.refuse("dashboard", wait)
    token = str(form.token.data).strip()
    admin = _settings().admin_token
    assert admin is not None  # _guard answered 503 otherwise
    if not hmac.compare_digest(token.encode(), admin.encode()):
        throttle.record_failure("dashboard")
        log.warning("dashboard login refused from %s: not the admin token", request.remote_addr)
        form.token.errors = ["This is not the admin token."]
        return render_template("dashboard/login.html", form=form), 401
    # A new session: nothing of the one before the login (its CSRF token included) survives.
    session.clear()
    session.permanent = True
    session[LOGGED_IN] = True
    session[LOGIN_EXPIRES] = time.time() + _settings().dashboard_session_hours * 3600
    # The session's CSRF token now, in this cookie: the pages that follow then leave the
    # session as it is and send no cookie, until a flash message or the logout. (Flask-WTF
    # remembers the token of the cleared session in `g` for this request: forget it first.)
    g.pop(current_app.config["WTF_CSRF_FIELD_NAME"], None)
    generate_csrf()
    return redirect(safe_next(form.next.data) or url_for(".overview"), 303)


@blp.post("/logout")
def logout() -> ResponseReturnValue:
    """End the session: its cookie is deleted."""
    session.clear()
    return redirect(url_for(".login_form"), 303)


# ---------------------------------------------------------------------------------------------
# Pages
# ---------------------------------------------------------------------------------------------


@blp.get("/")
def overview() -> ResponseReturnValue:
    """The queue at a glance: tasks by status, what holds the due work, the spiral's signs,
    the chart, lease holders, leading companies."""
    settings = _settings()
    with reading() as connection:
        stats = tenant_stats.queue_stats(connection, limits=settings.stats_limits, top=LEADERS)
        series = dashboard.finished_per_minute(connection)
        holders = dashboard.lease_holders(connection)
        waiting = queue_health.waiting(connection)
        tables = queue_health.table_tuples(connection)
        cleanup_held_seconds = statistics.oldest_xmin_holder_age(connection)
    chart = {
        "t": [minute.minute.timestamp() for minute in series.minutes],
        "completed": [minute.completed for minute in series.minutes],
        "failed": [minute.failed for minute in series.minutes],
    }
    return render_template(
        "dashboard/overview.html",
        stats=stats,
        series=series,
        chart=chart,
        holders=holders,
        # In `Hold`'s order: waiting for a worker first.
        waiting=[(hold, waiting[hold]) for hold in queue_health.Hold],
        tables=tables,
        cleanup_held_seconds=cleanup_held_seconds,
        recent_limit=dashboard.RECENT_FINISHED_LIMIT,
        stale_after=settings.stale_after_seconds,
        refresh_seconds=REFRESH_SECONDS,
        now=stats.as_of,
    )


@blp.get("/companies")
def companies_list() -> ResponseReturnValue:
    """Every company, one row each, sorted and paged."""
    args = _query(CompanyListQuery())
    sort = dashboard.CompanySort(args["sort"])
    with reading() as reader:
        page = dashboard.list_companies(
            reader,
            sort=sort,
            descending=args["order"] == "desc",
            search=args["q"],
            limit=PAGE_SIZE,
            offset=(args["page"] - 1) * PAGE_SIZE,
        )
    pages = max(1, -(-page.total // PAGE_SIZE))
    return render_template(
        "dashboard/companies.html",
        page=page,
        sort=sort,
        order=args["order"],
        q=args["q"] or "",
        number=args["page"],
        pages=pages,
        page_size=PAGE_SIZE,
        now=page.window.now,
    )


@blp.get("/companies/<uuid:company_id>")
def company(company_id: uuid.UUID) -> ResponseReturnValue:
    """A company: its figures, actions, latest failures and its tasks, filtered."""
    return company_page(company_id)


def company_page(
    company_id: uuid.UUID,
    limits_form: LimitsForm | None = None,
    status: int = 200,
    issue_form: KeyIssueForm | None = None,
) -> ResponseReturnValue:
    """A company's page; with a form that failed validation, shown again with its errors."""
    args = _query(CompanyTasksQuery())
    offset = (args["page"] - 1) * PAGE_SIZE
    if offset > MAX_OFFSET:
        found = {"query": {"page": [f"Must be at most {MAX_OFFSET // PAGE_SIZE + 1}."]}}
        abort(422, message=errors.validation_message(found), errors=found)
    with reading() as reader:
        stored = companies.get_company(reader, company_id)
        stats = tenant_stats.company_stats(reader, company_id, limits=_settings().stats_limits)
        failures = dashboard.recent_failures(reader, company_id, limit=RECENT_FAILURES)
        keys = api_keys.list_keys(reader, company_id)
        tasks, has_more = queue.list_tasks(
            reader,
            company_id,
            status=args["status"],
            type=args["type"],
            limit=PAGE_SIZE,
            offset=offset,
        )
    form = limits_form or LimitsForm(
        weight=stored.weight, max_in_flight=stored.max_in_flight, max_pending=stored.max_pending
    )
    page = render_template(
        "dashboard/company.html",
        company=stored,
        stats=stats,
        failures=failures,
        failure_scan=dashboard.FAILURE_SCAN_LIMIT,
        tasks=tasks,
        has_more=has_more,
        status_filter=args["status"] or "",
        type_filter=args["type"] or "",
        number=args["page"],
        statuses=[s.value for s in TaskStatus],
        types=tasktypes.names(),
        form=form,
        keys=keys,
        issue_form=issue_form or KeyIssueForm(),
        rotate_form=KeyRotateForm(),
        now=stats.as_of,
    )
    return page, status


@blp.get("/companies/<uuid:company_id>/tasks/<uuid:task_id>")
def task(company_id: uuid.UUID, task_id: uuid.UUID) -> ResponseReturnValue:
    """A task: payload, result, attempts, its timeline and last error."""
    with reading() as reader:
        stored = companies.get_company(reader, company_id)
        detail = dashboard.task_detail(reader, company_id, task_id)
        now = dashboard.now(reader)
    record = detail.record
    return render_template(
        "dashboard/task.html",
        company=stored,
        task=record,
        detail=detail,
        timeline=_timeline(detail),
        payload=_pretty(record.payload),
        result=None if record.result is None else _pretty(record.result),
        now=now,
    )


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True)


def _timeline(detail: dashboard.TaskDetail) -> list[tuple[dt.datetime, str]]:
    """The task's moments, earliest first: (when, what happened)."""
    record = detail.record
    moments: list[tuple[dt.datetime | None, str]] = [
        (record.created_at, "created"),
        (record.run_after, "runnable from (eligible since)"),
        (record.started_at, "first started"),
        (detail.locked_at, f"last heartbeat of {detail.locked_by or 'its worker'}"),
        (record.finished_at, f"finished: {record.status}"),
        (record.updated_at, "last changed"),
    ]
    return sorted(((when, what) for when, what in moments if when is not None), key=_first)


def _first(moment: tuple[dt.datetime, str]) -> dt.datetime:
    return moment[0]


# ---------------------------------------------------------------------------------------------
# Actions: each a POST with the CSRF token, one db call, then back to the page
# ---------------------------------------------------------------------------------------------


@blp.post("/companies/<uuid:company_id>/pause")
def pause(company_id: uuid.UUID) -> ResponseReturnValue:
    """Pause a company: once this answers, no worker starts another of its tasks."""
    # Several statements that commit together (db.companies.pause_company).
    with database.transaction() as writer:
        paused = companies.pause_company(writer, company_id)
    # Workers trust what they read of pauses this long: answered later, none starts a task.
    time.sleep(workers.PAUSE_SEEN_WITHIN_SECONDS)
    flash(f"Paused {paused.name}: no worker starts its tasks now; running ones finish.")
    return back(url_for(".company", company_id=company_id))


@blp.post("/companies/<uuid:company_id>/resume")
def resume(company_id: uuid.UUID) -> ResponseReturnValue:
    """Resume a paused company: its waiting tasks are claimed again, in their order."""
    with database.transaction() as writer:
        resumed = companies.resume_company(
            writer, company_id, notify_channel=_settings().notify_channel
        )
    flash(f"Resumed {resumed.name}: its tasks are claimed again.")
    return back(url_for(".company", company_id=company_id))


@blp.post("/companies/<uuid:company_id>/limits")
def limits(company_id: uuid.UUID) -> ResponseReturnValue:
    """Set a company's weight, max_in_flight and max_pending; 422 naming a bad field."""
    form = LimitsForm()
    if not form.validate():
        return company_page(company_id, limits_form=form, status=422)
    weight = form.weight.data
    assert isinstance(weight, int)  # InputRequired passed
    changed = companies.update_company_limits(
        database.connection(),
        company_id,
        weight=weight,
        max_in_flight=form.max_in_flight.data,
        max_pending=form.max_pending.data,
    )
    flash(f"Saved the limits of {changed.name}.")
    return back(url_for(".company", company_id=company_id))


@blp.post("/companies/<uuid:company_id>/tasks/<uuid:task_id>/retry")
def retry(company_id: uuid.UUID, task_id: uuid.UUID) -> ResponseReturnValue:
    """Retry a failed or cancelled task now, its attempts reset; 409 from another status."""
    queue.retry_task(database.connection(), company_id, task_id)
    flash(f"Task {task_id} is pending again, runnable now.")
    return back(url_for(".task", company_id=company_id, task_id=task_id))


@blp.post("/companies/<uuid:company_id>/tasks/<uuid:task_id>/cancel")
def cancel(company_id: uuid.UUID, task_id: uuid.UUID) -> ResponseReturnValue:
    """Cancel a pending task; 409 from another status."""
    queue.cancel_task(database.connection(), company_id, task_id)
    flash(f"Task {task_id} is cancelled.")
    return back(url_for(".task", company_id=company_id, task_id=task_id))


# ---------------------------------------------------------------------------------------------
# Template filters
# ---------------------------------------------------------------------------------------------


@blp.app_template_filter("duration")
def duration(seconds: float | None) -> str:
    """`3 d 4 h`, `2 h 5 min`, `4 min 3 s`, `12 s`, `0.4 s`; an en dash for None."""
    if seconds is None:
        return "\u2013"
    if seconds < 10:
        return f"{seconds:.1f} s"
    whole = int(seconds)
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days} d {hours} h"
    if hours:
        return f"{hours} h {minutes} min"
    if minutes:
        return f"{minutes} min {secs} s"
    return f"{secs} s"


@blp.app_template_filter("when")
def when(moment: dt.datetime | None) -> str:
    """A moment in UTC to the second, e.g. `2026-12-01 10:56:12 UTC`."""
    if moment is None:
        return "\u2013"
    return moment.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


@blp.app_template_filter("ago")
def ago(moment: dt.datetime | None, now: dt.datetime) -> str:
    """How long before `now` (`5 min 2 s ago`) or after it (`in 3 h 1 min`)."""
    if moment is None:
        return "\u2013"
    seconds = (now - moment).total_seconds()
    if seconds >= 0:
        return f"{duration(seconds)} ago"
    return f"in {duration(-seconds)}"


@blp.app_template_filter("count")
def count(value: float | None) -> str:
    """A count with thousands separators; an en dash for None."""
    return "\u2013" if value is None else f"{round(value):,}"


@blp.app_template_filter("limit")
def limit(value: int | None) -> str:
    """A limit, or `unlimited` for None."""
    return "unlimited" if value is None else f"{value:,}"
