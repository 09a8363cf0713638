"""POST /companies/{companyId}/task-batches: many tasks in one request, all or nothing (design §3).

A batch behaves as its items created one at a time in order with the single create, except
that nothing is stored unless every item is: the same validation per item (its errors named
`tasks[<index>].<field>`), the same Idempotency-Key rules per item (the single create's
request fingerprint), one statement and one NOTIFY for the whole batch.
"""

from __future__ import annotations

import datetime as dt
import importlib
import json
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any

import psycopg
import pytest
import requests
from flask.testing import FlaskClient
from sqlalchemy import Engine, func, select, text
from sqlalchemy.orm import Session
from werkzeug.test import TestResponse

from api import errors as api_errors
from api.settings import ApiSettings
from api.tasks.routes import BATCH_KEY_HEADER_REFUSED
from api.tasks.schemas import MAX_BATCH_TASKS
from db import claims, errors, queue
from db.engine import driver_connection
from db.models import Task
from tests import pg
from tests import test_openapi_client as openapi_client
from tests.conftest import ADMIN_TOKEN, serve_app
from tests.factories import (
    CompanyWithKey,
    MakeCompany,
    count_tasks,
    insert_company,
    json_of,
)

# The client openapi-python-client generates from the served document, and its server.
live_api_url = openapi_client.live_api_url
spec = openapi_client.spec
generated_client = openapi_client.generated_client


def post_batch(
    client: FlaskClient, company: CompanyWithKey, body: Any, **headers: str
) -> TestResponse:
    """POST `body` (an object, or raw JSON text) to the company's task batches."""
    return client.post(
        f"/companies/{company.id}/task-batches",
        data=body if isinstance(body, str | bytes) else json.dumps(body),
        content_type="application/json",
        headers={**company.headers, **headers},
    )


def post_task(
    client: FlaskClient, company: CompanyWithKey, body: dict[str, Any], key: str | None = None
) -> TestResponse:
    """The single create, with an Idempotency-Key header when `key` is given."""
    headers = company.headers if key is None else {**company.headers, "Idempotency-Key": key}
    return client.post(f"/companies/{company.id}/tasks", json=body, headers=headers)


def items_of(response: TestResponse) -> list[dict[str, Any]]:
    """The `items` of a batch's answer."""
    items: list[dict[str, Any]] = json_of(response)["items"]
    return items


def assert_422(response: TestResponse) -> dict[str, Any]:
    """A 422 in the one error shape; return its `errors.json`, or {} when it has none."""
    assert response.status_code == 422, response.get_data(as_text=True)[:500]
    body = json_of(response)
    assert body["code"] == 422
    assert body["message"]
    found: dict[str, Any] = body.get("errors", {}).get("json", {})
    return found


# -- creating ----------------------------------------------------------------------------------


def test_a_batch_creates_its_tasks_in_request_order_with_201(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    tasks: list[dict[str, Any]] = [
        {"type": "noop"},
        {"type": "sleep", "payload": {"seconds": 2}, "max_attempts": 3},
        {"type": "send_email", "payload": {"to": "a@example.com", "subject": "hi"}},
        {"type": "webhook", "payload": {"url": "https://example.com/h"}, "timeout_seconds": 9},
    ]

    response = post_batch(client, company, {"tasks": tasks})

    assert response.status_code == 201
    items = items_of(response)
    assert [item["type"] for item in items] == [task["type"] for task in tasks]
    assert [item["payload"] for item in items] == [task.get("payload", {}) for task in tasks]
    assert [item["max_attempts"] for item in items] == [5, 3, 5, 5]
    # The type's default timeout when the item gives none, as for the single create.
    assert [item["timeout_seconds"] for item in items] == [60, 32, 90, 9]
    assert {item["status"] for item in items} == {"pending"}
    assert {item["company_id"] for item in items} == {str(company.id)}
    assert [item["replayed"] for item in items] == [False] * 4
    assert count_tasks(db_session, company.id) == 4


def test_each_item_is_the_task_json_of_a_read_plus_replayed(
    client: FlaskClient, company: CompanyWithKey
) -> None:
    response = post_batch(
        client,
        company,
        {"tasks": [{"type": "noop", "idempotency_key": "k-1"}, {"type": "noop"}]},
    )

    for item in items_of(response):
        read = client.get(f"/companies/{company.id}/tasks/{item['id']}", headers=company.headers)
        assert {**json_of(read), "replayed": False} == item


def test_a_batch_is_claimed_in_request_order(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    tasks = [{"type": "noop", "payload": {}, "idempotency_key": f"n-{n}"} for n in range(30)]
    ids = [item["id"] for item in items_of(post_batch(client, company, {"tasks": tasks}))]

    claimed = claims.claim(
        driver_connection(db_session, transaction=False), worker_id="test:1", batch_size=30
    )

    # One now() for the whole batch: ids in request order break the tie in run_after.
    assert [str(task.id) for task in claimed] == ids
    page = client.get(f"/companies/{company.id}/tasks?limit=30", headers=company.headers)
    assert [item["id"] for item in json_of(page)["items"]] == ids[::-1]


def test_run_at_is_kept_per_item_and_a_past_one_means_now(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    later = "2099-01-01T00:00:00+00:00"
    tasks = [
        {"type": "noop", "run_at": later},
        {"type": "noop", "run_at": "2000-01-01T00:00:00+00:00"},
        {"type": "noop"},
    ]

    items = items_of(post_batch(client, company, {"tasks": tasks}))

    assert dt.datetime.fromisoformat(items[0]["run_after"]) == dt.datetime.fromisoformat(later)
    now = db_session.execute(select(func.now())).scalar_one()
    assert {dt.datetime.fromisoformat(item["run_after"]) for item in items[1:]} == {now}


def test_1000_items_fit_in_one_batch(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    tasks = [{"type": "sleep", "payload": {"seconds": n % 300}} for n in range(MAX_BATCH_TASKS)]

    response = post_batch(client, company, {"tasks": tasks})

    assert response.status_code == 201
    assert [item["payload"]["seconds"] for item in items_of(response)] == [
        n % 300 for n in range(MAX_BATCH_TASKS)
    ]
    assert count_tasks(db_session, company.id) == MAX_BATCH_TASKS


# -- refusing bad input: 422 naming the item, nothing stored -----------------------------------


@pytest.mark.parametrize(
    ("item", "field"),
    [
        ({"type": "nope"}, "tasks[3].type"),
        ({"type": "sleep", "payload": {"seconds": -1}}, "tasks[3].payload"),
        ({"type": "noop", "payload": []}, "tasks[3].payload"),
        ({"type": "noop", "max_attempts": 0}, "tasks[3].max_attempts"),
        ({"type": "noop", "timeout_seconds": 86_401}, "tasks[3].timeout_seconds"),
        ({"type": "noop", "run_at": "tomorrow"}, "tasks[3].run_at"),
        ({"type": "noop", "colour": "red"}, "tasks[3].colour"),
        ({"type": "noop", "idempotency_key": "has space"}, "tasks[3].idempotency_key"),
        ({"type": "noop", "idempotency_key": "k" * 256}, "tasks[3].idempotency_key"),
        ({"payload": {}}, "tasks[3].type"),
        ("noop", "tasks[3]"),
        (None, "tasks[3]"),
    ],
    ids=[
        "unknown-type", "payload-out-of-range", "payload-not-object", "max-attempts",
        "timeout", "run-at", "unknown-field", "key-with-space", "key-too-long",
        "missing-type", "string-item", "null-item",
    ],
)  # fmt: skip
def test_an_invalid_item_is_422_naming_its_index_and_field_and_nothing_is_stored(
    client: FlaskClient, company: CompanyWithKey, db_session: Session, item: Any, field: str
) -> None:
    tasks = [{"type": "noop"}] * 3 + [item] + [{"type": "noop"}]

    response = post_batch(client, company, {"tasks": tasks})

    errors_ = assert_422(response)
    assert list(errors_) == [field]
    assert f"json.{field}" in json_of(response)["message"]
    assert count_tasks(db_session, company.id) == 0


@pytest.mark.parametrize("key", ["", "order-42"], ids=["empty", "a-key"])
def test_an_idempotency_key_header_is_422_naming_it_and_nothing_is_stored(
    client: FlaskClient, company: CompanyWithKey, db_session: Session, key: str
) -> None:
    body = {"tasks": [{"type": "noop"}, {"type": "noop", "idempotency_key": "item-1"}]}

    answers = [post_batch(client, company, body, **{"Idempotency-Key": key}) for _ in range(2)]

    for response in answers:
        assert assert_422(response) == {}
        error = json_of(response)
        assert error["errors"] == {"headers": {"Idempotency-Key": [BATCH_KEY_HEADER_REFUSED]}}
        assert error["message"] == f"invalid headers.Idempotency-Key: {BATCH_KEY_HEADER_REFUSED}"
    assert count_tasks(db_session, company.id) == 0


def test_an_idempotency_key_header_is_refused_after_authentication(
    client: FlaskClient, company: CompanyWithKey
) -> None:
    response = client.post(
        f"/companies/{company.id}/task-batches",
        json={"tasks": [{"type": "noop"}]},
        headers={"Idempotency-Key": "order-42"},
    )

    assert response.status_code == 401


@pytest.mark.parametrize("key", ["", "k" * 256], ids=["empty", "too-long"])
def test_a_key_of_a_wrong_length_gets_one_message_saying_how_to_send_none(
    client: FlaskClient, company: CompanyWithKey, key: str
) -> None:
    tasks = [{"type": "noop", "idempotency_key": key}]

    errors_ = assert_422(post_batch(client, company, {"tasks": tasks}))

    assert errors_ == {
        "tasks[0].idempotency_key": [
            "must be 1..255 characters long; send null or leave it out for no key"
        ]
    }


def test_the_errors_of_an_item_are_those_of_the_single_create(
    client: FlaskClient, company: CompanyWithKey
) -> None:
    item = {"type": "sleep", "payload": {"seconds": 301}, "max_attempts": 99}

    single = assert_422(post_task(client, company, item))
    batch = assert_422(post_batch(client, company, {"tasks": [{"type": "noop"}, item]}))

    assert batch == {f"tasks[1].{field}": why for field, why in single.items()}


def test_every_invalid_item_is_named_in_index_order(
    client: FlaskClient, company: CompanyWithKey
) -> None:
    tasks: list[dict[str, Any]] = [{"type": "noop"}] * 12
    tasks[11] = {"type": "nope"}
    tasks[2] = {"type": "noop", "max_attempts": "5"}
    tasks[10] = {"type": "sleep", "payload": {}}

    response = post_batch(client, company, {"tasks": tasks})

    assert set(assert_422(response)) == {
        "tasks[2].max_attempts",
        "tasks[10].payload",
        "tasks[11].type",
    }
    # (The JSON object's keys come sorted as strings; the message keeps the index order.)
    message = json_of(response)["message"]
    assert message.index("tasks[2]") < message.index("tasks[10]") < message.index("tasks[11]")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "tasks"),
        ({"tasks": []}, "tasks"),
        ({"tasks": {"type": "noop"}}, "tasks"),
        ({"tasks": None}, "tasks"),
        ({"tasks": [{"type": "noop"}], "priority": 1}, "priority"),
    ],
    ids=["missing", "empty", "object", "null", "unknown-field"],
)
def test_a_batch_without_a_list_of_tasks_is_422(
    client: FlaskClient,
    company: CompanyWithKey,
    db_session: Session,
    body: dict[str, Any],
    field: str,
) -> None:
    response = post_batch(client, company, body)

    assert field in assert_422(response)
    assert count_tasks(db_session, company.id) == 0


def test_more_than_1000_items_is_422_before_any_item_is_validated(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    # Every item is invalid, yet only the count is reported: items were never looked at.
    response = post_batch(client, company, {"tasks": [{"type": "nope"}] * (MAX_BATCH_TASKS + 1)})

    errors_ = assert_422(response)
    assert list(errors_) == ["tasks"]
    assert f"at most {MAX_BATCH_TASKS} items, got {MAX_BATCH_TASKS + 1}" in errors_["tasks"][0]
    assert count_tasks(db_session, company.id) == 0


def test_a_batch_may_be_larger_than_the_single_creates_1_mib(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    item = {"type": "webhook", "payload": {"url": "https://example.com/h", "body": "x" * 3000}}
    body = json.dumps({"tasks": [item] * 1000})
    assert ApiSettings.max_body_bytes < len(body) < ApiSettings.max_batch_body_bytes

    response = post_batch(client, company, body)

    assert response.status_code == 201
    assert count_tasks(db_session, company.id) == 1000


def test_a_batch_body_above_its_limit_is_413_naming_the_limit(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    limit = ApiSettings.max_batch_body_bytes
    body = json.dumps({"tasks": [{"type": "noop", "payload": {"pad": "x" * limit}}]})

    response = post_batch(client, company, body)

    assert response.status_code == 413
    assert json_of(response)["message"] == f"the request body must be at most {limit} bytes"
    assert count_tasks(db_session, company.id) == 0


def test_the_single_create_keeps_its_own_1_mib_limit(
    client: FlaskClient, company: CompanyWithKey
) -> None:
    limit = ApiSettings.max_body_bytes
    body = {"type": "webhook", "payload": {"url": "https://example.com/h", "body": "x" * limit}}

    response = post_task(client, company, body)

    assert response.status_code == 413
    assert json_of(response)["message"] == f"the request body must be at most {limit} bytes"


def test_a_chunked_batch_body_is_held_to_the_batch_limit(
    fresh_db_url: str, fresh_engine: Engine
) -> None:
    # Without Content-Length the parser reads the stream itself, to one byte past the limit.
    company = insert_company(fresh_engine)
    limit = ApiSettings.max_batch_body_bytes
    small = json.dumps({"tasks": [{"type": "noop", "payload": {"pad": "x" * 2**21}}]}).encode()
    large = json.dumps({"tasks": [{"type": "noop", "payload": {"pad": "x" * limit}}]}).encode()

    def chunks(body: bytes) -> Iterator[bytes]:
        for start in range(0, len(body), 65536):
            yield body[start : start + 65536]

    with serve_app(fresh_db_url) as port:
        url = f"http://127.0.0.1:{port}/companies/{company.id}/task-batches"
        headers = {**company.headers, "Content-Type": "application/json"}
        accepted = requests.post(url, data=chunks(small), headers=headers, timeout=60)
        refused = requests.post(url, data=chunks(large), headers=headers, timeout=60)

    # A 2 MiB payload is over the payload's own 64 KiB: a 422, so the body was read whole.
    assert accepted.status_code == 422, accepted.text[:300]
    assert "tasks[0].payload" in accepted.json()["errors"]["json"]
    assert refused.status_code == 413, refused.text[:300]
    assert refused.json()["message"] == f"the request body must be at most {limit} bytes"


# -- idempotency per item ----------------------------------------------------------------------


def test_an_item_whose_key_was_used_with_the_same_body_is_replayed_as_it_is(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    body = {"type": "sleep", "payload": {"seconds": 1}}
    first = json_of(post_task(client, company, body, key="order-42"))
    client.post(f"/companies/{company.id}/tasks/{first['id']}/cancel", headers=company.headers)

    response = post_batch(
        client,
        company,
        {"tasks": [{"type": "noop"}, {**body, "idempotency_key": "order-42"}, {"type": "noop"}]},
    )

    assert response.status_code == 201
    items = items_of(response)
    assert [item["replayed"] for item in items] == [False, True, False]
    assert items[1]["id"] == first["id"]
    assert items[1]["status"] == "cancelled"
    assert count_tasks(db_session, company.id) == 3


def test_a_key_from_a_batch_replays_on_the_single_create_and_the_reverse(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    # Default values spelled out on one side only, keys in another order: the same body.
    batch = items_of(
        post_batch(
            client,
            company,
            {"tasks": [{"payload": {"seconds": 3}, "type": "sleep", "idempotency_key": "a"}]},
        )
    )
    single = post_task(
        client,
        company,
        {"type": "sleep", "payload": {"seconds": 3}, "max_attempts": 5, "timeout_seconds": 33},
        key="a",
    )
    created = json_of(post_task(client, company, {"type": "noop"}, key="b"))
    replayed = post_batch(
        client, company, {"tasks": [{"type": "noop", "payload": {}, "idempotency_key": "b"}]}
    )

    assert single.status_code == 200
    assert json_of(single)["id"] == batch[0]["id"]
    assert replayed.status_code == 200
    assert items_of(replayed)[0]["id"] == created["id"]
    assert count_tasks(db_session, company.id) == 2


def test_a_key_used_with_another_body_makes_the_whole_batch_422_naming_the_item(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    post_task(client, company, {"type": "sleep", "payload": {"seconds": 1}}, key="k")

    response = post_batch(
        client,
        company,
        {
            "tasks": [
                {"type": "noop"},
                {"type": "sleep", "payload": {"seconds": 2}, "idempotency_key": "k"},
            ]
        },
    )

    errors_ = assert_422(response)
    message = json_of(response)["message"]
    assert message.startswith("tasks[1]")
    assert "Idempotency-Key" in message
    assert errors_ == {"tasks[1].idempotency_key": [message]}
    assert count_tasks(db_session, company.id) == 1


def test_two_items_with_one_key_and_one_body_are_one_task(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    item = {"type": "noop", "idempotency_key": "twice"}

    response = post_batch(client, company, {"tasks": [item, {"type": "noop"}, item]})

    assert response.status_code == 201
    items = items_of(response)
    assert [item["replayed"] for item in items] == [False, False, True]
    assert items[2] == {**items[0], "replayed": True}
    assert count_tasks(db_session, company.id) == 2


def test_two_items_with_one_key_and_different_bodies_are_422_naming_both(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    tasks = [
        {"type": "noop", "idempotency_key": "twice"},
        {"type": "noop", "idempotency_key": "twice", "max_attempts": 2},
    ]

    response = post_batch(client, company, {"tasks": tasks})

    errors_ = assert_422(response)
    message = json_of(response)["message"]
    assert "tasks[1]" in message
    assert "tasks[0]" in message
    assert errors_ == {"tasks[1].idempotency_key": [message]}
    assert count_tasks(db_session, company.id) == 0


def test_a_batch_of_only_replays_is_200_and_creates_nothing(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    tasks = [{"type": "noop", "idempotency_key": f"k-{n}"} for n in range(3)]
    first = post_batch(client, company, {"tasks": tasks})

    again = post_batch(client, company, {"tasks": tasks})

    assert first.status_code == 201
    assert "Idempotent-Replayed" not in first.headers
    assert again.status_code == 200
    assert again.headers["Idempotent-Replayed"] == "true"
    assert items_of(again) == [{**item, "replayed": True} for item in items_of(first)]
    assert count_tasks(db_session, company.id) == 3


def test_a_null_key_is_no_key(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    item = {"type": "noop", "idempotency_key": None}

    response = post_batch(client, company, {"tasks": [item, item]})

    assert response.status_code == 201
    assert [task["idempotency_key"] for task in items_of(response)] == [None, None]
    assert count_tasks(db_session, company.id) == 2


def test_a_key_in_another_companys_batch_is_another_task(
    client: FlaskClient, make_company: MakeCompany
) -> None:
    first, second = make_company("first"), make_company("second")
    body = {"tasks": [{"type": "noop", "idempotency_key": "shared"}]}

    a, b = post_batch(client, first, body), post_batch(client, second, body)

    assert (a.status_code, b.status_code) == (201, 201)
    assert items_of(a)[0]["id"] != items_of(b)[0]["id"]


# -- against concurrent creates, on the database itself ----------------------------------------


def new_task(key: str | None = None, request_hash: str | None = None) -> queue.NewTask:
    """A noop task for `queue.create_tasks`."""
    return queue.NewTask("noop", {}, None, 5, 60, key, request_hash)


def wait_for_a_lock_wait(engine: Engine, timeout: float = 30.0) -> None:
    """Return once a session of the database waits for a lock (a conflicting insert)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        # A transaction per look: within one, pg_stat_activity shows the same snapshot.
        with engine.connect() as conn:
            waiting = conn.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND wait_event_type = 'Lock'"
                )
            ).scalar_one()
        if waiting:
            return
        time.sleep(0.02)
    raise AssertionError("no session started waiting for a lock")


def batch_during_an_open_create(
    engine: Engine, company_id: uuid.UUID, batch_hash: str
) -> tuple[uuid.UUID, list[tuple[queue.TaskRecord, bool]] | Exception]:
    """Run a batch whose key `k` another transaction is inserting, then let that one commit.

    The batch's statement takes its snapshot first, then waits on the other's row in the
    unique index, and finds its key taken by a row its snapshot cannot see.
    """
    with Session(engine) as holder:
        held, _ = queue.create_task(
        driver_connection(holder, transaction=False),
        company_id=company_id, type="noop", payload={}, max_attempts=5,
            timeout_seconds=60, idempotency_key="k", request_hash="hash-1",
        )  # fmt: skip

        def batch() -> list[tuple[queue.TaskRecord, bool]]:
            with Session(engine) as session:
                created = queue.create_tasks(
                    driver_connection(session, transaction=False),
                    company_id=company_id,
                    tasks=[new_task(), new_task("k", batch_hash), new_task("other", "h")],
                )
                session.commit()
                return created

        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(batch)
            try:
                wait_for_a_lock_wait(engine)
            finally:
                # Also when the wait failed: the batch's thread must not wait forever.
                holder.commit()
            try:
                return held.id, future.result(timeout=30)
            except errors.DomainError as exc:
                return held.id, exc


def test_a_key_committed_by_a_concurrent_create_is_replayed_not_lost(
    fresh_engine: Engine, fresh_company_id: uuid.UUID
) -> None:
    held, results = batch_during_an_open_create(fresh_engine, fresh_company_id, "hash-1")

    assert not isinstance(results, Exception), results
    assert [created for _, created in results] == [True, False, True]
    assert results[1][0].id == held
    with Session(fresh_engine) as session:
        assert count_tasks(session, fresh_company_id) == 3


def test_a_concurrent_key_with_another_body_leaves_nothing_of_the_batch(
    fresh_engine: Engine, fresh_company_id: uuid.UUID
) -> None:
    _, results = batch_during_an_open_create(fresh_engine, fresh_company_id, "hash-2")

    assert isinstance(results, errors.IdempotencyKeyReused)
    assert str(results).startswith("tasks[1]")
    with Session(fresh_engine) as session:
        stored = session.scalars(select(Task.idempotency_key)).all()
    assert stored == ["k"]


def test_a_batch_wakes_idle_workers_once_and_a_batch_of_replays_not_at_all(
    fresh_db_url: str, fresh_engine: Engine, fresh_company_id: uuid.UUID
) -> None:
    tasks = [new_task(f"k-{n}", "h") for n in range(3)]
    with psycopg.connect(pg.libpq(fresh_db_url), autocommit=True) as listener:
        listener.execute("LISTEN batch_test")
        for _ in range(2):
            with Session(fresh_engine) as session:
                queue.create_tasks(
                    driver_connection(session, transaction=False),
                    company_id=fresh_company_id,
                    tasks=tasks,
                    notify_channel="batch_test",
                )
                session.commit()
        notes = list(listener.notifies(timeout=1.0))

    assert [(note.channel, note.payload) for note in notes] == [
        ("batch_test", str(fresh_company_id))
    ]


def test_concurrent_batches_with_the_same_keys_store_each_task_once(
    fresh_db_url: str, fresh_engine: Engine
) -> None:
    company = insert_company(fresh_engine)
    body = {"tasks": [{"type": "noop", "idempotency_key": f"k-{n}"} for n in range(50)]}
    clients = 10
    start = threading.Barrier(clients)

    def send(port: int) -> requests.Response:
        start.wait(timeout=30)
        return requests.post(
            f"http://127.0.0.1:{port}/companies/{company.id}/task-batches",
            json=body,
            headers=company.headers,
            timeout=60,
        )

    with serve_app(fresh_db_url) as port, ThreadPoolExecutor(clients) as pool:
        answers = list(pool.map(send, [port] * clients))

    assert sorted(answer.status_code for answer in answers) == [200] * (clients - 1) + [201]
    ids = {tuple(item["id"] for item in answer.json()["items"]) for answer in answers}
    assert len(ids) == 1
    with Session(fresh_engine) as session:
        assert count_tasks(session, company.id) == 50


# -- the OpenAPI document ----------------------------------------------------------------------


def test_the_batch_is_documented(client: FlaskClient) -> None:
    document = json_of(client.get("/openapi.json"))
    operation = document["paths"]["/companies/{company_id}/task-batches"]["post"]

    assert operation["operationId"] == "create_task_batch"
    assert {"200", "201", "409", "413", "422", "429"} <= set(operation["responses"])
    assert "Idempotent-Replayed" in operation["responses"]["200"]["headers"]
    assert "8 MiB" in operation["responses"]["413"]["description"]
    assert "`Idempotency-Key` header" in operation["responses"]["422"]["description"]
    assert "Idempotency-Key" not in {p["name"] for p in operation.get("parameters", [])}
    assert "Retry-After" in operation["responses"]["429"]["headers"]
    body = operation["requestBody"]["content"]["application/json"]["schema"]
    request = document["components"]["schemas"][body["$ref"].rsplit("/", 1)[-1]]
    assert request["properties"]["tasks"]["maxItems"] == MAX_BATCH_TASKS
    assert request["properties"]["tasks"]["minItems"] == 1


def test_a_generated_client_creates_a_batch_and_reads_its_replay_and_429(
    generated_client: ModuleType, live_api_url: str
) -> None:
    def module(name: str) -> Any:
        return importlib.import_module(f"fairq_client.{name}")

    models = module("models")
    admin = generated_client.AuthenticatedClient(base_url=live_api_url, token=ADMIN_TOKEN)
    company = module("api.companies.create_company").sync(
        client=admin, body=models.CompanyCreate(name="Batches", max_pending=2)
    )
    tenant = generated_client.AuthenticatedClient(base_url=live_api_url, token=company.api_key)
    create_batch = module("api.tasks.create_task_batch")
    body = models.TaskBatchCreate(
        tasks=[
            models.TaskBatchItem(
                type_="noop", payload=models.TaskBatchItemPayload(), idempotency_key=key
            )
            for key in ("a", "b")
        ]
    )

    created = create_batch.sync_detailed(company.id, client=tenant, body=body)
    replayed = create_batch.sync_detailed(company.id, client=tenant, body=body)
    body.tasks[1].idempotency_key = "c"
    refused = create_batch.sync_detailed(company.id, client=tenant, body=body)

    assert created.status_code == 201
    assert isinstance(created.parsed, models.TaskBatch)
    assert [item.replayed for item in created.parsed.items] == [False, False]
    assert replayed.status_code == 200
    assert [item.id for item in replayed.parsed.items] == [i.id for i in created.parsed.items]
    assert refused.status_code == 429
    assert isinstance(refused.parsed, models.Error)
    assert "of at most 2" in refused.parsed.message
    assert refused.headers["Retry-After"] == str(api_errors.BACKLOG_RETRY_AFTER_SECONDS)
