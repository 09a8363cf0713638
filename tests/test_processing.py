"""The processing pass (`worker.processing`) and `POST /workers/process`."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import multiprocessing
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import psycopg
import pytest
from flask import Flask
from flask.testing import FlaskClient
from marshmallow import INCLUDE, Schema
from psycopg_pool import ConnectionPool
from sqlalchemy import Engine, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from db import claims, connector, workers
from db.engine import driver_connection, make_engine, make_sessionmaker
from devtools.webhook_receiver import Receiver
from tests import pg
from tests.factories import CreatedTask, MakeCompany, insert_tasks, json_of, take_back
from worker import processing, tasktypes
from worker.errors import PermanentTaskError
from worker.processing import completer, sweep
from worker.settings import PassSettings
from worker.tasktypes import sleep
from worker.tasktypes.base import Handler, HandlerConfig, TaskContext, TaskType

Register = Callable[[str, Handler], None]


class Recorder:
    """A `PassObserver` that keeps every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def claimed(self, n: int) -> None:
        self.calls.append(("claimed", n))

    def claim_seconds(self, seconds: float) -> None:
        self.calls.append(("claim_seconds",))

    def completed(self, task_type: str, seconds: Sequence[float]) -> None:
        self.calls.extend(("completed", task_type) for _ in seconds)

    def retried(self, task_type: str, seconds: float | None = None) -> None:
        self.calls.append(("retried", task_type))

    def failed(self, task_type: str, seconds: float | None = None) -> None:
        self.calls.append(("failed", task_type, seconds is not None))

    def released(self, n: int) -> None:
        self.calls.append(("released", n))

    def lease_lost(self, n: int = 1) -> None:
        self.calls.append(("lease_lost", n))


class TopOfRange(random.Random):
    """Backoff at its ceiling, so the retry delay is known exactly."""

    def uniform(self, a: float, b: float) -> float:
        return b


@pytest.fixture
def sessions(fresh_engine: Engine) -> sessionmaker[Session]:
    """Sessions on a fresh database whose commits other threads and processes see."""
    return make_sessionmaker(fresh_engine)


class AnyPayload(Schema):
    """Any JSON object, loaded as it is: the payload of the tests' own task types."""

    class Meta:
        unknown = INCLUDE


@pytest.fixture
def register(monkeypatch: pytest.MonkeyPatch) -> Register:
    """`register(name, handler)` adds a task type for this test only (`AnyPayload`)."""

    def add(name: str, handler: Handler) -> None:
        monkeypatch.setitem(
            tasktypes.REGISTRY, name, TaskType(name, "test type", AnyPayload, handler)
        )

    return add


def rows(sessions: sessionmaker[Session], ids: list[uuid.UUID]) -> list[dict[str, Any]]:
    """The stored rows of `ids`, in that order, with the database time as `db_now`."""
    with sessions() as session:
        found = session.execute(
            text("SELECT *, now() AS db_now FROM tasks WHERE id = ANY(:ids)"), {"ids": ids}
        ).mappings()
        by_id = {r["id"]: dict(r) for r in found}
    return [by_id[i] for i in ids]


def silence(session: Session, worker_id: str = "test:1") -> None:
    """Make `worker_id`'s heartbeat an hour old: what a sweep sees of a worker that died."""
    session.execute(
        text("UPDATE workers SET heartbeat_at = now() - interval '1 hour' WHERE id = :id"),
        {"id": worker_id},
    )


def take_over(
    session: Session, *, worker_id: str, stale_after: float, batch_size: int = 1
) -> list[claims.ClaimedTask]:
    """What another worker does: sweep with `stale_after`, then claim."""
    take_back(session, stale_after=stale_after)
    return claims.claim(
        driver_connection(session, transaction=False), worker_id=worker_id, batch_size=batch_size
    )


@contextlib.contextmanager
def sweeping(sessions: sessionmaker[Session], stale_after: float) -> Iterator[list[uuid.UUID]]:
    """Another worker's sweep every 50 ms while the body runs; yields the ids it took back.

    It does not claim, so it cannot race a pass for a task before the pass has it.
    """
    done = threading.Event()
    taken: list[uuid.UUID] = []

    def compete() -> None:
        with sessions() as session:
            while not done.wait(0.05):
                taken.extend(t.id for t in take_back(session, stale_after=stale_after))
                session.commit()

    thread = threading.Thread(target=compete)
    thread.start()
    try:
        yield taken
    finally:
        done.set()
        thread.join()


def run_pass(sessions: sessionmaker[Session] | Engine, **kw: Any) -> processing.PassResult:
    """One pass with test defaults (batch 100, stale 300 s), on a worker's pool."""
    settings = kw.pop("settings", PassSettings())
    with pg.worker_pool(sessions) as pool:
        return processing.run_pass(pool, worker_id="test:1", settings=settings, **kw)


def test_noop_tasks_complete(sessions: sessionmaker[Session], fresh_company_id: uuid.UUID) -> None:
    ids = insert_tasks(sessions, fresh_company_id, 5, task_type="noop")
    observer = Recorder()

    result = run_pass(sessions, observer=observer)

    assert result == processing.PassResult(claimed=5, completed=5)
    for stored in rows(sessions, ids):
        assert stored["status"] == "completed"
        assert stored["attempts"] == 1
        assert stored["finished_at"] is not None
        assert stored["lease_token"] is stored["locked_by"] is stored["locked_at"] is None
    assert observer.calls == [
        ("claim_seconds",), ("claimed", 5), *[("completed", "noop")] * 5,
    ]  # fmt: skip
    assert run_pass(sessions) == processing.PassResult()


def test_a_raising_handler_is_retried_later_with_its_error(
    sessions: sessionmaker[Session], fresh_company_id: uuid.UUID, register: Register
) -> None:
    def flaky(task: TaskContext) -> None:
        raise ConnectionError("smtp down")

    register("flaky", flaky)
    [task_id] = insert_tasks(sessions, fresh_company_id, 1, task_type="flaky")
    observer = Recorder()

    result = run_pass(sessions, observer=observer, rng=TopOfRange())

    [stored] = rows(sessions, [task_id])
    assert result == processing.PassResult(claimed=1, retried=1)
    assert stored["status"] == "pending"
    assert stored["attempts"] == 1
    assert stored["last_error"] == "ConnectionError: smtp down"
    # Attempt 1 backs off up to 2 s; TopOfRange picks exactly 2 s from the retry's now().
    assert dt.timedelta(seconds=1.5) < stored["run_after"] - stored["db_now"]
    assert stored["run_after"] - stored["db_now"] <= dt.timedelta(seconds=2)
    assert ("retried", "flaky") in observer.calls


def test_the_last_attempt_fails_for_good(
    sessions: sessionmaker[Session], fresh_company_id: uuid.UUID, register: Register
) -> None:
    def flaky(task: TaskContext) -> None:
        raise TimeoutError

    register("flaky", flaky)
    [task_id] = insert_tasks(sessions, fresh_company_id, 1, task_type="flaky", max_attempts=1)

    assert run_pass(sessions) == processing.PassResult(claimed=1, failed=1)
    [stored] = rows(sessions, [task_id])
    assert stored["status"] == "failed"
    assert stored["last_error"] == "gave up after 1 attempts: TimeoutError"


def test_handlers_get_the_payload_their_schema_loads(
    sessions: sessionmaker[Session], fresh_company_id: uuid.UUID, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[TaskContext[sleep.Sleep]] = []
    spy = dataclasses.replace(sleep.TASK_TYPE, name="spy", handler=seen.append)
    monkeypatch.setitem(tasktypes.REGISTRY, "spy", spy)
    insert_tasks(sessions, fresh_company_id, 1, task_type="spy", payload={"seconds": 2})

    run_pass(sessions)

    [context] = seen
    assert context.payload == sleep.Sleep(seconds=2.0)
    assert isinstance(context.payload.seconds, float)


def test_a_stored_payload_its_schema_refuses_fails_the_task_for_good_naming_the_field(
    sessions: sessionmaker[Session], fresh_company_id: uuid.UUID
) -> None:
    # Stored past the API's validation (before the schema changed, or by hand).
    [task_id] = insert_tasks(
        sessions, fresh_company_id, 1, task_type="sleep", payload={"seconds": "a secret"}
    )

    assert run_pass(sessions) == processing.PassResult(claimed=1, failed=1)
    [stored] = rows(sessions, [task_id])
    assert stored["status"] == "failed"
    assert stored["attempts"] == 1
    assert "invalid seconds" in stored["last_error"]
    assert "a secret" not in stored["last_error"]


def test_permanent_errors_and_unknown_types_fail_without_retry(
    sessions: sessionmaker[Session], fresh_company_id: uuid.UUID, register: Register
) -> None:
    def refuse(task: TaskContext) -> None:
        raise PermanentTaskError("mailbox does not exist")

    register("refuse", refuse)
    [refused] = insert_tasks(sessions, fresh_company_id, 1, task_type="refuse")
    [unknown] = insert_tasks(sessions, fresh_company_id, 1, task_type="retired-type")
    observer = Recorder()

    assert run_pass(sessions, observer=observer) == processing.PassResult(claimed=2, failed=2)
    first, second = rows(sessions, [refused, unknown])
    assert first["status"] == second["status"] == "failed"
    assert first["attempts"] == 1
    assert first["last_error"] == "PermanentTaskError: mailbox does not exist"
    assert second["last_error"].startswith("unknown task type 'retired-type' (registered: ")
    assert ("failed", "refuse", True) in observer.calls
    assert ("failed", "retired-type", False) in observer.calls


def test_handlers_get_the_attempt_payload_and_config(
    sessions: sessionmaker[Session], fresh_company_id: uuid.UUID, register: Register
) -> None:
    seen: list[TaskContext] = []
    register("spy", seen.append)
    [task_id] = insert_tasks(
        sessions, fresh_company_id, 1, task_type="spy", payload={"to": "a@example.com"}
    )
    config = HandlerConfig(smtp_from="ops@example.com")

    run_pass(sessions, settings=PassSettings(handler_config=config))

    [context] = seen
    assert (context.task_id, context.company_id) == (task_id, fresh_company_id)
    assert (context.type, context.attempt, context.max_attempts) == ("spy", 1, 5)
    assert context.payload == {"to": "a@example.com"}
    assert context.config is config


def test_stop_mid_batch_releases_the_rest_with_attempts_restored(
    sessions: sessionmaker[Session], fresh_company_id: uuid.UUID, register: Register
) -> None:
    stop = threading.Event()
    register("stopper", lambda task: stop.set())
    ids = insert_tasks(sessions, fresh_company_id, 5, task_type="stopper")
    before = rows(sessions, ids)
    observer = Recorder()

    result = run_pass(sessions, stop=stop, observer=observer)

    assert result == processing.PassResult(claimed=5, completed=1, released=4)
    first, *rest = rows(sessions, ids)
    assert first["status"] == "completed"
    for stored, original in zip(rest, before[1:], strict=True):
        assert stored["status"] == "pending"
        assert stored["attempts"] == 0
        assert stored["run_after"] == original["run_after"]
        assert stored["lease_token"] is None
    assert ("released", 4) in observer.calls


def test_a_set_stop_flag_claims_nothing(
    sessions: sessionmaker[Session], fresh_company_id: uuid.UUID
) -> None:
    [task_id] = insert_tasks(sessions, fresh_company_id, 1, task_type="noop")
    assert run_pass(sessions, stop=lambda: True) == processing.PassResult()
    assert rows(sessions, [task_id])[0]["status"] == "pending"


def test_keyboard_interrupt_propagates_after_releasing_the_unstarted_rest(
    sessions: sessionmaker[Session], fresh_company_id: uuid.UUID, register: Register
) -> None:
    calls: list[uuid.UUID] = []

    def interrupted_second_time(task: TaskContext) -> None:
        calls.append(task.task_id)
        if len(calls) == 2:
            raise KeyboardInterrupt

    register("interruptible", interrupted_second_time)
    ids = insert_tasks(sessions, fresh_company_id, 4, task_type="interruptible")

    with pytest.raises(KeyboardInterrupt):
        run_pass(sessions)

    done, interrupted, *unstarted = rows(sessions, ids)
    assert done["status"] == "completed"
    # The interrupted task may have had side effects: lease expiry recovers it, counted.
    assert (interrupted["status"], interrupted["attempts"]) == ("processing", 1)
    assert [(r["status"], r["attempts"]) for r in unstarted] == [("pending", 0)] * 2


def test_a_lease_taken_over_during_the_handler_is_counted_as_lost(
    sessions: sessionmaker[Session], fresh_company_id: uuid.UUID, register: Register
) -> None:
    def overtaken(task: TaskContext) -> None:
        # Another worker declares this one dead and claims the task meanwhile.
        with sessions() as other:
            silence(other)
            [taken] = take_over(other, worker_id="other:2", stale_after=300)
            other.commit()
            assert taken.id == task.task_id

    register("overtaken", overtaken)
    [task_id] = insert_tasks(sessions, fresh_company_id, 1, task_type="overtaken")
    observer = Recorder()

    assert run_pass(sessions, observer=observer) == processing.PassResult(claimed=1, lease_lost=1)
    [stored] = rows(sessions, [task_id])
    assert (stored["status"], stored["locked_by"], stored["attempts"]) == (
        "processing", "other:2", 2,
    )  # fmt: skip
    assert ("lease_lost", 1) in observer.calls


def test_no_task_starts_once_a_sweep_declared_its_worker_dead(
    sessions: sessionmaker[Session], fresh_company_id: uuid.UUID, register: Register
) -> None:
    """Its leases were taken back: running one would process it twice at once (design §1.2).

    The next heartbeat finds the worker's row gone; the tasks not started are handed back
    fenced, so the one another worker claimed meanwhile is counted lost, not released.
    """
    started: list[uuid.UUID] = []

    def first(task: TaskContext) -> None:
        started.append(task.task_id)
        with sessions() as other:  # another worker finds this one dead, claims a task
            silence(other)
            take_over(other, worker_id="other:2", stale_after=2)
            other.commit()
        time.sleep(0.5)  # a few heartbeats

    register("first", first)
    register("second", lambda task: started.append(task.task_id))
    [first_id] = insert_tasks(
        sessions, fresh_company_id, 1, task_type="first", newest_age_seconds=60
    )
    [second_id] = insert_tasks(sessions, fresh_company_id, 1, task_type="second")
    settings = PassSettings(stale_after=2.0, heartbeat_interval=0.1)

    result = run_pass(sessions, settings=settings)

    assert result == processing.PassResult(claimed=2, lease_lost=2)
    assert started == [first_id]
    stored = rows(sessions, [first_id, second_id])
    assert [(r["status"], r["locked_by"]) for r in stored] == [
        ("processing", "other:2"), ("pending", None),
    ]  # fmt: skip


def test_completions_are_written_while_a_later_task_still_runs(
    sessions: sessionmaker[Session], fresh_company_id: uuid.UUID, register: Register
) -> None:
    """Batched completions wait about FLUSH_AFTER_SECONDS, not for the pass to end."""
    seen_by_slow: list[str] = []

    def slow(task: TaskContext) -> None:
        time.sleep(completer.FLUSH_AFTER_SECONDS * 5)
        seen_by_slow.append(rows(sessions, [fast_id])[0]["status"])

    register("slow", slow)
    [fast_id] = insert_tasks(sessions, fresh_company_id, 1, task_type="noop", newest_age_seconds=60)
    insert_tasks(sessions, fresh_company_id, 1, task_type="slow")

    assert run_pass(sessions) == processing.PassResult(claimed=2, completed=2)
    assert seen_by_slow == ["completed"]


# -- database errors: nothing unwritten is dropped ------------------------------------------


def _database_down() -> OperationalError:
    return OperationalError("statement", {}, psycopg.OperationalError("server closed"))


def test_a_database_error_before_a_task_starts_releases_that_task_unrun(
    sessions: sessionmaker[Session],
    fresh_company_id: uuid.UUID,
    register: Register,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The heartbeat before the second task fails: it and the rest go back."""
    started: list[uuid.UUID] = []

    def slow(task: TaskContext) -> None:
        started.append(task.task_id)
        time.sleep(0.3)  # past stale_after / 2: the next task beats first

    def heartbeat_fails_in_the_pass(conn: Any, worker_id: str) -> bool:
        if threading.current_thread() is threading.main_thread():
            raise _database_down()
        return real_heartbeat(conn, worker_id)

    real_heartbeat = workers.heartbeat
    monkeypatch.setattr(workers, "heartbeat", heartbeat_fails_in_the_pass)
    register("slow", slow)
    ids = insert_tasks(sessions, fresh_company_id, 3, task_type="slow", max_attempts=1)
    settings = PassSettings(stale_after=0.4, heartbeat_interval=0.35)
    observer = Recorder()

    with pytest.raises(OperationalError):
        run_pass(sessions, settings=settings, observer=observer)

    assert started == ids[:1]
    first, *rest = rows(sessions, ids)
    assert first["status"] == "completed"
    assert [(r["status"], r["attempts"], r["lease_token"]) for r in rest] == [
        ("pending", 0, None)
    ] * 2
    assert ("released", 2) in observer.calls


def test_outcomes_a_database_error_left_unwritten_are_written_by_the_next_pass_not_rerun(
    sessions: sessionmaker[Session],
    fresh_company_id: uuid.UUID,
    register: Register,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runs: list[uuid.UUID] = []
    down = True

    def while_down(real: Callable[..., set[uuid.UUID]]) -> Callable[..., set[uuid.UUID]]:
        def statement(session: Session, *args: Any) -> set[uuid.UUID]:
            if down:
                raise _database_down()
            return real(session, *args)

        return statement

    for name in ("complete_tasks", "release_tasks"):
        monkeypatch.setattr(claims, name, while_down(getattr(claims, name)))
    register("counted", lambda task: runs.append(task.task_id))
    ids = insert_tasks(sessions, fresh_company_id, 3, task_type="counted")
    unwritten = processing.UnwrittenOutcomes()
    observer = Recorder()

    # The first task runs, then the pass stops; neither its completion nor the release of
    # the other two can be written.
    with pytest.raises(OperationalError):
        run_pass(sessions, stop=lambda: len(runs) == 1, unwritten=unwritten, observer=observer)
    assert (unwritten.completions, unwritten.releases) == (1, 2)
    # Still down: the next pass writes nothing, claims nothing, and keeps it all unwritten.
    with pytest.raises(OperationalError):
        run_pass(sessions, unwritten=unwritten, observer=observer)
    assert (unwritten.completions, unwritten.releases) == (1, 2)
    assert [(r["status"], r["attempts"]) for r in rows(sessions, ids)] == [("processing", 1)] * 3
    assert not [c for c in observer.calls if c[0] in ("completed", "released")]

    down = False
    result = run_pass(sessions, unwritten=unwritten, observer=observer)

    assert not unwritten
    # The unwritten completion and releases first, then the released two are claimed and run.
    assert result == processing.PassResult(claimed=2, completed=3, released=2)
    assert sorted(runs) == sorted(ids)
    assert [r["status"] for r in rows(sessions, ids)] == ["completed"] * 3
    assert observer.calls.count(("completed", "counted")) == 3
    assert observer.calls.count(("released", 2)) == 1


def test_write_unwritten_writes_what_a_failed_pass_kept(
    sessions: sessionmaker[Session], fresh_company_id: uuid.UUID, monkeypatch: pytest.MonkeyPatch
) -> None:
    def complete_fails(session: Session, *args: Any) -> set[uuid.UUID]:
        raise _database_down()

    ids = insert_tasks(sessions, fresh_company_id, 2, task_type="noop")
    unwritten = processing.UnwrittenOutcomes()
    with monkeypatch.context() as patched:
        patched.setattr(claims, "complete_tasks", complete_fails)
        with pytest.raises(OperationalError):
            run_pass(sessions, unwritten=unwritten)
    assert unwritten.completions == 2

    with pg.worker_pool(sessions) as pool:
        written = processing.write_unwritten(pool, unwritten)
    assert written == processing.PassResult(completed=2)
    assert not unwritten
    assert [r["status"] for r in rows(sessions, ids)] == ["completed"] * 2


# -- fewer round trips: the pass's connection, the sweep schedule, one keeper --------------


def test_a_pass_given_a_pool_checks_out_one_connection_for_all_its_writes(
    fresh_engine: Engine,
    fresh_company_id: uuid.UUID,
    sessions: sessionmaker[Session],
    register: Register,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sweep, claim, the keeper's flushes and the final ones share one checkout (one ping)."""
    register("slow", lambda task: time.sleep(completer.FLUSH_AFTER_SECONDS * 3))
    insert_tasks(sessions, fresh_company_id, 2, task_type="noop", newest_age_seconds=60)
    insert_tasks(sessions, fresh_company_id, 1, task_type="slow")
    checkouts: list[object] = []
    real_checkout = connector.checkout

    def checkout(pool: Any, **kw: Any) -> psycopg.Connection[Any]:
        checkouts.append(pool)
        return real_checkout(pool, **kw)

    monkeypatch.setattr(connector, "checkout", checkout)
    result = run_pass(fresh_engine)
    assert result == processing.PassResult(claimed=3, completed=3)
    assert len(checkouts) == 1


def test_a_sweep_schedule_sweeps_expired_leases_only_when_due(
    fresh_engine: Engine, fresh_company_id: uuid.UUID, sessions: sessionmaker[Session]
) -> None:
    def lease_expired_task() -> uuid.UUID:
        [task_id] = insert_tasks(sessions, fresh_company_id, 1, task_type="noop")
        with sessions() as session:
            [claimed] = claims.claim(
                driver_connection(session, transaction=False), worker_id="dead:1", batch_size=1
            )
            session.execute(
                text("UPDATE tasks SET locked_at = now() - interval '1 hour' WHERE id = :id"),
                {"id": claimed.id},
            )
            session.commit()
        assert claimed.id == task_id
        return task_id

    schedule = processing.SweepSchedule(interval=3600)
    first = lease_expired_task()
    # Due at first: the expired lease is taken back, then claimed and run by the same pass.
    result = run_pass(fresh_engine, sweep_schedule=schedule)
    assert result == processing.PassResult(claimed=1, completed=1)
    second = lease_expired_task()
    # Not due again for an hour: the second expired lease waits.
    assert run_pass(fresh_engine, sweep_schedule=schedule) == processing.PassResult()
    assert [(r["status"], r["locked_by"]) for r in rows(sessions, [first, second])] == [
        ("completed", None), ("processing", "dead:1"),
    ]  # fmt: skip
    # Without a schedule a pass sweeps every time.
    assert run_pass(fresh_engine) == processing.PassResult(claimed=1, completed=1)


def test_the_child_sweeps_at_least_every_tenth_of_the_stale_window() -> None:
    assert processing.SweepSchedule.for_stale_window(300).interval == sweep.SWEEP_INTERVAL_SECONDS
    assert processing.SweepSchedule.for_stale_window(2).interval == pytest.approx(0.2)


@pytest.mark.slow
def test_one_lease_keeper_heartbeats_for_pass_after_pass(
    fresh_engine: Engine,
    fresh_company_id: uuid.UUID,
    sessions: sessionmaker[Session],
    register: Register,
) -> None:
    """Two passes with one keeper: each long task outlives the stale window, none is lost."""
    stale, task_seconds = 0.6, 1.0
    register("long", lambda task: time.sleep(task_seconds))
    settings = PassSettings(stale_after=stale, heartbeat_interval=0.1)
    keeper = processing.LeaseKeeper()
    with sweeping(sessions, stale) as stolen:
        try:
            for _ in range(2):
                insert_tasks(sessions, fresh_company_id, 1, task_type="long")
                result = run_pass(fresh_engine, settings=settings, keeper=keeper)
                assert result == processing.PassResult(claimed=1, completed=1)
        finally:
            keeper.close()
    assert stolen == []


def test_the_lease_keeper_logs_a_database_outage_once_not_every_tick(
    sessions: sessionmaker[Session],
    fresh_company_id: uuid.UUID,
    register: Register,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def complete_fails(session: Session, *args: Any) -> set[uuid.UUID]:
        raise _database_down()

    monkeypatch.setattr(claims, "complete_tasks", complete_fails)
    register("slow", lambda task: time.sleep(0.6))  # about ten keeper ticks of failed flushes
    insert_tasks(sessions, fresh_company_id, 1, task_type="noop", newest_age_seconds=60)
    insert_tasks(sessions, fresh_company_id, 1, task_type="slow")

    with (
        caplog.at_level("WARNING", logger="fairq.worker.processing"),
        pytest.raises(OperationalError),
    ):
        run_pass(sessions)

    keeper = [r for r in caplog.records if r.getMessage().startswith("lease keeper")]
    assert len(keeper) == 1, [r.getMessage() for r in keeper]
    assert keeper[0].levelname == "WARNING"
    assert keeper[0].exc_info is None


# -- the worker's connections -------------------------------------------------------------


def test_worker_connections_bound_statements_and_detect_dead_peers(fresh_db_url: str) -> None:
    with connector.connect(
        fresh_db_url, application_name="fairq-tests", statement_timeout_ms=1234
    ) as conn:
        assert conn.execute("SHOW statement_timeout").fetchone() == ("1234ms",)
        params = conn.info.get_parameters()
        assert (params["keepalives_idle"], params["tcp_user_timeout"]) == ("10", "30000")
        with pytest.raises(psycopg.errors.QueryCanceled, match="statement timeout"):
            conn.execute("SELECT pg_sleep(2)")
    with connector.connect(fresh_db_url, application_name="fairq-tests") as conn:
        assert conn.execute("SHOW statement_timeout").fetchone() == ("0",)


# -- leases held by a live worker, lost by a dead one -------------------------------------


@pytest.mark.slow
def test_heartbeat_keeps_a_long_task_from_being_reclaimed(
    sessions: sessionmaker[Session], fresh_company_id: uuid.UUID, register: Register
) -> None:
    """A 30 s task with a 10 s stale window and 2 s heartbeats, time-scaled by 1/10.

    A competitor sweeps every 50 ms with the same stale window throughout; the control at the
    end shows a lease nobody refreshes is taken over.
    """
    stale, task_seconds, beat = 1.0, 3.0, 0.2
    register("long", lambda task: time.sleep(task_seconds))
    [task_id] = insert_tasks(sessions, fresh_company_id, 1, task_type="long")
    settings = PassSettings(stale_after=stale, heartbeat_interval=beat)
    with sweeping(sessions, stale) as stolen:
        result = run_pass(sessions, settings=settings)

    assert stolen == []
    assert result == processing.PassResult(claimed=1, completed=1)
    [stored] = rows(sessions, [task_id])
    assert (stored["status"], stored["attempts"]) == ("completed", 1)

    # Control: a lease of a worker that does not beat is taken over after the stale window.
    [orphan] = insert_tasks(sessions, fresh_company_id, 1, task_type="long")
    with sessions() as session:
        claims.claim(
            driver_connection(session, transaction=False), worker_id="dies:1", batch_size=1
        )
        session.commit()
        time.sleep(stale + 0.1)
        [taken] = take_over(session, worker_id="thief:9", stale_after=stale)
        session.commit()
    assert taken.id == orphan


def _pass_in_child(url: str) -> None:
    # A forked child builds its own engine (STACK "Forking"); the handler kills the process.
    with pg.worker_pool(make_engine(url), application_name="dying-worker") as pool:
        processing.run_pass(pool, worker_id=f"child:{os.getpid()}")


@pytest.mark.slow
def test_a_task_that_kills_its_worker_every_time_ends_failed(
    sessions: sessionmaker[Session],
    fresh_company_id: uuid.UUID,
    register: Register,
    fresh_db_url: str,
) -> None:
    """Real worker processes die inside the handler; after max_attempts the sweep fails it."""
    register("fatal", lambda task: os._exit(13))
    [task_id] = insert_tasks(sessions, fresh_company_id, 1, task_type="fatal", max_attempts=3)
    context = multiprocessing.get_context("fork")
    for attempt in (1, 2, 3):
        child = context.Process(target=_pass_in_child, args=(fresh_db_url,))
        child.start()
        child.join(30)
        assert child.exitcode == 13
        [stored] = rows(sessions, [task_id])
        assert (stored["status"], stored["attempts"]) == ("processing", attempt)
        with sessions() as session:  # time passes: the dead worker's heartbeat goes stale
            silence(session, f"child:{child.pid}")
            session.commit()

    assert run_pass(sessions) == processing.PassResult(failed=1)
    [stored] = rows(sessions, [task_id])
    assert stored["status"] == "failed"
    assert stored["last_error"].startswith("worker lost (lease expired) after 3 attempts")


# -- POST /workers/process ---------------------------------------------------------------


@pytest.fixture
def quiet_processing_logs(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Keep the pass's per-task log lines out of the captured output."""
    with caplog.at_level("WARNING", logger="fairq.worker.processing"):
        yield


@pytest.mark.usefixtures("quiet_processing_logs")
def test_post_workers_process_runs_one_pass_for_the_admin(
    client: FlaskClient,
    make_company: MakeCompany,
    created_task: CreatedTask,
    admin_headers: dict[str, str],
) -> None:
    company = make_company()
    tasks = [created_task(company) for _ in range(3)]

    response = client.post("/workers/process", headers=admin_headers)

    assert response.status_code == 200
    assert json_of(response) == {
        "claimed": 3, "completed": 3, "retried": 0, "failed": 0, "released": 0, "lease_lost": 0,
    }  # fmt: skip
    for task in tasks:
        shown = client.get(f"/companies/{company.id}/tasks/{task['id']}", headers=company.headers)
        assert json_of(shown)["status"] == "completed"


@pytest.mark.usefixtures("quiet_processing_logs")
def test_post_workers_process_runs_handlers_with_the_api_handler_settings(
    app: Flask,
    make_company: MakeCompany,
    created_task: CreatedTask,
    admin_headers: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # WEBHOOK_ALLOW_PRIVATE=true reaches the API's pass as it reaches the worker's: a webhook
    # to 127.0.0.1 is delivered instead of failed for good by the SSRF guard.
    allow_private = HandlerConfig(webhook_allow_private=True, webhook_timeout=5.0)
    settings = dataclasses.replace(app.config["FAIRQ_SETTINGS"], handler_config=allow_private)
    monkeypatch.setitem(app.config, "FAIRQ_SETTINGS", settings)
    company = make_company()

    with Receiver() as receiver:
        task = created_task(company, "webhook", {"url": receiver.url})
        response = app.test_client().post("/workers/process", headers=admin_headers)
        deliveries = receiver.deliveries()

    assert json_of(response)["completed"] == 1
    assert deliveries == {task["id"]: [200]}
    shown = app.test_client().get(
        f"/companies/{company.id}/tasks/{task['id']}", headers=company.headers
    )
    assert json_of(shown)["result"] == {"status": 200, "body": ""}  # the receiver's empty 200


def test_post_workers_process_needs_the_admin_token(
    client: FlaskClient, make_company: MakeCompany
) -> None:
    company = make_company()
    assert client.post("/workers/process").status_code == 401
    response = client.post("/workers/process", headers=company.headers)
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"].startswith("Bearer")


# application_name of the engine whose connections a test kills (and nothing else's).
HELD = "fairq-test-held"


@pytest.fixture
def worker_engine(fresh_engine: Engine) -> Iterator[ConnectionPool[psycopg.Connection[Any]]]:
    """A pool like a worker child's, with its own application_name."""
    with pg.worker_pool(fresh_engine, application_name=HELD) as pool:
        yield pool


def test_a_retry_is_written_when_the_held_connection_died_during_the_handler(
    sessions: sessionmaker[Session],
    fresh_company_id: uuid.UUID,
    worker_engine: ConnectionPool[psycopg.Connection[Any]],
    fresh_engine: Engine,
    register: Register,
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

    register("flaky", connection_dies_then_handler_fails)
    [task_id] = insert_tasks(sessions, fresh_company_id, 1, task_type="flaky")
    keeper = processing.LeaseKeeper()
    try:
        result = processing.run_pass(
            worker_engine,
            worker_id="test:1",
            unwritten=processing.UnwrittenOutcomes(),
            keeper=keeper,
        )
    finally:
        keeper.close()

    assert result == processing.PassResult(claimed=1, retried=1)
    [stored] = rows(sessions, [task_id])
    assert (stored["status"], stored["attempts"]) == ("pending", 1)
    assert stored["last_error"] == "RuntimeError: webhook target answered 502"


def test_a_sweep_that_hit_its_limit_sweeps_again_on_the_next_pass(
    sessions: sessionmaker[Session],
    fresh_company_id: uuid.UUID,
    worker_engine: ConnectionPool[psycopg.Connection[Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with sessions() as session:
        ids = insert_tasks(session, fresh_company_id, 3, task_type="noop")
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
    monkeypatch.setattr(sweep, "SWEEP_LIMIT", 2)  # stands for 1000
    schedule = processing.SweepSchedule(interval=3600)
    settings = PassSettings(batch_size=1)

    first = processing.run_pass(
        worker_engine, worker_id="test:1", settings=settings, sweep_schedule=schedule
    )
    second = processing.run_pass(
        worker_engine, worker_id="test:1", settings=settings, sweep_schedule=schedule
    )

    assert (first.claimed, second.claimed) == (1, 1)
    with sessions() as session:
        still_dead = session.execute(
            text("SELECT count(*) FROM tasks WHERE locked_by = 'dead:1'")
        ).scalar_one()
    assert still_dead == 0
