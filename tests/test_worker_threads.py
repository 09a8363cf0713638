"""Several handlers at once in one pass (`WORKER_THREADS`, design §5 "Threads in a child").

A pass with `threads` N runs its batch's tasks on N threads (its own and N - 1 runners),
taken in claim order; each task keeps its own lease, timeout and outcome. Concurrency is
shown by the handlers' own records (a barrier only N handlers at once can pass, start and
finish times that overlap), not by how long a pass took. Real threads, real PostgreSQL, and
for the worker itself real processes, signals and HTTP.
"""

from __future__ import annotations

import collections
import itertools
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from common.environment import SettingsError
from tests import pg, test_processing
from tests import supervisor_harness as harness
from tests.factories import insert_company, insert_tasks
from tests.supervisor_harness import RunningSupervisor, StartSupervisor, wait_for
from tests.test_processing import Recorder, Register, TopOfRange, rows, run_pass
from tests.test_timeouts import set_timeout, started_timeout_worker
from worker import cli, processing
from worker.errors import PermanentTaskError
from worker.processing import timeouts
from worker.settings import PassSettings, WorkerSettings
from worker.tasktypes.base import TaskContext

# The processing tests' fixtures: sessions on a fresh database, a task type per test.
sessions = test_processing.sessions
register = test_processing.register

pytestmark = pytest.mark.timeout(90)

URL = "postgresql+psycopg://fairq@localhost/fairq"


class Spans:
    """What handlers record of themselves: entry order, start and end (`time.monotonic()`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.entered: list[uuid.UUID] = []
        self.started: dict[uuid.UUID, float] = {}
        self.ended: dict[uuid.UUID, float] = {}
        self.threads: dict[uuid.UUID, threading.Thread] = {}

    def enter(self, task: TaskContext) -> None:
        """Record that `task`'s handler started, on this thread."""
        with self._lock:
            self.entered.append(task.task_id)
            self.started[task.task_id] = time.monotonic()
            self.threads[task.task_id] = threading.current_thread()

    def leave(self, task: TaskContext) -> None:
        """Record that `task`'s handler is about to return."""
        with self._lock:
            self.ended[task.task_id] = time.monotonic()

    def most_at_once(self) -> int:
        """The most handlers that ran at the same time."""
        events = sorted(
            [(t, 1) for t in self.started.values()] + [(t, -1) for t in self.ended.values()],
            key=lambda event: (event[0], event[1]),  # an end before a start at the same time
        )
        running = most = 0
        for _, change in events:
            running += change
            most = max(most, running)
        return most


def sleeper(spans: Spans, seconds: float) -> Any:
    """A handler that records itself around a sleep of `seconds`."""

    def handler(task: TaskContext) -> None:
        spans.enter(task)
        time.sleep(seconds)
        spans.leave(task)

    return handler


def threads(n: int, **settings: Any) -> PassSettings:
    """Pass settings with `threads` n."""
    return PassSettings(threads=n, **settings)


# -- concurrency and order -------------------------------------------------------------


def test_n_threads_run_n_handlers_at_once_taking_tasks_in_claim_order(
    sessions: sessionmaker[Session], fresh_company_id: uuid.UUID, register: Register
) -> None:
    spans = Spans()
    first_wave = threading.Barrier(4, timeout=10)

    def nap(task: TaskContext) -> None:
        spans.enter(task)
        if task.task_id in ids[:4]:
            first_wave.wait()  # the first four of the batch run at once
        time.sleep(0.3)
        spans.leave(task)

    register("nap", nap)
    ids = insert_tasks(sessions, fresh_company_id, 12, task_type="nap")
    observer = Recorder()

    result = run_pass(sessions, settings=threads(4), observer=observer)

    assert result == processing.PassResult(claimed=12, completed=12)
    assert [r["status"] for r in rows(sessions, ids)] == ["completed"] * 12
    assert observer.calls.count(("completed", "nap")) == 12
    # Four at once, never five: a pool of four runners.
    assert spans.most_at_once() == 4
    # In claim order, four by four: a task starts only once an earlier one has finished,
    # so each wave of four is the next four of the batch (order within a wave is the
    # runners' race for the GIL).
    waves = [spans.entered[i : i + 4] for i in range(0, 12, 4)]
    assert [set(wave) for wave in waves] == [set(ids[i : i + 4]) for i in range(0, 12, 4)]
    for earlier, later in itertools.pairwise(waves):
        first_end = min(spans.ended[t] for t in earlier)
        assert all(spans.started[t] >= first_end for t in later)
    # The first wave overlaps whole: every one of them started before any ended.
    assert max(spans.started[t] for t in waves[0]) < min(spans.ended[t] for t in waves[0])
    assert len({spans.threads[t] for t in ids}) == 4
    assert threading.main_thread() in {spans.threads[t] for t in ids}


def test_one_thread_runs_the_whole_batch_on_the_pass_thread_in_claim_order(
    sessions: sessionmaker[Session], fresh_company_id: uuid.UUID, register: Register
) -> None:
    spans = Spans()
    register("nap", sleeper(spans, 0.01))
    ids = insert_tasks(sessions, fresh_company_id, 5, task_type="nap")
    before = threading.active_count()

    assert run_pass(sessions, settings=threads(1)) == processing.PassResult(claimed=5, completed=5)

    assert spans.entered == ids
    assert spans.most_at_once() == 1
    assert {spans.threads[t] for t in ids} == {threading.main_thread()}
    assert threading.active_count() == before  # no runner was started, none left behind


def test_a_batch_smaller_than_the_threads_starts_only_the_runners_it_needs(
    sessions: sessionmaker[Session], fresh_company_id: uuid.UUID, register: Register
) -> None:
    spans = Spans()
    started = threading.Barrier(2, timeout=10)
    alive: list[int] = []

    def both(task: TaskContext) -> None:
        spans.enter(task)
        started.wait()  # passes only with both handlers running at once
        alive.append(threading.active_count())
        spans.leave(task)

    register("both", both)
    ids = insert_tasks(sessions, fresh_company_id, 2, task_type="both")
    with pg.worker_pool(sessions) as pool:
        pool.open()  # its threads, as a child's, run before and after the pass
        before = threading.active_count()
        result = processing.run_pass(pool, worker_id="test:1", settings=threads(16))
        after = threading.active_count()

    assert result == processing.PassResult(claimed=2, completed=2)
    assert len({spans.threads[t] for t in ids}) == 2
    assert max(alive) - before == 2  # the pass's lease keeper and one runner, not fifteen
    assert after == before


def test_runners_kept_across_passes_serve_each_pass(
    fresh_engine: Engine,
    sessions: sessionmaker[Session],
    fresh_company_id: uuid.UUID,
    register: Register,
) -> None:
    """As a worker child does: one set of runner threads, pass after pass, one connection."""
    spans = Spans()
    together = threading.Barrier(3, timeout=10)

    def nap(task: TaskContext) -> None:
        spans.enter(task)
        together.wait()  # three at once, so on three threads
        spans.leave(task)

    register("nap", nap)
    runners = processing.Runners(2)
    keeper = processing.LeaseKeeper()
    try:
        for _ in range(2):
            ids = insert_tasks(sessions, fresh_company_id, 3, task_type="nap")
            result = run_pass(fresh_engine, settings=threads(3), runners=runners, keeper=keeper)
            assert result == processing.PassResult(claimed=3, completed=3)
            assert len({spans.threads[t] for t in ids}) == 3
    finally:
        keeper.close()
        runners.close()
    assert len(set(spans.threads.values())) == 3  # the same three threads both times


# -- each task its own outcome and timeout ---------------------------------------------------


def test_an_error_in_one_handler_fails_only_its_own_task(
    sessions: sessionmaker[Session], fresh_company_id: uuid.UUID, register: Register
) -> None:
    together = threading.Barrier(4, timeout=10)

    def together_then(task: TaskContext) -> dict[str, int] | None:
        together.wait()  # all four run at once when each decides its outcome
        match task.payload.get("do"):
            case "raise":
                raise ConnectionError("peer reset")
            case "refuse":
                raise PermanentTaskError("no such mailbox")
            case "return":
                return {"n": 1}
        return None

    register("mixed", together_then)
    company = fresh_company_id
    [raising] = insert_tasks(
        sessions, company, task_type="mixed", payload={"do": "raise"}, newest_age_seconds=9
    )
    [refusing] = insert_tasks(
        sessions, company, task_type="mixed", payload={"do": "refuse"}, newest_age_seconds=8
    )
    [returning] = insert_tasks(
        sessions, company, task_type="mixed", payload={"do": "return"}, newest_age_seconds=7
    )
    [plain] = insert_tasks(sessions, company, task_type="mixed")
    observer = Recorder()

    result = run_pass(sessions, settings=threads(4), observer=observer, rng=TopOfRange())

    assert result == processing.PassResult(claimed=4, completed=2, retried=1, failed=1)
    retried, failed, with_result, done = rows(sessions, [raising, refusing, returning, plain])
    assert (retried["status"], retried["last_error"]) == ("pending", "ConnectionError: peer reset")
    assert (failed["status"], failed["last_error"]) == (
        "failed", "PermanentTaskError: no such mailbox",
    )  # fmt: skip
    assert (with_result["status"], with_result["result"]) == ("completed", {"n": 1})
    assert (done["status"], done["result"]) == ("completed", None)
    assert collections.Counter(observer.calls) == collections.Counter(
        [("claim_seconds",), ("claimed", 4), ("retried", "mixed"), ("failed", "mixed", True),
         ("completed", "mixed"), ("completed", "mixed")]
    )  # fmt: skip


def deadline_keeper(spans: Spans) -> Any:
    """A handler that records itself, sleeps until its deadline and fails there."""

    def handler(task: TaskContext) -> None:
        spans.enter(task)
        time.sleep(task.within_timeout(60))
        spans.leave(task)
        raise TimeoutError("the peer did not answer in time")

    return handler


def test_each_running_handler_ends_at_its_own_deadline(
    sessions: sessionmaker[Session], fresh_company_id: uuid.UUID, register: Register
) -> None:
    spans = Spans()
    register("patient", deadline_keeper(spans))
    register("nap", sleeper(spans, 0.5))
    company = fresh_company_id
    [one] = insert_tasks(sessions, company, task_type="patient", newest_age_seconds=9)
    [two] = insert_tasks(sessions, company, task_type="patient", newest_age_seconds=8)
    [nap] = insert_tasks(sessions, company, task_type="nap")
    set_timeout(sessions, [one], 1)
    set_timeout(sessions, [two], 2)

    result = run_pass(sessions, settings=threads(3), rng=TopOfRange())

    assert result == processing.PassResult(claimed=3, completed=1, retried=2)
    first, second, napped = rows(sessions, [one, two, nap])
    assert first["last_error"].startswith("timed out after 1.")
    assert first["last_error"].endswith(
        "(timeout 1 s): TimeoutError: the peer did not answer in time"
    )
    assert second["last_error"].startswith("timed out after 2.")
    assert [r["status"] for r in (first, second)] == ["pending", "pending"]
    assert napped["status"] == "completed"
    assert max(spans.started.values()) < spans.ended[nap]  # all three ran at once
    assert len(set(spans.threads.values())) == 3


def test_an_overrun_among_four_threads_writes_each_siblings_outcome_then_reports(
    sessions: sessionmaker[Session],
    fresh_company_id: uuid.UUID,
    register: Register,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(timeouts, "OVERRUN_GRACE_SECONDS", 0.5)
    released = threading.Event()
    overruns: list[tuple[processing.Overrun, float]] = []
    spans = Spans()

    def ignore_the_deadline(task: TaskContext) -> None:
        spans.enter(task)
        n = 0
        while not released.is_set():  # a Python loop, as a worker child's exit would end
            n += 1

    def on_overrun(overrun: processing.Overrun) -> None:
        overruns.append((overrun, time.monotonic()))
        released.set()

    register("spin", ignore_the_deadline)
    register("slow", sleeper(spans, 2.5))
    register("patient", deadline_keeper(spans))
    register("counted", sleeper(spans, 0))
    company = fresh_company_id
    [spin_1] = insert_tasks(sessions, company, task_type="spin", newest_age_seconds=9)
    [slow] = insert_tasks(sessions, company, task_type="slow", newest_age_seconds=8)
    [patient] = insert_tasks(sessions, company, task_type="patient", newest_age_seconds=7)
    [spin_3] = insert_tasks(sessions, company, task_type="spin", newest_age_seconds=6)
    after = insert_tasks(sessions, company, 2, task_type="counted")
    set_timeout(sessions, [spin_1], 1)
    set_timeout(sessions, [patient], 2)
    set_timeout(sessions, [spin_3], 3)
    started = time.monotonic()

    result = run_pass(sessions, settings=threads(4), rng=TopOfRange(), on_overrun=on_overrun)

    assert result == processing.PassResult(claimed=6, completed=1, retried=3, released=2)
    [(report, reported_at)] = overruns
    # The first overrun (1.5 s) is the one reported, and only once every sibling had returned
    # (the slow one at 2.5 s: completed; the patient one at 2 s: timed out) or overrun too
    # (the second loop, at 3.5 s): a worker child exits there, its siblings all written.
    assert (report.task.id, report.timeout) == (spin_1, 1)
    assert reported_at - started >= 3 + 0.5
    assert reported_at >= spans.ended[slow]
    assert set(spans.started) == {spin_1, slow, patient, spin_3}  # none started after 1.5 s
    first, done, timed_out, third, *unstarted = rows(
        sessions, [spin_1, slow, patient, spin_3, *after]
    )
    for overran, timeout in ((first, 1), (third, 3)):
        assert (overran["status"], overran["attempts"], overran["lease_token"]) == (
            "pending",
            1,
            None,
        )
        assert overran["last_error"].endswith(
            f"(timeout {timeout} s): overran: still running 0.5 s past it"
        )
    assert (done["status"], done["attempts"]) == ("completed", 1)
    assert (timed_out["status"], timed_out["attempts"]) == ("pending", 1)
    assert "TimeoutError" in timed_out["last_error"]
    assert [(r["status"], r["attempts"]) for r in unstarted] == [("pending", 0)] * 2


# -- stopping --------------------------------------------------------------------------------


def test_stop_lets_the_running_handlers_finish_and_releases_the_unstarted_rest(
    sessions: sessionmaker[Session], fresh_company_id: uuid.UUID, register: Register
) -> None:
    stop = threading.Event()
    spans = Spans()
    both = threading.Barrier(2, timeout=10)

    def stopper(task: TaskContext) -> None:
        spans.enter(task)
        both.wait()  # both runners are in a handler
        stop.set()
        time.sleep(0.2)
        spans.leave(task)

    register("stopper", stopper)
    ids = insert_tasks(sessions, fresh_company_id, 6, task_type="stopper")
    before = rows(sessions, ids)
    observer = Recorder()

    result = run_pass(sessions, settings=threads(2), stop=stop, observer=observer)

    assert result == processing.PassResult(claimed=6, completed=2, released=4)
    assert set(spans.entered) == set(ids[:2])
    stored = rows(sessions, ids)
    assert [r["status"] for r in stored[:2]] == ["completed"] * 2
    for row, original in zip(stored[2:], before[2:], strict=True):
        assert (row["status"], row["attempts"], row["lease_token"]) == ("pending", 0, None)
        assert row["run_after"] == original["run_after"]
    assert ("released", 4) in observer.calls


def test_a_keyboard_interrupt_in_one_runner_lets_the_others_finish_then_propagates(
    sessions: sessionmaker[Session], fresh_company_id: uuid.UUID, register: Register
) -> None:
    spans = Spans()
    both = threading.Barrier(2, timeout=10)

    def interrupting(task: TaskContext) -> None:
        spans.enter(task)
        both.wait()
        if task.payload.get("interrupt"):
            raise KeyboardInterrupt
        time.sleep(0.3)
        spans.leave(task)

    register("interrupting", interrupting)
    company = fresh_company_id
    [interrupted] = insert_tasks(
        sessions, company, task_type="interrupting", payload={"interrupt": True},
        newest_age_seconds=9,
    )  # fmt: skip
    rest = insert_tasks(sessions, company, 4, task_type="interrupting")

    with pytest.raises(KeyboardInterrupt):
        run_pass(sessions, settings=threads(2))

    stopped, finished, *unstarted = rows(sessions, [interrupted, *rest])
    # The interrupted one may have had side effects: lease expiry recovers it, counted.
    assert (stopped["status"], stopped["attempts"]) == ("processing", 1)
    assert finished["status"] == "completed"  # the other runner's handler returned first
    assert [(r["status"], r["attempts"]) for r in unstarted] == [("pending", 0)] * 3
    assert set(spans.entered) == {interrupted, rest[0]}


# -- settings --------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["0", "-1", "257", "many", "1.5", "4 threads"])
def test_worker_threads_outside_1_to_256_or_not_an_integer_is_refused_naming_it(
    value: str,
) -> None:
    with pytest.raises(SettingsError) as raised:
        WorkerSettings.from_env({"DATABASE_URL": URL, "WORKER_THREADS": value})

    message = str(raised.value)
    assert message.startswith("WORKER_THREADS must be ")
    assert value in message


def test_worker_threads_defaults_to_the_pass_default_and_is_read() -> None:
    assert WorkerSettings.from_env({"DATABASE_URL": URL}).threads == PassSettings().threads
    assert WorkerSettings.from_env({"DATABASE_URL": URL, "WORKER_THREADS": " 16 "}).threads == 16
    assert WorkerSettings.from_env({"DATABASE_URL": URL, "WORKER_THREADS": "256"}).threads == 256


def test_the_threads_flag_is_validated_like_the_variable() -> None:
    environment = {**os.environ, "DATABASE_URL": "postgresql+psycopg://x@127.0.0.1:1/x"}
    done = subprocess.run(
        [sys.executable, "-m", "worker", "--threads", "0"],
        cwd=harness.ROOT, env=environment, capture_output=True, text=True,
        stdin=subprocess.DEVNULL, timeout=60, check=False,
    )  # fmt: skip

    assert done.returncode == cli.SETTINGS_ERROR_EXIT
    assert "invalid configuration: WORKER_THREADS must be between 1 and 256, got 0" in done.stderr
    assert "(given as --threads)" in done.stderr


# -- the worker itself: a real supervisor, child, signals and HTTP ------------------------------


class HeldWebhooks:
    """A webhook target on 127.0.0.1 that holds every request until `release()`.

    Records each request's Idempotency-Key (the task id) as it arrives, so a test sees which
    handlers are running right now, from outside the worker.
    """

    def __init__(self) -> None:
        self.released = threading.Event()
        self._lock = threading.Lock()
        self._arrived: list[uuid.UUID] = []
        holder = self

        class Hook(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with holder._lock:
                    holder._arrived.append(uuid.UUID(self.headers["Idempotency-Key"]))
                holder.released.wait(30)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                """Silence."""

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        """Where the webhooks go."""
        return f"http://127.0.0.1:{self._server.server_address[1]}/hook"

    def arrived(self) -> list[uuid.UUID]:
        """Task ids of the requests received so far, in arrival order."""
        with self._lock:
            return list(self._arrived)

    def release(self) -> None:
        """Answer 200 to every request held, and to every later one at once."""
        self.released.set()

    def __enter__(self) -> HeldWebhooks:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.released.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)


@pytest.fixture
def webhooks() -> Iterator[HeldWebhooks]:
    """A `HeldWebhooks` target, served for the test."""
    with HeldWebhooks() as target:
        yield target


def _metric(multiproc_dir: Path, name: str, labels: dict[str, str] | None = None) -> float:
    """A sample summed over the metrics files a stopped supervisor left."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(multiproc_dir))  # type: ignore[no-untyped-call]
    return registry.get_sample_value(name, labels or {}) or 0.0


def test_sigterm_lets_a_childs_running_handlers_finish_and_hands_back_the_rest(
    supervisor: StartSupervisor, fresh_engine: Engine, webhooks: HeldWebhooks
) -> None:
    company = insert_company(fresh_engine).id
    ids = insert_tasks(
        fresh_engine, company, 10, task_type="webhook", payload={"url": webhooks.url}
    )
    sup = supervisor(
        "--concurrency", "1", "--batch-size", "10", "--threads", "3",
        WEBHOOK_ALLOW_PRIVATE="true",
    )  # fmt: skip
    # Three requests held at once by one child: three handlers running, the first three of
    # its batch; the other seven claimed and waiting for a runner.
    wait_for(lambda: len(webhooks.arrived()) == 3, 15, f"three webhooks:\n{sup.log()[-3000:]}")
    assert set(webhooks.arrived()) == set(ids[:3])
    assert harness.status_counts(fresh_engine) == {"processing": 10}

    sup.send(signal.SIGTERM)
    wait_for(lambda: "stopping (" in sup.log(), 10, "the supervisor to pass TERM on")
    time.sleep(0.5)  # for the child to take its signal; its handlers are still held
    webhooks.release()
    assert sup.wait(15) == 0

    assert sorted(webhooks.arrived()) == sorted(ids[:3])  # nothing started after TERM
    for task_id in ids[:3]:
        row = harness.task_row(fresh_engine, task_id)
        assert (row["status"], row["attempts"]) == ("completed", 1)
    for task_id in ids[3:]:
        row = harness.task_row(fresh_engine, task_id)
        assert (row["status"], row["attempts"], row["lease_token"]) == ("pending", 0, None)
    assert _metric(sup.multiproc_dir, "tasks_claimed_total") == 10
    assert _metric(sup.multiproc_dir, "tasks_completed_total", {"type": "webhook"}) == 3
    assert _metric(sup.multiproc_dir, "task_duration_seconds_count", {"type": "webhook"}) == 3
    assert _metric(sup.multiproc_dir, "tasks_released_total") == 7


def test_a_child_whose_handlers_all_outlast_its_child_timeout_is_not_killed(
    supervisor: StartSupervisor, fresh_engine: Engine, webhooks: HeldWebhooks
) -> None:
    company = insert_company(fresh_engine).id
    ids = insert_tasks(fresh_engine, company, 4, task_type="webhook", payload={"url": webhooks.url})
    sup = supervisor(
        "--concurrency", "1", "--threads", "4",
        WEBHOOK_ALLOW_PRIVATE="true", WORKER_CHILD_TIMEOUT_SECONDS="1",
    )  # fmt: skip
    (child,) = sup.wait_ready(1)
    wait_for(lambda: len(webhooks.arrived()) == 4, 15, "four webhooks held at once")
    time.sleep(3)  # three child timeouts with every runner and the main thread in a handler
    webhooks.release()

    wait_for(
        lambda: harness.status_counts(fresh_engine) == {"completed": 4},
        15,
        f"the four tasks to complete:\n{sup.log()[-3000:]}",
    )
    assert [harness.task_row(fresh_engine, t)["attempts"] for t in ids] == [1] * 4
    assert sup.children() == [child]
    assert "gave no sign of life" not in sup.log()
    metrics = sup.metrics()
    assert metrics["worker_child_timeouts_total"] == 0
    assert metrics['tasks_completed_total{type="webhook"}'] == 4
    sup.send(signal.SIGTERM)
    assert sup.wait(15) == 0


@pytest.fixture
def threaded_timeout_worker(tmp_path: Path, fresh_db_url: str) -> Iterator[RunningSupervisor]:
    """`python -m tests.timeout_worker` (with `block_in_c` and `spin`), one child of 4 threads."""
    with started_timeout_worker(tmp_path, fresh_db_url, "--threads", "4") as running:
        yield running


@pytest.mark.slow
def test_a_child_of_four_threads_exits_once_its_siblings_returned_and_no_task_is_lost(
    threaded_timeout_worker: RunningSupervisor, fresh_engine: Engine
) -> None:
    company = insert_company(fresh_engine).id
    [blocked] = insert_tasks(
        fresh_engine, company, 1, task_type="block_in_c", newest_age_seconds=10, max_attempts=2
    )
    [spinning] = insert_tasks(
        fresh_engine, company, 1, task_type="spin", newest_age_seconds=9, max_attempts=2
    )
    # Run beside them, past the blocked one's timeout and grace (1 + 5 s) and the spinning
    # one's (2 + 5 s): the child exits only after they completed, so each runs once.
    slow = insert_tasks(
        fresh_engine, company, 2, task_type="sleep", payload={"seconds": 8}, newest_age_seconds=8
    )
    # Not started by the first child (its four threads are busy): handed back at 6 s.
    after = insert_tasks(fresh_engine, company, 3, task_type="noop")
    set_timeout(sessionmaker(fresh_engine), [blocked], 1)
    set_timeout(sessionmaker(fresh_engine), [spinning], 2)
    sup = threaded_timeout_worker
    (first_child,) = sup.wait_ready(1)

    wait_for(
        lambda: harness.status_counts(fresh_engine) == {"completed": 7},
        40,
        f"every task to complete:\n{sup.log()[-4000:]}",
    )

    # Timed out in the first child (their attempts counted), run again by the next one.
    assert harness.task_row(fresh_engine, blocked)["attempts"] == 2
    assert harness.task_row(fresh_engine, spinning)["attempts"] == 2
    assert [harness.task_row(fresh_engine, t)["attempts"] for t in slow] == [1] * 2
    assert [harness.task_row(fresh_engine, t)["attempts"] for t in after] == [1] * 3
    (second_child,) = sup.wait_children(1)
    assert second_child != first_child
    log = sup.log()
    assert f"child {first_child} exited: task {blocked} (type block_in_c)" in log
    exited = log.index(f"child {first_child} exited")
    for task in slow:
        completed = re.search(rf"task {task} \(company [^)]*\) completed", log)
        assert completed is not None, log[-4000:]
        assert completed.start() < exited  # its completion written before the child exited
    assert sup.metrics()["worker_child_restarts_total"] == 1
    assert sup.metrics()["worker_child_timeouts_total"] == 0
    sup.send(signal.SIGTERM)
    assert sup.wait(15) == 0


@pytest.mark.slow
def test_a_child_frozen_by_a_handler_is_killed_and_its_siblings_tasks_come_back_counted(
    tmp_path: Path, fresh_db_url: str, fresh_engine: Engine
) -> None:
    company = insert_company(fresh_engine).id
    # Claimed first, so running when the other freezes the child: it started, its attempt counts.
    [sibling] = insert_tasks(
        fresh_engine, company, task_type="sleep", payload={"seconds": 1}, newest_age_seconds=9
    )
    [frozen] = insert_tasks(fresh_engine, company, task_type="hold_gil", newest_age_seconds=8)
    set_timeout(sessionmaker(fresh_engine), [frozen], 1)
    with started_timeout_worker(
        tmp_path, fresh_db_url, "--threads", "2",
        WORKER_CHILD_TIMEOUT_SECONDS="2", STALE_AFTER_SECONDS="4",
    ) as sup:  # fmt: skip
        (first_child,) = sup.wait_ready(1)

        # Its keeper cannot write the overrun (no thread of it runs): the supervisor kills
        # it as hung, and the sweep takes both leases back once its row is stale.
        wait_for(
            lambda: harness.status_counts(fresh_engine) == {"completed": 2},
            40,
            f"both tasks to complete:\n{sup.log()[-4000:]}",
        )

        # Both ran twice: the sibling had started, so its first attempt counts.
        assert harness.task_row(fresh_engine, frozen)["attempts"] == 2
        assert harness.task_row(fresh_engine, sibling)["attempts"] == 2
        assert f"child {first_child} gave no sign of life" in sup.log()
        assert sup.metrics()["worker_child_timeouts_total"] == 1
        sup.send(signal.SIGTERM)
        assert sup.wait(15) == 0
