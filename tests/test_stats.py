"""Task statistics (issue 13): GET /companies/{companyId}/stats, GET /stats and `db.tenant_stats`.

The figures on a small known data set, exact; estimates flagged past (small) limits; who may
read them; a statement timeout is a 503 that says so; the OpenAPI document.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import Engine, text
from sqlalchemy.exc import DataError
from sqlalchemy.orm import Session

from api import database
from api.settings import ApiSettings
from common.environment import SettingsError
from db import errors, tenant_stats
from db.engine import driver_connection, make_sessionmaker
from tests.conftest import make_test_app
from tests.factories import CompanyWithKey, MakeCompany, insert_company, insert_task, json_of

FIGURE_FIELDS = {
    "as_of",
    "tasks",
    "runnable",
    "in_flight",
    "oldest_runnable_wait_seconds",
    "completed_last_5m",
    "failed_last_5m",
    "completed_last_60m",
    "failed_last_60m",
    "estimated",
}
COMPANY_STATS_FIELDS = FIGURE_FIELDS | {"company_id", "name", "paused", "max_pending"}
QUEUE_STATS_FIELDS = FIGURE_FIELDS | {"top_by_backlog", "top_by_oldest_wait"}

# What `add_known_tasks` stores, as the figures should report it.
KNOWN_TASKS = {"pending": 5, "processing": 1, "completed": 4, "failed": 3, "cancelled": 1}
KNOWN_RECENT = {
    "completed_last_5m": 2,
    "failed_last_5m": 1,
    "completed_last_60m": 3,
    "failed_last_60m": 2,
}


def ago(interval: str) -> Any:
    """A timestamp `interval` before the database's now()."""
    return text(f"now() - interval '{interval}'")


def add_known_tasks(session: Session, company_id: uuid.UUID) -> None:
    """Tasks in every status: runnable and delayed pending, finished 3, 30 and 120 min ago.

    The oldest runnable task came due 90 s ago; a delayed one, created earlier, is due in an
    hour (it waits, but is not runnable). A cancelled task finished a minute ago counts in
    neither the completed nor the failed windows; tasks finished 2 hours ago in no window.
    """
    for due in ("90 seconds", "30 seconds", "1 second"):
        insert_task(session, company_id, run_after=ago(due))
    for _ in range(2):
        insert_task(
            session,
            company_id,
            run_after=text("now() + interval '1 hour'"),
            created_at=ago("2 hours"),
        )
    insert_task(
        session,
        company_id,
        status="processing",
        attempts=1,
        lease_token=uuid.uuid4(),
        locked_by="test:1",
        locked_at=ago("10 seconds"),
        started_at=ago("10 seconds"),
        run_after=ago("20 seconds"),
    )
    for status, finished in (
        ("completed", "3 minutes"),
        ("completed", "3 minutes"),
        ("completed", "30 minutes"),
        ("completed", "2 hours"),
        ("failed", "3 minutes"),
        ("failed", "30 minutes"),
        ("failed", "2 hours"),
        ("cancelled", "1 minute"),
    ):
        insert_task(
            session,
            company_id,
            status=status,
            attempts=1,
            finished_at=ago(finished),
            created_at=ago("3 hours"),
            run_after=ago("3 hours"),
        )


@pytest.fixture
def known(make_company: MakeCompany, db_session: Session) -> tuple[CompanyWithKey, CompanyWithKey]:
    """(a company with `add_known_tasks`, another one with tasks of its own)."""
    company, other = make_company("known"), make_company("other")
    add_known_tasks(db_session, company.id)
    insert_task(db_session, other.id, run_after=ago("1 hour"))
    insert_task(db_session, other.id, status="completed", finished_at=ago("1 minute"))
    return company, other


# ---------------------------------------------------------------------------------------------
# The figures
# ---------------------------------------------------------------------------------------------


def test_a_companys_figures_are_exact_on_a_known_data_set(
    client: FlaskClient, known: tuple[CompanyWithKey, CompanyWithKey]
) -> None:
    company, _ = known

    response = client.get(f"/companies/{company.id}/stats", headers=company.headers)

    assert response.status_code == 200
    body = json_of(response)
    assert set(body) == COMPANY_STATS_FIELDS
    assert body["company_id"] == str(company.id)
    assert (body["name"], body["paused"]) == ("known", False)
    assert body["tasks"] == KNOWN_TASKS
    assert body["runnable"] == 3
    assert body["in_flight"] == 1
    # The test's transaction fixes now(): the oldest runnable task came due 90 s before it.
    assert body["oldest_runnable_wait_seconds"] == 90.0
    assert {name: body[name] for name in KNOWN_RECENT} == KNOWN_RECENT
    assert body["estimated"] == []


def test_an_admin_reads_any_companys_figures(
    client: FlaskClient,
    known: tuple[CompanyWithKey, CompanyWithKey],
    admin_headers: dict[str, str],
) -> None:
    _, other = known

    response = client.get(f"/companies/{other.id}/stats", headers=admin_headers)

    assert response.status_code == 200
    body = json_of(response)
    assert body["tasks"] == {
        "pending": 1,
        "processing": 0,
        "completed": 1,
        "failed": 0,
        "cancelled": 0,
    }
    assert (body["runnable"], body["oldest_runnable_wait_seconds"]) == (1, 3600.0)
    assert (body["completed_last_5m"], body["completed_last_60m"]) == (1, 1)


def test_a_company_with_nothing_runnable_has_no_oldest_wait(
    client: FlaskClient, make_company: MakeCompany, db_session: Session
) -> None:
    company = make_company()
    insert_task(db_session, company.id, run_after=text("now() + interval '1 minute'"))

    body = json_of(client.get(f"/companies/{company.id}/stats", headers=company.headers))

    assert body["tasks"]["pending"] == 1
    assert body["runnable"] == 0
    assert body["oldest_runnable_wait_seconds"] is None


def test_a_paused_companys_runnable_tasks_still_wait_and_say_why(
    client: FlaskClient, make_company: MakeCompany, db_session: Session
) -> None:
    company = make_company()
    insert_task(db_session, company.id, run_after=ago("5 minutes"))
    db_session.execute(
        text("UPDATE companies SET paused = true WHERE id = :id"), {"id": company.id}
    )

    body = json_of(client.get(f"/companies/{company.id}/stats", headers=company.headers))

    assert body["paused"] is True
    assert (body["runnable"], body["oldest_runnable_wait_seconds"]) == (1, 300.0)


@pytest.fixture
def fresh_app(fresh_db_url: str) -> Iterator[Flask]:
    """An app on the fresh database (its requests see what the test committed there)."""
    app = make_test_app(fresh_db_url)
    yield app
    database.close(app)


def test_the_queues_figures_add_up_every_company_and_rank_them(
    fresh_engine: Engine, fresh_app: Flask, admin_headers: dict[str, str]
) -> None:
    with make_sessionmaker(fresh_engine)() as session:
        known = insert_company(session, "known")
        add_known_tasks(session, known.id)
        busy = insert_company(session, "busy")
        for _ in range(8):
            insert_task(session, busy.id, run_after=ago("10 seconds"))
        waiting = insert_company(session, "waiting")
        insert_task(session, waiting.id, run_after=ago("2 hours"))
        insert_company(session, "idle")

    response = fresh_app.test_client().get("/stats", headers=admin_headers)

    assert response.status_code == 200
    body = json_of(response)
    assert set(body) == QUEUE_STATS_FIELDS
    assert body["tasks"] == {**KNOWN_TASKS, "pending": KNOWN_TASKS["pending"] + 9}
    assert (body["runnable"], body["in_flight"]) == (3 + 8 + 1, 1)
    assert {name: body[name] for name in KNOWN_RECENT} == KNOWN_RECENT
    assert body["estimated"] == []
    # Each row was inserted in a transaction of its own, a moment before the request.
    assert 7200 <= body["oldest_runnable_wait_seconds"] < 7260
    backlog = [(rank["name"], rank["unfinished"]) for rank in body["top_by_backlog"]]
    assert backlog == [("busy", 8), ("known", 6), ("waiting", 1)]
    by_wait = [rank["name"] for rank in body["top_by_oldest_wait"]]
    assert by_wait == ["waiting", "known", "busy"]
    with fresh_engine.connect() as connection:
        max_pending = connection.execute(
            text("SELECT max_pending FROM companies WHERE id = :id"), {"id": waiting.id}
        ).scalar_one()
    assert body["top_by_oldest_wait"][0] == {
        "company_id": str(waiting.id),
        "name": "waiting",
        "paused": False,
        "max_pending": max_pending,
        "unfinished": 1,
        "oldest_runnable_wait_seconds": body["oldest_runnable_wait_seconds"],
    }


def test_an_empty_queue_has_zeros_no_oldest_wait_and_no_ranking(
    fresh_app: Flask, admin_headers: dict[str, str]
) -> None:
    body = json_of(fresh_app.test_client().get("/stats", headers=admin_headers))

    assert set(body["tasks"].values()) == {0}
    assert body["runnable"] == body["in_flight"] == body["completed_last_60m"] == 0
    assert body["oldest_runnable_wait_seconds"] is None
    assert body["top_by_backlog"] == body["top_by_oldest_wait"] == []
    assert body["estimated"] == []


def test_rankings_list_at_most_top_companies_ties_by_id(
    db_session: Session, make_company: MakeCompany
) -> None:
    companies = sorted((make_company(f"c{i}") for i in range(4)), key=lambda c: c.id)
    for company in companies:
        # The same backlog and the same run_after (one now()) for every company: a tie.
        insert_task(db_session, company.id, run_after=ago("1 minute"))
    connection = db_session.connection()

    by_backlog = tenant_stats.top_by_backlog(
        driver_connection(connection, transaction=False), top=2
    )
    by_wait = tenant_stats.top_by_oldest_wait(
        driver_connection(connection, transaction=False), top=2
    )

    assert [rank.company_id for rank in by_backlog] == [c.id for c in companies[:2]]
    assert [rank.company_id for rank in by_wait] == [c.id for c in companies[:2]]


def test_an_unknown_company_is_not_found(db_session: Session) -> None:
    with pytest.raises(errors.NotFound):
        tenant_stats.company_stats(driver_connection(db_session), uuid.uuid4())


# ---------------------------------------------------------------------------------------------
# Past the limits
# ---------------------------------------------------------------------------------------------


def test_runnable_is_exact_past_the_limit_while_the_delayed_tasks_are_within_it(
    db_session: Session, make_company: MakeCompany
) -> None:
    company = make_company()
    add_known_tasks(db_session, company.id)  # 3 runnable, 2 delayed

    stats = tenant_stats.company_stats(
        driver_connection(db_session), company.id, limits=tenant_stats.Limits(live=2, finished=100)
    )

    assert stats.runnable == 3
    assert stats.estimated == ()


# More pages than any test's `tasks` has: a sample of the whole table, so estimates are exact.
WHOLE_TABLE = 10**9


def test_figures_past_the_limits_are_estimates_and_flagged(
    db_session: Session, make_company: MakeCompany
) -> None:
    company = make_company()
    add_known_tasks(db_session, company.id)
    insert_task(db_session, company.id, run_after=text("now() + interval '1 hour'"))
    # Both ranges (3 runnable, 3 delayed) and the processing count (1) past a limit of 0 and
    # 2; 15 tasks in all past the limit of finished rows. The sample takes every page: the
    # shared database's table is larger than the default sample after other tests.
    limits = tenant_stats.Limits(live=2, finished=3, sample_pages=WHOLE_TABLE)
    connection = db_session.connection()

    stats = tenant_stats.company_stats(
        driver_connection(connection, transaction=False), company.id, limits=limits
    )

    assert set(stats.estimated) == {
        "runnable",
        "tasks.completed",
        "tasks.failed",
        "tasks.cancelled",
        # Its history is past the limit, and so is the queue's hour: 5 tasks finished in it
        # (this company's are the only ones). The 4 newest reach back 30 minutes, so they
        # cover the last 5 minutes whole: those counts are exact.
        "completed_last_60m",
        "failed_last_60m",
    }
    assert (stats.completed_last_5m, stats.failed_last_5m) == (2, 1)
    # Exact: pending and processing (the backlog counter minus 1 lease), the oldest wait.
    assert (stats.tasks.pending, stats.tasks.processing, stats.in_flight) == (6, 1, 1)
    assert stats.oldest_runnable_wait_seconds == 90.0
    # A table this small is sampled whole: the estimates are the true counts.
    assert stats.runnable == 3
    assert (stats.tasks.completed, stats.tasks.failed, stats.tasks.cancelled) == (4, 3, 1)
    # The hour from its 4 newest finished tasks (the limit + 1): the 3 of 3 minutes ago and
    # one of the 2 of 30 minutes ago (either), so half an hour at that rate, doubled.
    assert (stats.completed_last_60m, stats.failed_last_60m) in {(6, 2), (4, 4)}


def test_a_processing_count_past_the_limit_makes_pending_an_estimate_too(
    db_session: Session, make_company: MakeCompany
) -> None:
    company = make_company()
    add_known_tasks(db_session, company.id)

    stats = tenant_stats.company_stats(
        driver_connection(db_session),
        company.id,
        limits=tenant_stats.Limits(live=0, finished=100, sample_pages=WHOLE_TABLE),
    )

    assert {"tasks.pending", "tasks.processing", "in_flight", "runnable"} <= set(stats.estimated)
    # The sample's shares of the exact backlog (6 unfinished), from the whole (small) table.
    assert (stats.tasks.pending, stats.tasks.processing, stats.runnable) == (5, 1, 3)


def test_the_queues_figures_past_small_limits_are_flagged_in_the_json(
    fresh_db_url: str, fresh_engine: Engine, admin_headers: dict[str, str]
) -> None:
    with make_sessionmaker(fresh_engine)() as session:
        company = insert_company(session)
        add_known_tasks(session, company.id)
        insert_task(session, company.id, run_after=text("now() + interval '1 hour'"))
    app = make_test_app(fresh_db_url, stats_limits=tenant_stats.Limits(live=2, finished=3))
    try:
        client = app.test_client()
        queue = json_of(client.get("/stats", headers=admin_headers))
        own = json_of(client.get(f"/companies/{company.id}/stats", headers=company.headers))
    finally:
        database.close(app)

    for body in (queue, own):
        assert {"runnable", "tasks.completed", "completed_last_60m"} <= set(body["estimated"])
        assert set(body["estimated"]) <= set(tenant_stats.ESTIMABLE)
        assert (body["tasks"]["pending"], body["in_flight"]) == (6, 1)
        assert body["runnable"] > 2


def test_estimates_come_from_a_sample_that_sees_how_status_and_company_go_together(
    fresh_engine: Engine,
) -> None:
    """A sample of a quarter of the table: close to the truth, where the planner is not.

    The whale has 12,000 runnable and 8,000 delayed tasks and has never finished one; another
    company has 20,000 completed tasks. The planner, taking company, status and run_after as
    independent, would give the whale a quarter of all completed tasks and count most pending
    tasks runnable (every finished task's run_after is past).
    """
    with make_sessionmaker(fresh_engine)() as session:
        whale, other = insert_company(session, "whale"), insert_company(session, "other")
        # Interleaved, so that every page holds some of each.
        session.execute(
            text(
                "INSERT INTO tasks (company_id, type, payload, status, run_after, finished_at) "
                "SELECT CASE WHEN g % 2 = 0 THEN :whale ELSE :other END, 'noop', '{}', "
                "       CASE WHEN g % 2 = 0 THEN 'pending' ELSE 'completed' END, "
                "       CASE WHEN g % 10 < 6 THEN now() - interval '1 day' "
                "            ELSE now() + interval '1 day' END, "
                "       CASE WHEN g % 2 = 1 THEN now() - interval '1 day' END "
                "FROM generate_series(0, 39999) AS g"
            ),
            {"whale": whale.id, "other": other.id},
        )
        session.commit()
    limits = tenant_stats.Limits(live=1000, finished=100, sample_pages=100)
    with fresh_engine.connect() as connection:
        pages = connection.execute(text("SELECT pg_relation_size('tasks') / 8192")).scalar_one()
        stats = tenant_stats.company_stats(
            driver_connection(connection, transaction=False), whale.id, limits=limits
        )
        queue = tenant_stats.queue_stats(
            driver_connection(connection, transaction=False), limits=limits
        )

    assert pages > 3 * limits.sample_pages  # a sample, not the whole table
    assert {"runnable", "tasks.completed"} <= set(stats.estimated)
    assert stats.tasks.pending == 20_000  # exact: the backlog counter
    assert 12_000 * 0.85 <= stats.runnable <= 12_000 * 1.15
    assert stats.tasks.completed == 0
    assert "runnable" in queue.estimated
    assert 12_000 * 0.85 <= queue.runnable <= 12_000 * 1.15


# ---------------------------------------------------------------------------------------------
# Who may read them
# ---------------------------------------------------------------------------------------------


def test_another_companys_key_gets_the_404_of_a_missing_company(
    client: FlaskClient, known: tuple[CompanyWithKey, CompanyWithKey]
) -> None:
    company, other = known

    response = client.get(f"/companies/{company.id}/stats", headers=other.headers)
    missing = client.get(f"/companies/{uuid.uuid4()}/stats", headers=other.headers)

    assert response.status_code == missing.status_code == 404
    assert json_of(response) == json_of(missing)


def test_the_admin_asking_for_a_missing_company_gets_404(
    client: FlaskClient, admin_headers: dict[str, str]
) -> None:
    response = client.get(f"/companies/{uuid.uuid4()}/stats", headers=admin_headers)

    assert response.status_code == 404
    assert json_of(response)["message"] == "company not found"


@pytest.mark.parametrize("path", ["/stats", "/companies/{id}/stats"])
def test_no_token_gets_401_with_www_authenticate(
    client: FlaskClient, company: CompanyWithKey, path: str
) -> None:
    response = client.get(path.format(id=company.id))

    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"].startswith("Bearer")
    assert json_of(response)["code"] == 401


def test_a_companys_key_on_the_queues_stats_gets_the_401_of_an_admin_route(
    client: FlaskClient, known: tuple[CompanyWithKey, CompanyWithKey]
) -> None:
    company, _ = known

    response = client.get("/stats", headers=company.headers)
    admin_route = client.post("/workers/process", headers=company.headers)

    assert response.status_code == admin_route.status_code == 401
    assert json_of(response) == json_of(admin_route)
    assert str(company.id) not in response.get_data(as_text=True)


def test_the_queues_stats_answer_503_without_an_admin_token(main_db_url: str) -> None:
    app = make_test_app(main_db_url, admin_token=None)
    try:
        response = app.test_client().get("/stats", headers={"Authorization": "Bearer some-token"})
    finally:
        database.close(app)

    assert response.status_code == 503
    assert "ADMIN_TOKEN" in json_of(response)["message"]


# ---------------------------------------------------------------------------------------------
# The statement timeout
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/stats", "/companies/{id}/stats"])
def test_a_query_past_the_statement_timeout_is_a_503_that_says_so(
    fresh_db_url: str, fresh_engine: Engine, admin_headers: dict[str, str], path: str
) -> None:
    company = insert_company(fresh_engine)
    app = make_test_app(fresh_db_url, stats_timeout_ms=200)
    client = app.test_client()
    try:
        # A migration's lock: every read of the table waits for it, here past the timeout.
        with fresh_engine.connect() as locker, locker.begin():
            locker.execute(text("LOCK TABLE company_backlogs IN ACCESS EXCLUSIVE MODE"))
            response = client.get(path.format(id=company.id), headers=admin_headers)
        after = client.get(path.format(id=company.id), headers=admin_headers)
    finally:
        database.close(app)

    assert response.status_code == 503
    body = json_of(response)
    assert body["code"] == 503
    assert "took longer than 200 ms" in body["message"]
    assert "STATS_TIMEOUT_MS" in body["message"]
    assert response.headers["Retry-After"] == "5"
    # The connection went back to the pool fit for use: the lock gone, the next read works.
    assert after.status_code == 200


@pytest.mark.parametrize("value", ["99", "30001", "2s", "-1"])
def test_stats_timeout_ms_out_of_range_stops_the_api_naming_it(value: str) -> None:
    environment = {"DATABASE_URL": "postgresql+psycopg://u@h/d", "STATS_TIMEOUT_MS": value}

    with pytest.raises(SettingsError, match="STATS_TIMEOUT_MS"):
        ApiSettings.from_env(environment)


def test_stats_timeout_ms_defaults_to_two_seconds_and_is_read_from_the_environment() -> None:
    url = "postgresql+psycopg://u@h/d"

    assert ApiSettings.from_env({"DATABASE_URL": url}).stats_timeout_ms == 2000
    assert (
        ApiSettings.from_env({"DATABASE_URL": url, "STATS_TIMEOUT_MS": "750"}).stats_timeout_ms
        == 750
    )


def run_limited(engine: Engine, timeout_ms: int, sql: str) -> None:
    """Run `sql` in a transaction of its own under `tenant_stats.time_limit`."""
    with (
        engine.connect() as connection,
        connection.begin(),
        tenant_stats.time_limit(driver_connection(connection, transaction=False), timeout_ms),
    ):
        connection.execute(text(sql))


def test_time_limit_turns_only_a_cancelled_statement_into_statistics_timeout(
    fresh_engine: Engine,
) -> None:
    with pytest.raises(tenant_stats.StatisticsTimeout, match="ran past 50 ms"):
        run_limited(fresh_engine, 50, "SELECT pg_sleep(1)")
    with pytest.raises(DataError, match="division by zero"):
        run_limited(fresh_engine, 1000, "SELECT 1 / 0")


# ---------------------------------------------------------------------------------------------
# The OpenAPI document
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spec(shared_app: Flask) -> dict[str, Any]:
    """The OpenAPI document as served."""
    document: dict[str, Any] = shared_app.test_client().get("/openapi.json").get_json()
    return document


@pytest.mark.parametrize(
    ("path", "operation_id", "schema", "errors_"),
    [
        (
            "/companies/{company_id}/stats",
            "get_company_stats",
            "CompanyStats",
            {"401", "404", "503"},
        ),
        ("/stats", "get_queue_stats", "QueueStats", {"401", "503"}),
    ],
)
def test_openapi_documents_each_stats_operation_its_schema_and_errors(
    spec: dict[str, Any], path: str, operation_id: str, schema: str, errors_: set[str]
) -> None:
    operation = spec["paths"][path]["get"]

    assert operation["operationId"] == operation_id
    assert operation["summary"]
    ok = operation["responses"]["200"]["content"]["application/json"]["schema"]
    assert ok == {"$ref": f"#/components/schemas/{schema}"}
    assert errors_ <= set(operation["responses"])
    for status in errors_:
        error = operation["responses"][status]["content"]["application/json"]["schema"]
        assert error == {"$ref": "#/components/schemas/Error"}, status


def test_openapi_describes_every_figure_and_which_may_be_estimated(spec: dict[str, Any]) -> None:
    schemas = spec["components"]["schemas"]
    company, queue = schemas["CompanyStats"]["properties"], schemas["QueueStats"]["properties"]

    assert set(company) == COMPANY_STATS_FIELDS
    assert set(queue) == QUEUE_STATS_FIELDS
    assert company["estimated"]["items"]["enum"] == list(tenant_stats.ESTIMABLE)
    assert company["oldest_runnable_wait_seconds"]["nullable"] is True
    assert set(schemas["StatusCounts"]["properties"]) == set(KNOWN_TASKS)
    rank = queue["top_by_backlog"]["items"]
    assert rank == {"$ref": "#/components/schemas/CompanyRank"}
    for name, field in company.items():
        assert (
            field.get("description")
            or "$ref" in field
            or name
            in {
                "as_of",
                "company_id",
                "name",
                "tasks",
            }
        ), name
