"""Fenced finalization, heartbeat, expired leases and poison pills, backoff (design §1.4, §4)."""

from __future__ import annotations

import datetime as dt
import random
import uuid
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from db import claims, workers
from db.engine import driver_connection
from db.models import Task
from tests.factories import MakeCompany, MakeTask, take_back
from worker import backoff


def fetch(session: Session, task_id: uuid.UUID) -> dict[str, Any]:
    """The task row as a dict, read fresh from the database."""
    result = session.execute(text("SELECT * FROM tasks WHERE id = :id"), {"id": task_id})
    return dict(result.mappings().one())


def lease(task: Task) -> claims.Lease:
    """The lease a `claimed_task` row is held under."""
    assert task.lease_token is not None
    return claims.Lease(task.id, task.lease_token)


def take_over(session: Session, task: Task) -> claims.ClaimedTask:
    """Let `task`'s lease expire, requeue it and have another worker claim it; return that."""
    session.execute(
        text("UPDATE tasks SET locked_at = now() - interval '1 hour' WHERE id = :id"),
        {"id": task.id},
    )
    assert [e.id for e in take_back(session, stale_after=60)] == [task.id]
    [claimed] = claims.claim(
        driver_connection(session, transaction=False), worker_id="new:2", batch_size=10
    )
    session.commit()
    assert claimed.id == task.id
    return claimed


# -- complete, fail, retry, release: each fenced ------------------------------------------


def test_complete_clears_the_lease_and_the_last_error(
    db_session: Session, make_company: MakeCompany, claimed_task: MakeTask
) -> None:
    task = claimed_task(make_company().id, last_error="earlier failure")

    assert (
        claims.complete_tasks(driver_connection(db_session, transaction=False), [lease(task)]) == []
    )

    stored = fetch(db_session, task.id)
    assert stored["status"] == "completed"
    assert stored["finished_at"] is not None
    assert stored["last_error"] is None
    assert stored["lease_token"] is stored["locked_by"] is stored["locked_at"] is None
    assert stored["attempts"] == 1


def test_complete_tasks_completes_only_the_leases_still_held(
    db_session: Session, make_company: MakeCompany, claimed_task: MakeTask
) -> None:
    company = make_company().id
    held, lost = claimed_task(company), claimed_task(company)
    stale_lease = claims.Lease(lost.id, uuid.uuid4())

    assert claims.complete_tasks(
        driver_connection(db_session, transaction=False), [lease(held), stale_lease]
    ) == [stale_lease]
    assert fetch(db_session, lost.id)["status"] == "processing"
    assert claims.complete_tasks(driver_connection(db_session, transaction=False), []) == []


def test_fail_records_the_error_clipped_and_without_nul(
    db_session: Session, make_company: MakeCompany, claimed_task: MakeTask
) -> None:
    task = claimed_task(make_company().id)

    assert claims.fail_task(
        driver_connection(db_session, transaction=False),
        task.id,
        lease(task).lease_token,
        error="bad\x00" + "x" * 5000,
    )

    stored = fetch(db_session, task.id)
    assert stored["status"] == "failed"
    assert stored["finished_at"] is not None
    assert stored["lease_token"] is None
    assert len(stored["last_error"]) == claims.MAX_ERROR_CHARS
    assert stored["last_error"].startswith("bad\\0xxx")
    assert stored["last_error"].endswith("\u2026")


def test_retry_puts_the_task_back_to_pending_after_the_delay(
    db_session: Session, make_company: MakeCompany, claimed_task: MakeTask
) -> None:
    task = claimed_task(make_company().id, attempts=2)

    assert claims.schedule_retry(
        driver_connection(db_session, transaction=False),
        task.id,
        lease(task).lease_token,
        delay_seconds=90.5,
        error="TimeoutError",
    )

    stored = fetch(db_session, task.id)
    now = db_session.execute(text("SELECT now()")).scalar_one()
    assert stored["status"] == "pending"
    assert stored["run_after"] - now == dt.timedelta(seconds=90.5)
    assert stored["attempts"] == 2
    assert stored["last_error"] == "TimeoutError"
    assert stored["finished_at"] is None
    assert stored["lease_token"] is stored["locked_by"] is stored["locked_at"] is None


def test_release_restores_attempts_and_keeps_run_after(
    db_session: Session, make_company: MakeCompany, make_task: MakeTask
) -> None:
    company = make_company().id
    tasks = [
        make_task(company, run_after=text(f"now() - interval '{n} minutes'")) for n in (3, 2, 1)
    ]
    before = {t.id: fetch(db_session, t.id) for t in tasks}
    claimed = claims.claim(
        driver_connection(db_session, transaction=False), worker_id="w:1", batch_size=10
    )
    assert {t.attempts for t in claimed} == {1}

    assert (
        claims.release_tasks(driver_connection(db_session, transaction=False), list(claimed)) == []
    )

    for task in tasks:
        stored = fetch(db_session, task.id)
        assert stored["status"] == "pending"
        assert stored["attempts"] == 0
        assert stored["run_after"] == before[task.id]["run_after"]
        assert stored["lease_token"] is stored["locked_by"] is stored["locked_at"] is None
    assert claims.release_tasks(driver_connection(db_session, transaction=False), []) == []


def test_a_late_worker_changes_nothing_after_its_lease_was_taken_over(
    db_session: Session, make_company: MakeCompany, claimed_task: MakeTask
) -> None:
    """Fencing (design §1.4): every finalizer with the old token misses and changes nothing."""
    task = claimed_task(make_company().id, locked_by="old:1")
    old = lease(task)
    new = take_over(db_session, task)
    after_takeover = fetch(db_session, task.id)

    assert claims.complete_tasks(driver_connection(db_session, transaction=False), [old]) == [old]
    assert (
        claims.fail_task(
            driver_connection(db_session, transaction=False), old.id, old.lease_token, error="late"
        )
        is False
    )
    assert (
        claims.schedule_retry(
            driver_connection(db_session, transaction=False),
            old.id,
            old.lease_token,
            delay_seconds=1,
            error="late",
        )
        is False
    )
    assert claims.release_tasks(driver_connection(db_session, transaction=False), [old]) == [old]

    assert fetch(db_session, task.id) == after_takeover
    assert after_takeover["lease_token"] == new.lease_token
    assert after_takeover["locked_by"] == "new:2"
    assert after_takeover["attempts"] == 2
    # The new holder still finalizes normally.
    assert claims.complete_tasks(driver_connection(db_session, transaction=False), [new]) == []


def test_finalizers_miss_on_tasks_that_are_no_longer_processing(
    db_session: Session, make_company: MakeCompany, claimed_task: MakeTask
) -> None:
    task = claimed_task(make_company().id)
    assert (
        claims.complete_tasks(driver_connection(db_session, transaction=False), [lease(task)]) == []
    )
    assert (
        claims.fail_task(
            driver_connection(db_session, transaction=False),
            task.id,
            lease(task).lease_token,
            error="x",
        )
        is False
    )
    assert fetch(db_session, task.id)["status"] == "completed"


# -- the worker heartbeat and the sweep (decision 0010) --------------------------------------


def test_a_live_workers_leases_are_kept_however_old_and_a_silent_ones_are_taken_back(
    db_session: Session, make_company: MakeCompany, claimed_task: MakeTask
) -> None:
    """The holder's heartbeat, not the lease's age, says whether a lease is still held."""
    conn = driver_connection(db_session, transaction=False)
    company = make_company().id
    workers.register(conn, "live:1:a", host="live", pid=1)
    workers.register(conn, "silent:2:b", host="silent", pid=2)
    hour_ago = text("now() - interval '1 hour'")
    kept = claimed_task(company, locked_by="live:1:a", locked_at=hour_ago)
    lost = claimed_task(company, locked_by="silent:2:b", locked_at=text("now()"))
    db_session.execute(
        text("UPDATE workers SET heartbeat_at = now() - interval '301 seconds' WHERE id = :id"),
        {"id": "silent:2:b"},
    )

    taken = take_back(db_session, stale_after=300)

    assert [(t.id, t.locked_by, t.failed) for t in taken] == [(lost.id, "silent:2:b", False)]
    assert fetch(db_session, kept.id)["lease_token"] == kept.lease_token
    assert fetch(db_session, lost.id)["status"] == "pending"
    # Its row is gone with its leases: its next heartbeat tells it so.
    assert workers.heartbeat(conn, "live:1:a") is True
    assert workers.heartbeat(conn, "silent:2:b") is False
    ids = db_session.execute(text("SELECT id FROM workers ORDER BY id")).scalars().all()
    assert ids == ["live:1:a"]


def test_a_lease_whose_holder_has_no_row_is_taken_back_once_older_than_the_stale_window(
    db_session: Session, make_company: MakeCompany, claimed_task: MakeTask
) -> None:
    """A holder swept already (over the limit), or one that never registered."""
    company = make_company().id
    young = claimed_task(company, locked_by="nobody:1", locked_at=text("now() - interval '299 s'"))
    old = claimed_task(company, locked_by="nobody:1", locked_at=text("now() - interval '301 s'"))

    assert [t.id for t in take_back(db_session, stale_after=300)] == [old.id]
    assert fetch(db_session, young.id)["status"] == "processing"


def test_register_heartbeat_and_deregister_keep_one_row_per_worker(db_session: Session) -> None:
    conn = driver_connection(db_session, transaction=False)
    workers.register(conn, "h:7:c", host="h", pid=7)
    workers.register(conn, "h:7:c", host="h", pid=7)  # again, after a sweep found it gone
    row = db_session.execute(text("SELECT host, pid, heartbeat_at = now() FROM workers")).one()
    assert tuple(row) == ("h", 7, True)
    workers.deregister(conn, "h:7:c")
    assert workers.heartbeat(conn, "h:7:c") is False


# -- expired leases and poison pills ------------------------------------------------------


def test_a_task_whose_worker_dies_every_time_ends_failed_after_max_attempts(
    db_session: Session, make_company: MakeCompany, make_task: MakeTask
) -> None:
    """Each claim counts an attempt; expiry requeues the task until none are left, then fails it."""
    company = make_company().id
    task = make_task(company, max_attempts=3)
    expire = text("UPDATE tasks SET locked_at = now() - interval '10 minutes' WHERE id = :id")
    for attempt in (1, 2, 3):
        [claimed] = claims.claim(
            driver_connection(db_session, transaction=False),
            worker_id=f"doomed:{attempt}",
            batch_size=1,
        )
        assert claimed.attempts == attempt
        db_session.execute(expire, {"id": task.id})  # the worker dies; its lease expires
        [expired] = take_back(db_session, stale_after=300)
        assert (expired.id, expired.attempts, expired.locked_by) == (
            task.id, attempt, f"doomed:{attempt}",
        )  # fmt: skip
        assert expired.failed is (attempt == 3)

    stored = fetch(db_session, task.id)
    assert stored["status"] == "failed"
    assert stored["attempts"] == 3
    assert stored["finished_at"] is not None
    assert stored["last_error"] == (
        "worker lost (lease expired) after 3 attempts (last holder doomed:3)"
    )
    assert stored["lease_token"] is stored["locked_by"] is stored["locked_at"] is None
    assert (
        claims.claim(driver_connection(db_session, transaction=False), worker_id="w", batch_size=1)
        == []
    )
    assert take_back(db_session, stale_after=300) == []


def test_the_sweep_leaves_live_leases_alone(
    db_session: Session, make_company: MakeCompany, claimed_task: MakeTask
) -> None:
    company = make_company().id
    live = claimed_task(company, attempts=5, max_attempts=5)  # last attempt, still alive
    almost = claimed_task(company, locked_at=text("now() - interval '299 seconds'"))

    assert take_back(db_session, stale_after=300) == []

    for task in (live, almost):
        stored = fetch(db_session, task.id)
        assert (stored["status"], stored["lease_token"]) == ("processing", task.lease_token)


def test_the_sweep_requeues_a_task_with_attempts_left_and_keeps_its_history(
    db_session: Session, make_company: MakeCompany, claimed_task: MakeTask
) -> None:
    company = make_company().id
    task = claimed_task(
        company,
        attempts=2,
        locked_by="gone:7",
        locked_at=text("now() - interval '1 hour'"),
        started_at=text("now() - interval '2 hours'"),
        last_error="HTTP 503",
    )
    before = fetch(db_session, task.id)

    [expired] = take_back(db_session, stale_after=300)

    assert expired == workers.TakenBack(task.id, company, "noop", 2, "gone:7", False)
    stored = fetch(db_session, task.id)
    assert stored["status"] == "pending"
    assert stored["attempts"] == 2  # crashes count
    assert stored["run_after"] == before["locked_at"]  # first in its company's line
    assert stored["started_at"] == before["started_at"]
    assert stored["last_error"] == "HTTP 503"
    assert stored["finished_at"] is None
    assert stored["lease_token"] is stored["locked_by"] is stored["locked_at"] is None
    # The old holder's lease is fenced off.
    assert claims.complete_tasks(
        driver_connection(db_session, transaction=False), [lease(task)]
    ) == [lease(task)]


# -- backoff -----------------------------------------------------------------------------


def test_backoff_ceiling_doubles_from_two_seconds_up_to_an_hour() -> None:
    assert [backoff.ceiling(a) for a in range(1, 14)] == [
        2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 3600, 3600,
    ]  # fmt: skip


@pytest.mark.parametrize(("attempt", "top"), [(1, 2.0), (16, 3600.0), (1_000_000, 3600.0)])
def test_backoff_delay_is_full_jitter_below_the_ceiling(attempt: int, top: float) -> None:
    rng = random.Random(7)
    delays = [backoff.delay(attempt, rng=rng) for _ in range(2000)]
    assert all(0.0 <= d <= top for d in delays)
    # Full jitter: the whole range is used, not just the top or a band around it.
    assert min(delays) < top * 0.01
    assert max(delays) > top * 0.99


def test_backoff_never_overflows() -> None:
    assert backoff.ceiling(10**100) == 3600.0
    assert 0.0 <= backoff.delay(2**63) <= 3600.0


def test_backoff_rejects_attempt_zero() -> None:
    with pytest.raises(ValueError, match="counts from 1"):
        backoff.delay(0)
