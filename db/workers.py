"""Worker processes: who is alive (a row each, with a heartbeat), the sweep that takes back the
leases of the dead, and what workers read of the companies whose tasks they hold.

Sent to psycopg directly; each function takes the connection and never commits (the caller
owns the transaction; in autocommit each statement is its own). Driver errors come out
translated (`db.engine.driver_errors`).
"""

from __future__ import annotations

import uuid
from collections.abc import Collection
from typing import Any, NamedTuple

import psycopg

from db.engine import driver_errors

# A worker trusts what it read of its companies' pauses (`paused_companies`) for at most this
# long, counted from before the read was sent; a pause answers only this long after it
# committed (`api`). Together: once a pause has answered, no worker starts another of the
# company's tasks (README "Pause and resume", design §4 "Pause").
PAUSE_SEEN_WITHIN_SECONDS = 1.0

_PAUSED_COMPANIES = "SELECT id FROM companies WHERE id = ANY(%(ids)s) AND paused"


def paused_companies(
    conn: psycopg.Connection[Any], company_ids: Collection[uuid.UUID]
) -> set[uuid.UUID]:
    """Which of `company_ids` are paused now: primary-key probes, a read that writes nothing."""
    if not company_ids:
        return set()
    with driver_errors("paused_companies"):
        rows = conn.execute(_PAUSED_COMPANIES, {"ids": list(company_ids)}).fetchall()
    return {row[0] for row in rows}


# -- who is alive: a row per worker process, its heartbeat, and the one sweep ---------------


def register(conn: psycopg.Connection[Any], worker_id: str, *, host: str, pid: int) -> None:
    """Store the row of a worker that is about to claim, its heartbeat now.

    `worker_id` is unique to the process (`worker.child.new_worker_id`): the leases it takes
    carry it in `tasks.locked_by`. Registering again (after `heartbeat` found the row gone)
    starts afresh.
    """
    with driver_errors("register_worker"):
        conn.execute(
            "INSERT INTO workers (id, host, pid) VALUES (%(id)s, %(host)s, %(pid)s) "
            "ON CONFLICT (id) DO UPDATE SET heartbeat_at = now()",
            {"id": worker_id, "host": host, "pid": pid},
        )


def heartbeat(conn: psycopg.Connection[Any], worker_id: str) -> bool:
    """Refresh the worker's `heartbeat_at`; False if its row is gone.

    Gone: a sweep found the worker's heartbeat stale and took back every lease it held (or
    it never registered). Its leases are then lost, all of them: it must start none of the
    tasks it holds, and `register` again before it claims.
    """
    with driver_errors("worker_heartbeat"):
        cursor = conn.execute(
            "UPDATE workers SET heartbeat_at = now() WHERE id = %(id)s", {"id": worker_id}
        )
    return cursor.rowcount == 1


def deregister(conn: psycopg.Connection[Any], worker_id: str) -> None:
    """Delete the worker's row: it exits, holding no lease (it handed back what it held)."""
    with driver_errors("deregister_worker"):
        conn.execute("DELETE FROM workers WHERE id = %(id)s", {"id": worker_id})


class TakenBack(NamedTuple):
    """A `processing` task whose holder was found dead, as `take_back_leases` left it.

    `failed`: its attempts were used up (its workers kept dying: a poison pill), so it is
    now `failed`; else it is `pending` again, first in its company's line.
    """

    id: uuid.UUID
    company_id: uuid.UUID
    type: str
    attempts: int
    locked_by: str | None
    failed: bool


_TAKE_BACK_LEASES = """
WITH dead AS (
    -- Locked: a heartbeat sent now waits for this statement, then finds its row gone and
    -- its worker learns that its leases were taken back. A row being written now is alive.
    SELECT w.id
    FROM workers w
    WHERE w.heartbeat_at < now() - make_interval(secs => CAST(%(stale_after)s AS float8))
    FOR UPDATE SKIP LOCKED
),
lost AS (
    -- ix_tasks_processing_locked_at: only processing rows are read, never finished ones.
    SELECT t.id, t.locked_by, t.attempts >= t.max_attempts AS used_up
    FROM tasks t
    WHERE t.status = 'processing'
      AND (
        t.locked_by IN (SELECT d.id FROM dead d)
        -- A holder without a row: swept already (its leases over the last sweep's limit), or
        -- one that never registered (a release before 0013). Its lease, older than the stale
        -- window, was taken while it was last known alive, or longer ago.
        OR (t.locked_at < now() - make_interval(secs => CAST(%(stale_after)s AS float8))
            AND NOT EXISTS (SELECT 1 FROM workers w WHERE w.id = t.locked_by))
      )
    ORDER BY t.locked_at
    -- Bounded, so a mass crash costs each pass a slice, not one long statement.
    LIMIT %(limit)s
    -- A row someone holds right now is being finalized; leave it to them.
    FOR UPDATE OF t SKIP LOCKED
),
gone AS (
    DELETE FROM workers w USING dead d WHERE w.id = d.id
)
UPDATE tasks t
SET status = CASE WHEN e.used_up THEN 'failed' ELSE 'pending' END,
    -- Waiting for a worker since it was claimed: first in its company's line, like a
    -- released task.
    run_after = CASE WHEN e.used_up THEN t.run_after ELSE t.locked_at END,
    finished_at = CASE WHEN e.used_up THEN now() END,
    updated_at = now(),
    last_error = CASE WHEN e.used_up
        THEN format('worker lost (lease expired) after %%s attempts (last holder %%s)',
                    t.attempts, coalesce(e.locked_by, 'unknown'))
        ELSE t.last_error END,
    lease_token = NULL,
    locked_by = NULL,
    locked_at = NULL
FROM lost e
WHERE t.id = e.id
RETURNING t.id, t.company_id, t.type, t.attempts, e.locked_by, e.used_up
"""


def take_back_leases(
    conn: psycopg.Connection[Any], *, stale_after: float, limit: int = 1000
) -> list[TakenBack]:
    """Take back up to `limit` leases of dead holders, delete their rows; return the tasks.

    Dead: a worker whose `heartbeat_at` is older than `stale_after` seconds; a holder without
    a row once its lease is that old. A task with attempts left becomes `pending` (attempts
    stay counted: crashes count); a poison pill, whose workers died on every attempt, becomes
    `failed` with `last_error` saying so. The lease token is cleared, so whatever the holder
    still writes changes nothing (fenced finalization), and a heartbeat it sends finds its
    row gone. The one place leases are taken back (decision 0010).
    """
    with driver_errors("take_back_leases"):
        params = {"stale_after": stale_after, "limit": limit}
        rows = conn.execute(_TAKE_BACK_LEASES, params).fetchall()
    return [TakenBack(*row) for row in rows]
