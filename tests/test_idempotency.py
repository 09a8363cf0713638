"""Idempotency-Key on task creation (design §3, IETF Idempotency-Key header draft)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import pytest
import requests
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session
from werkzeug.serving import make_server
from werkzeug.test import TestResponse

from api import database
from api import errors as api_errors
from db import errors
from db.models import Task
from tests.conftest import make_test_app
from tests.factories import (
    CompanyWithKey,
    MakeCompany,
    MakeTask,
    count_tasks,
    insert_company,
    json_of,
)


def post_with_key(
    client: FlaskClient, company: CompanyWithKey, key: str, body: str | dict[str, Any]
) -> TestResponse:
    """POST a task body (an object, or raw JSON text) with `Idempotency-Key: key`."""
    return client.post(
        f"/companies/{company.id}/tasks",
        data=body if isinstance(body, str) else json.dumps(body),
        content_type="application/json",
        headers={**company.headers, "Idempotency-Key": key},
    )


def test_same_key_and_body_replays_the_task_with_200(
    client: FlaskClient, make_company: MakeCompany, db_session: Session
) -> None:
    company = make_company()
    body = {"type": "sleep", "payload": {"seconds": 2}}
    first = post_with_key(client, company, "order-42", body)

    again = post_with_key(client, company, "order-42", body)

    assert first.status_code == 201
    assert "Idempotent-Replayed" not in first.headers
    assert again.status_code == 200
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.headers["Location"] == first.headers["Location"]
    assert json_of(again) == json_of(first)
    assert json_of(again)["idempotency_key"] == "order-42"
    assert count_tasks(db_session, company.id) == 1


def test_replay_returns_the_task_as_it_is_now(
    client: FlaskClient, make_company: MakeCompany
) -> None:
    company = make_company()
    body = {"type": "noop"}
    task = json_of(post_with_key(client, company, "k", body))
    client.post(f"/companies/{company.id}/tasks/{task['id']}/cancel", headers=company.headers)

    again = post_with_key(client, company, "k", body)

    assert again.status_code == 200
    assert json_of(again)["id"] == task["id"]
    assert json_of(again)["status"] == "cancelled"


def test_same_body_with_reordered_keys_and_whitespace_counts_as_the_same(
    client: FlaskClient, make_company: MakeCompany, db_session: Session
) -> None:
    company = make_company()
    first = post_with_key(
        client,
        company,
        "k-1",
        '{"type":"send_email","payload":{"to":"a@example.com","subject":"hi"}}',
    )

    again = post_with_key(
        client,
        company,
        "k-1",
        '{ "payload": { "subject": "hi", "to": "a@example.com" },\n  "type": "send_email" }',
    )

    assert first.status_code == 201
    assert again.status_code == 200
    assert json_of(again)["id"] == json_of(first)["id"]
    assert count_tasks(db_session, company.id) == 1


def test_same_key_with_a_different_body_is_422_and_nothing_is_stored(
    client: FlaskClient, make_company: MakeCompany, db_session: Session
) -> None:
    company = make_company()
    first = json_of(
        post_with_key(client, company, "k", {"type": "sleep", "payload": {"seconds": 1}})
    )

    response = post_with_key(client, company, "k", {"type": "sleep", "payload": {"seconds": 2}})

    assert response.status_code == 422
    body = json_of(response)
    assert body["code"] == 422
    assert "Idempotency-Key" in body["message"]
    assert count_tasks(db_session, company.id) == 1
    stored = db_session.scalars(select(Task).where(Task.company_id == company.id)).one()
    assert str(stored.id) == first["id"]
    assert stored.payload == {"seconds": 1}


def test_a_key_reused_with_another_body_names_the_header_under_errors(
    client: FlaskClient, company: CompanyWithKey
) -> None:
    post_with_key(client, company, "k", {"type": "sleep", "payload": {"seconds": 1}})

    body = json_of(
        post_with_key(client, company, "k", {"type": "sleep", "payload": {"seconds": 2}})
    )

    assert set(body) == {"code", "status", "message", "errors"}
    assert body["errors"] == {"headers": {"Idempotency-Key": [body["message"]]}}


@pytest.mark.parametrize(
    ("raised", "named"),
    [
        (
            errors.IdempotencyKeyInFlux("in flux; retry"),
            {"headers": {"Idempotency-Key": ["in flux; retry"]}},
        ),
        (
            errors.IdempotencyKeyReused("reused", item=3),
            {"json": {"tasks[3].idempotency_key": ["reused"]}},
        ),
        (
            errors.IdempotencyKeyInFlux("in flux", item=0),
            {"json": {"tasks[0].idempotency_key": ["in flux"]}},
        ),
    ],
    ids=["single-create-in-flux", "batch-item-reused", "batch-item-in-flux"],
)
def test_an_idempotency_conflict_names_its_key_where_the_request_gave_it(
    raised: errors.IdempotencyKeyReused | errors.IdempotencyKeyInFlux, named: dict[str, Any]
) -> None:
    # The in-flux race needs a key's row created and deleted under three inserts in a row;
    # the mapping of what the storage layer raises is checked on its own.
    assert api_errors.idempotency_key_errors(raised) == named


def test_a_409_of_another_cause_names_no_key_even_when_one_was_sent(
    client: FlaskClient, company: CompanyWithKey, make_task: MakeTask
) -> None:
    task = make_task(company.id, status="cancelled")

    response = client.post(
        f"/companies/{company.id}/tasks/{task.id}/cancel",
        headers={**company.headers, "Idempotency-Key": "k"},
    )

    assert response.status_code == 409
    assert "errors" not in json_of(response)


def test_same_key_in_two_companies_creates_two_tasks(
    client: FlaskClient, make_company: MakeCompany, db_session: Session
) -> None:
    first, second = make_company("first"), make_company("second")
    body = {"type": "noop"}

    a = post_with_key(client, first, "shared-key", body)
    b = post_with_key(client, second, "shared-key", body)

    assert (a.status_code, b.status_code) == (201, 201)
    assert json_of(a)["id"] != json_of(b)["id"]
    assert json_of(a)["company_id"] == str(first.id)
    assert json_of(b)["company_id"] == str(second.id)
    assert count_tasks(db_session, first.id) == count_tasks(db_session, second.id) == 1


def test_different_keys_create_different_tasks(
    client: FlaskClient, make_company: MakeCompany, db_session: Session
) -> None:
    company = make_company()

    a = post_with_key(client, company, "a", {"type": "noop"})
    b = post_with_key(client, company, "b", {"type": "noop"})

    assert (a.status_code, b.status_code) == (201, 201)
    assert count_tasks(db_session, company.id) == 2


def test_creates_without_a_key_are_never_deduplicated(
    client: FlaskClient, make_company: MakeCompany, db_session: Session
) -> None:
    company = make_company()

    for _ in range(2):
        response = client.post(
            f"/companies/{company.id}/tasks", json={"type": "noop"}, headers=company.headers
        )
        assert response.status_code == 201
        assert json_of(response)["idempotency_key"] is None

    assert count_tasks(db_session, company.id) == 2


def test_key_of_255_visible_ascii_characters_is_accepted(
    client: FlaskClient, make_company: MakeCompany
) -> None:
    company = make_company()
    key = "".join(chr(33 + i % 94) for i in range(255))

    response = post_with_key(client, company, key, {"type": "noop"})

    assert response.status_code == 201
    assert json_of(response)["idempotency_key"] == key


@contextmanager
def serving(app: Flask) -> Iterator[str]:
    """Serve `app` over real HTTP on 127.0.0.1 (one thread per request); yield its base URL."""
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, name="test-http", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_50_parallel_creates_with_the_same_key_store_exactly_one_task(
    fresh_db_url: str, fresh_engine: Engine
) -> None:
    with Session(fresh_engine) as session:
        company = insert_company(session)
    app = make_test_app(fresh_db_url)
    requests_count = 50
    start = threading.Barrier(requests_count)
    body = {"type": "sleep", "payload": {"seconds": 1}}

    def create(base_url: str) -> tuple[int, dict[str, Any]]:
        start.wait(timeout=30)
        response = requests.post(
            f"{base_url}/companies/{company.id}/tasks",
            json=body,
            headers={**company.headers, "Idempotency-Key": "same-key"},
            timeout=60,
        )
        return response.status_code, response.json()

    try:
        with serving(app) as base_url, ThreadPoolExecutor(requests_count) as pool:
            results = list(pool.map(create, [base_url] * requests_count))
    finally:
        database.close(app)

    statuses = sorted(status for status, _ in results)
    assert statuses == [200] * (requests_count - 1) + [201], statuses
    assert len({task["id"] for _, task in results}) == 1
    with fresh_engine.connect() as conn:
        stored = conn.execute(select(func.count()).select_from(Task)).scalar_one()
    assert stored == 1
