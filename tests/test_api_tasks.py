"""The task endpoints: create, read, list, cancel and retry (design §3)."""

from __future__ import annotations

import datetime as dt
import re
import urllib.parse
import uuid
from typing import Any

import pytest
from flask import Flask, jsonify
from flask.testing import FlaskClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import text
from sqlalchemy.orm import Session

from api.tasks.schemas import TaskPageSchema, TaskSchema
from api.tasks.task_json import task_response
from db import queue
from db.engine import driver_connection
from db.models import TaskStatus
from tests.factories import (
    CompanyWithKey,
    CreatedTask,
    MakeCompany,
    MakeTask,
    count_tasks,
    json_of,
)
from tests.strategies import json_values

TASK_FIELDS = {
    "id",
    "company_id",
    "type",
    "payload",
    "status",
    "attempts",
    "max_attempts",
    "timeout_seconds",
    "result",
    "run_after",
    "idempotency_key",
    "last_error",
    "created_at",
    "updated_at",
    "started_at",
    "finished_at",
}
TIMESTAMP_FIELDS = ("run_after", "created_at", "updated_at", "started_at", "finished_at")
# ISO 8601 with an explicit offset (or Z): what a client in any time zone can parse unambiguously.
ISO_WITH_OFFSET = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?([+-]\d{2}:\d{2}|Z)$")


def tasks_url(company: CompanyWithKey, suffix: str = "") -> str:
    """URL of the company's task collection, plus `suffix`."""
    return f"/companies/{company.id}/tasks{suffix}"


def list_tasks(client: FlaskClient, company: CompanyWithKey, query: str = "") -> dict[str, Any]:
    """GET the company's task list with `query`; assert 200 and return the page."""
    response = client.get(tasks_url(company, f"?{query}"), headers=company.headers)
    assert response.status_code == 200, response.get_data(as_text=True)
    return json_of(response)


def ids_of(page: dict[str, Any]) -> list[str]:
    """Task ids of a page, in order."""
    return [item["id"] for item in page["items"]]


def test_create_returns_201_with_a_location_header_pointing_to_the_get(
    client: FlaskClient, company: CompanyWithKey
) -> None:
    response = client.post(
        tasks_url(company),
        json={"type": "sleep", "payload": {"seconds": 1.5}, "max_attempts": 3},
        headers=company.headers,
    )

    assert response.status_code == 201
    task = json_of(response)
    location = urllib.parse.urlsplit(response.headers["Location"]).path
    assert location == tasks_url(company, f"/{task['id']}")
    fetched = client.get(location, headers=company.headers)
    assert fetched.status_code == 200
    assert json_of(fetched) == task


def test_created_task_has_every_field_of_the_design_with_defaults(
    client: FlaskClient, company: CompanyWithKey, created_task: CreatedTask
) -> None:
    task = created_task(company, "send_email", {"to": "a@example.com", "subject": "hi"})

    assert set(task) == TASK_FIELDS
    uuid.UUID(task["id"])
    assert task["company_id"] == str(company.id)
    assert task["type"] == "send_email"
    # Loaded defaults of the payload schema are not stored: the payload is what was sent.
    assert task["payload"] == {"to": "a@example.com", "subject": "hi"}
    assert task["status"] == "pending"
    assert task["attempts"] == 0
    assert task["max_attempts"] == 5
    assert task["timeout_seconds"] == 90  # send_email's own default
    assert task["result"] is None
    assert task["idempotency_key"] is None
    assert task["last_error"] is None
    assert task["started_at"] is None
    assert task["finished_at"] is None
    # Without run_at the task is runnable at once: run_after is the creation time.
    assert task["run_after"] == task["created_at"]


def test_timestamps_are_iso_8601_with_an_offset(
    client: FlaskClient, company: CompanyWithKey, make_task: MakeTask
) -> None:
    row = make_task(
        company.id,
        status="failed",
        started_at=text("now()"),
        finished_at=text("now()"),
        created_at=text("now() - interval '1 day'"),
    )

    task = json_of(client.get(tasks_url(company, f"/{row.id}"), headers=company.headers))

    for field in TIMESTAMP_FIELDS:
        value = task[field]
        assert ISO_WITH_OFFSET.match(value), (field, value)
        assert dt.datetime.fromisoformat(value).tzinfo is not None


def test_get_unknown_task_is_404(client: FlaskClient, company: CompanyWithKey) -> None:
    response = client.get(tasks_url(company, f"/{uuid.uuid4()}"), headers=company.headers)

    assert response.status_code == 404
    assert json_of(response)["message"] == "task not found"


def test_admin_token_cannot_act_for_a_company_on_task_endpoints(
    client: FlaskClient,
    company: CompanyWithKey,
    admin_headers: dict[str, str],
    db_session: Session,
) -> None:
    response = client.post(tasks_url(company), json={"type": "noop"}, headers=admin_headers)

    assert response.status_code == 403
    body = json_of(response)
    assert body["code"] == 403
    assert body["errors"] == {"headers": {"Authorization": [body["message"]]}}
    assert count_tasks(db_session, company.id) == 0


def test_list_is_newest_first(
    client: FlaskClient, company: CompanyWithKey, make_task: MakeTask
) -> None:
    old = make_task(company.id, created_at=text("now() - interval '2 hours'"))
    new = make_task(company.id, created_at=text("now()"))
    middle = make_task(company.id, created_at=text("now() - interval '1 hour'"))

    page = list_tasks(client, company)

    assert ids_of(page) == [str(new.id), str(middle.id), str(old.id)]


def test_list_breaks_created_at_ties_by_id_descending(
    client: FlaskClient, company: CompanyWithKey, make_task: MakeTask
) -> None:
    # One transaction: now() is the same for every row, so only the id orders them.
    rows = [make_task(company.id) for _ in range(5)]
    assert len({row.created_at for row in rows}) == 1

    page = list_tasks(client, company)

    assert ids_of(page) == sorted((str(row.id) for row in rows), reverse=True)


def test_list_filters_by_status_and_type(
    client: FlaskClient, company: CompanyWithKey, make_task: MakeTask
) -> None:
    pending_noop = make_task(company.id)
    failed_noop = make_task(company.id, status="failed", finished_at=text("now()"))
    pending_sleep = make_task(company.id, type="sleep", payload={"seconds": 1})

    assert ids_of(list_tasks(client, company, "status=failed")) == [str(failed_noop.id)]
    assert set(ids_of(list_tasks(client, company, "type=noop"))) == {
        str(pending_noop.id),
        str(failed_noop.id),
    }
    both = list_tasks(client, company, "status=pending&type=sleep")
    assert ids_of(both) == [str(pending_sleep.id)]
    assert list_tasks(client, company, "status=completed")["items"] == []


def test_list_pages_with_limit_offset_and_has_more(
    client: FlaskClient, company: CompanyWithKey, make_task: MakeTask
) -> None:
    rows = [
        make_task(company.id, created_at=text(f"now() - interval '{minutes} minutes'"))
        for minutes in range(5)
    ]
    newest_first = [str(row.id) for row in rows]

    first = list_tasks(client, company, "limit=2")
    second = list_tasks(client, company, "limit=2&offset=2")
    last = list_tasks(client, company, "limit=2&offset=4")
    beyond = list_tasks(client, company, "limit=2&offset=5")

    assert (first["limit"], first["offset"], first["has_more"]) == (2, 0, True)
    assert (second["limit"], second["offset"], second["has_more"]) == (2, 2, True)
    assert (last["limit"], last["offset"], last["has_more"]) == (2, 4, False)
    assert (beyond["items"], beyond["has_more"]) == ([], False)
    assert ids_of(first) + ids_of(second) + ids_of(last) == newest_first


def test_list_merges_leased_tasks_in_their_place_on_every_page_and_filter(
    client: FlaskClient, company: CompanyWithKey, make_task: MakeTask
) -> None:
    """Leased (`processing`) tasks are listed from their own index (migration 0009), merged
    with the rest by (created_at, id) descending: paging and filters see one sequence."""
    statuses = ["processing", "pending", "completed", "processing", "failed", "processing"]
    statuses += ["cancelled", "pending", "processing", "completed", "processing", "pending"]
    rows = [
        make_task(
            company.id,
            type="noop" if n % 2 else "sleep",
            payload={} if n % 2 else {"seconds": 1},
            status=status,
            created_at=text(f"now() - interval '{n} minutes'"),
            **(
                {"locked_at": text("now()"), "lease_token": uuid.uuid4(), "locked_by": "w:1"}
                if status == "processing"
                else {"finished_at": text("now()")}
                if status in ("completed", "failed", "cancelled")
                else {}
            ),
        )
        for n, status in enumerate(statuses)
    ]
    newest_first = [(str(row.id), row.status, row.type) for row in rows]

    pages = [list_tasks(client, company, f"limit=5&offset={offset}") for offset in (0, 5, 10)]
    assert [p["has_more"] for p in pages] == [True, True, False]
    assert [i for p in pages for i in ids_of(p)] == [i for i, _, _ in newest_first]
    filters: list[tuple[str, str | None, str | None, slice]] = [
        ("status=processing", "processing", None, slice(None)),
        ("status=processing&type=noop", "processing", "noop", slice(None)),
        ("status=pending", "pending", None, slice(None)),
        ("type=sleep", None, "sleep", slice(None)),
        ("type=noop&limit=2&offset=1", None, "noop", slice(1, 3)),
    ]
    for query, status, task_type, page in filters:
        expected = [
            i for i, s, t in newest_first if status in (None, s) and task_type in (None, t)
        ][page]
        assert ids_of(list_tasks(client, company, query)) == expected, query


def test_list_defaults_to_20_items_from_offset_0(
    client: FlaskClient, company: CompanyWithKey, make_task: MakeTask
) -> None:
    for _ in range(21):
        make_task(company.id)

    page = list_tasks(client, company)

    assert (len(page["items"]), page["limit"], page["offset"], page["has_more"]) == (
        20,
        20,
        0,
        True,
    )
    assert set(page["items"][0]) == TASK_FIELDS


def test_cancel_pending_task_returns_it_cancelled_with_finished_at(
    client: FlaskClient, company: CompanyWithKey, created_task: CreatedTask
) -> None:
    task = created_task(company)

    response = client.post(tasks_url(company, f"/{task['id']}/cancel"), headers=company.headers)

    assert response.status_code == 200
    cancelled = json_of(response)
    assert cancelled["id"] == task["id"]
    assert cancelled["status"] == "cancelled"
    assert cancelled["finished_at"] is not None
    fetched = json_of(client.get(tasks_url(company, f"/{task['id']}"), headers=company.headers))
    assert fetched == cancelled


def test_cancel_twice_is_409_with_a_message(
    client: FlaskClient, company: CompanyWithKey, created_task: CreatedTask
) -> None:
    task = created_task(company)
    url = tasks_url(company, f"/{task['id']}/cancel")
    assert client.post(url, headers=company.headers).status_code == 200

    response = client.post(url, headers=company.headers)

    assert response.status_code == 409
    body = json_of(response)
    assert body["code"] == 409
    assert body["status"] == "Conflict"
    assert "cancelled" in body["message"]


@pytest.mark.parametrize("status", ["processing", "completed", "failed"])
def test_cancel_is_409_unless_pending(
    client: FlaskClient, company: CompanyWithKey, make_task: MakeTask, status: str
) -> None:
    row = make_task(company.id, status=status)

    response = client.post(tasks_url(company, f"/{row.id}/cancel"), headers=company.headers)

    assert response.status_code == 409
    assert status in json_of(response)["message"]
    fetched = json_of(client.get(tasks_url(company, f"/{row.id}"), headers=company.headers))
    assert fetched["status"] == status


@pytest.mark.parametrize("status", ["cancelled", "failed"])
def test_retry_returns_the_task_pending_with_attempts_reset(
    client: FlaskClient, company: CompanyWithKey, make_task: MakeTask, status: str
) -> None:
    row = make_task(
        company.id,
        status=status,
        attempts=5,
        max_attempts=5,
        last_error="boom",
        run_after=text("now() + interval '1 day'"),
        finished_at=text("now()"),
    )

    response = client.post(tasks_url(company, f"/{row.id}/retry"), headers=company.headers)

    assert response.status_code == 200
    task = json_of(response)
    assert task["status"] == "pending"
    assert task["attempts"] == 0
    assert task["finished_at"] is None
    # Runnable now again, not at its old run_after.
    assert dt.datetime.fromisoformat(task["run_after"]) <= dt.datetime.fromisoformat(
        task["updated_at"]
    )


def test_retry_of_a_cancelled_task_created_through_the_api(
    client: FlaskClient, company: CompanyWithKey, created_task: CreatedTask
) -> None:
    task = created_task(company)
    client.post(tasks_url(company, f"/{task['id']}/cancel"), headers=company.headers)

    response = client.post(tasks_url(company, f"/{task['id']}/retry"), headers=company.headers)

    assert response.status_code == 200
    assert json_of(response)["status"] == "pending"
    assert json_of(response)["attempts"] == 0


@pytest.mark.parametrize("status", ["pending", "processing", "completed"])
def test_retry_is_409_unless_failed_or_cancelled(
    client: FlaskClient, company: CompanyWithKey, make_task: MakeTask, status: str
) -> None:
    row = make_task(company.id, status=status, attempts=1)

    response = client.post(tasks_url(company, f"/{row.id}/retry"), headers=company.headers)

    assert response.status_code == 409
    body = json_of(response)
    assert body["code"] == 409
    assert status in body["message"]
    fetched = json_of(client.get(tasks_url(company, f"/{row.id}"), headers=company.headers))
    assert (fetched["status"], fetched["attempts"]) == (status, 1)


@pytest.mark.parametrize("action", ["cancel", "retry"])
def test_cancel_or_retry_of_an_unknown_task_is_404(
    client: FlaskClient, company: CompanyWithKey, action: str
) -> None:
    response = client.post(tasks_url(company, f"/{uuid.uuid4()}/{action}"), headers=company.headers)

    assert response.status_code == 404
    assert json_of(response)["code"] == 404


def test_run_at_in_the_past_means_now_and_does_not_jump_the_queue(
    client: FlaskClient, make_company: MakeCompany
) -> None:
    company = make_company()
    response = client.post(
        f"/companies/{company.id}/tasks",
        json={"type": "noop", "run_at": "2001-01-01T00:00:00+00:00"},
        headers=company.headers,
    )

    assert response.status_code == 201
    task = response.get_json()
    # Runnable at once, but eligible since its creation, not since 2001.
    assert task["run_after"] == task["created_at"]


# -- serialization -----------------------------------------------------------------------------


# Aware instants in any zone (fixed offsets, DST zones with either fold), as psycopg reads them.
_instants = st.datetimes(
    min_value=dt.datetime(1970, 1, 2),
    max_value=dt.datetime(9998, 12, 31),
    timezones=st.one_of(st.timezones(), st.just(dt.UTC)),
    allow_imaginary=False,
)
_records = st.builds(
    queue.TaskRecord,
    id=st.uuids(),
    company_id=st.uuids(),
    type=st.text(min_size=1, max_size=30),
    payload=st.dictionaries(st.text(max_size=10), json_values, max_size=5),
    status=st.sampled_from([status.value for status in TaskStatus]),
    attempts=st.integers(0, 100),
    max_attempts=st.integers(1, 100),
    timeout_seconds=st.none() | st.integers(1, 86_400),
    run_after=_instants,
    idempotency_key=st.none() | st.text(min_size=1, max_size=30),
    request_hash=st.none() | st.text(max_size=64),
    last_error=st.none() | st.text(max_size=50),
    created_at=_instants,
    updated_at=_instants,
    started_at=st.none() | _instants,
    finished_at=st.none() | _instants,
    result=json_values,
)


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(records=st.lists(_records, max_size=5))
def test_task_response_gives_what_the_task_schema_gives_for_any_task(
    shared_app: Flask, records: list[queue.TaskRecord]
) -> None:
    # Create and read answer with `task_response`; the OpenAPI document describes `TaskSchema`.
    with shared_app.app_context():
        for record in records:
            assert task_response(record).get_json() == TaskSchema().dump(record)
            assert task_response(record).get_data() == jsonify(TaskSchema().dump(record)).get_data()


def test_create_read_and_list_answer_the_schemas_bytes(
    app: Flask, client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    created = client.post(
        tasks_url(company),
        json={"type": "sleep", "payload": {"seconds": 1}, "max_attempts": 2},
        headers={**company.headers, "Idempotency-Key": "bytes-1"},
    )
    replayed = client.post(
        tasks_url(company),
        json={"type": "sleep", "payload": {"seconds": 1}, "max_attempts": 2},
        headers={**company.headers, "Idempotency-Key": "bytes-1"},
    )
    task_id = uuid.UUID(json_of(created)["id"])
    read = client.get(tasks_url(company, f"/{task_id}"), headers=company.headers)
    page = client.get(tasks_url(company, "?limit=5"), headers=company.headers)

    record = queue.get_task(driver_connection(db_session, transaction=False), company.id, task_id)
    with app.app_context():
        # What flask-smorest sends for a schema's dump: `jsonify`.
        one = jsonify(TaskSchema().dump(record)).get_data()
        listed = jsonify(
            TaskPageSchema().dump({"items": [record], "limit": 5, "offset": 0, "has_more": False})
        ).get_data()
    assert (created.status_code, replayed.status_code, read.status_code) == (201, 200, 200)
    assert created.get_data() == replayed.get_data() == read.get_data() == one
    assert page.get_data() == listed
    assert created.headers["Location"].endswith(f"/tasks/{task_id}")
    assert created.content_type == read.content_type == page.content_type == "application/json"
