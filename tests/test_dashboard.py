"""The operator's dashboard over HTTP (issue 14): its login, session cookie, CSRF and headers,
what each page shows, every action and every refused input; and its statements in `db`.

The browser's side (scripts run, nothing leaves the app, pause and resume with a real worker)
is `tests/test_dashboard_browser.py`; 20,000 companies and 1M tasks are measured by
`test_every_page_answers_within_its_bounded_cost` there.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import html
import json
import re
import statistics
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from html.parser import HTMLParser
from http.cookies import SimpleCookie
from urllib.parse import parse_qs, urlsplit

import pytest
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session
from werkzeug.test import TestResponse

from api import auth, database
from api.dashboard import SESSION_COOKIE_NAME, views
from db import dashboard
from db.engine import driver_connection
from tests.conftest import ADMIN_TOKEN, make_test_app
from tests.factories import (
    CompanyWithKey,
    MakeCompany,
    MakeTask,
    insert_company,
    insert_tasks,
)

LOGIN = "/dashboard/login"
# Where a page's CSRF token is read: a search that matches nothing is the cheapest page.
CHEAP_PAGE = "/dashboard/companies?q=%20nothing%20matches%20this%20%20"

_CSRF = re.compile(r'name="csrf_token"[^>]*value="([^"]+)"')


def csrf_of(response: TestResponse) -> str:
    """The CSRF token a page carries in its forms."""
    found = _CSRF.search(response.get_data(as_text=True))
    assert found is not None, response.get_data(as_text=True)[:500]
    return found.group(1)


def log_in(client: FlaskClient, token: str = ADMIN_TOKEN, **form: str) -> TestResponse:
    """POST the login form with the CSRF token of the login page."""
    csrf = csrf_of(client.get(LOGIN))
    return client.post(LOGIN, data={"token": token, "csrf_token": csrf, **form})


@pytest.fixture
def operator(client: FlaskClient) -> FlaskClient:
    """The test client, logged in to the dashboard."""
    response = log_in(client)
    assert response.status_code == 303, response.get_data(as_text=True)[:500]
    return client


def act(client: FlaskClient, path: str, **form: str) -> TestResponse:
    """POST an action with a valid CSRF token of the client's session."""
    return client.post(path, data={"csrf_token": csrf_of(client.get(CHEAP_PAGE)), **form})


def session_cookie(response: TestResponse) -> SimpleCookie:
    """The dashboard's Set-Cookie of `response` (fails when there is none)."""
    headers = [h for h in response.headers.getlist("Set-Cookie") if SESSION_COOKIE_NAME in h]
    assert len(headers) == 1, response.headers
    cookie = SimpleCookie()
    cookie.load(headers[0])
    return cookie


def page_text(response: TestResponse) -> str:
    """The page's text with tags and runs of whitespace collapsed, for assertions."""
    return html.unescape(" ".join(re.sub(r"<[^>]+>", " ", response.get_data(as_text=True)).split()))


def stored(session: Session, sql: str, **params: object) -> object:
    """One value read past the session's cache."""
    return session.execute(text(sql), params).scalar_one()


# ---------------------------------------------------------------------------------------------
# Login, session, CSRF, headers
# ---------------------------------------------------------------------------------------------


# No company has the id 404; a fixed id, as every pytest-xdist worker must collect the same tests.
@pytest.mark.parametrize(
    "path",
    ["/dashboard/", "/dashboard/companies", f"/dashboard/companies/{uuid.UUID(int=404)}"],
)
def test_every_page_sends_a_visitor_without_a_session_to_the_login_form(
    client: FlaskClient, path: str
) -> None:
    response = client.get(path)

    assert response.status_code == 303
    location = urlsplit(response.headers["Location"])
    assert location.path == LOGIN
    assert parse_qs(location.query) == {"next": [path]}


def test_the_dashboard_root_without_a_slash_leads_to_it(client: FlaskClient) -> None:
    response = client.get("/dashboard")

    assert response.status_code == 308
    assert response.headers["Location"].endswith("/dashboard/")


def test_an_action_without_a_session_is_a_401_and_changes_nothing(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    csrf = csrf_of(client.get(LOGIN))

    response = client.post(f"/dashboard/companies/{company.id}/pause", data={"csrf_token": csrf})

    assert response.status_code == 401
    assert "log in to the dashboard first" in page_text(response)
    assert stored(db_session, "SELECT paused FROM companies WHERE id = :id", id=company.id) is False


def test_the_login_exchanges_the_token_for_a_signed_httponly_strict_cookie_with_an_expiry(
    client: FlaskClient,
) -> None:
    response = log_in(client)

    assert response.status_code == 303
    assert response.headers["Location"] == "/dashboard/"
    morsel = session_cookie(response)[SESSION_COOKIE_NAME]
    assert morsel["httponly"] is True
    assert morsel["samesite"] == "Strict"
    assert morsel["path"] == "/dashboard"
    assert not morsel["secure"], "plain HTTP (make run on localhost): no Secure flag"
    expires = dt.datetime.strptime(morsel["expires"], "%a, %d %b %Y %H:%M:%S GMT")
    hours = (expires.replace(tzinfo=dt.UTC) - dt.datetime.now(dt.UTC)).total_seconds() / 3600
    assert 7.9 < hours <= 8.0
    assert ADMIN_TOKEN not in morsel.value
    assert client.get("/dashboard/companies?q=x").status_code == 200


def test_the_cookie_is_secure_when_the_request_came_over_https(app: Flask) -> None:
    client = app.test_client()
    csrf = csrf_of(client.get(LOGIN, base_url="https://fairq.example"))

    response = client.post(
        LOGIN,
        data={"token": ADMIN_TOKEN, "csrf_token": csrf},
        base_url="https://fairq.example",
        # Flask-WTF checks an HTTPS POST's Referer (the pages send it: same-origin policy).
        headers={"Referer": "https://fairq.example/dashboard/login"},
    )

    assert response.status_code == 303
    assert session_cookie(response)[SESSION_COOKIE_NAME]["secure"] is True


def test_a_wrong_token_is_a_401_naming_the_field_and_logs_nobody_in(client: FlaskClient) -> None:
    response = log_in(client, token="not-the-admin-token-at-all")

    assert response.status_code == 401
    assert "token: This is not the admin token." in page_text(response)
    assert client.get("/dashboard/").status_code == 303


def test_a_login_without_a_token_is_a_422_naming_the_field(client: FlaskClient) -> None:
    response = log_in(client, token="")

    assert response.status_code == 422
    assert "token: This field is required." in page_text(response)


@pytest.mark.parametrize("csrf", [None, "", "forged-token", "wrong"])
def test_a_post_without_a_valid_csrf_token_is_refused_and_changes_nothing(
    operator: FlaskClient, company: CompanyWithKey, db_session: Session, csrf: str | None
) -> None:
    if csrf == "wrong":
        # A real token, but of another session: not this one's.
        other = operator.application.test_client()
        csrf = csrf_of(other.get(LOGIN))
    data = {} if csrf is None else {"csrf_token": csrf}

    response = operator.post(f"/dashboard/companies/{company.id}/pause", data=data)

    assert response.status_code == 400
    assert "CSRF" in page_text(response)
    assert stored(db_session, "SELECT paused FROM companies WHERE id = :id", id=company.id) is False


def test_the_login_form_needs_its_csrf_token_too(client: FlaskClient) -> None:
    response = client.post(LOGIN, data={"token": ADMIN_TOKEN})

    assert response.status_code == 400
    assert client.get("/dashboard/").status_code == 303


def test_the_admin_token_never_appears_in_a_page_or_a_url(
    operator: FlaskClient, company: CompanyWithKey
) -> None:
    pages = [
        operator.get("/dashboard/"),
        operator.get("/dashboard/companies"),
        operator.get(f"/dashboard/companies/{company.id}"),
        operator.get(LOGIN, follow_redirects=True),
    ]

    for response in pages:
        assert response.status_code == 200
        assert ADMIN_TOKEN not in response.get_data(as_text=True)
        assert ADMIN_TOKEN not in response.headers.get("Location", "")


def test_the_login_goes_back_to_the_page_asked_for_and_never_to_another_site(
    client: FlaskClient,
) -> None:
    asked = client.get("/dashboard/companies?sort=backlog")
    back = log_in(client, next="/dashboard/companies?sort=backlog")
    client.post("/dashboard/logout", data={"csrf_token": csrf_of(client.get(CHEAP_PAGE))})
    away = [
        log_in(client.application.test_client(), next=target).headers["Location"]
        for target in ("https://evil.example/", "//evil.example/dashboard", "/docs", "/\\evil")
    ]

    assert asked.headers["Location"] == f"{LOGIN}?next=/dashboard/companies?sort%3Dbacklog"
    assert back.headers["Location"] == "/dashboard/companies?sort=backlog"
    assert away == ["/dashboard/"] * 4


def test_a_login_expires_after_its_hours_even_while_the_page_refreshes(
    operator: FlaskClient,
) -> None:
    with operator.session_transaction("/dashboard/") as state:
        state[views.LOGIN_EXPIRES] = time.time() - 1

    response = operator.get("/dashboard/")

    assert response.status_code == 303
    assert response.headers["Location"].startswith(LOGIN)
    # The stale cookie is deleted with that answer.
    assert session_cookie(response)[SESSION_COOKIE_NAME]["expires"].startswith("Thu, 01 Jan 1970")


def test_pages_do_not_extend_the_login_nor_rewrite_the_cookie(operator: FlaskClient) -> None:
    with operator.session_transaction("/dashboard/") as state:
        expires = state[views.LOGIN_EXPIRES]

    responses = [operator.get("/dashboard/"), operator.get("/dashboard/companies")]

    with operator.session_transaction("/dashboard/") as state:
        assert state[views.LOGIN_EXPIRES] == expires
    for response in responses:
        assert response.status_code == 200
        assert not [h for h in response.headers.getlist("Set-Cookie") if SESSION_COOKIE_NAME in h]


def test_rotating_the_admin_token_ends_every_session(
    operator: FlaskClient, main_db_url: str
) -> None:
    rotated = make_test_app(main_db_url, admin_token="a-new-admin-token-9876543210")
    try:
        client = rotated.test_client()
        cookie = operator.get_cookie(SESSION_COOKIE_NAME, path="/dashboard")
        assert cookie is not None
        client.set_cookie(SESSION_COOKIE_NAME, cookie.value, path="/dashboard")

        response = client.get("/dashboard/")

        assert response.status_code == 303
        assert response.headers["Location"].startswith(LOGIN)
    finally:
        database.close(rotated)


def test_the_logout_deletes_the_cookie_and_the_next_page_asks_for_the_login(
    operator: FlaskClient,
) -> None:
    response = act(operator, "/dashboard/logout")

    assert response.status_code == 303
    assert response.headers["Location"] == LOGIN
    assert session_cookie(response)[SESSION_COOKIE_NAME]["expires"].startswith("Thu, 01 Jan 1970")
    assert operator.get("/dashboard/").status_code == 303


def test_without_an_admin_token_the_dashboard_answers_503(main_db_url: str) -> None:
    app = make_test_app(main_db_url, admin_token=None)
    try:
        response = app.test_client().get(LOGIN)

        assert response.status_code == 503
        assert "ADMIN_TOKEN is not configured" in page_text(response)
    finally:
        database.close(app)


@pytest.mark.parametrize(
    "path",
    [
        LOGIN,
        "/dashboard/",
        "/dashboard/companies",
        "/dashboard/companies?sort=nonsense",
        f"/dashboard/companies/{uuid.UUID(int=404)}",  # fixed: the same test id in every worker
        "/dashboard/no-such-page",
        "/dashboard/static/dashboard.js",
    ],
)
def test_every_answer_carries_a_strict_content_security_policy_and_no_framing(
    operator: FlaskClient, path: str
) -> None:
    response = operator.get(path)
    response.close()

    policy = dict(
        part.strip().split(" ", 1)
        for part in response.headers["Content-Security-Policy"].split(";")
    )
    assert policy["default-src"] == "'none'"
    assert policy["script-src"] == "'self'"
    assert policy["style-src"] == "'self'"
    assert policy["frame-ancestors"] == "'none'"
    assert response.headers["X-Frame-Options"] == "DENY"
    assert response.headers["X-Content-Type-Options"] == "nosniff"


class _Markup(HTMLParser):
    """What a page asks the browser to run or style: script tags, inline handlers, styles."""

    def __init__(self) -> None:
        super().__init__()
        self.scripts: list[dict[str, str | None]] = []
        self.inline: list[tuple[str, str]] = []
        self.references: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "script":
            self.scripts.append(found)
        if tag == "style":
            self.inline.append((tag, "<style>"))
        for name, _ in attrs:
            if name.startswith("on") or name == "style":
                self.inline.append((tag, name))
        for name in ("src", "href", "action"):
            value = found.get(name)
            if value:
                self.references.append(value)


def test_no_page_has_an_inline_script_or_style_or_a_reference_to_another_origin(
    operator: FlaskClient, company: CompanyWithKey, make_task: MakeTask
) -> None:
    task = make_task(company.id, status="failed", last_error="boom")
    pages = [
        operator.application.test_client().get(LOGIN + "?next=/dashboard/"),
        operator.get("/dashboard/"),
        operator.get("/dashboard/companies"),
        operator.get(f"/dashboard/companies/{company.id}"),
        operator.get(f"/dashboard/companies/{company.id}/tasks/{task.id}"),
    ]

    for response in pages:
        markup = _Markup()
        markup.feed(response.get_data(as_text=True))
        assert markup.scripts, "each page loads the dashboard's script"
        assert all(script.get("src") for script in markup.scripts), markup.scripts
        assert markup.inline == []
        for reference in markup.references:
            assert reference.startswith(("/", "#")), reference
            assert not reference.startswith("//"), reference


def test_the_static_files_and_the_vendored_chart_library_with_its_licence_are_served(
    client: FlaskClient,
) -> None:
    for name in ("dashboard.js", "dashboard.css", "favicon.svg", "vendor/uplot/uPlot.iife.min.js"):
        response = client.get(f"/dashboard/static/{name}")
        assert response.status_code == 200, name
        response.close()
    licence = client.get("/dashboard/static/vendor/uplot/LICENSE")
    assert "The MIT License" in licence.get_data(as_text=True)
    licence.close()


# ---------------------------------------------------------------------------------------------
# Pages
# ---------------------------------------------------------------------------------------------


def test_the_overview_shows_the_queue_the_workers_holding_leases_and_the_longest_waiting(
    operator: FlaskClient, make_company: MakeCompany, make_task: MakeTask, db_session: Session
) -> None:
    waiting = make_company("dash-overview-waiting")
    insert_tasks(db_session, waiting.id, 3, newest_age_seconds=7200)
    make_task(
        waiting.id, status="processing", locked_by="host-a:4242", attempts=1,
        locked_at=text("now() - interval '3 seconds'"), lease_token=uuid.uuid4(),
    )  # fmt: skip
    make_task(
        waiting.id, status="failed", finished_at=text("now() - interval '2 minutes'"),
        last_error="boom",
    )  # fmt: skip

    response = operator.get("/dashboard/")

    assert response.status_code == 200
    shown = page_text(response)
    assert "Runnable 3 pending tasks due now" in shown
    assert "Waiting for a worker 2 h 0 min oldest of 1 company" in shown
    assert re.search(r"host-a:4242 1 \S*\s*\d+(\.\d)? s ago", shown), shown
    assert 'data-refresh-seconds="5"' in response.get_data(as_text=True)
    assert "Longest waiting Company Oldest wait Backlog dash-overview-waiting" in shown


def test_the_overview_tells_work_waiting_for_workers_from_work_held_by_a_pause_or_a_limit(
    operator: FlaskClient,
    make_company: MakeCompany,
    make_weighted_company: MakeCompany,
    make_task: MakeTask,
    db_session: Session,
) -> None:
    free = make_company("dash-free")
    insert_tasks(db_session, free.id, 2, newest_age_seconds=60)
    paused = make_company("dash-paused")
    insert_tasks(db_session, paused.id, 3, newest_age_seconds=7200)
    db_session.execute(text("UPDATE companies SET paused = true WHERE id = :id"), {"id": paused.id})
    full = make_weighted_company("dash-full", max_in_flight=1)
    insert_tasks(db_session, full.id, 4, newest_age_seconds=600)
    make_task(full.id, status="processing", lease_token=uuid.uuid4(), locked_at=text("now()"))

    response = operator.get("/dashboard/")

    assert response.status_code == 200
    shown = page_text(response)
    assert re.search(r"Waiting for a worker 1 2 1 min \d+ s", shown), shown
    assert "Held: paused 1 3 2 h 0 min" in shown
    # The paused company's two hours are no wait for a worker.
    assert re.search(r"Waiting for a worker 1 min \d+ s oldest of 1 company", shown), shown
    assert re.search(r"Held: at max_in_flight 1 5 10 min \d+ s", shown), shown
    assert "Oldest transaction holding back cleanup:" in shown
    assert re.search(r"tasks [\d,]+ [\d,]+", shown), shown
    assert "company_queues" in shown
    assert "claim_duration_seconds" in shown


def test_the_overview_chart_carries_a_point_per_minute_of_the_last_hour(
    operator: FlaskClient,
) -> None:
    response = operator.get("/dashboard/")

    found = re.search(r"data-series='([^']*)'", response.get_data(as_text=True))
    assert found is not None
    series = json.loads(html.unescape(found.group(1)))
    assert len(series["t"]) == len(series["completed"]) == len(series["failed"])
    assert len(series["t"]) == dashboard.RECENT_MINUTES


def test_the_companies_listing_sorts_by_oldest_wait_and_finds_by_name_or_id(
    operator: FlaskClient, make_company: MakeCompany, db_session: Session
) -> None:
    prefix = f"dash-{uuid.uuid4().hex[:8]}"
    newer, older, idle = (make_company(f"{prefix}-{name}") for name in ("newer", "older", "idle"))
    insert_tasks(db_session, newer.id, 1, newest_age_seconds=60)
    insert_tasks(db_session, older.id, 1, newest_age_seconds=3600)

    longest_first = page_text(operator.get(f"/dashboard/companies?q={prefix}"))
    shortest_first = page_text(
        operator.get(f"/dashboard/companies?q={prefix}&sort=oldest_wait&order=asc")
    )
    by_id = page_text(operator.get(f"/dashboard/companies?q={idle.id}"))

    names = re.compile(rf"{prefix}-(\w+)")
    assert names.findall(longest_first) == ["older", "newer", "idle"]
    assert names.findall(shortest_first) == ["newer", "older", "idle"]
    assert names.findall(by_id) == ["idle"]
    assert "3 companies matching" in longest_first


@pytest.mark.parametrize("column", ["max_in_flight", "max_pending"])
def test_the_companies_listing_sorts_by_a_limit_with_unlimited_as_the_largest(
    operator: FlaskClient, make_company: MakeCompany, db_session: Session, column: str
) -> None:
    prefix = f"dash-{uuid.uuid4().hex[:8]}"
    for name, value in (("ten", 10), ("unlimited", None), ("two", 2)):
        company = make_company(f"{prefix}-{name}")
        db_session.execute(
            text(f"UPDATE companies SET {column} = :value WHERE id = :id"),
            {"value": value, "id": company.id},
        )
    db_session.commit()

    largest_first = operator.get(f"/dashboard/companies?q={prefix}&sort={column}&order=desc")
    smallest_first = operator.get(f"/dashboard/companies?q={prefix}&sort={column}&order=asc")

    names = re.compile(rf"{prefix}-(\w+)")
    assert names.findall(page_text(largest_first)) == ["unlimited", "ten", "two"]
    assert names.findall(page_text(smallest_first)) == ["two", "ten", "unlimited"]
    # Its header is a sort link, as every other column's, and says which way it sorts now.
    page = largest_first.get_data(as_text=True)
    assert f"sort={column}&amp;order=asc" in page
    assert re.search(r'aria-sort="descending">\s*<a [^>]*>Max (in flight|pending) ▼', page)


def test_a_search_for_wildcards_matches_them_literally(
    operator: FlaskClient, make_company: MakeCompany
) -> None:
    make_company("dash-100%_sure")
    make_company("dash-1000-sure")

    shown = page_text(operator.get("/dashboard/companies?q=dash-100%25_"))

    assert "dash-100%_sure" in shown
    assert "dash-1000-sure" not in shown


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("sort=nonsense", "query.sort"),
        ("order=sideways", "query.order"),
        ("page=0", "query.page"),
        ("page=1_0", "query.page"),
        ("page=abc", "query.page"),
        ("q=" + "x" * 201, "query.q"),
        ("q=a%00b", "query.q"),
        ("sort=name&sort=backlog", "query.sort"),
    ],
)
def test_a_bad_listing_parameter_is_a_422_naming_it(
    operator: FlaskClient, query: str, field: str
) -> None:
    response = operator.get(f"/dashboard/companies?{query}")

    assert response.status_code == 422
    assert f"invalid {field}:" in page_text(response)


def test_an_error_is_the_apis_json_body_for_a_client_that_asks_for_json(
    operator: FlaskClient,
) -> None:
    response = operator.get(
        "/dashboard/companies?sort=nonsense", headers={"Accept": "application/json"}
    )

    assert response.status_code == 422
    body = response.get_json()
    assert body["code"] == 422
    assert body["errors"] == {"query": {"sort": [body["errors"]["query"]["sort"][0]]}}
    assert body["message"].startswith("invalid query.sort:")


def test_a_company_page_shows_its_figures_failures_with_their_errors_and_filtered_tasks(
    operator: FlaskClient, company: CompanyWithKey, make_task: MakeTask, db_session: Session
) -> None:
    insert_tasks(db_session, company.id, 1, newest_age_seconds=600)
    make_task(company.id, type="webhook", payload={"url": "https://example.com"},
              status="failed", attempts=5, last_error="webhook answered 500 Internal Server Error",
              finished_at=text("now()"))  # fmt: skip

    everything = page_text(operator.get(f"/dashboard/companies/{company.id}"))
    failed = operator.get(f"/dashboard/companies/{company.id}?status=failed&type=webhook")
    none = page_text(operator.get(f"/dashboard/companies/{company.id}?status=cancelled"))

    assert "Latest failures" in everything
    assert "webhook answered 500 Internal Server Error" in everything
    assert "Oldest runnable wait 10 min 0 s" in everything
    assert everything.count(" pending ") >= 1
    assert failed.status_code == 200
    rows = re.findall(r"<td>\s*<span class=\"badge status-(\w+)\"", failed.get_data(as_text=True))
    assert rows == ["failed"]
    assert "No task matches these filters on this page." in none


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("status=finished", "query.status"),
        ("type=" + "t" * 101, "query.type"),
        ("page=2002", "query.page"),
        ("page=-1", "query.page"),
    ],
)
def test_a_bad_task_filter_is_a_422_naming_it(
    operator: FlaskClient, company: CompanyWithKey, query: str, field: str
) -> None:
    response = operator.get(f"/dashboard/companies/{company.id}?{query}")

    assert response.status_code == 422
    assert f"invalid {field}:" in page_text(response)


def test_an_unknown_company_or_task_is_a_404_page(
    operator: FlaskClient, company: CompanyWithKey
) -> None:
    missing = operator.get(f"/dashboard/companies/{uuid.uuid4()}")
    task = operator.get(f"/dashboard/companies/{company.id}/tasks/{uuid.uuid4()}")
    malformed = operator.get("/dashboard/companies/not-a-uuid")

    assert missing.status_code == 404
    assert "company not found" in page_text(missing)
    assert task.status_code == 404
    assert "task not found" in page_text(task)
    assert malformed.status_code == 404


def test_a_task_of_another_company_is_a_404_under_this_one(
    operator: FlaskClient, make_company: MakeCompany, make_task: MakeTask
) -> None:
    mine, other = make_company("dash-mine"), make_company("dash-other")
    theirs = make_task(other.id)

    response = operator.get(f"/dashboard/companies/{mine.id}/tasks/{theirs.id}")

    assert response.status_code == 404


def test_a_task_page_shows_payload_result_attempts_timeline_and_last_error(
    operator: FlaskClient, company: CompanyWithKey, make_task: MakeTask
) -> None:
    task = make_task(
        company.id, type="sleep", payload={"seconds": 1}, status="completed", attempts=2,
        max_attempts=5, timeout_seconds=31, result={"slept": 1},
        last_error="first attempt: connection reset",
        created_at=text("now() - interval '10 minutes'"),
        started_at=text("now() - interval '9 minutes'"),
        finished_at=text("now() - interval '1 minute'"),
    )  # fmt: skip

    shown = page_text(operator.get(f"/dashboard/companies/{company.id}/tasks/{task.id}"))

    assert "completed" in shown
    assert "Attempts 2 of at most 5" in shown
    assert "Timeout 31 s per attempt" in shown
    assert '"seconds": 1' in shown
    assert '"slept": 1' in shown
    assert "first attempt: connection reset" in shown
    timeline = re.findall(r"\(([^)]*ago)\) (created|first started|finished: completed)", shown)
    assert timeline == [
        ("10 min 0 s ago", "created"),
        ("9 min 0 s ago", "first started"),
        ("1 min 0 s ago", "finished: completed"),
    ]


def test_a_script_in_a_company_name_payload_or_error_is_shown_as_text(
    operator: FlaskClient, db_session: Session, make_task: MakeTask
) -> None:
    evil = insert_company(db_session, "<script>alert('name')</script>")
    task = make_task(
        evil.id, payload={"html": "<script>alert('payload')</script>"}, status="failed",
        last_error="<img src=x onerror=alert('error')>", finished_at=text("now()"),
    )  # fmt: skip

    pages = [
        operator.get(f"/dashboard/companies?q={evil.id}"),
        operator.get(f"/dashboard/companies/{evil.id}"),
        operator.get(f"/dashboard/companies/{evil.id}/tasks/{task.id}"),
        operator.get("/dashboard/"),
    ]

    for response in pages:
        body = response.get_data(as_text=True)
        assert "<script>alert" not in body
        assert "<img src=x" not in body
    assert "&lt;script&gt;alert(&#39;name&#39;)&lt;/script&gt;" in pages[0].get_data(as_text=True)
    assert "&lt;img src=x onerror=alert(&#39;error&#39;)&gt;" in pages[2].get_data(as_text=True)


# ---------------------------------------------------------------------------------------------
# Actions
# ---------------------------------------------------------------------------------------------


def test_pause_and_resume_set_the_company_and_its_queue_and_come_back_to_the_page(
    operator: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    page = f"/dashboard/companies/{company.id}"

    paused = act(operator, f"{page}/pause", next=page)
    paused_state = (
        stored(db_session, "SELECT paused FROM companies WHERE id = :id", id=company.id),
        stored(db_session, "SELECT paused FROM company_queues WHERE company_id = :id",
               id=company.id),
    )  # fmt: skip
    shown = page_text(operator.get(page))
    resumed = act(operator, f"{page}/resume", next=page)

    assert paused.status_code == 303
    assert paused.headers["Location"] == page
    assert paused_state == (True, True)
    assert "Paused acme: no worker starts its tasks now" in shown
    assert "Resume" in shown
    assert resumed.status_code == 303
    assert stored(db_session, "SELECT paused FROM companies WHERE id = :id", id=company.id) is False


def test_an_action_never_redirects_to_another_site(
    operator: FlaskClient, company: CompanyWithKey
) -> None:
    response = act(
        operator, f"/dashboard/companies/{company.id}/pause", next="https://evil.example/"
    )

    assert response.headers["Location"] == f"/dashboard/companies/{company.id}"


def test_pausing_an_unknown_company_is_a_404(operator: FlaskClient) -> None:
    response = act(operator, f"/dashboard/companies/{uuid.uuid4()}/pause")

    assert response.status_code == 404
    assert "company not found" in page_text(response)


def test_the_limits_form_sets_weight_and_limits_and_blank_means_unlimited(
    operator: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    response = act(
        operator,
        f"/dashboard/companies/{company.id}/limits",
        weight="7",
        max_in_flight="3",
        max_pending="",
    )

    assert response.status_code == 303
    row = db_session.execute(
        text("SELECT weight, max_in_flight, max_pending FROM companies WHERE id = :id"),
        {"id": company.id},
    ).one()
    assert tuple(row) == (7, 3, None)
    assert "Saved the limits of acme." in page_text(operator.get(response.headers["Location"]))


@pytest.mark.parametrize(
    ("form", "field", "why"),
    [
        ({"weight": ""}, "weight", "This field is required."),
        ({"weight": "0"}, "weight", "Number must be between 1 and 1000."),
        ({"weight": "1001"}, "weight", "Number must be between 1 and 1000."),
        ({"weight": "1_0"}, "weight", "Not a valid integer value."),
        ({"weight": "2.5"}, "weight", "Not a valid integer value."),
        ({"weight": "٣"}, "weight", "Not a valid integer value."),
        ({"weight": "9" * 5000}, "weight", "Not a valid integer value."),
        ({"max_in_flight": "0"}, "max_in_flight", "Number must be between 1 and 100000."),
        ({"max_pending": "10000001"}, "max_pending", "Number must be between 1 and 10000000."),
        ({"max_pending": "lots"}, "max_pending", "Not a valid integer value."),
    ],
)
def test_a_bad_limit_is_a_422_naming_the_field_and_changes_nothing(
    operator: FlaskClient,
    company: CompanyWithKey,
    *,
    db_session: Session,
    form: dict[str, str],
    field: str,
    why: str,
) -> None:
    sent = {"weight": "2", "max_in_flight": "", "max_pending": "", **form}

    response = act(operator, f"/dashboard/companies/{company.id}/limits", **sent)

    assert response.status_code == 422
    assert f"{field}: {why}" in page_text(response)
    row = db_session.execute(
        text("SELECT weight, max_in_flight FROM companies WHERE id = :id"), {"id": company.id}
    ).one()
    assert tuple(row) == (1, None)


@pytest.mark.parametrize("value", ["abc", "1_0", "9" * 5000])
def test_a_limit_that_is_no_integer_gets_one_message_not_also_a_range_one(
    operator: FlaskClient, company: CompanyWithKey, value: str
) -> None:
    sent = {"weight": value, "max_in_flight": value, "max_pending": ""}

    response = act(operator, f"/dashboard/companies/{company.id}/limits", **sent)

    assert response.status_code == 422
    shown = page_text(response)
    assert re.findall(r"(weight|max_in_flight|max_pending): ([^.]*\.)", shown) == [
        ("weight", "Not a valid integer value."),
        ("max_in_flight", "Not a valid integer value."),
    ]


def test_the_backlog_and_runnable_figures_say_what_they_count(
    operator: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    insert_tasks(db_session, company.id, 1)  # so that both rankings list it
    pages = [operator.get(path).get_data(as_text=True) for path in (
        "/dashboard/", "/dashboard/companies", f"/dashboard/companies/{company.id}",
    )]  # fmt: skip

    backlog = "Unfinished tasks: pending (due now or scheduled for later) plus processing"
    runnable = "Pending tasks due now (not scheduled for later, not backing off)"
    overview, listing, page = pages
    # Both rankings' column, "Largest backlogs", and the column of "Why due work waits".
    assert overview.count(f'title="{backlog}') == 4
    assert overview.count(f'title="{runnable}') == 1
    assert listing.count(f'title="{backlog}') == 1
    assert page.count(f'title="{backlog}') == page.count(f'title="{runnable}') == 1


def test_retry_makes_a_failed_task_pending_and_runnable_now(
    operator: FlaskClient, company: CompanyWithKey, make_task: MakeTask, db_session: Session
) -> None:
    task = make_task(company.id, status="failed", attempts=5, last_error="boom",
                     finished_at=text("now()"))  # fmt: skip
    path = f"/dashboard/companies/{company.id}/tasks/{task.id}"

    response = act(operator, f"{path}/retry", next=path)

    assert response.status_code == 303
    assert response.headers["Location"] == path
    row = db_session.execute(
        text("SELECT status, attempts FROM tasks WHERE id = :id"), {"id": task.id}
    ).one()
    assert tuple(row) == ("pending", 0)
    assert f"Task {task.id} is pending again" in page_text(operator.get(path))


def test_cancel_makes_a_pending_task_cancelled(
    operator: FlaskClient, company: CompanyWithKey, make_task: MakeTask, db_session: Session
) -> None:
    task = make_task(company.id)

    response = act(operator, f"/dashboard/companies/{company.id}/tasks/{task.id}/cancel")

    assert response.status_code == 303
    assert stored(db_session, "SELECT status FROM tasks WHERE id = :id", id=task.id) == "cancelled"


@pytest.mark.parametrize(
    ("status", "action", "why"),
    [
        ("completed", "retry", "cannot retry a task in status 'completed'"),
        ("pending", "retry", "cannot retry a task in status 'pending'"),
        ("failed", "cancel", "cannot cancel a task in status 'failed'"),
    ],
)
def test_an_action_the_tasks_status_forbids_is_a_409_and_changes_nothing(
    operator: FlaskClient,
    company: CompanyWithKey,
    *,
    make_task: MakeTask,
    db_session: Session,
    status: str,
    action: str,
    why: str,
) -> None:
    task = make_task(company.id, status=status)

    response = act(operator, f"/dashboard/companies/{company.id}/tasks/{task.id}/{action}")

    assert response.status_code == 409
    assert why in page_text(response)
    assert stored(db_session, "SELECT status FROM tasks WHERE id = :id", id=task.id) == status


def test_an_action_on_an_unknown_task_is_a_404(
    operator: FlaskClient, company: CompanyWithKey
) -> None:
    response = act(operator, f"/dashboard/companies/{company.id}/tasks/{uuid.uuid4()}/retry")

    assert response.status_code == 404
    assert "task not found" in page_text(response)


def test_a_retry_beyond_the_backlog_quota_is_a_429_and_changes_nothing(
    operator: FlaskClient, company: CompanyWithKey, make_task: MakeTask, db_session: Session
) -> None:
    make_task(company.id)
    failed = make_task(company.id, status="failed", finished_at=text("now()"))
    db_session.execute(
        text("UPDATE companies SET max_pending = 1 WHERE id = :id"), {"id": company.id}
    )
    db_session.commit()

    response = act(operator, f"/dashboard/companies/{company.id}/tasks/{failed.id}/retry")

    assert response.status_code == 429
    assert response.headers["Retry-After"]
    assert "backlog quota exceeded: 1 unfinished tasks" in page_text(response)
    assert stored(db_session, "SELECT status FROM tasks WHERE id = :id", id=failed.id) == "failed"


@pytest.fixture
def slow_app(fresh_db_url: str) -> Iterator[Flask]:
    """An app on a database of its own whose page queries may run 200 ms at most."""
    app = make_test_app(fresh_db_url, stats_timeout_ms=200)
    yield app
    database.close(app)


def test_a_page_whose_query_runs_past_the_timeout_is_a_503_with_retry_after(
    slow_app: Flask, fresh_engine: Engine
) -> None:
    client = slow_app.test_client()
    assert log_in(client).status_code == 303
    # Another transaction holds the counters: the listing's read waits for it.
    with fresh_engine.connect() as blocker, blocker.begin():
        blocker.execute(text("LOCK TABLE company_backlogs IN ACCESS EXCLUSIVE MODE"))
        started = time.monotonic()

        response = client.get("/dashboard/companies")

        waited = time.monotonic() - started
    assert response.status_code == 503
    assert response.headers["Retry-After"] == str(views.RETRY_AFTER_SECONDS)
    assert "took longer than 200 ms (STATS_TIMEOUT_MS)" in page_text(response)
    assert waited < 5
    assert client.get("/dashboard/companies").status_code == 200


# ---------------------------------------------------------------------------------------------
# The statements (db.dashboard)
# ---------------------------------------------------------------------------------------------


def test_the_series_counts_completed_and_failed_tasks_per_minute(
    db_session: Session, company: CompanyWithKey, make_task: MakeTask
) -> None:
    for minutes_ago, status in ((1, "completed"), (1, "completed"), (1, "failed"),
                                (5, "failed"), (61, "completed"), (3, "cancelled"),
                                (0, "completed")):  # fmt: skip
        make_task(
            company.id, status=status,
            finished_at=text(f"date_trunc('minute', now()) - interval '{minutes_ago} minutes'"),
        )  # fmt: skip

    series = dashboard.finished_per_minute(driver_connection(db_session))

    assert series.window.complete
    assert len(series.minutes) == dashboard.RECENT_MINUTES
    by_age = {
        round((series.window.now - m.minute).total_seconds() / 60): (m.completed, m.failed)
        for m in series.minutes
    }
    assert by_age[1] == (2, 1)
    assert by_age[5] == (0, 1)
    assert by_age[3] == (0, 0), "a cancelled task is neither"
    assert sum(m.completed + m.failed for m in series.minutes) == 4, "out: over an hour ago, now"


def test_the_series_read_past_its_limit_covers_only_the_minutes_read_in_full(
    db_session: Session, company: CompanyWithKey
) -> None:
    db_session.execute(
        text(
            "INSERT INTO tasks (company_id, type, payload, status, finished_at) "
            "SELECT :id, 'noop', '{}', 'completed', "
            "       date_trunc('minute', now()) - make_interval(mins => g % 10) "
            "FROM generate_series(1, 100) AS g"
        ),
        {"id": company.id},
    )

    series = dashboard.finished_per_minute(driver_connection(db_session), recent_limit=25)

    assert not series.window.complete
    # 10 a minute, newest first: 25 rows reach into the third minute, which is left out, and
    # the current one is not shown.
    assert [m.completed for m in series.minutes] == [10]
    assert series.window.since == series.window.now - dt.timedelta(minutes=1)


def test_lease_holders_list_the_oldest_heartbeat_first_with_their_counts(
    db_session: Session, company: CompanyWithKey, claimed_task: MakeTask
) -> None:
    claimed_task(company.id, locked_by="host-b:2", locked_at=text("now() - interval '1 s'"))
    claimed_task(company.id, locked_by="host-a:1", locked_at=text("now() - interval '30 s'"))
    claimed_task(company.id, locked_by="host-a:1", locked_at=text("now() - interval '2 s'"))

    holders = dashboard.lease_holders(driver_connection(db_session))

    assert (holders.holders, holders.tasks) == (2, 3)
    assert [(h.locked_by, h.tasks, round(h.oldest_heartbeat_seconds)) for h in holders.listed] == [
        ("host-a:1", 2, 30),
        ("host-b:2", 1, 1),
    ]


def test_the_listing_counts_backlog_in_flight_and_failures_per_company(
    db_session: Session, make_company: MakeCompany, make_task: MakeTask, claimed_task: MakeTask
) -> None:
    prefix = f"dash-{uuid.uuid4().hex[:8]}"
    busy = make_company(f"{prefix}-busy")
    make_company(f"{prefix}-quiet")
    insert_tasks(db_session, busy.id, 4, newest_age_seconds=30)
    claimed_task(busy.id)
    make_task(busy.id, status="failed", finished_at=text("now()"))
    make_task(busy.id, status="failed", finished_at=text("now() - interval '2 hours'"))

    page = dashboard.list_companies(
        driver_connection(db_session), sort=dashboard.CompanySort.BACKLOG, search=prefix
    )

    assert page.total == 2
    first, second = page.rows
    assert (first.name, first.backlog, first.in_flight, first.failed) == (f"{prefix}-busy", 5, 1, 1)
    assert first.oldest_wait_seconds is not None
    assert 32 < first.oldest_wait_seconds < 40
    assert (second.name, second.backlog, second.in_flight, second.failed) == (
        f"{prefix}-quiet", 0, 0, 0,
    )  # fmt: skip
    assert second.oldest_wait_seconds is None


@pytest.mark.parametrize("sort", list(dashboard.CompanySort))
@pytest.mark.parametrize("descending", [True, False])
def test_every_sort_pages_through_every_company_once(
    db_session: Session, sort: dashboard.CompanySort, descending: bool
) -> None:
    prefix = f"dash-{uuid.uuid4().hex[:8]}"
    ids = {insert_company(db_session, f"{prefix}-{i}").id for i in range(5)}
    seen = []
    for offset in range(0, 6, 2):
        page = dashboard.list_companies(
            driver_connection(db_session), sort=sort, descending=descending, search=prefix,
            limit=2, offset=offset,
        )  # fmt: skip
        seen += [row.id for row in page.rows]

    assert sorted(seen) == sorted(ids)


def test_recent_failures_read_only_the_newest_tasks_of_the_company(
    db_session: Session, company: CompanyWithKey, make_task: MakeTask
) -> None:
    old = make_task(company.id, status="failed", created_at=text("now() - interval '1 day'"))
    insert_tasks(db_session, company.id, 3)
    new = make_task(company.id, status="failed", created_at=text("now() + interval '1 s'"))

    found = dashboard.recent_failures(driver_connection(db_session), company.id, scan=4)
    everything = dashboard.recent_failures(driver_connection(db_session), company.id, scan=10)

    assert [task.id for task in found] == [new.id]
    assert [task.id for task in everything] == [new.id, old.id]


# ---------------------------------------------------------------------------------------------
# Bounded cost: 20,000 companies and 1M tasks
# ---------------------------------------------------------------------------------------------

# Companies `first..last` of the workload (ids and names derived from their number).
_SEED_COMPANIES = """
INSERT INTO companies (id, name, created_at, weight, max_in_flight, paused)
SELECT md5('dash-company-' || i)::uuid, 'tenant-' || lpad(CAST(i AS text), 5, '0'),
       now() - interval '30 days' + i * interval '1 s',
       1 + i % 5, CASE WHEN i % 7 = 0 THEN 10 END, i % 100 = 0
FROM generate_series(CAST(:first AS int), CAST(:last AS int)) AS i
"""
# :tasks tasks created one every 600 ms up to now (a week for 1M), the first :big of them of
# tenant 1, the rest spread over tenants 1..:companies. 60% completed and 5% failed (finished
# within the last 2 hours), 34.8% pending (a tenth of those scheduled for tomorrow), 0.2%
# processing under 20 workers' leases. Task numbers :writer, :writer + :writers, ... up to
# :tasks, in one statement: the triggers keep the counters.
_SEED_TASKS = """
INSERT INTO tasks (company_id, type, payload, status, attempts, max_attempts, run_after,
                   created_at, updated_at, started_at, finished_at, last_error, locked_by,
                   locked_at, lease_token)
SELECT md5('dash-company-' || company)::uuid, 'noop', '{}'::jsonb, status,
       CASE WHEN status = 'pending' THEN 0 ELSE 1 END, 5,
       CASE WHEN delayed THEN now() + interval '1 day' ELSE created_at END,
       created_at, created_at,
       CASE WHEN status IN ('completed', 'failed', 'processing') THEN created_at END,
       CASE WHEN status IN ('completed', 'failed') THEN now() - r2 * interval '2 hours' END,
       CASE WHEN status = 'failed' THEN 'webhook answered 500 Internal Server Error' END,
       CASE WHEN status = 'processing' THEN 'host-' || (g % 20) || ':' || (1000 + g % 20) END,
       CASE WHEN status = 'processing' THEN now() - r2 * interval '10 s' END,
       CASE WHEN status = 'processing' THEN gen_random_uuid() END
FROM (
    SELECT g,
           CASE WHEN g <= :big THEN 1 ELSE 1 + g % CAST(:companies AS int) END AS company,
           CASE WHEN r < 0.6 THEN 'completed' WHEN r < 0.65 THEN 'failed'
                WHEN r < 0.998 THEN 'pending' ELSE 'processing' END AS status,
           random() < 0.1 AS delayed, random() AS r2,
           now() - (CAST(:tasks AS int) - g) * interval '600 ms' AS created_at
    FROM (SELECT g, random() AS r
          FROM generate_series(CAST(:writer AS int), CAST(:tasks AS int),
                               CAST(:writers AS int)) AS g) AS x
) AS y
"""
# The ids the seed gives tenants 1 and 17 (md5 as a uuid: an id, not a digest of secrets).
BIG_TENANT = uuid.UUID(hashlib.md5(b"dash-company-1").hexdigest())
SMALL_TENANT = uuid.UUID(hashlib.md5(b"dash-company-17").hexdigest())


# Connections inserting the tasks at once. One statement runs on one core, and inserting the
# rows into the table and its indexes is most of the seed: 1M tasks took 36 s in one
# statement, 22 s in two. Each takes every other task, so the table's pages still follow
# created_at as they do when tasks arrive one by one (correlation 0.999 either way).
SEED_WRITERS = 2


def seed_workload(
    engine: Engine, *, first: int, last: int, tasks: int, big: int, writers: int = 1
) -> None:
    """Add companies `first..last` and `tasks` tasks over companies 1..last, then analyze.

    The tasks come from `writers` concurrent transactions (`SEED_WRITERS`).
    """
    with engine.begin() as conn:
        conn.execute(text("SELECT setseed(0.42)"))
        conn.execute(text(_SEED_COMPANIES), {"first": first, "last": last})

    def insert(writer: int) -> None:
        with engine.begin() as conn:
            conn.execute(text("SELECT setseed(:seed)"), {"seed": 0.42 - writer / 100})
            conn.execute(
                text(_SEED_TASKS),
                {"tasks": tasks, "big": big, "companies": last, "writer": writer,
                 "writers": writers},
            )  # fmt: skip

    with ThreadPoolExecutor(writers) as pool:
        list(pool.map(insert, range(1, writers + 1)))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE"))


def dashboard_pages(client: FlaskClient, engine: Engine) -> dict[str, str]:
    """Every page an operator opens, by name: path."""
    with engine.connect() as conn:
        failed = conn.execute(
            text("SELECT id FROM tasks WHERE company_id = :id AND status = 'failed' LIMIT 1"),
            {"id": BIG_TENANT},
        ).scalar_one()
        companies = conn.execute(text("SELECT count(*) FROM companies")).scalar_one()
    last_page = max(1, -(-companies // views.PAGE_SIZE))
    big = f"/dashboard/companies/{BIG_TENANT}"
    return {
        "overview": "/dashboard/",
        "companies by oldest wait": "/dashboard/companies",
        "companies by backlog": "/dashboard/companies?sort=backlog",
        "companies by failed": "/dashboard/companies?sort=failed",
        "companies by name, last page": f"/dashboard/companies?sort=name&page={last_page}",
        "companies found by name": "/dashboard/companies?q=tenant-0001",
        "largest tenant": big,
        "largest tenant, failed tasks": f"{big}?status=failed",
        "largest tenant, page 100": f"{big}?page=100",
        "small tenant": f"/dashboard/companies/{SMALL_TENANT}",
        "a task": f"{big}/tasks/{failed}",
    }


def median_ms(client: FlaskClient, path: str, runs: int = 5) -> float:
    """The median time of `runs` GETs of `path` after one warm-up, in milliseconds."""
    timings = []
    for attempt in range(runs + 1):
        started = time.perf_counter()
        response = client.get(path)
        elapsed = (time.perf_counter() - started) * 1000
        assert response.status_code == 200, (path, page_text(response)[:300])
        if attempt:
            timings.append(elapsed)
    return statistics.median(timings)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_every_page_answers_within_its_bounded_cost(
    fresh_db_url: str, fresh_engine: Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    app = make_test_app(fresh_db_url)
    try:
        client = app.test_client()
        assert log_in(client).status_code == 303
        # The reference: 20 companies and 1,000 tasks, the same shape.
        seed_workload(fresh_engine, first=1, last=20, tasks=1_000, big=200)
        small = {name: median_ms(client, path) for name, path in dashboard_pages(
            client, fresh_engine).items()}  # fmt: skip
        started = time.perf_counter()
        seed_workload(fresh_engine, first=21, last=20_000, tasks=999_000, big=199_800,
                      writers=SEED_WRITERS)  # fmt: skip
        seeded = time.perf_counter() - started
        large = {name: median_ms(client, path) for name, path in dashboard_pages(
            client, fresh_engine).items()}  # fmt: skip
    finally:
        database.close(app)

    with capsys.disabled():
        print(f"\n\ndashboard pages, median of 5 (ms); 20,000 companies and 1M tasks seeded "
              f"in {seeded:.0f} s")  # fmt: skip
        print(f"{'page':<32}{'20 / 1k':>10}{'20k / 1M':>10}{'ratio':>8}")
        for name, measured in large.items():
            ratio = measured / small[name]
            print(f"{name:<32}{small[name]:>10.1f}{measured:>10.1f}{ratio:>8.1f}")


# -- API keys (issue 28) ----------------------------------------------------------------------


def active_key_hashes(session: Session, company_id: uuid.UUID) -> set[str]:
    rows = session.execute(
        text(
            "SELECT key_hash FROM api_keys WHERE company_id = :id AND revoked_at IS NULL "
            "AND (expires_at IS NULL OR expires_at > now())"
        ),
        {"id": company_id},
    ).scalars()
    return set(rows)


def test_a_company_page_lists_its_keys_without_their_secrets(
    operator: FlaskClient, company: CompanyWithKey
) -> None:
    response = operator.get(f"/dashboard/companies/{company.id}")
    shown = page_text(response)

    assert "API keys" in shown
    assert "active" in shown
    assert "Issue a new key" in shown
    assert company.api_key not in response.get_data(as_text=True)


def test_issuing_a_key_shows_its_secret_once_and_it_works(
    operator: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    response = act(operator, f"/dashboard/companies/{company.id}/keys", expires_in_days="30")

    assert response.status_code == 201
    assert response.headers["Cache-Control"] == "no-store"
    secret = re.search(r'id="new-api-key"[^>]*>([^<]+)<', response.get_data(as_text=True))
    assert secret is not None
    key = secret.group(1)
    assert "only time it is shown" in page_text(response)
    assert auth.hash_api_key(key) in active_key_hashes(db_session, company.id)
    assert len(active_key_hashes(db_session, company.id)) == 2
    assert key not in operator.get(f"/dashboard/companies/{company.id}").get_data(as_text=True)
    # The secret never went into the session cookie (no flash message carries it).
    cookie = operator.get_cookie(SESSION_COOKIE_NAME, path="/dashboard")
    assert cookie is None or key not in cookie.value


@pytest.mark.parametrize("days", ["0", "lots", "99999"])
def test_a_bad_expiry_is_a_422_naming_the_field_and_issues_nothing(
    operator: FlaskClient, company: CompanyWithKey, db_session: Session, days: str
) -> None:
    response = act(operator, f"/dashboard/companies/{company.id}/keys", expires_in_days=days)

    assert response.status_code == 422
    assert "expires_in_days:" in page_text(response)
    assert len(active_key_hashes(db_session, company.id)) == 1


def test_rotating_a_key_keeps_the_old_one_for_the_overlap_and_revoking_ends_it(
    operator: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    old_hash = auth.hash_api_key(company.api_key)
    key_id = stored(db_session, "SELECT id FROM api_keys WHERE key_hash = :h", h=old_hash)
    keys = f"/dashboard/companies/{company.id}/keys/{key_id}"

    rotated = act(operator, f"{keys}/rotate", overlap_hours="2")

    assert rotated.status_code == 201
    assert "works until" in page_text(rotated)
    expires_in = stored(
        db_session,
        "SELECT extract(epoch FROM expires_at - now()) FROM api_keys WHERE id = :id",
        id=key_id,
    )
    assert 7000 < float(expires_in) <= 7200  # type: ignore[arg-type]
    assert old_hash in active_key_hashes(db_session, company.id)
    assert len(active_key_hashes(db_session, company.id)) == 2

    revoked = act(operator, f"{keys}/revoke", next=f"/dashboard/companies/{company.id}")

    assert revoked.status_code == 303
    assert old_hash not in active_key_hashes(db_session, company.id)
    assert f"Revoked API key {key_id}." in page_text(operator.get(revoked.headers["Location"]))


def test_key_actions_need_the_csrf_token(
    operator: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    key_id = stored(
        db_session,
        "SELECT id FROM api_keys WHERE key_hash = :h",
        h=auth.hash_api_key(company.api_key),
    )
    base = f"/dashboard/companies/{company.id}/keys"
    for path in (base, f"{base}/{key_id}/rotate", f"{base}/{key_id}/revoke"):
        assert operator.post(path, data={}).status_code == 400
    assert active_key_hashes(db_session, company.id) == {auth.hash_api_key(company.api_key)}


def test_revoking_a_key_of_another_company_is_a_404(
    operator: FlaskClient, company: CompanyWithKey, make_company: MakeCompany, db_session: Session
) -> None:
    other = make_company("other")
    other_key = stored(
        db_session,
        "SELECT id FROM api_keys WHERE key_hash = :h",
        h=auth.hash_api_key(other.api_key),
    )

    response = act(operator, f"/dashboard/companies/{company.id}/keys/{other_key}/revoke")

    assert response.status_code == 404
    assert auth.hash_api_key(other.api_key) in active_key_hashes(db_session, other.id)
