"""The API's queue gauges (design §7): what they report, and that their cost stays bounded."""

from __future__ import annotations

import json
import uuid
from typing import Any

from sqlalchemy import Engine, pool, text
from sqlalchemy.orm import Session

from api.metrics import TASKS_BY_STATUS_HELP, QueueCollector
from db import statistics
from db.engine import make_engine, make_sessionmaker
from tests.factories import MakeCompany, insert_company, insert_delayed_tasks, insert_task


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

    values = gauges(QueueCollector(fresh_engine, 1000))

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
    values = gauges(QueueCollector(fresh_engine, 1000))
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
    collector = QueueCollector(fresh_engine, 1000, live_limit=3, terminal_limit=2)
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
        f for f in QueueCollector(fresh_engine, 1000).collect() if f.name == "tasks_by_status"
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
        assert list(QueueCollector(engine, 1000).collect()) == []
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
        text("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + str(statistics._OLDEST_ELIGIBLE.text))
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
