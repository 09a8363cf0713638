"""The API's queue gauges (design §7): what they report, and that their cost stays bounded."""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import psycopg
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Connection, Engine, pool, text
from sqlalchemy.orm import Session

from api import database
from api.metrics import OLDEST_XMIN_HOLDER_HELP, TASKS_BY_STATUS_HELP, QueueCollector
from db import statistics
from db.engine import make_engine, make_sessionmaker
from tests.conftest import serve_app
from tests.factories import MakeCompany, insert_company, insert_delayed_tasks, insert_task


def connecting(engine: Engine) -> Callable[[], AbstractContextManager[psycopg.Connection[Any]]]:
    """What `QueueCollector` opens per scrape: the API's probe connection to `engine`'s database."""
    url = engine.url.render_as_string(hide_password=False)
    settings = {
        "url": url,
        "application_name": "fairq-tests",
        "transaction_pooling": False,
        "connect_timeout": 2,
    }
    return functools.partial(database.probe_for, settings)


def gauges(collector: QueueCollector) -> dict[str, dict[str, float]]:
    """One collection: metric name -> {status label or "": value}."""
    return {
        family.name: {sample.labels.get("status", ""): sample.value for sample in family.samples}
        for family in collector.collect()
    }


def add(session: Session, company: uuid.UUID, count: int, **values: Any) -> None:
    """`count` task rows of `company` with these column values."""
    for _ in range(count):
        insert_task(session, company, **values)


def test_small_queues_are_counted_exactly_and_only_runnable_work_ages(
    fresh_engine: Engine,
) -> None:
    with make_sessionmaker(fresh_engine)() as session:
        company = insert_company(session).id
        add(session, company, 3, run_after=text("now() - interval '90 seconds'"))
        add(session, company, 2, run_after=text("now() + interval '1 hour'"))  # not runnable
        add(session, company, 1, status="processing", lease_token=uuid.uuid4())
        add(session, company, 4, status="completed")
        add(session, company, 1, status="cancelled")

    values = gauges(QueueCollector(connecting(fresh_engine), 1000))

    assert values["tasks_by_status"] == {
        "pending": 5,
        "processing": 1,
        "completed": 4,
        "failed": 0,
        "cancelled": 1,
    }
    [age] = values["oldest_eligible_pending_age_seconds"].values()
    assert 90 <= age < 150


def test_an_empty_queue_reports_zeros(fresh_engine: Engine) -> None:
    values = gauges(QueueCollector(connecting(fresh_engine), 1000))
    assert set(values["tasks_by_status"].values()) == {0}
    assert values["oldest_eligible_pending_age_seconds"] == {"": 0}


def test_counts_above_the_limits_are_estimates_never_below_the_limit(
    fresh_engine: Engine,
) -> None:
    """Past its limit a status reports the planner's estimate, at least limit + 1.

    Tiny limits stand in for the real ones. Never analyzed, the table has no estimate: the
    capped count's lower bound is reported. After ANALYZE, rows added to the same page do
    not move the estimate (it scales with the table's pages), which shows it is one.
    """
    collector = QueueCollector(connecting(fresh_engine), 1000, live_limit=3, terminal_limit=2)
    with make_sessionmaker(fresh_engine)() as session:
        company = insert_company(session).id
        add(session, company, 5)
        add(session, company, 2, status="processing", lease_token=uuid.uuid4())
        add(session, company, 2, status="completed")
        add(session, company, 2, status="failed")

        before_analyze = gauges(collector)["tasks_by_status"]
        assert before_analyze["pending"] == 4  # more than 3: the lower bound, no statistics
        assert before_analyze["processing"] == 2  # within its limit: exact
        # 4 finished > 2: each status keeps what the capped count saw of it (3 rows in all).
        assert before_analyze["completed"] + before_analyze["failed"] == 3
        assert before_analyze["cancelled"] == 0

        with fresh_engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("ANALYZE tasks"))
        add(session, company, 3)  # 8 pending now; the statistics still say 5

    assert gauges(collector)["tasks_by_status"] == {
        "pending": 5,
        "processing": 2,
        "completed": 2,
        "failed": 2,
        "cancelled": 0,
    }


def test_the_help_text_says_when_counts_are_estimates(fresh_engine: Engine) -> None:
    [family] = [
        f
        for f in QueueCollector(connecting(fresh_engine), 1000).collect()
        if f.name == "tasks_by_status"
    ]
    assert family.documentation == TASKS_BY_STATUS_HELP
    assert "estimate" in TASKS_BY_STATUS_HELP
    assert "100,000" in TASKS_BY_STATUS_HELP


def test_a_database_error_yields_nothing() -> None:
    engine = make_engine(
        "postgresql+psycopg://nobody@127.0.0.1:1/none",
        application_name="fairq-tests",
        poolclass=pool.NullPool,
    )
    try:
        assert list(QueueCollector(connecting(engine), 1000).collect()) == []
    finally:
        engine.dispose()


def test_the_oldest_eligible_task_costs_one_probe_per_company_despite_a_delayed_backlog(
    db_session: Session, make_company: MakeCompany
) -> None:
    """20,000 tasks due tomorrow are never read: each company's oldest runnable is one entry."""
    companies = [make_company(f"c{i}").id for i in range(5)]
    insert_delayed_tasks(db_session, companies[0], 20_000)
    for company in companies:
        add(db_session, company, 3, run_after=text("now() - interval '1 minute'"))
    db_session.execute(text("ANALYZE tasks, companies"))

    [plan] = db_session.execute(
        text("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + statistics._OLDEST_ELIGIBLE)
    ).scalar_one()

    scans = [
        node
        for node in _nodes(plan["Plan"])
        if node.get("Index Name") == "ix_tasks_pending_company_run_after"
    ]
    assert len(scans) == 1, json.dumps(plan, indent=1)
    [scan] = scans
    # One probe per company in the table: these five, and any a test committed to the shared
    # database (tests through the live API do).
    assert scan["Actual Loops"] == db_session.scalar(text("SELECT count(*) FROM companies"))
    assert scan["Actual Loops"] >= len(companies)
    assert "(run_after <= now())" in scan["Index Cond"]
    assert scan["Actual Rows"] <= 1
    assert scan.get("Rows Removed by Filter", 0) == 0


def _nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    return [node, *(n for child in node.get("Plans", []) for n in _nodes(child))]


# -- oldest_xmin_holder_age_seconds ------------------------------------------------------------

HOLDER = "oldest_xmin_holder_age_seconds"


def holder_age(collector: QueueCollector) -> float:
    """The cleanup holder's age, from one collection."""
    [age] = gauges(collector)[HOLDER].values()
    return age


def scraped_holder_age(port: int) -> float:
    """The cleanup holder's age, from a real HTTP scrape of the API's /metrics."""
    response = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
    assert response.status_code == 200
    [family] = [
        family for family in text_string_to_metric_families(response.text) if family.name == HOLDER
    ]
    assert family.documentation == OLDEST_XMIN_HOLDER_HELP
    [sample] = family.samples
    return float(sample.value)


def backend_xids(conn: Connection) -> tuple[str | None, str | None]:
    """The xid and the snapshot's xmin of `conn`'s session, as pg_stat_activity shows them."""
    row = conn.execute(
        text(
            "SELECT CAST(backend_xid AS text), CAST(backend_xmin AS text) "
            "FROM pg_stat_activity WHERE pid = pg_backend_pid()"
        )
    ).one()
    return row[0], row[1]


def open_snapshot(engine: Engine, isolation_level: str = "REPEATABLE READ") -> Connection:
    """A connection whose transaction has run one query (so holds a snapshot if RR)."""
    conn = engine.connect().execution_options(isolation_level=isolation_level)
    conn.execute(text("SELECT count(*) FROM tasks")).scalar_one()
    return conn


def test_a_transaction_holding_a_snapshot_shows_its_age_on_metrics_until_it_ends(
    fresh_db_url: str, fresh_engine: Engine
) -> None:
    with serve_app(fresh_db_url) as port:
        assert scraped_holder_age(port) == 0  # nothing open on this database

        holder = open_snapshot(fresh_engine)
        try:
            opened = time.monotonic()  # the transaction began before this
            time.sleep(1.5)
            scraping = time.monotonic()
            age = scraped_holder_age(port)
            assert scraping - opened <= age <= time.monotonic() - opened + 1.0
        finally:
            holder.rollback()
            holder.close()

        assert scraped_holder_age(port) == 0


def test_an_idle_writer_is_the_holder_not_the_younger_snapshots_that_wait_on_it(
    fresh_engine: Engine,
) -> None:
    """Every snapshot taken while a writer is open has the writer's xid as its xmin: a tie.

    The holder is the writer (the oldest start among them), idle in transaction with no
    snapshot of its own (READ COMMITTED between statements) but an xid.
    """
    collector = QueueCollector(connecting(fresh_engine), 1000)
    writer = fresh_engine.connect()
    reader: Connection | None = None
    try:
        writer.execute(text("INSERT INTO companies (name) VALUES ('w')"))
        writer_opened = time.monotonic()
        writer_xid = backend_xids(writer)[0]
        time.sleep(1.0)
        # Younger, its xmin the writer's xid. A snapshot's xmin is the server's oldest running
        # xid: while a transaction of another database began before the writer (another test
        # process, a benchmark) and still runs, the reader's is older and there is no tie.
        deadline = time.monotonic() + 30
        reader = open_snapshot(fresh_engine)
        while backend_xids(reader)[1] != writer_xid and time.monotonic() < deadline:
            reader.rollback()
            reader.close()
            time.sleep(0.1)
            reader = open_snapshot(fresh_engine)
        assert backend_xids(reader)[1] == writer_xid, "no snapshot whose xmin is the writer's"
        time.sleep(0.3)
        checking = time.monotonic()
        age = holder_age(collector)
        assert age >= checking - writer_opened
    finally:
        if reader is not None:
            reader.rollback()
            reader.close()
        writer.rollback()
        writer.close()
    assert holder_age(collector) == 0


def test_a_read_committed_transaction_between_statements_holds_nothing(
    fresh_engine: Engine,
) -> None:
    """Open is not enough: without a snapshot or an xid, a transaction pins no row version."""
    collector = QueueCollector(connecting(fresh_engine), 1000)
    idle = open_snapshot(fresh_engine, "READ COMMITTED")
    try:
        time.sleep(0.5)
        assert holder_age(collector) == 0
    finally:
        idle.rollback()
        idle.close()


def test_a_prepared_transaction_holds_back_cleanup_from_its_prepare(fresh_engine: Engine) -> None:
    with fresh_engine.connect() as conn:
        if int(conn.execute(text("SHOW max_prepared_transactions")).scalar_one()) == 0:
            pytest.skip("the server has max_prepared_transactions = 0")
    collector = QueueCollector(connecting(fresh_engine), 1000)
    gid = f"fairq-test-{uuid.uuid4()}"
    with fresh_engine.connect() as conn:
        conn.execute(text("INSERT INTO companies (name) VALUES ('p')"))
        conn.execute(text(f"PREPARE TRANSACTION '{gid}'"))
    prepared = time.monotonic()  # its PREPARE ran before this
    try:
        time.sleep(1.0)
        checking = time.monotonic()
        assert holder_age(collector) >= checking - prepared
    finally:
        with fresh_engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text(f"ROLLBACK PREPARED '{gid}'"))
    assert holder_age(collector) == 0
