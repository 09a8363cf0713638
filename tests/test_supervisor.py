"""The supervisor (design §5) as a real process tree: real forks, real signals, real PostgreSQL."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
from sqlalchemy import Engine

from devtools.embedded_postgres import free_port
from tests import supervisor_harness as harness
from tests.factories import insert_company, insert_tasks
from tests.supervisor_harness import RunningSupervisor, StartSupervisor, wait_for
from worker import supervisor as supervisor_module


def test_ttin_adds_a_child_and_ttou_never_goes_below_one(supervisor: StartSupervisor) -> None:
    sup = supervisor("--concurrency", "2")
    sup.wait_children(2)
    assert sup.metrics()["worker_children"] == 2
    # Forking a threaded process is unsafe (docs/stack-notes.md): the supervisor has one thread.
    assert len(list(Path(f"/proc/{sup.pid}/task").iterdir())) == 1

    # One signal at a time: the kernel merges a signal sent while the same one is pending.
    sup.send(signal.SIGTTIN)
    sup.wait_children(3)
    wait_for(lambda: sup.metrics()["worker_children"] == 3, 5, "worker_children == 3")

    sup.send(signal.SIGTTOU)
    sup.wait_children(2)
    sup.send(signal.SIGTTOU)
    survivors = sup.wait_children(1)
    wait_for(lambda: sup.metrics()["worker_children"] == 1, 5, "worker_children == 1")

    sup.send(signal.SIGTTOU)
    time.sleep(1.0)
    assert sup.children() == survivors
    assert sup.metrics()["worker_children"] == 1
    assert sup.metrics()["worker_child_restarts_total"] == 0  # retired, not crashed

    sup.send(signal.SIGTERM)
    assert sup.wait(15) == 0


def test_ttou_retires_the_oldest_child(supervisor: StartSupervisor) -> None:
    sup = supervisor("--concurrency", "1")
    (oldest,) = sup.wait_ready(1)
    sup.send(signal.SIGTTIN)
    newest = next(pid for pid in sup.wait_children(2) if pid != oldest)
    sup.send(signal.SIGTTOU)
    assert sup.wait_children(1) == [newest]
    sup.send(signal.SIGTERM)
    assert sup.wait(15) == 0


def test_hup_replaces_every_child_keeping_the_count(supervisor: StartSupervisor) -> None:
    sup = supervisor("--concurrency", "2")
    before = set(sup.wait_ready(2))

    sup.send(signal.SIGHUP)

    def replaced() -> bool:
        now = set(sup.children())
        return len(now) == 2 and not now & before

    wait_for(replaced, 15, "both children replaced")
    assert sup.proc.poll() is None
    assert sup.metrics()["worker_child_restarts_total"] == 0
    sup.send(signal.SIGTERM)
    assert sup.wait(15) == 0


@pytest.mark.slow
def test_sigkilled_child_is_replaced_and_its_task_runs_again(
    supervisor: StartSupervisor, fresh_engine: Engine
) -> None:
    company = insert_company(fresh_engine).id
    (slow,) = insert_tasks(
        fresh_engine, company, task_type="sleep", payload={"seconds": 1}, newest_age_seconds=60
    )
    quick = insert_tasks(fresh_engine, company, 5)
    sup = supervisor("--concurrency", "1", "--batch-size", "1")
    (victim,) = sup.wait_children(1)
    wait_for(
        lambda: harness.task_row(fresh_engine, slow)["status"] == "processing",
        10,
        "the sleep task to start",
    )
    assert harness.task_row(fresh_engine, slow)["locked_by"].split(":")[1] == str(victim)

    sup.seen_children.add(victim)
    os.kill(victim, signal.SIGKILL)

    (replacement,) = wait_for(
        lambda: [p for p in sup.children() if p != victim] or None, 10, "a replacement child"
    )
    wait_for(lambda: sup.metrics()["worker_child_restarts_total"] == 1, 5, "restart counted")
    assert "likely out of memory" in sup.log()
    # Recovered once its lease is stale (STALE_AFTER_SECONDS=2), then run to completion.
    wait_for(
        lambda: harness.task_row(fresh_engine, slow)["status"] == "completed",
        15,
        "the killed child's task to complete on the replacement",
    )
    row = harness.task_row(fresh_engine, slow)
    assert row["attempts"] == 2
    assert row["locked_by"] is None
    wait_for(
        lambda: harness.status_counts(fresh_engine) == {"completed": 1 + len(quick)},
        10,
        "every task completed (nothing lost)",
    )
    assert replacement in sup.children()
    sup.send(signal.SIGTERM)
    assert sup.wait(15) == 0


def _released_total(multiproc_dir: Path) -> float:
    """`tasks_released_total` summed over the metrics files a stopped supervisor left."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(multiproc_dir))  # type: ignore[no-untyped-call]
    value = registry.get_sample_value("tasks_released_total")
    return value or 0.0


def test_sigterm_finishes_the_task_in_hand_and_releases_the_rest(
    supervisor: StartSupervisor, fresh_engine: Engine
) -> None:
    company = insert_company(fresh_engine).id
    # The oldest runs first: 1.5 s of sleep, then nine tasks the batch holds but never starts.
    (first,) = insert_tasks(
        fresh_engine, company, task_type="sleep", payload={"seconds": 1.5}, newest_age_seconds=60
    )
    rest = insert_tasks(fresh_engine, company, 9, newest_age_seconds=30)
    sup = supervisor(
        "--concurrency", "1", "--batch-size", "10",
        SHUTDOWN_TIMEOUT_SECONDS="10",
    )  # fmt: skip
    wait_for(
        lambda: harness.status_counts(fresh_engine).get("processing") == 10,
        10,
        "the batch of 10 to be claimed",
    )
    assert harness.task_row(fresh_engine, first)["status"] == "processing"

    started = time.monotonic()
    sup.send(signal.SIGTERM)
    assert sup.wait(10) == 0
    assert time.monotonic() - started < 10

    assert harness.task_row(fresh_engine, first)["status"] == "completed"
    for task_id in rest:
        row = harness.task_row(fresh_engine, task_id)
        assert (row["status"], row["attempts"], row["lease_token"]) == ("pending", 0, None)
    assert _released_total(sup.multiproc_dir) == 9


def test_child_stuck_past_shutdown_timeout_is_killed(
    supervisor: StartSupervisor, fresh_engine: Engine
) -> None:
    company = insert_company(fresh_engine).id
    (stuck,) = insert_tasks(fresh_engine, company, task_type="sleep", payload={"seconds": 60})
    sup = supervisor("--concurrency", "1", SHUTDOWN_TIMEOUT_SECONDS="1")
    (child,) = sup.wait_children(1)
    wait_for(
        lambda: harness.task_row(fresh_engine, stuck)["status"] == "processing",
        10,
        "the long task to start",
    )
    started = time.monotonic()
    sup.send(signal.SIGTERM)
    assert sup.wait(8) == 0
    assert time.monotonic() - started < 5
    assert not harness.is_alive(child)
    assert "killing them" in sup.log()
    # Left to lease expiry, as design §5 says.
    assert harness.task_row(fresh_engine, stuck)["status"] == "processing"


def test_sigquit_stops_within_about_a_second(
    supervisor: StartSupervisor, fresh_engine: Engine
) -> None:
    company = insert_company(fresh_engine).id
    insert_tasks(fresh_engine, company, task_type="sleep", payload={"seconds": 60})
    sup = supervisor("--concurrency", "2", SHUTDOWN_TIMEOUT_SECONDS="30")
    sup.wait_ready(2)
    wait_for(
        lambda: harness.status_counts(fresh_engine).get("processing") == 1, 10, "a task to start"
    )
    started = time.monotonic()
    sup.send(signal.SIGQUIT)
    assert sup.wait(8) == 0
    assert time.monotonic() - started < 4


def test_children_exit_when_the_supervisor_is_killed(supervisor: StartSupervisor) -> None:
    sup = supervisor("--concurrency", "2")
    children = sup.wait_ready(2)
    sup.send(signal.SIGKILL)
    sup.proc.wait(5)
    wait_for(
        lambda: not any(harness.is_alive(pid) for pid in children),
        5,
        "orphaned children to exit",
    )
    assert sup.log().count("is gone; stopping") == 2


def test_children_that_cannot_boot_stop_the_supervisor(supervisor: StartSupervisor) -> None:
    closed = free_port()
    sup = supervisor(
        "--concurrency", "2",
        DATABASE_URL=f"postgresql+psycopg://postgres@127.0.0.1:{closed}/nowhere",
        # Without it each child waits a minute for the database to come up before failing.
        WORKER_BOOT_TIMEOUT_SECONDS="0",
    )  # fmt: skip
    code = sup.wait(30)
    assert code == 3
    log = sup.log()
    assert "failed to boot 5 times in a row" in log
    assert "database unreachable" in log
    assert sup.children() == []


def replaced(sup: RunningSupervisor, victim: int) -> Callable[[], list[int] | None]:
    """A condition: some child other than `victim` runs."""
    return lambda: [p for p in sup.children() if p != victim] or None


@pytest.mark.slow
def test_a_child_that_ran_a_while_is_replaced_without_backoff(
    supervisor: StartSupervisor,
) -> None:
    sup = supervisor("--concurrency", "1")
    # Three quick deaths in a row: the backoff grows (0.25 s, 0.5 s, 1 s).
    for _ in range(3):
        (victim,) = sup.wait_children(1)
        sup.seen_children.add(victim)
        os.kill(victim, signal.SIGKILL)
        wait_for(replaced(sup, victim), 10, "a replacement child")
    assert "replacing it in 1.00s" in sup.log()
    (steady,) = sup.wait_children(1)
    time.sleep(supervisor_module.RESTART_STABLE_AFTER_SECONDS + 0.5)
    sup.seen_children.add(steady)
    os.kill(steady, signal.SIGKILL)
    wait_for(lambda: [p for p in sup.children() if p != steady] or None, 10, "a replacement")
    # It had been healthy: its successor starts at once, as after a first death.
    assert sup.log().rstrip().count("replacing it in 0.25s") == 2
    sup.send(signal.SIGTERM)
    assert sup.wait(15) == 0


def test_without_a_metrics_directory_children_write_to_a_temporary_one_removed_at_exit(
    supervisor: StartSupervisor, tmp_path: Path
) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    sup = supervisor("--concurrency", "1", PROMETHEUS_MULTIPROC_DIR=None, TMPDIR=str(tmp))
    sup.wait_ready(1)
    [made] = tmp.glob("fairq-worker-metrics-*")
    # Exported before the fork (common.metrics_dir): the child's counters are files there.
    wait_for(lambda: list(made.glob("counter_*.db")), 5, "the child's metrics files")
    assert sup.metrics()["worker_children"] == 1

    sup.send(signal.SIGTERM)
    assert sup.wait(15) == 0
    assert not made.exists()
