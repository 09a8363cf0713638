"""The chaos run (`devtools.chaos`) scaled down: SIGKILLed workers lose no task (design §1.1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from devtools import chaos


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_killing_worker_children_loses_no_task_and_redelivers_only_reclaimed_ones(
    fresh_db_url: str, tmp_path: Path
) -> None:
    config = chaos.ChaosConfig(
        tasks=1000,
        companies=20,
        supervisors=2,
        children=2,
        api_threads=2,
        create_threads=6,
        kill_interval=1.0,
        # Each delivery takes a moment, so batches are long enough for kills to land in them.
        delivery_delay=0.01,
        stale_after=2.0,
        chaos_seconds=40.0,
        drain_timeout=30.0,
        database_url=fresh_db_url,
    )

    report = chaos.run(config, workdir=tmp_path, log=lambda line: None)

    summary = chaos.format_report(report)
    assert report.drained, summary
    assert report.lost == 0, summary
    assert report.statuses == {"completed": 1000}, summary
    assert report.completed_undelivered == 0, summary
    assert (report.unknown_tasks, report.unknown_keys) == (0, 0), summary
    # At-least-once: a second delivery only ever goes to a task that was claimed again.
    assert report.duplicates_unexplained == 0, summary
    assert report.duplicates == report.duplicates_reclaimed, summary
    # The run really killed children while they held tasks.
    assert report.kills >= 3, summary
    assert report.held_by_killed > 0, summary
    assert report.ok, summary
