"""Guessing the admin token is slowed per client address (issue 28, part 6): after
`auth_failure_limit` failures in a window, 429 with `Retry-After` on the API and on the
dashboard's login, logged and counted; other addresses and company keys unaffected."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from flask import Flask
from flask.testing import FlaskClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine

from api import database, throttle
from api.settings import DEFAULT_AUTH_FAILURE_LIMIT
from tests.conftest import ADMIN_TOKEN, Clock, make_test_app
from tests.factories import CompanyWithKey, insert_company, json_of

LIMIT = DEFAULT_AUTH_FAILURE_LIMIT
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
WRONG = {"Authorization": "Bearer not-the-admin-token-and-no-key-either"}
ATTACKER, OPERATOR = "203.0.113.7", "198.51.100.20"
LOGIN = "/dashboard/login"
_CSRF = re.compile(r'name="csrf_token"[^>]*value="([^"]+)"')


@pytest.fixture
def clock() -> Clock:
    return Clock()


def throttled_app(database_url: str, clock: Clock, **settings: object) -> Flask:
    app = make_test_app(database_url, auth_failure_limit=LIMIT, **settings)
    throttle.throttle_of(app).clock = clock
    return app


@pytest.fixture
def app(fresh_db_url: str, clock: Clock) -> Iterator[Flask]:
    """An app with the production throttle (`make_test_app` turns it off), on a hand clock."""
    app = throttled_app(fresh_db_url, clock)
    yield app
    database.close(app)


@pytest.fixture
def company(app: Flask, fresh_engine: Engine) -> CompanyWithKey:
    return insert_company(fresh_engine)


def client_from(app: Flask, address: str) -> FlaskClient:
    client = app.test_client()
    client.environ_base["REMOTE_ADDR"] = address
    return client


def auth_failures(client: FlaskClient) -> dict[tuple[str, str], float]:
    """`auth_failures_total` by (surface, outcome), from /metrics."""
    found: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(client.get("/metrics").get_data(as_text=True)):
        if family.name == "auth_failures":
            for sample in family.samples:
                if sample.name == "auth_failures_total":
                    key = (sample.labels["surface"], sample.labels["outcome"])
                    found[key] = sample.value
    return found


# -- the API ----------------------------------------------------------------------------------


def test_wrong_tokens_get_401_then_429_with_retry_after_even_for_the_right_token(
    app: Flask, company: CompanyWithKey, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    attacker = client_from(app, ATTACKER)
    for _ in range(LIMIT):
        assert attacker.get("/stats", headers=WRONG).status_code == 401

    refused = attacker.get("/stats", headers=WRONG)
    right_token = attacker.get("/stats", headers=ADMIN)

    assert refused.status_code == 429
    assert refused.headers["Retry-After"] == "60"
    assert "too many failed authentications" in json_of(refused)["message"]
    assert right_token.status_code == 429  # a right guess looks like a wrong one meanwhile
    assert f"throttling authentication from {ATTACKER}" in caplog.text
    # A company key from that address still works; the operator elsewhere is not affected.
    assert attacker.get(f"/companies/{company.id}", headers=company.headers).status_code == 200
    assert client_from(app, OPERATOR).get("/stats", headers=ADMIN).status_code == 200

    clock.now += 30
    waiting = attacker.get("/stats", headers=ADMIN)
    assert waiting.status_code == 429
    assert waiting.headers["Retry-After"] == "30"
    clock.now += 30
    assert attacker.get("/stats", headers=ADMIN).status_code == 200


def test_failures_and_refusals_are_counted_in_a_metric(app: Flask) -> None:
    attacker = client_from(app, ATTACKER)
    for _ in range(LIMIT + 3):
        attacker.get("/stats", headers=WRONG)

    counts = auth_failures(app.test_client())

    assert counts[("api", "invalid")] == LIMIT
    assert counts[("api", "throttled")] == 3


def test_failures_below_the_limit_never_throttle_and_a_window_starts_over(
    app: Flask, clock: Clock
) -> None:
    attacker = client_from(app, ATTACKER)
    for _ in range(LIMIT - 1):
        assert attacker.get("/stats", headers=WRONG).status_code == 401
    assert attacker.get("/stats", headers=ADMIN).status_code == 200
    clock.now += throttle.WINDOW_SECONDS

    for _ in range(LIMIT - 1):
        assert attacker.get("/stats", headers=WRONG).status_code == 401
    assert attacker.get("/stats", headers=ADMIN).status_code == 200


def test_a_missing_token_is_not_a_guess(app: Flask) -> None:
    attacker = client_from(app, ATTACKER)
    for _ in range(LIMIT * 2):
        assert attacker.get("/stats").status_code == 401
    assert attacker.get("/stats", headers=ADMIN).status_code == 200


def test_x_forwarded_for_is_ignored_without_proxy_hops(app: Flask) -> None:
    attacker = client_from(app, ATTACKER)
    for number in range(LIMIT):
        forged = {**WRONG, "X-Forwarded-For": f"192.0.2.{number}"}
        assert attacker.get("/stats", headers=forged).status_code == 401

    escaped = attacker.get("/stats", headers={**WRONG, "X-Forwarded-For": "192.0.2.99"})
    assert escaped.status_code == 429


def test_behind_a_proxy_the_forwarded_address_is_counted(fresh_db_url: str, clock: Clock) -> None:
    app = throttled_app(fresh_db_url, clock, proxy_hops=1)
    try:
        proxy = client_from(app, "10.0.0.1")
        attacker = {**WRONG, "X-Forwarded-For": ATTACKER}
        for _ in range(LIMIT):
            assert proxy.get("/stats", headers=attacker).status_code == 401
        assert proxy.get("/stats", headers=attacker).status_code == 429
        operator = {**ADMIN, "X-Forwarded-For": OPERATOR}
        assert proxy.get("/stats", headers=operator).status_code == 200
    finally:
        database.close(app)


# -- the dashboard's login ----------------------------------------------------------------------


def log_in(client: FlaskClient, token: str) -> int:
    page = client.get(LOGIN).get_data(as_text=True)
    found = _CSRF.search(page)
    assert found is not None
    response = client.post(LOGIN, data={"token": token, "csrf_token": found.group(1)})
    if response.status_code == 429:
        assert response.headers["Retry-After"].isdigit()
    return response.status_code


def test_wrong_logins_are_throttled_with_the_api_and_counted(app: Flask) -> None:
    attacker = client_from(app, ATTACKER)
    for _ in range(LIMIT):
        assert log_in(attacker, "not-the-admin-token") == 401

    assert log_in(attacker, "not-the-admin-token") == 429
    assert log_in(attacker, ADMIN_TOKEN) == 429
    assert attacker.get("/stats", headers=ADMIN).status_code == 429  # one count per address
    assert log_in(client_from(app, OPERATOR), ADMIN_TOKEN) == 303
    counts = auth_failures(app.test_client())
    assert counts[("dashboard", "invalid")] == LIMIT
    assert counts[("dashboard", "throttled")] == 2


# -- the throttle itself ------------------------------------------------------------------------


def test_the_throttle_remembers_a_bounded_number_of_addresses(clock: Clock) -> None:
    limiter = throttle.FailureThrottle(limit=2, window=60, size=3, clock=clock)
    for address in ("a", "a", "b", "c"):
        limiter.failed(address)
    assert limiter.retry_after("a") == 60

    limiter.failed("d")  # the oldest window, a's, is forgotten

    assert limiter.retry_after("a") is None
    assert limiter.failed("d") is True
    assert limiter.retry_after("d") == 60
