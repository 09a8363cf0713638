"""Due work split by what holds it, and the spiral's predictors (issue 28): `db.queue_health`
and the API gauges built on it."""

from __future__ import annotations

import time
import uuid
from typing import Any

from prometheus_client.core import Metric
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from api.metrics import QueueCollector
from db import queue_health
from db.engine import driver_connection, make_sessionmaker
from db.queue_health import Hold, Waiting
from tests.factories import (
    insert_company,
    insert_delayed_tasks,
    insert_task,
    insert_weighted_company,
)
from tests.test_queue_metrics import connecting


def add(session: Session, company: uuid.UUID, count: int, **values: Any) -> None:
    """`count` task rows of `company` with these column values."""
    for _ in range(count):
        insert_task(session, company, **values)


def due(session: Session, company: uuid.UUID, count: int, seconds_ago: int) -> None:
    """`count` pending tasks of `company` due since `seconds_ago`."""
    add(session, company, count, run_after=text(f"now() - interval '{seconds_ago} seconds'"))


def leased(session: Session, company: uuid.UUID, count: int) -> None:
    """`count` processing tasks of `company`."""
    add(session, company, count, status="processing", lease_token=uuid.uuid4())


def pause(session: Session, company: uuid.UUID) -> None:
    """Pause `company` (its queue row's copy follows by trigger)."""
    session.execute(text("UPDATE companies SET paused = true WHERE id = :id"), {"id": company})
    session.commit()


def build_mixed_queue(session: Session) -> None:
    """Companies waiting for workers, paused, at their limit, below it, and not due."""
    free = insert_company(session, "free").id
    due(session, free, 3, 90)
    add(session, free, 1, run_after=text("now() + interval '1 hour'"))
    leased(session, free, 1)
    paused = insert_company(session, "paused").id
    due(session, paused, 2, 7200)
    pause(session, paused)
    full = insert_weighted_company(session, "full", max_in_flight=1).id
    leased(session, full, 1)
    due(session, full, 2, 3600)
    below = insert_weighted_company(session, "below", max_in_flight=2).id
    leased(session, below, 1)
    due(session, below, 1, 30)
    later = insert_company(session, "later").id
    add(session, later, 4, run_after=text("now() + interval '1 hour'"))


def rounded(waiting: dict[Hold, Waiting]) -> dict[Hold, tuple[int, int, int]]:
    """Each hold's companies, backlog, and oldest wait in whole minutes."""
    return {
        hold: (w.companies, w.backlog, int(w.oldest_seconds // 60)) for hold, w in waiting.items()
    }


def test_due_work_is_split_into_waiting_for_workers_paused_and_at_the_limit(
    db_session: Session,
) -> None:
    build_mixed_queue(db_session)

    waiting = queue_health.waiting(driver_connection(db_session))

    assert rounded(waiting) == {
        # free (5 unfinished: its delayed task and its lease count too) and below its limit.
        Hold.NONE: (2, 7, 1),
        Hold.PAUSED: (1, 2, 120),
        Hold.MAX_IN_FLIGHT: (1, 3, 60),
    }


def test_a_paused_company_at_its_limit_is_held_by_its_pause(db_session: Session) -> None:
    company = insert_weighted_company(db_session, "both", max_in_flight=1).id
    leased(db_session, company, 3)
    due(db_session, company, 2, 60)
    pause(db_session, company)

    waiting = queue_health.waiting(driver_connection(db_session))

    assert rounded(waiting)[Hold.PAUSED] == (1, 5, 1)
    assert waiting[Hold.MAX_IN_FLIGHT] == Waiting(0, 0, 0.0)
    assert waiting[Hold.NONE] == Waiting(0, 0, 0.0)


def test_an_empty_queue_waits_for_nothing(db_session: Session) -> None:
    waiting = queue_health.waiting(driver_connection(db_session))

    assert waiting == {hold: Waiting(0, 0, 0.0) for hold in Hold}


def samples(families: list[Metric]) -> dict[str, dict[str, float]]:
    """Metric name -> {its one label's value, or "": value}."""
    return {
        family.name: {
            next(iter(sample.labels.values()), ""): sample.value for sample in family.samples
        }
        for family in families
    }


def test_the_backlog_gauge_counts_only_work_waiting_for_workers(fresh_engine: Engine) -> None:
    with make_sessionmaker(fresh_engine)() as session:
        build_mixed_queue(session)

    values = samples(list(QueueCollector(connecting(fresh_engine), 1000).collect()))

    assert 90 <= values["oldest_runnable_pending_age_seconds"][""] < 150
    assert values["oldest_held_pending_age_seconds"].keys() == {"paused", "max_in_flight"}
    assert 7200 <= values["oldest_held_pending_age_seconds"]["paused"] < 7260
    assert 3600 <= values["oldest_held_pending_age_seconds"]["max_in_flight"] < 3660
    assert values["due_companies"] == {"none": 2, "paused": 1, "max_in_flight": 1}
    assert values["due_backlog_tasks"] == {"none": 7, "paused": 2, "max_in_flight": 3}
    # The deprecated gauge still reports the oldest of all, paused included.
    assert 7200 <= values["oldest_eligible_pending_age_seconds"][""] < 7260


def test_a_queue_held_only_by_a_pause_reports_no_runnable_wait(fresh_engine: Engine) -> None:
    with make_sessionmaker(fresh_engine)() as session:
        company = insert_company(session).id
        due(session, company, 5, 600)
        pause(session, company)

    values = samples(list(QueueCollector(connecting(fresh_engine), 1000).collect()))

    assert values["oldest_runnable_pending_age_seconds"] == {"": 0}
    assert values["due_companies"] == {"none": 0, "paused": 1, "max_in_flight": 0}


def test_dead_row_versions_of_the_queue_tables_are_reported(fresh_engine: Engine) -> None:
    with make_sessionmaker(fresh_engine)() as session:
        company = insert_company(session).id
        add(session, company, 20)
        session.execute(text("UPDATE tasks SET attempts = attempts + 1"))
        session.commit()

    # The updating backend reports its counts to the statistics when it ends (NullPool:
    # closed above); the report can take a moment to become visible.
    deadline = time.monotonic() + 15
    while True:
        values = samples(list(QueueCollector(connecting(fresh_engine), 1000).collect()))
        if values["queue_table_dead_tuples"].get("tasks", 0) >= 20 or time.monotonic() > deadline:
            break
        time.sleep(0.2)

    assert set(values["queue_table_dead_tuples"]) == set(queue_health.QUEUE_TABLES)
    assert values["queue_table_dead_tuples"]["tasks"] >= 20
    assert values["queue_table_live_tuples"]["tasks"] == 20


def _nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    return [node, *(n for child in node.get("Plans", []) for n in _nodes(child))]


def test_the_split_reads_one_entry_per_due_company_and_leases_up_to_the_limit(
    db_session: Session,
) -> None:
    """20,000 tasks due tomorrow are never read; leases only of a limited company, up to 2."""
    delayed = insert_company(db_session, "delayed").id
    insert_delayed_tasks(db_session, delayed, 20_000)
    due(db_session, delayed, 1, 60)
    others = [insert_company(db_session, f"c{i}").id for i in range(4)]
    for company in others:
        due(db_session, company, 3, 60)
    limited = insert_weighted_company(db_session, "limited", max_in_flight=2).id
    leased(db_session, limited, 50)
    due(db_session, limited, 1, 60)
    db_session.execute(text("ANALYZE tasks, companies, company_queues, company_backlogs"))
    due_companies = db_session.scalar(
        text("SELECT count(*) FROM company_queues WHERE due_at <= now()")
    )

    [(explained,)] = driver_connection(db_session).execute(
        "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + queue_health._WAITING
    )
    [plan] = explained

    nodes = _nodes(plan["Plan"])
    [pending] = [n for n in nodes if n.get("Index Name") == "ix_tasks_pending_company_run_after"]
    assert pending["Actual Loops"] == due_companies >= 6
    assert pending["Actual Rows"] <= 1
    assert pending.get("Rows Removed by Filter", 0) == 0
    [leases] = [n for n in nodes if n.get("Index Name") == "ix_tasks_processing_company_locked_at"]
    # Scanned for the limited company alone, and up to its limit, not its 50 leases.
    assert (leases["Actual Loops"], leases["Actual Rows"]) == (1, 2)
    assert rounded(queue_health.waiting(driver_connection(db_session)))[Hold.MAX_IN_FLIGHT] == (
        1, 51, 1,
    )  # fmt: skip
