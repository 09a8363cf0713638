"""Housekeeping statements of the worker: retention of finished tasks (design §4 Retention).

Functions take a psycopg connection and never commit, as in `db.queue`.
"""

from __future__ import annotations

from typing import Any

import psycopg

from db.engine import driver_errors

# Key of the transaction-scoped advisory lock that admits one retention runner at a time
# across every host ("fairqrt" in ASCII).
RETENTION_LOCK_KEY = 0x66_61_69_72_71_72_74

# Rows per DELETE: small statements hold row locks briefly and keep WAL bursts short.
RETENTION_BATCH_SIZE = 1000

_TRY_LOCK = "SELECT pg_try_advisory_xact_lock(%(key)s)"

_DELETE_EXPIRED = """
WITH doomed AS (
    -- A CTE runs once. As an `IN (subquery)` it may run per row, and with FOR UPDATE it
    -- then skips the rows this very DELETE removed and reaches past LIMIT.
    SELECT id
    FROM tasks
    -- Repeats the predicate of ix_tasks_terminal_finished_at, so the planner may use it: an
    -- ordered range scan over terminal rows only, oldest first, stopping after the limit.
    WHERE status IN ('completed', 'failed', 'cancelled')
      AND finished_at < now() - make_interval(secs => CAST(%(retention)s AS float8))
    ORDER BY finished_at
    LIMIT %(limit)s
    -- A row someone is changing (a retry through the API) is not ours to judge now.
    FOR UPDATE SKIP LOCKED
)
DELETE FROM tasks t
USING doomed
WHERE t.id = doomed.id
  -- Again on the row being deleted: a task retried (back to pending) after our snapshot
  -- must survive; the CTE's predicate was checked against the old row version only.
  AND t.status IN ('completed', 'failed', 'cancelled')
  AND t.finished_at < now() - make_interval(secs => CAST(%(retention)s AS float8))
"""


def delete_expired_tasks(
    conn: psycopg.Connection[Any], *, retention_seconds: float, limit: int = RETENTION_BATCH_SIZE
) -> int | None:
    """Delete up to `limit` terminal tasks finished more than `retention_seconds` ago.

    Returns how many were deleted, or None when another session holds the retention lock
    (a runner elsewhere is at it; try again later). The lock is transaction-scoped: it is
    released by the caller's commit, so call this once per transaction and loop while it
    returns `limit`.
    """
    with driver_errors("delete_expired_tasks"):
        locked = conn.execute(_TRY_LOCK, {"key": RETENTION_LOCK_KEY}).fetchone()
        if locked is None or not locked[0]:
            return None
        params = {"retention": retention_seconds, "limit": limit}
        return conn.execute(_DELETE_EXPIRED, params).rowcount
