"""The dashboard in a real browser (issue 14): headless Chromium driven by Playwright.

An operator logs in, sees the overview refresh itself, opens a company, pauses it and sees a
real worker supervisor (`python -m worker`) leave its tasks alone while another company's
run, retries its failed task, resumes it and sees its tasks run, and logs out. Every request
the pages make goes to the app: any other is refused and fails the test; so does any console
error or uncaught exception (a script the Content-Security-Policy blocked shows there too).
A screenshot of each page is saved: in `DASHBOARD_SCREENSHOT_DIR` when set (the ones in
`docs/dashboard/` come from `DASHBOARD_SCREENSHOT_DIR=docs/dashboard`), else in the test's
temporary directory.

Playwright drives the Debian package's Chromium (`executable_path`), never a browser build of
its own; without Chromium the tests skip, except in CI (`CI=true`), where they fail
(`tests/system_tools.py`).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
from playwright.sync_api import Browser, ConsoleMessage, Page, Request, Route, sync_playwright
from sqlalchemy import Engine, text

from tests import system_tools
from tests.conftest import ADMIN_TOKEN, serve_app
from tests.factories import CompanyWithKey, insert_company
from tests.supervisor_harness import StartSupervisor, wait_for

pytestmark = [pytest.mark.timeout(180)]

SCREENSHOT_DIR_ENV = "DASHBOARD_SCREENSHOT_DIR"
VIEWPORT = {"width": 1280, "height": 860}
# Playwright's waits, in milliseconds.
WAIT_MS = 15_000

# The tenants of the screenshots: names, weights, and what their history looks like.
TENANTS = (
    ("Acme Corp", 3),
    ("Globex", 2),
    ("Initech", 1),
    ("Umbrella", 5),
    ("Hooli", 1),
    ("Stark Industries", 4),
    ("Wayne Enterprises", 2),
    ("Soylent", 1),
    ("Cyberdyne", 2),
    ("Tyrell", 1),
)


@dataclass
class BrowserLog:
    """What a page did besides rendering: its requests, console errors and exceptions."""

    origin: str
    requests: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def watch(self, page: Page) -> None:
        """Record `page`'s requests, console errors and uncaught exceptions; refuse any
        request to another origin."""
        page.on("request", self._request)
        page.on("console", self._console)
        page.on("pageerror", lambda error: self.errors.append(f"pageerror: {error}"))
        page.route("**/*", self._route)

    def _request(self, request: Request) -> None:
        self.requests.append(request.url)

    def _console(self, message: ConsoleMessage) -> None:
        if message.type in ("error", "warning"):
            self.errors.append(f"console {message.type}: {message.text}")

    def _route(self, route: Route) -> None:
        url = route.request.url
        if url == self.origin or url.startswith(self.origin + "/"):
            route.continue_()
        else:
            self.refused.append(url)
            route.abort()

    def check(self) -> None:
        """Fail when a request left the app, or a console error or exception happened."""
        assert self.refused == [], f"requests to other origins: {self.refused}"
        foreign = [url for url in self.requests if not url.startswith(self.origin + "/")]
        assert foreign == []
        assert self.errors == []


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """Headless Chromium of the Debian package, driven by Playwright."""
    chromium = system_tools.require("chromium", package="chromium")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=chromium,
            # Root (CI) cannot start the sandbox; containers have a tiny /dev/shm.
            args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"],
        )
        yield launched
        launched.close()


@pytest.fixture
def screenshots(tmp_path: Path) -> Path:
    """Where this test's screenshots go (module docstring)."""
    configured = os.environ.get(SCREENSHOT_DIR_ENV, "").strip()
    directory = Path(configured) if configured else tmp_path / "screenshots"
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def seed_history(engine: Engine, tenants: dict[str, CompanyWithKey]) -> None:
    """An hour of finished tasks, a delayed backlog and a paused tenant with waiting work.

    What an operator's overview looks like on a working day: per minute, each tenant's
    completions in a wave of its own and a few failures; scheduled work for tomorrow; Hooli
    paused with a runnable backlog of 47 minutes (no worker takes it); a long task of Stark
    Industries that a worker holds.
    """
    ids = [str(company.id) for company in tenants.values()]
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO tasks (company_id, type, payload, status, attempts, created_at, "
                "                   updated_at, run_after, started_at, finished_at, last_error) "
                "SELECT c.id, s.type, '{}', s.status, s.attempts, f.at - interval '2 s', f.at, "
                "       f.at - interval '2 s', f.at - interval '1 s', f.at, s.error "
                "FROM unnest(CAST(:ids AS uuid[])) WITH ORDINALITY AS c(id, k), "
                "     generate_series(1, 60) AS m, "
                "     LATERAL (SELECT now() - make_interval(mins => m, secs => k) AS at) AS f, "
                "     LATERAL (SELECT (ARRAY['noop', 'send_email', 'webhook'])[1 + n % 3] AS type, "
                "                     'completed' AS status, 1 AS attempts, NULL AS error "
                "              FROM generate_series(1, 8 + CAST(round(6 * sin(CAST(m AS float8) "
                "                                   / 7 + k)) AS int)) AS n "
                "              UNION ALL "
                "              SELECT 'webhook', 'failed', 5, "
                "                     'webhook answered 503 Service Unavailable' "
                "              FROM generate_series(1, (m + k) % 7 / 5)) AS s"
            ),
            {"ids": ids},
        )
        conn.execute(
            text(
                "INSERT INTO tasks (company_id, type, payload, run_after, created_at) "
                "SELECT c.id, 'noop', '{}', now() + interval '1 day', now() "
                "FROM unnest(CAST(:ids AS uuid[])) WITH ORDINALITY AS c(id, k), "
                "     generate_series(1, 3 * CAST(c.k AS int))"
            ),
            {"ids": ids},
        )
        hooli = tenants["Hooli"].id
        conn.execute(text("UPDATE companies SET paused = true WHERE id = :id"), {"id": hooli})
        conn.execute(
            text(
                "INSERT INTO tasks (company_id, type, payload, created_at, run_after) "
                "SELECT :id, 'noop', '{}', now() - interval '47 minutes' + g * interval '1 s', "
                "       now() - interval '47 minutes' + g * interval '1 s' "
                "FROM generate_series(1, 140) AS g"
            ),
            {"id": hooli},
        )
        # Claimed first and alone (nothing else is runnable but the paused tenant's): one
        # child holds its lease, heartbeating, while the other runs everything else.
        conn.execute(
            text(
                "INSERT INTO tasks (company_id, type, payload, timeout_seconds) "
                "VALUES (:id, 'sleep', '{\"seconds\": 120}', 150)"
            ),
            {"id": tenants["Stark Industries"].id},
        )
        for name, weight in TENANTS:
            conn.execute(
                text("UPDATE companies SET weight = :w, max_pending = 100000 WHERE id = :id"),
                {"w": weight, "id": tenants[name].id},
            )


def failed_task(engine: Engine, company: CompanyWithKey) -> uuid.UUID:
    """A task of `company` that failed for good: its workers kept dying (a poison pill)."""
    with engine.begin() as conn:
        task_id: uuid.UUID = conn.execute(
            text(
                "INSERT INTO tasks (company_id, type, payload, status, attempts, max_attempts, "
                "                   created_at, run_after, started_at, finished_at, "
                "                   updated_at, last_error, timeout_seconds) "
                "VALUES (:id, 'sleep', '{\"seconds\": 0.2}', 'failed', 5, 5, "
                "        now() - interval '25 minutes', now() - interval '25 minutes', "
                "        now() - interval '24 minutes', now() - interval '3 minutes', "
                "        now() - interval '3 minutes', "
                "        'worker lost (lease expired) after 5 attempts (last holder "
                "worker-7:3112)', 31) "
                "RETURNING id"
            ),
            {"id": company.id},
        ).scalar_one()
    return task_id


def statuses(engine: Engine, task_ids: list[uuid.UUID]) -> dict[str, int]:
    """How many of these tasks are in each status."""
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT status, count(*) FROM tasks WHERE id = ANY(:ids) GROUP BY status"),
            {"ids": task_ids},
        ).all()
    return {str(status): int(count) for status, count in rows}


def claimed_ever(engine: Engine, task_ids: list[uuid.UUID]) -> int:
    """How many of these tasks a worker has claimed at least once."""
    with engine.connect() as conn:
        claimed: int = conn.execute(
            text("SELECT count(*) FROM tasks WHERE id = ANY(:ids) AND attempts > 0"),
            {"ids": task_ids},
        ).scalar_one()
    return claimed


def create_tasks(base: str, company: CompanyWithKey, count: int) -> list[uuid.UUID]:
    """Create `count` noop tasks through the API, as the tenant's producer does."""
    created = []
    for _ in range(count):
        response = requests.post(
            f"{base}/companies/{company.id}/tasks",
            json={"type": "noop", "payload": {}},
            headers=company.headers,
            timeout=10,
        )
        assert response.status_code == 201, response.text
        created.append(uuid.UUID(response.json()["id"]))
    return created


def shoot(page: Page, directory: Path, name: str, *, full_page: bool = True) -> None:
    """Save a screenshot of the page (the whole page, or what the window shows) as
    `<name>.png`."""
    page.screenshot(path=str(directory / f"{name}.png"), full_page=full_page)


def log_in(page: Page, origin: str) -> None:
    """Open the dashboard, meet the login form, enter the admin token."""
    page.goto(f"{origin}/dashboard/")
    page.wait_for_url(f"{origin}/dashboard/login?next=/dashboard/")
    page.fill("#token", ADMIN_TOKEN)
    page.click("form button[type=submit]")
    page.wait_for_url(f"{origin}/dashboard/")


def flash(page: Page) -> str:
    """The flash message the page shows."""
    text_: str = page.inner_text("p.flash", timeout=WAIT_MS)
    return text_


@pytest.mark.slow
def test_an_operator_pauses_retries_and_resumes_a_tenant_in_the_browser(
    browser: Browser,
    fresh_db_url: str,
    fresh_engine: Engine,
    supervisor: StartSupervisor,
    screenshots: Path,
) -> None:
    tenants = {name: insert_company(fresh_engine, name) for name, _ in TENANTS}
    acme, globex = tenants["Acme Corp"], tenants["Globex"]
    seed_history(fresh_engine, tenants)
    poison = failed_task(fresh_engine, acme)
    worker = supervisor("--concurrency", "2")
    worker.wait_ready(2)

    with serve_app(fresh_db_url) as port:
        origin = f"http://127.0.0.1:{port}"
        context = browser.new_context(viewport=VIEWPORT)  # type: ignore[arg-type]
        page = context.new_page()
        page.set_default_timeout(WAIT_MS)
        log = BrowserLog(origin)
        log.watch(page)
        try:
            # The login form, then the overview, which draws its chart and refreshes itself.
            page.goto(f"{origin}/dashboard/")
            page.wait_for_url(f"{origin}/dashboard/login?next=/dashboard/")
            shoot(page, screenshots, "login")
            page.fill("#token", ADMIN_TOKEN)
            page.click("form button[type=submit]")
            page.wait_for_url(f"{origin}/dashboard/")
            assert page.inner_text("h1") == "Overview"
            page.wait_for_selector("#finished-chart canvas")
            with page.expect_response(
                lambda r: r.request.resource_type == "fetch" and r.url == f"{origin}/dashboard/"
            ) as refreshed:
                pass
            assert refreshed.value.status == 200
            page.wait_for_selector("#leaders-wait >> text=Hooli")
            page.wait_for_selector("#holders td code")
            shoot(page, screenshots, "overview")

            # The companies, longest waiting first; then Acme Corp's page.
            page.click("header nav >> text=Companies")
            page.wait_for_url(f"{origin}/dashboard/companies")
            assert page.inner_text("table.companies tbody tr:first-child td:first-child") == (
                "Hooli"
            )
            shoot(page, screenshots, "companies")
            page.click("table.companies >> text=Acme Corp")
            page.wait_for_url(f"{origin}/dashboard/companies/{acme.id}")
            assert "worker lost (lease expired)" in page.inner_text("#failures-title + table")
            # The window: its figures, actions and failures (50 tasks follow below).
            shoot(page, screenshots, "company", full_page=False)

            # Paused: new tasks are accepted and kept, none is claimed, while Globex's run.
            page.click("button:has-text('Pause')")
            assert flash(page).startswith("Paused Acme Corp")
            acme_tasks = create_tasks(origin, acme, 5)
            globex_tasks = create_tasks(origin, globex, 5)
            wait_for(
                lambda: statuses(fresh_engine, globex_tasks) == {"completed": 5},
                30,
                "Globex's tasks to run while Acme Corp is paused",
            )
            assert statuses(fresh_engine, acme_tasks) == {"pending": 5}
            assert claimed_ever(fresh_engine, acme_tasks) == 0
            page.reload()
            assert page.locator("table.tasks .status-pending").count() >= 5

            # The failed task's page; retry it: pending again, and still not claimed.
            page.click(f"#failures-title + table a[href$='/tasks/{poison}']")
            page.wait_for_url(f"{origin}/dashboard/companies/{acme.id}/tasks/{poison}")
            assert "worker lost (lease expired)" in page.inner_text("pre.error-text")
            shoot(page, screenshots, "task")
            page.click("button:has-text('Retry')")
            assert "is pending again" in flash(page)
            assert statuses(fresh_engine, [poison]) == {"pending": 1}

            # Resumed: every one of its tasks runs.
            page.click(".crumbs >> text=Acme Corp")
            page.click("button:has-text('Resume')")
            assert flash(page).startswith("Resumed Acme Corp")
            wait_for(
                lambda: statuses(fresh_engine, [*acme_tasks, poison]) == {"completed": 6},
                30,
                "Acme Corp's tasks to run once resumed",
            )
            page.goto(f"{origin}/dashboard/companies/{acme.id}/tasks/{poison}")
            assert page.inner_text("h1 .badge") == "completed"

            # Logged out: the next page asks for the token again.
            page.click("button:has-text('Log out')")
            page.wait_for_url(f"{origin}/dashboard/login")
            page.goto(f"{origin}/dashboard/companies")
            page.wait_for_url(f"{origin}/dashboard/login?next=/dashboard/companies")
        finally:
            context.close()
    log.check()
    assert f"{origin}/dashboard/static/vendor/uplot/uPlot.iife.min.js" in log.requests


def test_a_script_in_a_company_name_payload_or_error_runs_nowhere(
    browser: Browser, fresh_db_url: str, fresh_engine: Engine
) -> None:
    evil = insert_company(fresh_engine, "<script>window.__fairq_xss = 'name'</script>Evil")
    with fresh_engine.begin() as conn:
        task_id = conn.execute(
            text(
                "INSERT INTO tasks (company_id, type, payload, status, last_error, finished_at) "
                "VALUES (:id, 'noop', CAST(:payload AS jsonb), 'failed', :error, now()) "
                "RETURNING id"
            ),
            {
                "id": evil.id,
                "payload": '{"html": "<img src=x onerror=\\"window.__fairq_xss = 1\\">"}',
                "error": "<script>window.__fairq_xss = 'error'</script>",
            },
        ).scalar_one()

    with serve_app(fresh_db_url) as port:
        origin = f"http://127.0.0.1:{port}"
        page = browser.new_page()
        page.set_default_timeout(WAIT_MS)
        log = BrowserLog(origin)
        log.watch(page)
        try:
            log_in(page, origin)
            shown: list[str] = []
            for path in (
                "/dashboard/",
                f"/dashboard/companies?q={evil.id}",
                f"/dashboard/companies/{evil.id}",
                f"/dashboard/companies/{evil.id}/tasks/{task_id}",
            ):
                page.goto(origin + path)
                executed: Any = page.evaluate("() => window.__fairq_xss")
                assert executed is None, path
                shown.append(page.inner_text("main"))
        finally:
            page.close()
    assert "<script>window.__fairq_xss = 'name'</script>Evil" in shown[1]
    assert '<img src=x onerror=\\"window.__fairq_xss = 1\\">' in shown[3] or (
        '<img src=x onerror="window.__fairq_xss = 1">' in shown[3]
    )
    assert "<script>window.__fairq_xss = 'error'</script>" in shown[3]
    log.check()


def test_an_operator_issues_rotates_and_revokes_a_tenants_api_key_in_the_browser(
    browser: Browser, fresh_db_url: str, fresh_engine: Engine, screenshots: Path
) -> None:
    acme = insert_company(fresh_engine, "Acme Corp")

    with serve_app(fresh_db_url) as port:
        origin = f"http://127.0.0.1:{port}"
        tasks = f"{origin}/companies/{acme.id}/tasks"
        context = browser.new_context(viewport=VIEWPORT)  # type: ignore[arg-type]
        page = context.new_page()
        page.set_default_timeout(WAIT_MS)
        log = BrowserLog(origin)
        log.watch(page)
        try:
            log_in(page, origin)
            page.goto(f"{origin}/dashboard/companies/{acme.id}")
            assert page.locator("table.keys .key-active").count() == 1

            # A new key, expiring in 30 days: its secret shown once, and it works.
            page.fill("#expires_in_days", "30")
            page.click("button:has-text('Issue a new key')")
            issued = page.inner_text("#new-api-key").strip()
            issued_id = page.inner_text("#new-api-key-id").strip()
            shoot(page, screenshots, "key-issued", full_page=False)
            assert requests.get(tasks, headers=bearer(issued), timeout=10).status_code == 200
            page.click(".crumbs >> text=Acme Corp")
            assert page.locator("table.keys .key-active").count() == 2
            assert issued not in page.content()

            # The first key rotated with no overlap: a third key, and the first one refused.
            first_row = page.locator("table.keys tbody tr").last
            first_row.locator("input[name=overlap_hours]").fill("0")
            first_row.locator("button:has-text('Rotate')").click()
            rotated = page.inner_text("#new-api-key").strip()
            assert requests.get(tasks, headers=bearer(rotated), timeout=10).status_code == 200
            assert requests.get(tasks, headers=acme.headers, timeout=10).status_code == 401

            # The issued key revoked: refused at once.
            page.click(".crumbs >> text=Acme Corp")
            issued_row = page.locator(f"table.keys tbody tr:has(code[title='{issued_id}'])")
            issued_row.locator("button:has-text('Revoke')").click()
            assert flash(page).startswith("Revoked API key")
            assert requests.get(tasks, headers=bearer(issued), timeout=10).status_code == 401
            assert page.locator("table.keys .key-active").count() == 1
            shoot(page, screenshots, "company-keys")
        finally:
            context.close()
    log.check()


def bearer(key: str) -> dict[str, str]:
    """An Authorization header for `key`."""
    return {"Authorization": f"Bearer {key}"}
