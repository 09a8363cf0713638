"""Per-task timeouts (design §4, Timeouts): one mechanism, the task's deadline.

A handler that honours its deadline ends there, and its attempt is a retryable failure whose
`last_error` says so. One still running the grace past it has overrun, whatever it is doing
(a Python loop, a read without a timeout, a lock, C code): the pass writes its timeout
outcome and what else it owes, and a worker child exits to be replaced. Real handlers, real
threads and processes; timeouts of about a second (`timeout_seconds` is at least 1).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from flask.testing import FlaskClient
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from tests import supervisor_harness as harness
from tests import test_processing
from tests.factories import CreatedTask, MakeCompany, insert_company, insert_tasks, json_of
from tests.supervisor_harness import RunningSupervisor, wait_for
from tests.test_processing import Register, TopOfRange, rows, run_pass
from worker import processing
from worker.errors import PermanentTaskError
from worker.processing import outcome, timeouts
from worker.tasktypes.base import TaskContext

# The processing tests' fixtures: sessions on a fresh database, a task type per test.
sessions = test_processing.sessions
register = test_processing.register

pytestmark = pytest.mark.timeout(60)


# The grace the pass tests use: a handler has overrun half a second past its deadline.
GRACE = 0.5


@pytest.fixture
def short_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    """Handlers overrun `GRACE` seconds past their deadlines, not 5."""
    monkeypatch.setattr(timeouts, "OVERRUN_GRACE_SECONDS", GRACE)


def spinner(released: threading.Event) -> Callable[[TaskContext], None]:
    """A handler that ignores its deadline: a Python loop until `released` is set."""

    def spin(task: TaskContext) -> None:
        n = 0
        while not released.is_set():
            n += 1

    return spin


def set_timeout(sessions: sessionmaker[Session], ids: list[uuid.UUID], seconds: int) -> None:
    """Give these tasks `timeout_seconds`."""
    with sessions() as session:
        session.execute(
            text("UPDATE tasks SET timeout_seconds = :s WHERE id = ANY(:ids)"),
            {"s": seconds, "ids": ids},
        )
        session.commit()


def test_the_handler_is_given_its_timeout_and_deadline(
    sessions: sessionmaker[Session], fresh_company_id: uuid.UUID, register: Register
) -> None:
    seen: list[tuple[TaskContext, float]] = []
    register("spy", lambda task: seen.append((task, time.monotonic())))
    ids = insert_tasks(sessions, fresh_company_id, 1, task_type="spy")
    set_timeout(sessions, ids, 7)

    run_pass(sessions)

    [(context, called_at)] = seen
    assert context.timeout == 7
    assert context.deadline is not None
    assert 6 < context.deadline - called_at <= 7
    remaining = context.remaining()
    assert remaining is not None
    assert remaining < 7
    assert context.within_timeout(1) == 1


# -- a handler that honours its deadline --------------------------------------------------


def test_a_handler_that_fails_at_its_deadline_has_timed_out_but_a_permanent_error_stands(
    sessions: sessionmaker[Session], fresh_company_id: uuid.UUID, register: Register
) -> None:
    def give_up_at_deadline(task: TaskContext) -> None:
        time.sleep(task.within_timeout(60))
        if task.payload.get("permanent"):
            raise PermanentTaskError("the peer said no")
        raise ConnectionError("no answer in time")

    register("patient", give_up_at_deadline)
    [slow] = insert_tasks(sessions, fresh_company_id, 1, task_type="patient", newest_age_seconds=9)
    [refused] = insert_tasks(
        sessions, fresh_company_id, 1, task_type="patient", payload={"permanent": True}
    )
    set_timeout(sessions, [slow, refused], 1)

    assert run_pass(sessions) == processing.PassResult(claimed=2, retried=1, failed=1)

    slow_row, refused_row = rows(sessions, [slow, refused])
    assert slow_row["last_error"].startswith("timed out after 1.")
    assert slow_row["last_error"].endswith("(timeout 1 s): ConnectionError: no answer in time")
    assert refused_row["last_error"] == "PermanentTaskError: the peer said no"


def test_the_builtin_sleep_ends_at_its_timeout_and_is_retried(
    sessions: sessionmaker[Session], fresh_company_id: uuid.UUID
) -> None:
    ids = insert_tasks(sessions, fresh_company_id, 1, task_type="sleep", payload={"seconds": 30})
    set_timeout(sessions, ids, 1)
    started = time.monotonic()

    assert run_pass(sessions) == processing.PassResult(claimed=1, retried=1)

    assert time.monotonic() - started < 1 + timeouts.OVERRUN_GRACE_SECONDS  # not an overrun
    [stored] = rows(sessions, ids)
    # It sleeps what was left of the second when it started: a busy box starts it late.
    found = re.search(
        r"\(timeout 1 s\): TimeoutError: slept ([0-9.]+) s of 30 s", stored["last_error"]
    )
    assert found is not None, stored["last_error"]
    assert 0.5 < float(found.group(1)) <= 1


@pytest.mark.usefixtures("short_grace")
def test_a_handler_that_returns_late_but_within_the_grace_completes(
    sessions: sessionmaker[Session], fresh_company_id: uuid.UUID, register: Register
) -> None:
    def a_little_late(task: TaskContext) -> str:
        time.sleep(task.within_timeout(60) + GRACE / 5)
        return "done"

    register("late", a_little_late)
    ids = insert_tasks(sessions, fresh_company_id, 1, task_type="late")
    set_timeout(sessions, ids, 1)

    assert run_pass(sessions) == processing.PassResult(claimed=1, completed=1)

    assert rows(sessions, ids)[0]["status"] == "completed"


# -- a handler that overruns it -------------------------------------------------------------


@pytest.mark.usefixtures("short_grace")
def test_a_handler_that_ignores_its_deadline_overruns_and_the_pass_writes_what_it_owes(
    sessions: sessionmaker[Session], fresh_company_id: uuid.UUID, register: Register
) -> None:
    released = threading.Event()
    overruns: list[processing.Overrun] = []
    ran: list[uuid.UUID] = []

    def on_overrun(overrun: processing.Overrun) -> None:
        overruns.append(overrun)
        released.set()  # as a worker child's exit would free its thread

    register("spin", spinner(released))
    register("counted", lambda task: ran.append(task.task_id))
    company = fresh_company_id
    [before] = insert_tasks(sessions, company, 1, task_type="counted", newest_age_seconds=9)
    [spinning] = insert_tasks(sessions, company, 1, task_type="spin", newest_age_seconds=5)
    after = insert_tasks(sessions, company, 2, task_type="counted")
    set_timeout(sessions, [spinning], 1)
    observer = test_processing.Recorder()

    result = run_pass(sessions, observer=observer, rng=TopOfRange(), on_overrun=on_overrun)

    assert result == processing.PassResult(claimed=4, completed=1, retried=1, released=2)
    [report] = overruns
    assert (report.task.id, report.timeout) == (spinning, 1)
    assert 1 + GRACE <= report.ran < 1 + GRACE + 1  # written at its deadline plus the grace
    assert ran == [before]  # nothing started after it
    done, retried, *unstarted = rows(sessions, [before, spinning, *after])
    assert done["status"] == "completed"
    # Fenced, its attempt counted, backoff as usual (attempt 1 waits up to 2 s; TopOfRange).
    assert (retried["status"], retried["attempts"], retried["lease_token"]) == ("pending", 1, None)
    assert retried["run_after"] > retried["db_now"]
    assert retried["last_error"].startswith("timed out after 1.5")
    assert retried["last_error"].endswith("(timeout 1 s): overran: still running 0.5 s past it")
    assert ("retried", "spin") in observer.calls
    # Handed back with their attempt undone: they run later, as if never claimed.
    assert [(r["status"], r["attempts"]) for r in unstarted] == [("pending", 0)] * 2
    assert worker_rows(sessions) == 0  # it holds no lease: its row is gone at once


@pytest.mark.usefixtures("short_grace")
@pytest.mark.parametrize("call", ["recv", "lock", "sleep"])
def test_a_handler_blocked_in_a_call_without_a_timeout_overruns_at_its_deadline_plus_the_grace(
    sessions: sessionmaker[Session], fresh_company_id: uuid.UUID, register: Register, call: str
) -> None:
    left, right = socket.socketpair()
    lock = threading.Lock()
    lock.acquire()
    released = threading.Event()

    def block(task: TaskContext) -> None:  # none of them looks at the deadline
        if call == "recv":
            left.recv(1)  # a read without a timeout, from a peer that does not write
        elif call == "lock":
            lock.acquire()
        else:
            released.wait()

    def on_overrun(overrun: processing.Overrun) -> None:
        overran_at.append(time.monotonic())
        right.send(b"x")
        lock.release()
        released.set()

    register("block", block)
    ids = insert_tasks(sessions, fresh_company_id, 1, task_type="block")
    set_timeout(sessions, ids, 1)
    overran_at: list[float] = []
    started = time.monotonic()
    try:
        result = run_pass(sessions, on_overrun=on_overrun)
    finally:
        left.close()
        right.close()

    assert result == processing.PassResult(claimed=1, retried=1)
    [at] = overran_at
    assert 1 + GRACE <= at - started < 1 + GRACE + 1
    [stored] = rows(sessions, ids)
    assert (stored["status"], stored["attempts"]) == ("pending", 1)
    assert "(timeout 1 s): overran: still running 0.5 s past it" in stored["last_error"]


@pytest.mark.usefixtures("short_grace")
def test_an_overrun_on_the_last_attempt_fails_the_task_for_good(
    sessions: sessionmaker[Session], fresh_company_id: uuid.UUID, register: Register
) -> None:
    released = threading.Event()
    register("spin", spinner(released))
    ids = insert_tasks(sessions, fresh_company_id, 1, task_type="spin", max_attempts=1)
    set_timeout(sessions, ids, 1)

    result = run_pass(sessions, on_overrun=lambda overrun: released.set())

    assert result == processing.PassResult(claimed=1, failed=1)
    [stored] = rows(sessions, ids)
    assert stored["status"] == "failed"
    assert stored["last_error"].startswith("gave up after 1 attempts: timed out after 1.")


def test_a_handler_returning_at_its_deadline_never_counts_twice(
    sessions: sessionmaker[Session],
    fresh_company_id: uuid.UUID,
    register: Register,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Handlers that return just at the grace's end, many times: one outcome each."""
    monkeypatch.setattr(timeouts, "OVERRUN_GRACE_SECONDS", 0.05)
    released = threading.Event()

    def return_at_overrun(task: TaskContext) -> None:
        assert task.deadline is not None
        while time.monotonic() < task.deadline + 0.05 and not released.is_set():
            pass

    register("edge", return_at_overrun)
    ids = insert_tasks(sessions, fresh_company_id, 3, task_type="edge")
    set_timeout(sessions, ids, 1)

    result = run_pass(sessions, on_overrun=lambda overrun: released.set())

    assert result.claimed == 3
    assert result.completed + result.retried + result.released == 3
    assert {r["status"] for r in rows(sessions, ids)} <= {"completed", "pending"}


def worker_rows(sessions: sessionmaker[Session]) -> int:
    """How many `workers` rows there are."""
    with sessions() as session:
        return int(session.execute(text("SELECT count(*) FROM workers")).scalar_one())


def worker_environment(settings: dict[str, str]) -> dict[str, str]:
    """This process's environment with `settings`."""
    return {**os.environ, **settings}


@pytest.fixture
def timeout_worker(tmp_path: Path, fresh_db_url: str) -> Iterator[RunningSupervisor]:
    """`python -m tests.timeout_worker` (the worker with `block_in_c`) on the fresh database.

    As the `supervisor` fixture starts `python -m worker`: a stale window of a minute (no
    task comes back by the sweep within the test), one child, batches of 10.
    """
    with started_timeout_worker(tmp_path, fresh_db_url) as running:
        yield running


@contextlib.contextmanager
def started_timeout_worker(
    tmp_path: Path, database_url: str, *flags: str, **env: str
) -> Iterator[RunningSupervisor]:
    """`timeout_worker`'s supervisor, with these command-line flags and `env` added; killed
    after."""
    workdir = tmp_path / "supervisor"
    workdir.mkdir()
    environment = worker_environment(
        {
            "DATABASE_URL": database_url,
            "PROMETHEUS_MULTIPROC_DIR": str(workdir / "prometheus"),
            **harness.FAST_ENV,
            "STALE_AFTER_SECONDS": "60",
            **env,
        }
    )
    with (workdir / "stdout.log").open("wb") as out, (workdir / "stderr.log").open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.timeout_worker", "--metrics-port-file",
             str(workdir / "metrics.port"), "--concurrency", "1", "--batch-size", "10",
             *flags],
            cwd=harness.ROOT, env=environment, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    running = RunningSupervisor(proc, workdir)
    try:
        yield running
    finally:
        running.kill_all()


@pytest.mark.slow
@pytest.mark.parametrize("blocking", ["block_in_c", "spin"])
def test_a_child_whose_handler_overruns_is_replaced_and_no_task_is_lost(
    timeout_worker: RunningSupervisor, fresh_engine: Engine, blocking: str
) -> None:
    company = insert_company(fresh_engine).id
    before = insert_tasks(fresh_engine, company, 3, task_type="noop", newest_age_seconds=20)
    [blocked] = insert_tasks(
        fresh_engine, company, 1, task_type=blocking, newest_age_seconds=10, max_attempts=2
    )
    after = insert_tasks(fresh_engine, company, 3, task_type="noop")
    with fresh_engine.begin() as conn:
        conn.execute(text("UPDATE tasks SET timeout_seconds = 1 WHERE id = :id"), {"id": blocked})
    sup = timeout_worker
    (first_child,) = sup.wait_ready(1)

    def settled() -> bool:
        return harness.status_counts(fresh_engine) == {"completed": 7}

    wait_for(settled, 30, f"every task to complete:\n{sup.log()[-4000:]}")

    # Written back by the child itself and run by its successor, within seconds: the stale
    # window is a minute.
    row = harness.task_row(fresh_engine, blocked)
    assert (row["attempts"], row["result"]) == (2, {"attempt": 2})
    # The tasks completed before it stayed completed; the ones after it were handed back
    # unstarted and run once, by the next child.
    assert [harness.task_row(fresh_engine, t)["attempts"] for t in before + after] == [1] * 6
    (second_child,) = sup.wait_children(1)
    assert second_child != first_child
    with fresh_engine.connect() as conn:  # it held no lease: it deleted its row as it exited
        assert first_child not in conn.execute(text("SELECT pid FROM workers")).scalars().all()
    log = sup.log()
    assert f"child {first_child} exited: task {blocked} (type {blocking}) was still running" in log
    assert "past its timeout of 1s and the grace" in log
    assert "(TaskTimeout), retry in" in log  # the retry the child wrote before it exited
    assert "likely out of memory" not in log
    metrics = sup.metrics()
    assert metrics["worker_child_restarts_total"] == 1
    assert metrics["worker_child_timeouts_total"] == 0  # not hung: its threads ran on
    sup.send(signal.SIGTERM)
    assert sup.wait(15) == 0


@pytest.mark.slow
def test_once_exits_4_when_a_handler_overruns_having_written_what_it_owed(
    fresh_db_url: str, fresh_engine: Engine
) -> None:
    company = insert_company(fresh_engine).id
    [blocked] = insert_tasks(
        fresh_engine, company, 1, task_type="block_in_c", newest_age_seconds=10, max_attempts=2
    )
    after = insert_tasks(fresh_engine, company, 2, task_type="noop")
    with fresh_engine.begin() as conn:
        conn.execute(text("UPDATE tasks SET timeout_seconds = 1 WHERE id = :id"), {"id": blocked})

    done = subprocess.run(
        [sys.executable, "-m", "tests.timeout_worker", "--once"],
        cwd=harness.ROOT,
        env=worker_environment({"DATABASE_URL": fresh_db_url, "STALE_AFTER_SECONDS": "60"}),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )

    assert done.returncode == 4, done.stderr[-3000:]
    assert f"task {blocked} (type block_in_c) was still running" in done.stderr
    row = harness.task_row(fresh_engine, blocked)
    assert (row["status"], row["attempts"], row["lease_token"]) == ("pending", 1, None)
    assert "(timeout 1 s): overran: still running 5 s past it" in row["last_error"]
    assert [
        (harness.task_row(fresh_engine, t)["status"], harness.task_row(fresh_engine, t)["attempts"])
        for t in after
    ] == [("pending", 0)] * 2
    with fresh_engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM workers")).scalar_one() == 0


# -- POST /workers/process: a timeout there --------------------------------------------------


@pytest.mark.usefixtures("quiet_processing_logs", "short_grace")
def test_post_workers_process_writes_an_overrun_and_answers_once_the_handler_returns(
    client: FlaskClient,
    make_company: MakeCompany,
    created_task: CreatedTask,
    admin_headers: dict[str, str],
    register: Register,
) -> None:
    def overrun_then_return(task: TaskContext) -> None:
        assert task.deadline is not None
        while time.monotonic() < task.deadline + GRACE + 0.5:
            pass

    register("spin", overrun_then_return)
    company = make_company()
    spinning = created_task(company, "spin", timeout_seconds=1)
    noop = created_task(company)

    response = client.post("/workers/process", headers=admin_headers)

    assert json_of(response) == {
        "claimed": 2, "completed": 0, "retried": 1, "failed": 0, "released": 1, "lease_lost": 0,
    }  # fmt: skip
    shown = json_of(
        client.get(f"/companies/{company.id}/tasks/{spinning['id']}", headers=company.headers)
    )
    assert (shown["status"], shown["timeout_seconds"]) == ("pending", 1)
    assert shown["last_error"].endswith("(timeout 1 s): overran: still running 0.5 s past it")
    assert noop["timeout_seconds"] == 60


@pytest.fixture
def quiet_processing_logs(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Keep the pass's per-task log lines out of the captured output."""
    with caplog.at_level("WARNING", logger="fairq.worker.processing"):
        yield


# -- the rule, on its own ----------------------------------------------------------------


def test_a_timed_out_attempt_is_retried_with_backoff_and_fails_once_attempts_are_used_up() -> None:
    retry = outcome.timed_out(
        timeout=1,
        ran=1.0123,
        detail="TimeoutError: slept 1 s of 3 s",
        attempt=1,
        max_attempts=3,
        backoff=lambda a: 1.5,
    )
    assert retry == outcome.Retry(
        1.5, "timed out after 1.01 s (timeout 1 s): TimeoutError: slept 1 s of 3 s", "TaskTimeout"
    )

    fail = outcome.timed_out(
        timeout=30,
        ran=30.5,
        detail="overran: still running 5 s past it",
        attempt=3,
        max_attempts=3,
        backoff=math.sqrt,
    )
    assert fail == outcome.Fail(
        "gave up after 3 attempts: timed out after 30.50 s (timeout 30 s): overran: still "
        "running 5 s past it",
        "TaskTimeout",
    )
