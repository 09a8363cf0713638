"""The supervisor's metrics port (design §7): children's counters summed, plus /health."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import requests
from sqlalchemy import Engine, text

from devtools.stack import exporter_of
from tests import supervisor_harness as harness
from tests.factories import insert_company, insert_tasks
from tests.supervisor_harness import StartSupervisor, wait_for
from worker import exporter

BATCH_SIZE = 20


@pytest.mark.slow
def held_by(engine: Engine, pid: int) -> int:
    """Tasks in `processing` whose lease belongs to worker process `pid`."""
    with engine.connect() as conn:
        count: int = conn.execute(
            text("SELECT count(*) FROM tasks WHERE status = 'processing' AND locked_by LIKE :w"),
            {"w": f"%:{pid}:%"},
        ).scalar_one()
    return count


def test_completed_total_matches_the_database_across_a_child_kill(
    supervisor: StartSupervisor, fresh_engine: Engine
) -> None:
    for index in range(10):
        company = insert_company(fresh_engine, f"company-{index}").id
        # 10 ms each: a batch is in hand for ~200 ms, the gap between passes is ~1 ms.
        insert_tasks(fresh_engine, company, 100, task_type="sleep", payload={"seconds": 0.01})
    sup = supervisor("--concurrency", "2", "--batch-size", str(BATCH_SIZE))
    victim = sup.wait_children(2)[0]
    wait_for(
        lambda: harness.status_counts(fresh_engine).get("completed", 0) >= 200,
        15,
        "some tasks to complete",
    )
    # Kill only while the victim holds a batch; between passes it holds nothing, and the
    # test would not exercise recovery. Then count what it held: exactly those are claimed
    # a second time.
    wait_for(lambda: held_by(fresh_engine, victim) > 0, 10, "the victim to hold a batch")
    os.kill(victim, signal.SIGKILL)
    sup.seen_children.add(victim)
    held = held_by(fresh_engine, victim)

    # The victim's claimed tasks come back after STALE_AFTER_SECONDS=2.
    wait_for(
        lambda: harness.status_counts(fresh_engine) == {"completed": 1000},
        30,
        "all 1,000 tasks to complete",
    )
    sup.wait_children(2)
    wait_for(lambda: sup.metrics()["worker_child_restarts_total"] == 1, 5, "the restart")
    metrics = sup.metrics()

    completed = metrics['tasks_completed_total{type="sleep"}']
    # The killed child may have committed completions it had not counted yet: at most the
    # one batch it held when it died. Everything else is counted exactly once.
    assert 1000 - BATCH_SIZE <= completed <= 1000
    assert metrics['task_duration_seconds_count{type="sleep"}'] == completed
    # Counters of dead children stay in the aggregate: the victim's batch counts twice.
    assert metrics["tasks_claimed_total"] == 1000 + held
    assert metrics["claim_duration_seconds_count"] >= 1
    assert metrics["worker_children"] == 2
    assert metrics.get("tasks_lease_lost_total", 0) == 0
    sup.send(signal.SIGTERM)
    assert sup.wait(15) == 0


def test_health_answers_and_unknown_paths_are_404(supervisor: StartSupervisor) -> None:
    sup = supervisor("--concurrency", "1")
    base = f"http://127.0.0.1:{sup.port()}"

    health = requests.get(f"{base}/health", timeout=5)
    assert health.status_code == 200
    assert json.loads(health.text) == {"status": "ok"}
    assert requests.get(f"{base}/nope", timeout=5).status_code == 404
    assert requests.post(f"{base}/metrics", timeout=5).status_code == 405
    scrape = requests.get(f"{base}/metrics", timeout=5)
    assert scrape.headers["Content-Type"].startswith("text/plain")
    assert "worker_children" in scrape.text
    sup.send(signal.SIGTERM)
    assert sup.wait(15) == 0


def test_a_killed_exporter_is_replaced_and_the_port_answers_again(
    supervisor: StartSupervisor,
) -> None:
    sup = supervisor("--concurrency", "1")
    children = sup.wait_children(1)
    base = f"http://127.0.0.1:{sup.port()}"
    wait_for(lambda: sup.metrics()["worker_children"] == 1, 10, "the first scrape")
    first = exporter_of(sup.pid)
    assert first is not None
    # The supervisor names itself only around the fork (its child has the name from birth).
    assert Path(f"/proc/{sup.pid}/comm").read_text().strip() != exporter.PROCESS_NAME

    os.kill(first, signal.SIGKILL)

    # The supervisor keeps the socket: a scrape sent meanwhile waits in its backlog.
    scrape = requests.get(f"{base}/metrics", timeout=10)
    assert scrape.status_code == 200
    assert "worker_children 1.0" in scrape.text
    second = wait_for(lambda: exporter_of(sup.pid), 5, "a second exporter")
    assert second != first
    assert f"metrics exporter {first} exited" in sup.log()
    assert sup.children() == children, "worker children are not touched"
    assert sup.metrics().get("worker_child_restarts_total", 0) == 0
    sup.send(signal.SIGTERM)
    assert sup.wait(15) == 0
    assert not harness.is_alive(first)
    assert not harness.is_alive(second)


def test_a_scraper_that_sends_nothing_holds_up_no_other(supervisor: StartSupervisor) -> None:
    sup = supervisor("--concurrency", "1")
    port = sup.port()
    with socket.create_connection(("127.0.0.1", port)) as silent:
        silent.sendall(b"GET /metr")  # and nothing more
        head = requests.head(f"http://127.0.0.1:{port}/metrics", timeout=3)
        assert head.status_code == 200
        assert head.headers["Content-Type"].startswith("text/plain")
        assert head.content == b""
        assert requests.get(f"http://127.0.0.1:{port}/metrics", timeout=3).status_code == 200
    sup.send(signal.SIGTERM)
    assert sup.wait(15) == 0


def test_the_exporter_exits_when_its_supervisor_is_killed(supervisor: StartSupervisor) -> None:
    sup = supervisor("--concurrency", "1")
    sup.wait_children(1)
    sup.port()
    exporter = wait_for(lambda: exporter_of(sup.pid), 5, "the exporter")

    os.kill(sup.pid, signal.SIGKILL)

    wait_for(lambda: not harness.is_alive(exporter), 10, "the orphaned exporter to exit")


def test_every_task_type_has_its_series_at_zero_before_its_first_event() -> None:
    from worker import metrics

    task_metrics = metrics.TaskMetrics(["noop", "webhook"])

    for counter in (
        task_metrics.tasks_completed,
        task_metrics.tasks_retried,
        task_metrics.tasks_failed,
    ):
        samples = {
            s.labels["type"]: s.value
            for family in counter.collect()
            for s in family.samples
            if s.name.endswith("_total")
        }
        assert samples == {"noop": 0.0, "webhook": 0.0}


@pytest.mark.parametrize(
    "amounts",
    [
        [0.0001] * 100,
        [0.0, 0.001, 0.0011, 0.005, 0.7, 2.5, 299.0, 300.0, 301.0, 1e9],
        [0.02, 0.003, 0.02, 0.5, 0.003],
        [0.002, math.nan],  # a NaN is in no bucket
    ],
)
def test_observe_all_exposes_what_one_observe_per_amount_does(amounts: list[float]) -> None:
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
            if not line.startswith("t_created")
        ]

    def one_by_one(histogram: Histogram) -> None:
        for amount in amounts:
            histogram.observe(amount)

    expected = exposition(one_by_one)
    got = exposition(lambda histogram: metrics.observe_all(histogram, amounts))
    # Bucket counts exactly; the sum up to the order its floats were added in.
    sums = [i for i, line in enumerate(expected) if line.startswith("t_sum")]
    assert [line for i, line in enumerate(got) if i not in sums] == [
        line for i, line in enumerate(expected) if i not in sums
    ]
    for i in sums:
        assert float(got[i].split()[-1]) == pytest.approx(
            float(expected[i].split()[-1]), nan_ok=True
        )


def test_completions_reported_per_batch_count_each_task() -> None:
    from worker import metrics

    task_metrics = metrics.TaskMetrics(["noop"])
    task_metrics.completed("noop", [0.0002] * 70)
    task_metrics.completed("noop", [0.002, 0.2])
    task_metrics.completed("noop", [])

    def sample(family: Any, name: str) -> float:
        return float(sum(s.value for f in family.collect() for s in f.samples if s.name == name))

    assert sample(task_metrics.tasks_completed, "tasks_completed_total") == 72
    assert sample(task_metrics.task_duration, "task_duration_seconds_count") == 72
    assert sample(task_metrics.task_duration, "task_duration_seconds_sum") == pytest.approx(
        70 * 0.0002 + 0.202
    )


def test_a_scrape_passes_over_the_empty_file_of_a_child_still_creating_it(
    tmp_path: Path,
) -> None:
    # A child that has created its metrics file but not sized it yet: reading that file
    # failed the whole scrape with struct.error (prometheus/client_python#604).
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.mmap_dict import MmapedDict, mmap_key

    from worker import metrics

    written = MmapedDict(str(tmp_path / "counter_101.db"))  # type: ignore[no-untyped-call]
    key = mmap_key("tasks_claimed", "tasks_claimed_total", [], [], "Tasks claimed.")
    written.write_value(key, 7.0, 0.0)  # type: ignore[no-untyped-call]
    written.close()  # type: ignore[no-untyped-call]
    (tmp_path / "counter_102.db").touch()

    registry = CollectorRegistry()
    registry.register(metrics.FilesCollector(tmp_path))
    body = generate_latest(registry).decode()

    assert "tasks_claimed_total 7.0" in body
