"""Worker children (design §4 Wake-up, Retention; §5): NOTIFY, polling, database restarts."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic import command
from sqlalchemy import Engine, pool, text
from sqlalchemy.orm import Session

from db import maintenance
from db.engine import driver_connection, make_engine
from devtools.embedded_postgres import EmbeddedPostgres, free_port
from tests import pg
from tests import supervisor_harness as harness
from tests.factories import MakeCompany, MakeTask, insert_company, insert_tasks
from tests.supervisor_harness import StartSupervisor, wait_for
from worker import wakeups


def _listener_pids(engine: Engine) -> set[int]:
    with engine.connect() as conn:
        return set(
            conn.execute(
                text(
                    "SELECT pid FROM pg_stat_activity "
                    "WHERE datname = current_database() AND application_name = :name"
                ),
                {"name": wakeups.LISTEN_APPLICATION_NAME},
            ).scalars()
        )


def _terminate_listeners(engine: Engine) -> set[int]:
    pids = _listener_pids(engine)
    with engine.connect() as conn:
        for pid in pids:
            conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
    return pids


def _start_delay(engine: Engine, task_id: uuid.UUID) -> float:
    """Seconds from creation to first claim, by the database clock."""
    row = harness.task_row(engine, task_id)
    delay: float = (row["started_at"] - row["created_at"]).total_seconds()
    return delay


def _wait_completed(engine: Engine, task_id: uuid.UUID, timeout: float) -> None:
    wait_for(
        lambda: harness.task_row(engine, task_id)["status"] == "completed",
        timeout,
        f"task {task_id} to complete",
    )


def test_notify_wakes_an_idle_child_at_once(
    supervisor: StartSupervisor, fresh_engine: Engine
) -> None:
    company = insert_company(fresh_engine).id
    # With a 10 s poll, only the NOTIFY can explain a start well under a second.
    sup = supervisor("--concurrency", "1", "--poll-interval", "10")
    sup.wait_ready(1)
    wait_for(lambda: _listener_pids(fresh_engine), 5, "the child to LISTEN")

    (task,) = insert_tasks(fresh_engine, company, notify_channel="fairq_tasks")
    _wait_completed(fresh_engine, task, 3)
    assert _start_delay(fresh_engine, task) < 0.5

    # A lost LISTEN connection is noticed and re-established; NOTIFY works again after it.
    old = _terminate_listeners(fresh_engine)
    wait_for(lambda: _listener_pids(fresh_engine) - old, 5, "the child to LISTEN again")
    (again,) = insert_tasks(fresh_engine, company, notify_channel="fairq_tasks")
    _wait_completed(fresh_engine, again, 3)
    assert _start_delay(fresh_engine, again) < 0.5
    assert "LISTEN connection lost" in sup.log()
    assert sup.metrics()["worker_child_restarts_total"] == 0


def test_polling_alone_runs_tasks_when_notify_never_arrives(
    supervisor: StartSupervisor, fresh_engine: Engine
) -> None:
    company = insert_company(fresh_engine).id
    sup = supervisor("--concurrency", "1", "--poll-interval", "0.3")
    (pid,) = sup.wait_ready(1)
    wait_for(lambda: _listener_pids(fresh_engine), 5, "the child to LISTEN")
    _terminate_listeners(fresh_engine)

    # No NOTIFY at all (as behind PgBouncer in transaction mode): the poll finds them.
    tasks = insert_tasks(fresh_engine, company, 3)
    for task in tasks:
        _wait_completed(fresh_engine, task, 5)
    assert sup.children() == [pid]


@pytest.fixture
def restartable(server: pg.TestServer, tmp_path: Path) -> Iterator[tuple[EmbeddedPostgres, str]]:
    """An embedded server this test may restart, and a migrated database URL on it.

    The session's own server when it is embedded (tests run serially, so a restart that is
    waited out harms no other test); else, with `TEST_DATABASE_URL`, a dedicated one.
    """
    if server.embedded is not None:
        name = server.create_from_template()
        yield server.embedded, server.url(name)
        server.embedded.start()  # whatever happened, leave the session's server running
        server.drop(name)
        return
    dedicated = EmbeddedPostgres(
        pg.ROOT / ".pgdata" / f"restart-{uuid.uuid4().hex[:8]}",
        free_port(),
        options={"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"},
    )
    try:
        dedicated.start()
        url = dedicated.url("postgres")
        command.upgrade(pg.alembic_config(url), "head")
        yield dedicated, url
    finally:
        dedicated.destroy()
        dedicated.log_path.unlink(missing_ok=True)


@pytest.mark.slow
def test_work_resumes_after_postgresql_restarts(
    supervisor: StartSupervisor, restartable: tuple[EmbeddedPostgres, str]
) -> None:
    postgres, url = restartable
    engine = make_engine(url, application_name="fairq-tests", poolclass=pool.NullPool)
    try:
        company = insert_company(engine).id
        # A 10 s poll: after the restart, only re-established LISTEN connections (or the
        # immediate pass that follows each reconnect) can explain a prompt start.
        sup = supervisor("--concurrency", "2", "--poll-interval", "10", DATABASE_URL=url)
        children = sup.wait_ready(2)
        wait_for(lambda: len(_listener_pids(engine)) == 2, 5, "both children to LISTEN")
        (before,) = insert_tasks(engine, company, notify_channel="fairq_tasks")
        _wait_completed(engine, before, 5)

        postgres.restart()

        # Children back off 0.5, 1, 2 ... s between attempts, LISTEN included.
        wait_for(lambda: len(_listener_pids(engine)) == 2, 15, "both children to LISTEN again")
        (after,) = insert_tasks(engine, company, notify_channel="fairq_tasks")
        _wait_completed(engine, after, 3)
        assert _start_delay(engine, after) < 1.0
        assert sup.children() == children  # the same processes: nobody exited or restarted
        assert sup.metrics()["worker_child_restarts_total"] == 0
    finally:
        engine.dispose()


# -- retention (db.maintenance, run by the children every minute) --------------------------


def test_retention_deletes_only_terminal_tasks_past_the_window(
    db_session: Session, make_company: MakeCompany, make_task: MakeTask
) -> None:
    company = make_company()
    old = text("now() - interval '8 days'")
    recent = text("now() - interval '1 day'")
    expired = [
        make_task(company.id, status=status, finished_at=old)
        for status in ("completed", "failed", "cancelled")
    ]
    kept = [
        make_task(company.id, status="completed", finished_at=recent),
        make_task(company.id, status="pending", created_at=old),
        make_task(company.id, status="processing", locked_at=old, created_at=old),
    ]

    deleted = maintenance.delete_expired_tasks(
        driver_connection(db_session, transaction=False), retention_seconds=7 * 86400
    )

    assert deleted == len(expired)
    remaining = set(db_session.scalars(text("SELECT id FROM tasks WHERE company_id = :c"),
                                       {"c": company.id}))  # fmt: skip
    assert remaining == {task.id for task in kept}


def test_retention_deletes_in_batches(
    db_session: Session, make_company: MakeCompany, make_task: MakeTask
) -> None:
    company = make_company()
    for _ in range(5):
        make_task(company.id, status="completed", finished_at=text("now() - interval '30 days'"))
    assert (
        maintenance.delete_expired_tasks(
            driver_connection(db_session, transaction=False), retention_seconds=86400, limit=2
        )
        == 2
    )


def test_retention_skips_while_another_runner_holds_the_lock(
    db_session: Session, engine: Engine, make_company: MakeCompany, make_task: MakeTask
) -> None:
    company = make_company()
    make_task(company.id, status="completed", finished_at=text("now() - interval '30 days'"))
    with engine.connect() as other, other.begin():
        other.execute(
            text("SELECT pg_advisory_xact_lock(:k)"), {"k": maintenance.RETENTION_LOCK_KEY}
        )
        assert (
            maintenance.delete_expired_tasks(
                driver_connection(db_session, transaction=False), retention_seconds=86400
            )
            is None
        )


@pytest.mark.slow
def test_supervisor_started_while_postgresql_is_down_waits_and_then_works(
    supervisor: StartSupervisor, restartable: tuple[EmbeddedPostgres, str]
) -> None:
    postgres, url = restartable
    engine = make_engine(url, application_name="fairq-tests", poolclass=pool.NullPool)
    try:
        company = insert_company(engine).id
        postgres.stop()
        sup = supervisor("--concurrency", "2", "--poll-interval", "0.2", DATABASE_URL=url)
        # A deploy that restarts the database must not take the workers down with it.
        wait_for(lambda: "database unreachable at boot" in sup.log(), 10, "boot retries")
        postgres.start()
        sup.wait_ready(2)
        (task,) = insert_tasks(engine, company)
        _wait_completed(engine, task, 10)
        assert sup.metrics()["worker_child_restarts_total"] == 0
    finally:
        postgres.start()
        engine.dispose()
