"""A worker pass where things go wrong on the hot path's shortcuts.

A pass holds one connection and writes in autocommit; the claim and completions go to psycopg
directly; the lease sweep runs on a schedule; durations are observed per batch. Each test
shows one of those still behaves as the plain path did: a connection that died while a
handler ran, a driver error in `--once`, a sweep that hit its limit, a NaN duration.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from db import queue
from db.engine import make_engine, make_sessionmaker
from tests import supervisor_harness as harness
from tests.factories import insert_company, insert_tasks
from worker import processing, tasktypes
from worker.tasktypes.base import TaskContext, TaskType
from worker.tasktypes.noop import NoopPayload

# application_name of the engine whose connections a test kills (and nothing else's).
HELD = "fairq-test-held"


@pytest.fixture
def sessions(fresh_engine: Engine) -> sessionmaker[Session]:
    """Sessions on a fresh database whose commits other threads and processes see."""
    return make_sessionmaker(fresh_engine)


@pytest.fixture
def company(sessions: sessionmaker[Session]) -> uuid.UUID:
    """A company in the fresh database."""
    with sessions() as session:
        return insert_company(session).id


@pytest.fixture
def worker_engine(fresh_db_url: str) -> Iterator[Engine]:
    """An engine like a worker child's (a real pool, pre-ping), with its own application_name."""
    engine = make_engine(
        fresh_db_url,
        application_name=HELD,
        statement_timeout_ms=processing.WORKER_STATEMENT_TIMEOUT_MS,
    )
    yield engine
    engine.dispose()


def register(
    monkeypatch: pytest.MonkeyPatch, name: str, handler: Callable[[TaskContext], None]
) -> None:
    monkeypatch.setitem(tasktypes.REGISTRY, name, TaskType(name, "test type", NoopPayload, handler))


def status_of(sessions: sessionmaker[Session], task_id: uuid.UUID) -> tuple[Any, ...]:
    with sessions() as session:
        row = session.execute(
            text("SELECT status, attempts, last_error FROM tasks WHERE id = :id"), {"id": task_id}
        ).one()
    return tuple(row)


def test_a_retry_is_written_when_the_held_connection_died_during_the_handler(
    sessions: sessionmaker[Session],
    company: uuid.UUID,
    worker_engine: Engine,
    fresh_engine: Engine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def connection_dies_then_handler_fails(task: TaskContext) -> None:
        # What a PostgreSQL restart does to the pass's idle connection while a handler runs.
        with fresh_engine.connect() as conn:
            conn.execute(
                text(
                    "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity "
                    "WHERE application_name = :name AND datname = current_database()"
                ),
                {"name": HELD},
            )
            conn.commit()
        raise RuntimeError("webhook target answered 502")

    register(monkeypatch, "flaky", connection_dies_then_handler_fails)
    with sessions() as session:
        [task_id] = insert_tasks(session, company, 1, task_type="flaky")
    keeper = processing.LeaseKeeper()
    try:
        result = processing.process_batch(
            worker_engine, worker_id="review:1", owed=processing.Owed(), keeper=keeper
        )
    finally:
        keeper.close()

    assert result == processing.PassResult(claimed=1, retried=1)
    status, attempts, last_error = status_of(sessions, task_id)
    assert (status, attempts) == ("pending", 1)
    assert last_error == "RuntimeError: webhook target answered 502"


def test_once_reports_a_driver_error_in_the_claim_as_a_database_error(
    tmp_path: Path, fresh_db_url: str, fresh_engine: Engine
) -> None:
    with fresh_engine.connect() as conn:
        database = conn.execute(text("SELECT current_database()")).scalar_one()
        # The worker's own statement_timeout (30 s) raises the same kind of error; a database
        # level lock_timeout gets there in 300 ms (the worker's options do not override it).
        conn.execute(text(f'ALTER DATABASE "{database}" SET lock_timeout = 300'))
        conn.commit()
    holder = fresh_engine.connect()
    try:
        # Another claimer that holds the claimers' lock for longer than the timeout.
        holder.execute(text("SELECT pg_advisory_lock(:key)"), {"key": queue.CLAIM_LOCK_KEY})
        holder.commit()
        environment = {**os.environ, "PYTHONPATH": str(harness.ROOT), "DATABASE_URL": fresh_db_url}
        done = subprocess.run(
            [sys.executable, "-m", "worker", "--once"],
            cwd=harness.ROOT, env=environment, capture_output=True, text=True,
            stdin=subprocess.DEVNULL, timeout=60, check=False,
        )  # fmt: skip
    finally:
        holder.close()

    assert done.returncode == 1
    assert "fairq worker: database error" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_a_sweep_that_hit_its_limit_sweeps_again_on_the_next_pass(
    sessions: sessionmaker[Session],
    company: uuid.UUID,
    worker_engine: Engine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with sessions() as session:
        ids = insert_tasks(session, company, 3, task_type="noop")
        session.execute(
            text(
                "UPDATE tasks SET status = 'processing', attempts = 1, "
                "lease_token = gen_random_uuid(), locked_by = 'dead:1', "
                "locked_at = now() - interval '1 hour', started_at = now() - interval '1 hour' "
                "WHERE id = ANY(:ids)"
            ),
            {"ids": ids},
        )
        session.commit()
    monkeypatch.setattr(processing, "SWEEP_LIMIT", 2)  # stands for 1000
    schedule = processing.SweepSchedule(interval=3600)
    settings = processing.PassDefaults(batch_size=1)

    first = processing.process_batch(
        worker_engine, worker_id="r:1", settings=settings, sweep=schedule
    )
    second = processing.process_batch(
        worker_engine, worker_id="r:1", settings=settings, sweep=schedule
    )

    assert (first.claimed, second.claimed) == (1, 1)
    with sessions() as session:
        still_dead = session.execute(
            text("SELECT count(*) FROM tasks WHERE locked_by = 'dead:1'")
        ).scalar_one()
    assert still_dead == 0


def test_observe_all_matches_observe_for_a_nan() -> None:
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from worker import metrics

    def exposition(observe: Callable[[Histogram], None]) -> list[str]:
        registry = CollectorRegistry()
        histogram = Histogram(
            "t", "t", ["type"], buckets=metrics.TASK_DURATION_BUCKETS, registry=registry
        )
        observe(histogram.labels("noop"))
        return [
            line
            for line in generate_latest(registry).decode().splitlines()
            if line.startswith("t_bucket") or line.startswith("t_count")
        ]

    amounts = [0.002, math.nan]

    def one_by_one(histogram: Histogram) -> None:
        for amount in amounts:
            histogram.observe(amount)

    expected = exposition(one_by_one)
    assert exposition(lambda h: metrics.observe_all(h, amounts)) == expected
