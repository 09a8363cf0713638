"""The supervisor's metrics port (DESIGN §7): children's counters summed, plus /health."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from sqlalchemy import Engine

from tests import supervisor_harness as harness
from tests.supervisor_harness import StartSupervisor, wait_for

BATCH_SIZE = 20


@pytest.fixture
def supervisor(tmp_path: Path, fresh_db_url: str) -> Iterator[StartSupervisor]:
    """`supervisor(*flags, **env)` runs `python -m worker` on the fresh database."""
    yield from harness.supervisors(tmp_path, fresh_db_url)


@pytest.mark.slow
def test_completed_total_matches_the_database_across_a_child_kill(
    supervisor: StartSupervisor, fresh_engine: Engine
) -> None:
    for index in range(10):
        company = harness.add_company(fresh_engine, f"company-{index}")
        # A few milliseconds each, so the kill lands while batches are still in hand.
        harness.add_tasks(fresh_engine, company, 100, type="sleep", payload='{"seconds": 0.003}')
    sup = supervisor("--concurrency", "2", "--batch-size", str(BATCH_SIZE))
    victim = sup.wait_children(2)[0]
    wait_for(
        lambda: harness.status_counts(fresh_engine).get("completed", 0) >= 200,
        15,
        "some tasks to complete",
    )
    os.kill(victim, signal.SIGKILL)
    sup.seen_children.add(victim)

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
    assert metrics["tasks_claimed_total"] > 1000  # the victim's batch was claimed twice
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
