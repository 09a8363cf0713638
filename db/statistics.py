"""Queue statistics for the API's gauges (design §7): tasks by status, oldest eligible task,
and the age of the oldest transaction holding back cleanup.

All cost about the same at 10M rows as at 10k, so they do not vanish behind the statement
timeout as the table grows: the oldest eligible task is one index probe per company; counts
are exact up to a limit per status and the planner's estimate above it; the cleanup holder
reads only the server's activity views. Read-only; callers own the connection and its
transaction, as in `db.queue`.
"""

from __future__ import annotations

from typing import Any

import psycopg

from db.engine import driver_errors
from db.models import TERMINAL_STATUSES, TaskStatus

# Exact counts stop at these many rows per status; above, the planner's estimate is reported.
# A count reads every row it counts (an index-only scan of a partial index for pending and
# processing, ~0.1 to 0.4 us per row here; heap fetches through ix_tasks_terminal_finished_at for
# finished tasks, ~7 us per row cold), so an uncapped count grows with the backlog and the
# history and, at ~10M rows, outlasts the statement timeout and takes every queue gauge with it.
LIVE_EXACT_LIMIT = 100_000  # pending, processing: each counted on its own
TERMINAL_EXACT_LIMIT = 10_000  # completed, failed, cancelled: counted together

# Capped exact counts: LIMIT stops each scan after limit + 1 rows, so a result above the
# limit means "more than the limit", at a bounded cost. `SELECT FROM` reads no columns, so
# pending and processing are counted index-only from their partial indexes (or a short seq
# scan when the status is most of the table: the planner stops it at the LIMIT too).
_CAPPED_COUNTS = """
SELECT 'pending' AS status,
       (SELECT count(*) FROM (SELECT FROM tasks WHERE status = 'pending'
                              LIMIT %(live_limit)s + 1) AS p) AS n
UNION ALL
SELECT 'processing',
       (SELECT count(*) FROM (SELECT FROM tasks WHERE status = 'processing'
                              LIMIT %(live_limit)s + 1) AS p)
UNION ALL
-- Finished tasks together (ix_tasks_terminal_finished_at covers exactly them), one row per
-- status present among the first terminal_limit + 1 found.
SELECT status, count(*)
FROM (SELECT status FROM tasks WHERE status IN ('completed', 'failed', 'cancelled')
      LIMIT %(terminal_limit)s + 1) AS f
GROUP BY status
"""

# What the planner would assume (estimate_rel_size): rows per page at the last ANALYZE times
# the pages the table has now, so growth since then counts; times each status's frequency
# among the most common values of that ANALYZE. No rows while the table was never analyzed
# (reltuples < 0). Reads only catalogs and the relation's size: constant cost.
_ESTIMATES = """
SELECT v.status,
       CASE WHEN c.relpages > 0
            THEN c.reltuples / c.relpages
                 * (pg_relation_size(c.oid) / current_setting('block_size')::float8)
            ELSE c.reltuples END * v.freq AS estimate
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
JOIN pg_stats s
  ON s.schemaname = n.nspname AND s.tablename = c.relname AND s.attname = 'status'
 AND NOT s.inherited
CROSS JOIN LATERAL unnest(CAST(CAST(s.most_common_vals AS text) AS text[]),
                          s.most_common_freqs) AS v(status, freq)
WHERE c.oid = CAST('tasks' AS regclass) AND c.reltuples >= 0
"""

# Only runnable work counts as waiting: delayed and backed-off tasks do not. One probe per
# company into ix_tasks_pending_company_run_after (company_id, run_after, id): its first entry
# at or before now() is the company's oldest runnable task, so the cost is O(companies), not
# O(pending), and rows due tomorrow are never read.
_OLDEST_ELIGIBLE = """
SELECT coalesce(extract(epoch FROM now() - min(o.run_after)), 0)
FROM companies c
CROSS JOIN LATERAL (
    SELECT t.run_after
    FROM tasks t
    WHERE t.company_id = c.id AND fairq_runnable(t, now())
    ORDER BY t.run_after
    LIMIT 1
) AS o
"""


# The transaction pinning this database's cleanup horizon: the one whose snapshot (xmin) or
# own transaction id (xid: it has written) is oldest, so VACUUM may not remove any row version
# deleted or updated after it began. While it stays open the queue's dead rows pile up in the
# heap and indexes and every claim reads past them (README "Monitoring"). Candidates: sessions
# on this database (idle in transaction included; pg_stat_activity) other than this one, and
# prepared transactions (pg_prepared_xacts, which keep their xid until COMMIT/ROLLBACK
# PREPARED). Autovacuum workers are left out: a VACUUM's snapshot does not hold back other
# VACUUMs. Replication slots' xmin has no timestamp to give an age from: not covered.
#
# The age is that transaction's: now - xact_start (for a prepared one, now - its PREPARE).
# Not the age of the session's oldest open transaction: a READ COMMITTED session open for an
# hour that just started a statement holds only a seconds-old snapshot. Ties in xmin (every
# snapshot taken while an old writer is open has the writer's xid as xmin) go to the earliest
# start, the writer. An upper bound for a READ COMMITTED holder, whose snapshot is as old as
# its current statement, not its transaction. xact_start of another role's session is visible
# only to superusers and members of pg_read_all_stats: without that, such a session cannot
# be aged and is skipped. Cost: one pass over the server's backend slots (max_connections).
_OLDEST_XMIN_HOLDER = """
SELECT coalesce(
    (SELECT greatest(extract(epoch FROM clock_timestamp() - h.since), 0)
     FROM (SELECT greatest(age(a.backend_xid), age(a.backend_xmin)) AS xids,
                  a.xact_start AS since
           FROM pg_stat_activity AS a
           WHERE a.datname = current_database()
             AND a.pid <> pg_backend_pid()
             AND a.backend_type <> 'autovacuum worker'
             AND (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL)
             AND a.xact_start IS NOT NULL
           UNION ALL
           SELECT age(p.transaction), p.prepared
           FROM pg_prepared_xacts AS p
           WHERE p.database = current_database()) AS h
     ORDER BY h.xids DESC, h.since
     LIMIT 1),
    0)
"""


def limit_statement_time(connection: psycopg.Connection[Any], timeout_ms: int) -> None:
    """Make the server cancel any later statement of this transaction after `timeout_ms`."""
    # `SET` takes no bind parameters (docs/stack-notes.md); set_config(..., true) is SET LOCAL.
    with driver_errors("limit_statement_time"):
        connection.execute(
            "SELECT set_config('statement_timeout', %(ms)s, true)", {"ms": str(int(timeout_ms))}
        )


def tasks_by_status(
    connection: psycopg.Connection[Any],
    *,
    live_limit: int = LIVE_EXACT_LIMIT,
    terminal_limit: int = TERMINAL_EXACT_LIMIT,
) -> dict[TaskStatus, float]:
    """How many tasks are in each status, every status present.

    Exact while pending and processing each have at most `live_limit` tasks and the finished
    statuses together at most `terminal_limit`; past its limit, a status reports the
    planner's estimate, never less than the limit plus one (the estimate can be stale, or
    missing on a table never analyzed).
    """
    params = {"live_limit": live_limit, "terminal_limit": terminal_limit}
    with driver_errors("tasks_by_status"):
        counts: dict[str, int] = dict(connection.execute(_CAPPED_COUNTS, params).fetchall())
    over = _over_limit(counts, live_limit, terminal_limit)
    estimates = status_estimates(connection) if over else {}
    result: dict[TaskStatus, float] = {}
    for status in TaskStatus:
        value = float(counts.get(status.value, 0))
        if status.value in over:
            # More than the limit for sure: the capped count says so.
            value = max(value, float(round(estimates.get(status, 0.0))))
        result[status] = value
    return result


def status_estimates(connection: psycopg.Connection[Any]) -> dict[TaskStatus, float]:
    """The planner's estimate of the tasks in each status (see `_ESTIMATES`), at constant cost.

    Statuses absent from the last ANALYZE's most common values are missing; so is every
    status while the table was never analyzed. Also used by `db.tenant_stats`.
    """
    with driver_errors("status_estimates"):
        rows = connection.execute(_ESTIMATES).fetchall()
    known = {status.value for status in TaskStatus}
    return {TaskStatus(name): float(value) for name, value in rows if name in known}


def _over_limit(counts: dict[str, int], live_limit: int, terminal_limit: int) -> set[str]:
    """The statuses whose capped count stopped at its limit: those get estimates."""
    live = (TaskStatus.PENDING.value, TaskStatus.PROCESSING.value)
    over = {status for status in live if counts.get(status, 0) > live_limit}
    terminal = {status.value for status in TERMINAL_STATUSES}
    if sum(counts.get(status, 0) for status in terminal) > terminal_limit:
        over |= terminal
    return over


def oldest_eligible_pending_age(connection: psycopg.Connection[Any]) -> float:
    """Seconds since the oldest pending task that may run now became runnable; 0 if none."""
    return _scalar(connection, _OLDEST_ELIGIBLE, "oldest_eligible_pending_age")


def oldest_xmin_holder_age(connection: psycopg.Connection[Any]) -> float:
    """Seconds the transaction holding back cleanup on this database has been open; 0 if none.

    See `_OLDEST_XMIN_HOLDER` for which transaction that is; this connection's own is never it.
    """
    return _scalar(connection, _OLDEST_XMIN_HOLDER, "oldest_xmin_holder_age")


def _scalar(connection: psycopg.Connection[Any], statement: str, what: str) -> float:
    with driver_errors(what):
        row = connection.execute(statement).fetchone()
    assert row is not None  # an aggregate without GROUP BY returns one row
    return float(row[0])
