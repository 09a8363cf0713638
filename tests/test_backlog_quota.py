"""The backlog quota's answer: 429 with Retry-After and the numbers, nothing stored (design §3).

A company's `max_pending` bounds its unfinished (pending or processing) tasks; the triggers of
migration 0006 refuse a statement that would go past it with SQLSTATE FQ429, and the API
answers 429 on every write that adds to the backlog: the single create, the batch (refused
whole) and the retry.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest
import requests
from flask.testing import FlaskClient
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session
from werkzeug.test import TestResponse

from api import errors
from db import claims, queue
from db.engine import driver_connection
from tests import pg
from tests.conftest import ADMIN_TOKEN, serve_app
from tests.factories import CompanyWithKey, MakeTask, count_tasks, insert_company, json_of

QUOTA_MESSAGE = re.compile(
    r"backlog quota exceeded: (\d+) unfinished tasks \(pending or processing\) of at most "
    r"(\d+) \(max_pending\), and this request adds (\d+)"
)


def set_max_pending(client: FlaskClient, company: CompanyWithKey, max_pending: int | None) -> None:
    """PATCH the company's quota as the admin."""
    response = client.patch(
        f"/companies/{company.id}",
        json={"max_pending": max_pending},
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
    )
    assert response.status_code == 200, response.get_json()


def create(client: FlaskClient, company: CompanyWithKey, key: str | None = None) -> TestResponse:
    """The single create of a noop task (with an Idempotency-Key when `key` is given)."""
    headers = company.headers if key is None else {**company.headers, "Idempotency-Key": key}
    return client.post(f"/companies/{company.id}/tasks", json={"type": "noop"}, headers=headers)


def create_batch(
    client: FlaskClient, company: CompanyWithKey, count: int, key_prefix: str | None = None
) -> TestResponse:
    """A batch of `count` noop tasks (keyed `<prefix>-<n>` when `key_prefix` is given)."""
    tasks = [
        {"type": "noop", **({"idempotency_key": f"{key_prefix}-{n}"} if key_prefix else {})}
        for n in range(count)
    ]
    return client.post(
        f"/companies/{company.id}/task-batches", json={"tasks": tasks}, headers=company.headers
    )


def assert_quota_refusal(
    response: TestResponse, *, unfinished: int, quota: int, adding: int
) -> None:
    """A 429 with Retry-After whose message gives the backlog, the quota and the addition."""
    assert response.status_code == 429, response.get_data(as_text=True)[:500]
    assert response.headers["Retry-After"] == str(errors.BACKLOG_RETRY_AFTER_SECONDS)
    body = json_of(response)
    assert (body["code"], body["status"]) == (429, "Too Many Requests")
    found = QUOTA_MESSAGE.match(body["message"])
    assert found, body["message"]
    assert tuple(int(n) for n in found.groups()) == (unfinished, quota, adding)


def backlog(session: Session, company_id: uuid.UUID) -> int:
    """The company's unfinished count as the triggers keep it."""
    return int(
        session.execute(
            text("SELECT unfinished FROM company_backlogs WHERE company_id = :id"),
            {"id": company_id},
        ).scalar_one()
    )


def test_at_the_quota_the_next_create_is_429_and_cancelling_one_makes_room(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    set_max_pending(client, company, 3)
    created = [create(client, company) for _ in range(3)]
    assert [response.status_code for response in created] == [201] * 3

    refused = create(client, company)

    assert_quota_refusal(refused, unfinished=3, quota=3, adding=1)
    assert count_tasks(db_session, company.id) == 3
    first = json_of(created[0])["id"]
    cancel = client.post(f"/companies/{company.id}/tasks/{first}/cancel", headers=company.headers)
    assert cancel.status_code == 200
    assert create(client, company).status_code == 201
    assert_quota_refusal(create(client, company), unfinished=3, quota=3, adding=1)
    assert backlog(db_session, company.id) == 3


def test_a_completed_task_makes_room_and_a_processing_one_does_not(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    set_max_pending(client, company, 2)
    assert create_batch(client, company, 2).status_code == 201
    claimed = claims.claim(
        driver_connection(db_session, transaction=False), worker_id="test:1", batch_size=1
    )
    assert len(claimed) == 1

    # Processing still counts: the claim moved nothing out of the backlog.
    assert_quota_refusal(create(client, company), unfinished=2, quota=2, adding=1)
    assert (
        claims.complete_tasks(driver_connection(db_session, transaction=False), [claimed[0]]) == []
    )
    assert create(client, company).status_code == 201
    assert backlog(db_session, company.id) == 2


def test_a_batch_that_does_not_fit_is_refused_whole(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    set_max_pending(client, company, 5)
    assert create_batch(client, company, 3).status_code == 201

    refused = create_batch(client, company, 3)

    assert_quota_refusal(refused, unfinished=3, quota=5, adding=3)
    assert count_tasks(db_session, company.id) == 3
    assert create_batch(client, company, 2).status_code == 201
    assert count_tasks(db_session, company.id) == 5


def test_replays_in_a_batch_take_no_room(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    set_max_pending(client, company, 4)
    assert create_batch(client, company, 3, key_prefix="k").status_code == 201

    # k-0..k-2 are there (replays, no room needed), k-3 takes the last slot.
    fits = create_batch(client, company, 4, key_prefix="k")
    # k-0..k-3 replayed, k-4 and k-5 are two more than the room left.
    refused = create_batch(client, company, 6, key_prefix="k")

    assert fits.status_code == 201
    assert [item["replayed"] for item in json_of(fits)["items"]] == [True] * 3 + [False]
    assert_quota_refusal(refused, unfinished=4, quota=4, adding=2)
    assert count_tasks(db_session, company.id) == 4


def test_a_batch_larger_than_the_quota_itself_is_422_as_it_can_never_fit(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    set_max_pending(client, company, 2)

    response = create_batch(client, company, 3)

    assert response.status_code == 422
    assert "Retry-After" not in response.headers
    message = json_of(response)["message"]
    assert "adds 3 tasks, more than the company's max_pending of 2" in message
    assert json_of(response)["errors"] == {"json": {"tasks": [message]}}
    assert count_tasks(db_session, company.id) == 0


def test_an_idempotent_replay_at_the_quota_still_replays(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    set_max_pending(client, company, 2)
    first = create(client, company, key="order-1")
    assert create_batch(client, company, 1, key_prefix="batch").status_code == 201

    again = create(client, company, key="order-1")
    batch_again = create_batch(client, company, 1, key_prefix="batch")

    assert again.status_code == 200
    assert again.headers["Idempotent-Replayed"] == "true"
    assert json_of(again)["id"] == json_of(first)["id"]
    assert batch_again.status_code == 200
    assert json_of(batch_again)["items"][0]["replayed"] is True
    assert_quota_refusal(create(client, company, key="order-2"), unfinished=2, quota=2, adding=1)
    assert count_tasks(db_session, company.id) == 2


@pytest.mark.parametrize("status", ["failed", "cancelled"])
def test_retrying_at_the_quota_is_429_and_leaves_the_task_as_it_was(
    client: FlaskClient,
    company: CompanyWithKey,
    make_task: MakeTask,
    db_session: Session,
    status: str,
) -> None:
    set_max_pending(client, company, 1)
    finished = make_task(company.id, status=status, attempts=5, last_error="boom")
    assert create(client, company).status_code == 201
    path = f"/companies/{company.id}/tasks/{finished.id}"

    refused = client.post(f"{path}/retry", headers=company.headers)

    assert_quota_refusal(refused, unfinished=1, quota=1, adding=1)
    task = json_of(client.get(path, headers=company.headers))
    assert (task["status"], task["attempts"]) == (status, 5)
    set_max_pending(client, company, 2)
    assert client.post(f"{path}/retry", headers=company.headers).status_code == 200


def test_lowering_max_pending_below_the_backlog_refuses_creates_until_it_drains(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    ids = [item["id"] for item in json_of(create_batch(client, company, 4))["items"]]

    set_max_pending(client, company, 2)

    # Nothing is dropped; new work waits until the backlog is below the new quota.
    assert count_tasks(db_session, company.id) == 4
    assert_quota_refusal(create(client, company), unfinished=4, quota=2, adding=1)
    for task_id in ids[:2]:
        client.post(f"/companies/{company.id}/tasks/{task_id}/cancel", headers=company.headers)
    assert_quota_refusal(create(client, company), unfinished=2, quota=2, adding=1)
    client.post(f"/companies/{company.id}/tasks/{ids[2]}/cancel", headers=company.headers)
    assert create(client, company).status_code == 201
    set_max_pending(client, company, None)
    assert create_batch(client, company, 10).status_code == 201


def test_a_quota_refusal_is_not_an_outage() -> None:
    # FQ429 arrives as an OperationalError (psycopg's class for an unknown SQLSTATE class),
    # like a lost connection; it must never be answered as a 503.
    body, status, headers = errors.backlog_quota_answer(
        "company=5f0e4fd2-0000-0000-0000-000000000000 max_pending=10 unfinished=10 adding=1"
    )
    assert status == 429
    assert headers == {"Retry-After": str(errors.BACKLOG_RETRY_AFTER_SECONDS)}
    assert QUOTA_MESSAGE.match(body["message"])
    fallback, status, headers = errors.backlog_quota_answer(None)
    assert status == 429
    assert fallback["message"].startswith("backlog quota exceeded")


def test_429_is_documented_with_retry_after_on_every_write_that_adds_to_the_backlog(
    client: FlaskClient,
) -> None:
    spec = json_of(client.get("/openapi.json"))
    operations = [
        spec["paths"]["/companies/{company_id}/tasks"]["post"],
        spec["paths"]["/companies/{company_id}/task-batches"]["post"],
        spec["paths"]["/companies/{company_id}/tasks/{task_id}/retry"]["post"],
    ]

    for operation in operations:
        answer = operation["responses"]["429"]
        assert "max_pending" in answer["description"]
        assert answer["headers"]["Retry-After"]["schema"] == {"type": "integer"}
        assert answer["content"]["application/json"]["schema"]["$ref"].endswith("/Error")


def test_20_parallel_creators_at_the_quota_never_exceed_it_and_the_201s_add_up(
    fresh_db_url: str, fresh_engine: Engine
) -> None:
    quota, prefilled = 40, 10
    with Session(fresh_engine) as session:
        company = insert_company(session)
        session.execute(
            text("UPDATE companies SET max_pending = :quota WHERE id = :id"),
            {"quota": quota, "id": company.id},
        )
        session.commit()
    creators, rounds = 20, 6
    start = threading.Barrier(creators)

    def creator(port: int, n: int) -> list[tuple[int, int, dict[str, Any]]]:
        """Half the creators send single creates, half batches of 1 to 3 tasks."""
        url = f"http://127.0.0.1:{port}/companies/{company.id}"
        answers = []
        with requests.Session() as http:
            http.headers.update(company.headers)
            start.wait(timeout=30)
            for r in range(rounds):
                if n % 2:
                    size = 1 + (n + r) % 3
                    tasks = [{"type": "noop"}] * size
                    response = http.post(f"{url}/task-batches", json={"tasks": tasks}, timeout=60)
                else:
                    size = 1
                    response = http.post(f"{url}/tasks", json={"type": "noop"}, timeout=60)
                answers.append((response.status_code, size, dict(response.headers)))
        return answers

    with serve_app(fresh_db_url) as port:
        with requests.Session() as http:
            for _ in range(prefilled):
                response = http.post(
                    f"http://127.0.0.1:{port}/companies/{company.id}/tasks",
                    json={"type": "noop"},
                    headers=company.headers,
                    timeout=30,
                )
                assert response.status_code == 201
        with ThreadPoolExecutor(creators) as pool:
            per_creator = list(pool.map(creator, [port] * creators, range(creators)))
    results = [answer for answers in per_creator for answer in answers]

    statuses = {status for status, _, _ in results}
    assert statuses <= {201, 429}, statuses
    assert all(
        headers.get("Retry-After") == str(errors.BACKLOG_RETRY_AFTER_SECONDS)
        for status, _, headers in results
        if status == 429
    )
    accepted = sum(size for status, size, _ in results if status == 201)
    with Session(fresh_engine) as session:
        stored = count_tasks(session, company.id)
        counted = backlog(session, company.id)
    assert stored == counted == prefilled + accepted
    assert stored <= quota
    # 60 single creates cannot all fit in 30 slots, and one is refused only at a full
    # backlog, which never shrinks here: the quota is reached exactly.
    assert stored == quota


# ---------------------------------------------------------------------------------------------
# The counter as any writer keeps it: plain SQL on the triggers (migrations 0006 and 0010).
# A statement inserting rows of one company takes migration 0010's one-statement count; rows
# of several companies take 0006's (per company, counters locked in company_id order).
# ---------------------------------------------------------------------------------------------

UNFINISHED_MISMATCHES = """
SELECT c.id, b.unfinished,
       (SELECT count(*) FROM tasks t
        WHERE t.company_id = c.id AND t.status IN ('pending', 'processing')) AS counted
FROM companies c JOIN company_backlogs b ON b.company_id = c.id
"""


def add_companies(conn: psycopg.Connection[Any], count: int) -> list[uuid.UUID]:
    """`count` companies (committed), in company_id order: the order counters are locked in."""
    rows = conn.execute(
        "INSERT INTO companies (name) SELECT 'c' || n FROM generate_series(1, %s) n RETURNING id",
        [count],
    ).fetchall()
    return sorted(row[0] for row in rows)


def insert_rows(
    conn: psycopg.Connection[Any], rows: list[tuple[uuid.UUID, str]]
) -> psycopg.Cursor[Any]:
    """One INSERT of `(company_id, status)` rows, whatever their companies."""
    return conn.execute(
        "INSERT INTO tasks (company_id, type, payload, status) "
        "SELECT company_id, 'noop', '{}', status FROM unnest(%s::uuid[], %s::text[]) "
        "AS r(company_id, status)",
        [[company for company, _ in rows], [status for _, status in rows]],
    )


def counts_of(conn: psycopg.Connection[Any]) -> list[tuple[uuid.UUID, int, int]]:
    """Every company's `(id, counter, unfinished rows)`."""
    return [(row[0], int(row[1]), int(row[2])) for row in conn.execute(UNFINISHED_MISMATCHES)]


def assert_counters_exact(conn: psycopg.Connection[Any]) -> None:
    """Every company's counter equals its pending and processing rows."""
    wrong = [row for row in counts_of(conn) if row[1] != row[2]]
    assert wrong == []


def set_quota(conn: psycopg.Connection[Any], company_id: uuid.UUID, quota: int | None) -> None:
    conn.execute("UPDATE companies SET max_pending = %s WHERE id = %s", [quota, company_id])


def wait_until_blocked(observer: psycopg.Connection[Any], pid: int) -> None:
    """Return once backend `pid` waits for a lock another backend holds (10 s at most)."""
    deadline = time.monotonic() + 10
    blocked = "SELECT cardinality(pg_blocking_pids(%s)) > 0"
    while observer.execute(blocked, [pid]).fetchall() != [(True,)]:
        assert time.monotonic() < deadline, f"backend {pid} never waited for a lock"
        time.sleep(0.01)


def insert_waiting(
    conn: psycopg.Connection[Any], company: uuid.UUID, *, observer: psycopg.Connection[Any]
) -> tuple[threading.Thread, list[psycopg.Error | None]]:
    """Insert one pending task of `company` on `conn` in a thread; return once it waits.

    The list gets None once the insert has committed, or its error once rolled back.
    """
    outcome: list[psycopg.Error | None] = []

    def insert() -> None:
        try:
            insert_rows(conn, [(company, "pending")])
            conn.commit()
            outcome.append(None)
        except psycopg.Error as error:
            conn.rollback()
            outcome.append(error)

    waiter = threading.Thread(target=insert)
    waiter.start()
    wait_until_blocked(observer, conn.info.backend_pid)
    return waiter, outcome


@pytest.fixture
def sql(fresh_db_url: str) -> Iterator[Callable[..., psycopg.Connection[Any]]]:
    """`sql(autocommit=True)` -> a new psycopg connection to a fresh migrated database."""
    opened: list[psycopg.Connection[Any]] = []

    def connect(*, autocommit: bool = True) -> psycopg.Connection[Any]:
        conn = psycopg.connect(pg.libpq(fresh_db_url), autocommit=autocommit)
        opened.append(conn)
        return conn

    yield connect
    for conn in opened:
        conn.close()


def test_every_writer_statement_keeps_the_counters_exact(
    sql: Callable[..., psycopg.Connection[Any]],
) -> None:
    conn = sql()
    a, b, c = add_companies(conn, 3)
    steps: list[Callable[[], object]] = [
        # No row; one company: one row, a batch of mixed statuses, rows none of which count.
        lambda: insert_rows(conn, []),
        lambda: insert_rows(conn, [(a, "pending")]),
        lambda: insert_rows(conn, [(b, "pending"), (b, "processing"), (b, "completed")] * 3),
        lambda: insert_rows(conn, [(c, "failed"), (c, "cancelled")]),
        # Several companies in one statement.
        lambda: insert_rows(conn, [(c, "pending"), (a, "pending"), (b, "failed"), (c, "pending")]),
        # A claim (no count changes), completions, a retry, cancels, deletes.
        lambda: conn.execute("UPDATE tasks SET status = 'processing' WHERE status = 'pending' "),
        lambda: conn.execute(
            "UPDATE tasks SET status = 'completed' "
            "WHERE id IN (SELECT id FROM tasks WHERE status = 'processing' LIMIT 3)"
        ),
        lambda: conn.execute("UPDATE tasks SET status = 'pending' WHERE status = 'failed'"),
        lambda: conn.execute("UPDATE tasks SET status = 'cancelled' WHERE company_id = %s", [a]),
        lambda: conn.execute("DELETE FROM tasks WHERE company_id = %s", [b]),
        lambda: insert_rows(conn, [(b, "pending")]),
        lambda: conn.execute("TRUNCATE tasks"),
        lambda: insert_rows(conn, [(a, "processing"), (a, "pending")]),
    ]

    seen: list[list[int]] = []
    for step in steps:
        step()
        assert_counters_exact(conn)
        seen.append([counter for _, counter, _ in counts_of(conn)])

    # The counters moved (the check above is not vacuous), and TRUNCATE zeroed them.
    assert max(sum(counters) for counters in seen) > 0
    assert sum(seen[-2]) == 0
    assert sum(seen[-1]) == 2


@pytest.mark.parametrize(
    ("rows_of", "adding"),
    [
        pytest.param(lambda a, b: [(a, "pending")], 1, id="one-row"),
        pytest.param(
            lambda a, b: [(a, "pending"), (a, "processing"), (a, "failed")], 2, id="one-company"
        ),
        pytest.param(
            lambda a, b: [(b, "pending"), (a, "pending"), (a, "pending")], 2, id="two-companies"
        ),
    ],
)
def test_a_statement_beyond_the_quota_fails_whole_with_the_numbers(
    sql: Callable[..., psycopg.Connection[Any]],
    rows_of: Callable[[uuid.UUID, uuid.UUID], list[tuple[uuid.UUID, str]]],
    adding: int,
) -> None:
    conn = sql()
    a, b = add_companies(conn, 2)
    set_quota(conn, a, 3)
    insert_rows(conn, [(a, "pending"), (a, "processing"), (a, "pending")])
    before = counts_of(conn)

    with pytest.raises(psycopg.Error) as refused:
        insert_rows(conn, rows_of(a, b))

    assert refused.value.sqlstate == "FQ429"
    assert refused.value.diag.message_primary == "backlog quota exceeded"
    assert refused.value.diag.message_detail == (
        f"company={a} max_pending=3 unfinished=3 adding={adding}"
    )
    assert counts_of(conn) == before
    set_quota(conn, a, 3 + adding)
    insert_rows(conn, rows_of(a, b))  # exactly at the quota: accepted
    assert_counters_exact(conn)


@pytest.mark.parametrize("first_ends", ["commit", "rollback"])
def test_concurrent_inserts_at_the_edge_queue_on_the_counter(
    sql: Callable[..., psycopg.Connection[Any]], first_ends: str
) -> None:
    """The second insert waits for the first's counter; it sees the first's outcome."""
    setup, first, second = sql(), sql(autocommit=False), sql(autocommit=False)
    (company,) = add_companies(setup, 1)
    set_quota(setup, company, 2)
    insert_rows(setup, [(company, "pending")])
    insert_rows(first, [(company, "pending")])  # the last slot, not committed yet
    waiter, outcome = insert_waiting(second, company, observer=setup)
    getattr(first, first_ends)()
    waiter.join(30)

    assert not waiter.is_alive()
    if first_ends == "commit":
        assert isinstance(outcome[0], psycopg.Error)
        assert outcome[0].sqlstate == "FQ429"
        assert outcome[0].diag.message_detail == (
            f"company={company} max_pending=2 unfinished=2 adding=1"
        )
    else:
        assert outcome == [None]
    assert counts_of(setup) == [(company, 2, 2)]


@pytest.mark.parametrize(
    ("before", "after", "refused"), [(100, 1, True), (2, 10, False), (None, 1, True)]
)
def test_a_quota_changed_while_an_insert_waits_for_the_counter_is_the_one_checked(
    sql: Callable[..., psycopg.Connection[Any]],
    before: int | None,
    after: int,
    refused: bool,
) -> None:
    """The quota is read after the wait for the counter, not from the insert's first snapshot."""
    setup, first, second = sql(), sql(autocommit=False), sql(autocommit=False)
    (company,) = add_companies(setup, 1)
    set_quota(setup, company, before)
    insert_rows(first, [(company, "pending")])  # holds the counter, not committed yet
    waiter, outcome = insert_waiting(second, company, observer=setup)
    set_quota(setup, company, after)  # committed while the second insert waits
    first.commit()
    waiter.join(30)

    assert not waiter.is_alive()
    if refused:
        assert isinstance(outcome[0], psycopg.Error)
        assert outcome[0].diag.message_detail == (
            f"company={company} max_pending={after} unfinished=1 adding=1"
        )
    else:
        assert outcome == [None]
    assert_counters_exact(setup)


def test_counters_are_locked_in_company_id_order(
    sql: Callable[..., psycopg.Connection[Any]],
) -> None:
    """A two-company insert waiting on the lower company's counter holds no other counter.

    So an insert of the higher company alone goes through meanwhile; in the other order the
    two could each hold the counter the other waits for.
    """
    setup = sql()
    holder, both, other = sql(autocommit=False), sql(autocommit=False), sql()
    lower, higher = add_companies(setup, 2)
    insert_rows(holder, [(lower, "pending")])
    both_pid = both.info.backend_pid

    def insert_both() -> None:
        insert_rows(both, [(higher, "pending"), (lower, "pending")])
        both.commit()

    waiter = threading.Thread(target=insert_both)
    waiter.start()
    wait_until_blocked(setup, both_pid)

    other.execute("SET lock_timeout = '5s'")
    insert_rows(other, [(higher, "pending")])  # not blocked by the waiting statement
    holder.commit()
    waiter.join(30)

    assert not waiter.is_alive()
    assert sorted((c, n) for c, n, _ in counts_of(setup)) == [(lower, 2), (higher, 2)]
    assert_counters_exact(setup)


def test_a_create_plans_no_statement_once_its_plans_are_cached(
    sql: Callable[..., psycopg.Connection[Any]],
) -> None:
    """The create's statement and every trigger it fires run on cached generic plans.

    What PostgreSQL plans is reported by `log_planner_stats`, one notice per planning.
    """
    conn = sql()
    companies = add_companies(conn, 4)
    notices: list[str] = []
    conn.add_notice_handler(lambda notice: notices.append(str(notice.message_primary)))

    def create(n: int) -> None:
        queue.create_task(
            driver_connection(conn, transaction=False),
            company_id=companies[n % 4],
            type="noop",
            payload={},
            notify_channel="fq",
        )

    for n in range(12):
        create(n)
    conn.execute("SET client_min_messages = log")
    conn.execute("SET log_planner_stats = on")
    notices.clear()
    for n in range(8):
        create(n)

    assert [notice for notice in notices if "PLANNER" in notice] == []
    assert_counters_exact(conn)
