"""POST /companies/{companyId}/pause and /resume over HTTP (design §3): who may, what they answer.

The queue's side (never claimed while paused, the race with claimers, resume through the
promotion) is `tests/test_pause.py`; the real worker supervisor's is `tests/test_pause_e2e.py`.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
import requests
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from api import auth
from db.engine import make_engine
from tests import pg
from tests.conftest import ADMIN_TOKEN, make_test_app, serve_app
from tests.factories import CompanyWithKey, CreatedTask, MakeCompany, insert_company, json_of

COMPANY_FIELDS = {"id", "name", "created_at", "weight", "max_in_flight", "max_pending", "paused"}
ACTIONS = ("pause", "resume")


@pytest.fixture
def remember(app: Flask) -> Callable[..., None]:
    """`remember(*companies)`: their keys authenticate from the key cache, with no lookup.

    The pause and the resume commit in a transaction of their own (`database.transaction`).
    In these tests every session joins the test's transaction through a savepoint, and the
    request's session, opened by a key lookup and never committed, is rolled back at the
    request's end, taking the later savepoint of the pause with it. (Outside tests the
    request's session is in autocommit: its lookup is committed at once.)
    """

    def put(*companies: CompanyWithKey) -> None:
        for company in companies:
            auth.key_cache(app).put(auth.hash_api_key(company.api_key), company.id)

    return put


def paused_in_db(session: Session, company_id: uuid.UUID) -> bool:
    """`companies.paused` as stored, read past the session's cache."""
    paused: bool = session.execute(
        text("SELECT paused FROM companies WHERE id = :id"), {"id": company_id}
    ).scalar_one()
    return paused


def post(
    client: FlaskClient, company_id: object, action: str, headers: dict[str, str]
) -> dict[str, Any]:
    """POST /companies/{company_id}/{action}; the JSON body, with `_status` added."""
    response = client.post(f"/companies/{company_id}/{action}", headers=headers)
    return {**json_of(response), "_status": response.status_code}


def test_a_company_pauses_and_resumes_itself_and_its_json_says_so(
    client: FlaskClient, company: CompanyWithKey, db_session: Session, remember: Callable[..., None]
) -> None:
    remember(company)
    paused = post(client, company.id, "pause", company.headers)

    assert paused.pop("_status") == 200
    assert set(paused) == COMPANY_FIELDS
    assert (paused["id"], paused["name"], paused["paused"]) == (str(company.id), "acme", True)
    assert paused_in_db(db_session, company.id)
    assert json_of(client.get(f"/companies/{company.id}", headers=company.headers))["paused"]

    resumed = post(client, company.id, "resume", company.headers)

    assert resumed.pop("_status") == 200
    assert resumed == {**paused, "paused": False}
    assert not paused_in_db(db_session, company.id)


def test_pausing_a_paused_company_or_resuming_a_running_one_is_a_200_that_changes_nothing(
    client: FlaskClient, company: CompanyWithKey, db_session: Session, remember: Callable[..., None]
) -> None:
    remember(company)
    for action, state in (("pause", True), ("pause", True), ("resume", False), ("resume", False)):
        body = post(client, company.id, action, company.headers)
        assert (body["_status"], body["paused"]) == (200, state)
        assert paused_in_db(db_session, company.id) is state


def test_the_admin_token_pauses_and_resumes_any_company(
    client: FlaskClient,
    make_company: MakeCompany,
    admin_headers: dict[str, str],
    db_session: Session,
) -> None:
    first, second = make_company("first"), make_company("second")

    assert post(client, first.id, "pause", admin_headers)["paused"] is True
    assert post(client, second.id, "pause", admin_headers)["paused"] is True
    assert post(client, first.id, "resume", admin_headers)["paused"] is False

    assert (paused_in_db(db_session, first.id), paused_in_db(db_session, second.id)) == (
        False,
        True,
    )


@pytest.mark.parametrize("action", ACTIONS)
def test_another_companys_key_gets_the_404_of_a_missing_company_and_changes_nothing(
    client: FlaskClient,
    make_company: MakeCompany,
    db_session: Session,
    remember: Callable[..., None],
    action: str,
) -> None:
    victim, intruder = make_company("victim"), make_company("intruder")
    remember(victim, intruder)
    if action == "resume":
        post(client, victim.id, "pause", victim.headers)
    before = paused_in_db(db_session, victim.id)

    response = client.post(f"/companies/{victim.id}/{action}", headers=intruder.headers)
    missing = client.post(f"/companies/{uuid.uuid4()}/{action}", headers=intruder.headers)

    assert response.status_code == 404
    assert json_of(response) == json_of(missing) == {
        "code": 404, "status": "Not Found", "message": "company not found",
    }  # fmt: skip
    assert "victim" not in response.get_data(as_text=True)
    assert paused_in_db(db_session, victim.id) is before
    assert paused_in_db(db_session, intruder.id) is False


@pytest.mark.parametrize("action", ACTIONS)
@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer not-a-key", "Basic dXNlcjpwYXNz", f"Bearer {ADMIN_TOKEN}x"],
    ids=["missing", "unknown-key", "basic", "admin-token-plus-one"],
)
def test_no_valid_token_is_a_401_with_www_authenticate_and_changes_nothing(
    client: FlaskClient,
    company: CompanyWithKey,
    db_session: Session,
    action: str,
    authorization: str | None,
) -> None:
    headers = {} if authorization is None else {"Authorization": authorization}

    response = client.post(f"/companies/{company.id}/{action}", headers=headers)

    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"].startswith("Bearer")
    assert json_of(response)["code"] == 401
    assert paused_in_db(db_session, company.id) is False


@pytest.mark.parametrize("action", ACTIONS)
def test_the_admin_on_an_unknown_company_gets_404(
    client: FlaskClient, admin_headers: dict[str, str], action: str
) -> None:
    body = post(client, uuid.uuid4(), action, admin_headers)

    assert (body["_status"], body["message"]) == (404, "company not found")


@pytest.mark.parametrize("action", ACTIONS)
@pytest.mark.parametrize("company_id", ["not-a-uuid", "12345"])
def test_a_company_id_that_is_not_a_uuid_is_a_json_404(
    client: FlaskClient, admin_headers: dict[str, str], action: str, company_id: str
) -> None:
    body = post(client, company_id, action, admin_headers)

    assert (body["_status"], body["code"]) == (404, 404)


def test_a_company_pauses_itself_when_no_admin_token_is_configured(main_db_url: str) -> None:
    """The company's own key needs no admin token: no 503 as on the admin-only routes."""
    app = make_test_app(main_db_url, admin_token=None)
    engine = make_engine(main_db_url, application_name="fairq-tests")
    company = insert_company(engine)
    try:
        client = app.test_client()
        for action, state in (("pause", True), ("resume", False)):
            response = client.post(f"/companies/{company.id}/{action}", headers=company.headers)
            assert (response.status_code, json_of(response)["paused"]) == (200, state)
    finally:
        with engine.begin() as conn:
            conn.execute(text("DELETE FROM companies WHERE id = :id"), {"id": company.id})
        engine.dispose()


def test_tasks_created_while_paused_are_accepted_and_run_only_after_resume(
    client: FlaskClient,
    make_company: MakeCompany,
    created_task: CreatedTask,
    admin_headers: dict[str, str],
    remember: Callable[..., None],
) -> None:
    paused, other = make_company("paused"), make_company("other")
    remember(paused)
    post(client, paused.id, "pause", paused.headers)

    kept = [created_task(paused)["id"] for _ in range(2)]
    theirs = created_task(other)["id"]
    first = json_of(client.post("/workers/process", headers=admin_headers))

    assert first["claimed"] == first["completed"] == 1
    done = json_of(client.get(f"/companies/{other.id}/tasks/{theirs}", headers=other.headers))
    assert done["status"] == "completed"
    for task in kept:
        body = json_of(client.get(f"/companies/{paused.id}/tasks/{task}", headers=paused.headers))
        assert (body["status"], body["attempts"]) == ("pending", 0)

    post(client, paused.id, "resume", paused.headers)
    second = json_of(client.post("/workers/process", headers=admin_headers))

    assert second["completed"] == 2
    listed = json_of(client.get(f"/companies/{paused.id}/tasks", headers=paused.headers))
    assert {task["status"] for task in listed["items"]} == {"completed"}


def test_resume_wakes_idle_workers_with_a_notify_on_the_task_channel(
    fresh_db_url: str, fresh_engine: Engine
) -> None:
    """Over real HTTP on a database of its own: the NOTIFY goes out when the resume commits."""
    company = insert_company(fresh_engine)
    with (
        psycopg.connect(pg.libpq(fresh_db_url), autocommit=True) as listener,
        serve_app(fresh_db_url) as port,
    ):
        listener.execute("LISTEN fairq_tasks")
        base = f"http://127.0.0.1:{port}/companies/{company.id}"
        assert requests.post(f"{base}/pause", headers=company.headers, timeout=10).ok
        assert list(listener.notifies(timeout=0.3)) == []  # a pause wakes nobody
        with Session(fresh_engine) as session:  # committed, the key looked up in the database
            assert paused_in_db(session, company.id)

        response = requests.post(f"{base}/resume", headers=company.headers, timeout=10)

        assert response.status_code == 200
        [notice] = listener.notifies(timeout=5, stop_after=1)
        assert (notice.channel, notice.payload) == ("fairq_tasks", str(company.id))


def test_pause_and_resume_are_documented_in_openapi(client: FlaskClient) -> None:
    spec = json_of(client.get("/openapi.json"))

    for action in ACTIONS:
        operation = spec["paths"][f"/companies/{{company_id}}/{action}"]["post"]
        assert operation["operationId"] == f"{action}_company"
        assert "admin only" not in operation["summary"]
        assert "own key" in operation["summary"]
        assert "requestBody" not in operation
        responses = operation["responses"]
        assert {"200", "401", "404"} <= set(responses)
        assert responses["200"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/Company"
        }
        assert "not yours" in responses["404"]["description"]
    paused = spec["components"]["schemas"]["Company"]["properties"]["paused"]
    assert paused["type"] == "boolean"
    assert "/pause" in paused["description"]
