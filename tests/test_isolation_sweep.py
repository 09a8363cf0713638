"""Tenant isolation swept over every route of the app that has a company in its path (design §1.5).

The routes come from `app.url_map`, so a route added later is swept without editing this file;
only the admin's expected answer must be added to `ADMIN_EXPECTED` (the sweep fails until it
is). For each route and method: another company's key gets the 404 of an id that does not
exist (on an admin-only route, `ADMIN_ONLY`, the 401 every company key gets there), the admin
token gets what design §3 says, no token gets a 401 with `WWW-Authenticate: Bearer`; no answer
carries the victim's data, and nothing changes (but what the admin may change).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import select
from sqlalchemy.orm import Session
from werkzeug.routing import Rule
from werkzeug.test import TestResponse

from api import auth
from db.models import ApiKey, Company, Task
from tests.conftest import ADMIN_TOKEN
from tests.factories import (
    CompanyWithKey,
    MakeCompany,
    MakeTask,
    add_key,
    company_limits,
    count_tasks,
    json_of,
)

NAME_MARKER = "victim-name-7f3a9c"
PAYLOAD_MARKER = "victim-payload-5e1b2d"
ERROR_MARKER = "victim-error-9d4c8a"

# What the admin token gets on each company route (design §3 "who"): it may read a company and
# set its limits, but does not act for a tenant on its tasks (403 with a message, the same for
# any company id).
ADMIN_EXPECTED: dict[tuple[str, str], int] = {
    ("/companies/<uuid:company_id>", "GET"): 200,
    ("/companies/<uuid:company_id>", "PATCH"): 200,
    ("/companies/<uuid:company_id>/tasks", "GET"): 403,
    ("/companies/<uuid:company_id>/tasks", "POST"): 403,
    ("/companies/<uuid:company_id>/tasks/<uuid:task_id>", "GET"): 403,
    ("/companies/<uuid:company_id>/tasks/<uuid:task_id>/cancel", "POST"): 403,
    ("/companies/<uuid:company_id>/tasks/<uuid:task_id>/retry", "POST"): 403,
    ("/companies/<uuid:company_id>/task-batches", "POST"): 403,
    ("/companies/<uuid:company_id>/pause", "POST"): 200,
    ("/companies/<uuid:company_id>/resume", "POST"): 200,
    ("/companies/<uuid:company_id>/stats", "GET"): 200,
    ("/companies/<uuid:company_id>/keys", "GET"): 200,
    ("/companies/<uuid:company_id>/keys", "POST"): 201,
    ("/companies/<uuid:company_id>/keys/<uuid:key_id>", "DELETE"): 200,
    ("/companies/<uuid:company_id>/keys/<uuid:key_id>/rotate", "POST"): 201,
}

# Admin-only company routes: every company key, its own included, gets the 401 of an
# admin-only endpoint (as on POST /companies), whatever company is in the path.
ADMIN_ONLY: set[tuple[str, str]] = {("/companies/<uuid:company_id>", "PATCH")}

# Path arguments the sweep knows how to fill; a route with another one fails the sweep.
KNOWN_ARGUMENTS = {"company_id", "task_id", "key_id"}

# A valid body per method: a refusal must come from who is asking, not from the body.
BODIES: dict[str, dict[str, Any]] = {
    "POST": {"type": "noop"},
    "PATCH": {"weight": 7, "max_in_flight": 3},
}
# Routes whose valid body is not their method's in BODIES.
ROUTE_BODIES: dict[tuple[str, str], dict[str, Any]] = {
    ("/companies/<uuid:company_id>/task-batches", "POST"): {"tasks": [{"type": "noop"}] * 2},
    ("/companies/<uuid:company_id>/keys", "POST"): {"expires_in_seconds": 3600},
    ("/companies/<uuid:company_id>/keys/<uuid:key_id>/rotate", "POST"): {"overlap_seconds": 60},
}
KEY_FIELDS = {
    "id",
    "company_id",
    "created_at",
    "last_used_at",
    "expires_at",
    "revoked_at",
    "active",
}
COMPANY_FIELDS = {"id", "name", "created_at", "weight", "max_in_flight", "max_pending", "paused"}
# The admin's 200 answers that are not the company itself: (their fields, the field with its id).
ADMIN_OK_BODIES: dict[tuple[str, str], tuple[set[str], str]] = {
    ("/companies/<uuid:company_id>/stats", "GET"): (
        {
            "company_id", "name", "paused", "max_pending", "as_of", "tasks", "runnable",
            "in_flight", "oldest_runnable_wait_seconds", "completed_last_5m", "failed_last_5m",
            "completed_last_60m", "failed_last_60m", "estimated",
        },
        "company_id",
    ),
    ("/companies/<uuid:company_id>/keys", "GET"): ({"company_id", "keys"}, "company_id"),
    ("/companies/<uuid:company_id>/keys", "POST"): (KEY_FIELDS | {"api_key"}, "company_id"),
    ("/companies/<uuid:company_id>/keys/<uuid:key_id>", "DELETE"): (KEY_FIELDS, "company_id"),
    ("/companies/<uuid:company_id>/keys/<uuid:key_id>/rotate", "POST"): (
        KEY_FIELDS | {"api_key", "replaces"},
        "company_id",
    ),
}  # fmt: skip


@dataclass(frozen=True)
class Route:
    """One method of one URL rule that has `company_id` in its path."""

    rule: Rule
    method: str

    @property
    def key(self) -> tuple[str, str]:
        """`(rule template, method)`, as `ADMIN_EXPECTED` is keyed."""
        return self.rule.rule, self.method

    def __str__(self) -> str:
        return f"{self.method} {self.rule.rule}"


def company_routes(app: Flask) -> list[Route]:
    """Every (rule, method) of `app` with a company id in its path, HEAD/OPTIONS excepted.

    The dashboard's pages are not API routes: no bearer token opens them (an operator's
    session does), as tests/test_dashboard.py shows.
    """
    return sorted(
        (
            Route(rule, method)
            for rule in app.url_map.iter_rules()
            if "company_id" in rule.arguments and not rule.endpoint.startswith("dashboard.")
            for method in rule.methods or ()
            if method not in {"HEAD", "OPTIONS"}
        ),
        key=str,
    )


@dataclass(frozen=True)
class Tenants:
    """A victim with tasks in several states and two API keys (the admin's sweep revokes
    `spare_key` and rotates `main_key`), and an intruder with one task of its own."""

    victim: CompanyWithKey
    intruder: CompanyWithKey
    victim_tasks: tuple[str, ...]
    intruder_task: str
    main_key: uuid.UUID
    spare_key: uuid.UUID

    def key_for(self, route: Route) -> uuid.UUID:
        """The victim's key a route with `key_id` is sent for."""
        return self.main_key if route.rule.rule.endswith("/rotate") else self.spare_key

    @property
    def secrets(self) -> tuple[str, ...]:
        """Strings no answer to anyone but the victim may contain."""
        return (str(self.victim.id), NAME_MARKER, PAYLOAD_MARKER, ERROR_MARKER, *self.victim_tasks)

    @property
    def task_secrets(self) -> tuple[str, ...]:
        """The victim's task data: not even the admin token may see it."""
        return (PAYLOAD_MARKER, ERROR_MARKER, *self.victim_tasks)


@pytest.fixture
def tenants(make_company: MakeCompany, make_task: MakeTask, db_session: Session) -> Tenants:
    """A victim whose tasks could be cancelled (pending) or retried (failed, cancelled)."""
    victim, intruder = make_company(f"corp {NAME_MARKER}"), make_company("intruder")
    payload = {"url": f"https://victim.example/{PAYLOAD_MARKER}", "body": PAYLOAD_MARKER}
    tasks = [
        make_task(victim.id, type="webhook", payload=payload, status=status, last_error=error)
        for status, error in (
            ("pending", None),
            ("failed", ERROR_MARKER),
            ("cancelled", ERROR_MARKER),
        )
    ]
    own = make_task(intruder.id)
    add_key(db_session, victim.id, auth.new_api_key())
    db_session.commit()
    main, spare = (
        db_session.execute(
            select(ApiKey.id)
            .where(ApiKey.company_id == victim.id)
            .order_by(ApiKey.key_hash != auth.hash_api_key(victim.api_key))
        )
        .scalars()
        .all()
    )
    return Tenants(victim, intruder, tuple(str(t.id) for t in tasks), str(own.id), main, spare)


def snapshot(session: Session) -> list[tuple[Any, ...]]:
    """Every task row's mutable state: what a leaked write would change."""
    rows = session.execute(
        select(Task.id, Task.status, Task.attempts, Task.updated_at).order_by(Task.id)
    )
    return [tuple(row) for row in rows]


def company_snapshot(session: Session) -> list[tuple[Any, ...]]:
    """Every company row's mutable state (name, limits, paused), and every API key's."""
    rows = session.execute(
        select(
            Company.id, Company.name, Company.weight, Company.max_in_flight, Company.paused
        ).order_by(Company.id)
    )
    keys = session.execute(
        select(ApiKey.id, ApiKey.company_id, ApiKey.expires_at, ApiKey.revoked_at).order_by(
            ApiKey.id
        )
    )
    return [tuple(row) for row in rows] + [tuple(row) for row in keys]


@pytest.fixture
def tasks_unchanged(db_session: Session, tenants: Tenants) -> Iterator[None]:
    """Assert after the test that no task was created, changed or deleted."""
    before = snapshot(db_session)
    yield
    db_session.expire_all()
    assert snapshot(db_session) == before
    assert count_tasks(db_session, tenants.victim.id) == len(tenants.victim_tasks)


@pytest.fixture
def unchanged(db_session: Session, tasks_unchanged: None) -> Iterator[None]:
    """Assert after the test that no task and no company was created, changed or deleted."""
    before = company_snapshot(db_session)
    yield
    db_session.expire_all()
    assert company_snapshot(db_session) == before


def call(
    client: FlaskClient,
    route: Route,
    *,
    company: object,
    task: object,
    headers: dict[str, str],
    key: object = None,
) -> TestResponse:
    """Send `route` with these path ids and a valid body (`ROUTE_BODIES`, else `BODIES`);
    `key`: the `key_id` (None: a random one)."""
    unknown = set(route.rule.arguments) - KNOWN_ARGUMENTS
    assert not unknown, f"{route}: the sweep cannot fill {sorted(unknown)}; extend it"
    values = {"company_id": company, "task_id": task, "key_id": key or uuid.uuid4()}
    adapter = client.application.url_map.bind("localhost")
    path = adapter.build(
        route.rule.endpoint,
        {name: values[name] for name in route.rule.arguments},
        method=route.method,
    )
    return client.open(
        path,
        method=route.method,
        headers=headers,
        json=ROUTE_BODIES.get(route.key, BODIES.get(route.method)),
    )


def leaks(response: TestResponse, secrets: tuple[str, ...]) -> list[str]:
    """The secrets that appear anywhere in the response's body or headers."""
    text = response.get_data(as_text=True) + str(response.headers)
    return [secret for secret in secrets if secret in text]


def test_every_company_route_has_an_expected_admin_answer(app: Flask) -> None:
    routes = {route.key for route in company_routes(app)}

    assert routes, "no route has company_id in its path: the sweep would check nothing"
    assert routes - set(ADMIN_EXPECTED) == set(), "add the admin's answer to ADMIN_EXPECTED"
    assert set(ADMIN_EXPECTED) - routes == set(), "ADMIN_EXPECTED names routes that are gone"
    assert ADMIN_ONLY - routes == set(), "ADMIN_ONLY names routes that are gone"
    assert {method for _, method in routes} <= {"GET", "DELETE", *BODIES}, "add a body to BODIES"


@pytest.mark.usefixtures("unchanged")
def test_another_companys_key_gets_the_404_of_a_missing_id_on_every_company_route(
    client: FlaskClient, tenants: Tenants
) -> None:
    problems: list[str] = []
    for route in company_routes(client.application):
        expected = 401 if route.key in ADMIN_ONLY else 404
        # (the company in the path, the one a missing-id request uses instead of it)
        companies = [(tenants.victim.id, uuid.uuid4())]
        if "task_id" in route.rule.arguments:
            # The intruder's own company path with the victim's task id.
            companies.append((tenants.intruder.id, tenants.intruder.id))
        for company, missing_company in companies:
            missing = call(
                client,
                route,
                company=missing_company,
                task=uuid.uuid4(),
                headers=tenants.intruder.headers,
            )
            for task in tenants.victim_tasks:
                response = call(
                    client,
                    route,
                    company=company,
                    task=task,
                    key=tenants.key_for(route),
                    headers=tenants.intruder.headers,
                )
                where = f"{route} company={company} task={task}"
                if response.status_code != expected or json_of(response)["code"] != expected:
                    problems.append(f"{where}: {response.status_code}, not {expected}")
                if response.get_json() != missing.get_json():
                    problems.append(f"{where}: differs from a missing id: {response.get_json()}")
                if found := leaks(response, tenants.secrets):
                    problems.append(f"{where}: leaks {found}")

    assert problems == []


@pytest.mark.usefixtures("tasks_unchanged")
def test_admin_token_gets_the_designed_answer_on_every_company_route(
    client: FlaskClient, tenants: Tenants, admin_headers: dict[str, str], db_session: Session
) -> None:
    problems: list[str] = []
    for route in company_routes(client.application):
        expected = ADMIN_EXPECTED.get(route.key)
        if expected is None:
            problems.append(f"{route}: no expected admin answer in ADMIN_EXPECTED")
            continue
        for task in tenants.victim_tasks:
            response = call(
                client,
                route,
                company=tenants.victim.id,
                task=task,
                key=tenants.key_for(route),
                headers=admin_headers,
            )
            where = f"{route} task={task}"
            if response.status_code != expected:
                problems.append(f"{where}: {response.status_code}, expected {expected}")
                continue
            if found := leaks(response, tenants.task_secrets):
                problems.append(f"{where}: leaks task data {found}")
            if expected in (200, 201):
                body = json_of(response)
                fields, id_field = ADMIN_OK_BODIES.get(route.key, (COMPANY_FIELDS, "id"))
                if set(body) != fields or body[id_field] != str(tenants.victim.id):
                    problems.append(f"{where}: unexpected body {body}")
                continue
            body = json_of(response)
            if body["code"] != expected or not body.get("message"):
                problems.append(f"{where}: not an error body with a message: {body}")
            if found := leaks(response, tenants.secrets):
                problems.append(f"{where}: leaks {found}")
            # Refused before any lookup: a company that does not exist gets the same answer.
            missing = call(
                client, route, company=uuid.uuid4(), task=uuid.uuid4(), headers=admin_headers
            )
            if (missing.status_code, missing.get_json()) != (expected, body):
                problems.append(f"{where}: tells existing ids from missing ones")

    assert problems == []
    # The admin's PATCH changed the victim's limits, and only the victim's.
    assert company_limits(db_session, tenants.victim.id) == (7, 3)
    assert company_limits(db_session, tenants.intruder.id) == (1, None)
    # It paused the victim, then resumed it (routes in order), and only the victim.
    paused = {row.id: row.paused for row in db_session.execute(select(Company.id, Company.paused))}
    assert (paused[tenants.victim.id], paused[tenants.intruder.id]) == (False, False)


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer not-a-key", "Basic dXNlcjpwYXNz", "Bearer", f"Bearer {ADMIN_TOKEN}x"],
    ids=["missing", "unknown-key", "basic", "empty-bearer", "admin-token-plus-one"],
)
@pytest.mark.usefixtures("unchanged")
def test_no_valid_token_gets_401_with_www_authenticate_on_every_company_route(
    client: FlaskClient, tenants: Tenants, authorization: str | None
) -> None:
    headers = {} if authorization is None else {"Authorization": authorization}
    problems: list[str] = []
    for route in company_routes(client.application):
        missing = call(client, route, company=uuid.uuid4(), task=uuid.uuid4(), headers=headers)
        for task in tenants.victim_tasks:
            response = call(client, route, company=tenants.victim.id, task=task, headers=headers)
            where = f"{route} task={task}"
            if response.status_code != 401:
                problems.append(f"{where}: {response.status_code}, not 401")
                continue
            if not response.headers.get("WWW-Authenticate", "").startswith("Bearer"):
                problems.append(f"{where}: no WWW-Authenticate: Bearer")
            if json_of(response) != json_of(missing):
                problems.append(f"{where}: differs from a missing id")
            if found := leaks(response, tenants.secrets):
                problems.append(f"{where}: leaks {found}")

    assert problems == []
