"""What an operator watches besides the counts (issue 28): why due work waits, and the signs
of the queue's death spiral under a long-held snapshot.

Due work waits for one of three reasons (`Hold`): workers are short (nothing of the tenant's
holds it: only this pages anyone), the tenant is paused, or the tenant is at its own
`max_in_flight`. The spiral (README "Monitoring"): while a snapshot stays open, VACUUM cannot
remove the dead row versions every claim and finalization leaves, each claim reads past more
of them and slows down, and the backlog grows; its predictors are the queue tables' dead row
versions (`table_tuples`), the claim's duration (the workers' `claim_duration_seconds`) and
the snapshot's age (`db.statistics.oldest_xmin_holder_age`).

Read-only, in the target style: functions take a `psycopg.Connection`, never commit; the
caller owns the transaction and its statement timeout. Costs: `waiting` one index probe per
company with due work, plus at most `max_in_flight` index entries per limited one: O(companies)
as the oldest-eligible gauge; `table_tuples` reads the statistics views only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import dict_row

from db.engine import driver_errors


class Hold(enum.StrEnum):
    """What keeps a company's due tasks from being claimed (the `reason` label's values).

    `NONE`: nothing of the company's: its due tasks wait for a worker. `PAUSED`: the company
    is paused (checked first: a paused company at its limit is `PAUSED`). `MAX_IN_FLIGHT`: it
    holds at least `max_in_flight` leases (`processing` tasks, expired ones included until
    they are taken back), counted as the claim counts them (db/sql/claim.sql).
    """

    NONE = "none"
    PAUSED = "paused"
    MAX_IN_FLIGHT = "max_in_flight"


HELD = (Hold.PAUSED, Hold.MAX_IN_FLIGHT)

# The queue's tables: every claim and finalization rewrites rows of these, so their dead row
# versions are what a held snapshot piles up.
QUEUE_TABLES = ("tasks", "company_queues", "company_backlogs")


@dataclass(frozen=True)
class Waiting:
    """Companies with due work of one `Hold`, as of the transaction's `now()`.

    `companies`: those with a pending task whose `run_after` has come; `backlog`: their
    unfinished tasks (pending, due or not, plus processing: `company_backlogs`, exact);
    `oldest_seconds`: how long the oldest of their due tasks has waited since its
    `run_after` (0.0 when there is none).
    """

    companies: int
    backlog: int
    oldest_seconds: float


@dataclass(frozen=True)
class TableTuples:
    """Row versions of one table, from the statistics collector (approximate, as of its last
    report): `live` and `dead` (deleted or updated, not yet removed by VACUUM)."""

    table: str
    live: int
    dead: int


# One row per company whose due_at has come (a lower bound of its earliest pending
# run_after, so no company with due work is missed): its oldest due task (the first entry of
# its runnable range of ix_tasks_pending_company_run_after; none when due_at was stale), its
# backlog, and, only for a limited company that is not paused (CASE evaluates the subquery
# for no other), its leases up to its limit, index-only over
# ix_tasks_processing_company_locked_at, as the claim counts them. Paused and max_in_flight
# are company_queues' copies of the companies' (kept by triggers, read by the claim too).
_WAITING = """
/* queue_health.waiting */
SELECT w.hold, count(*) AS companies, coalesce(sum(w.backlog), 0) AS backlog,
       coalesce(CAST(extract(epoch FROM now() - min(w.run_after)) AS float8), 0) AS oldest
FROM (SELECT CASE WHEN q.paused THEN 'paused'
                  WHEN q.max_in_flight IS NOT NULL
                       AND (SELECT count(*)
                            FROM (SELECT FROM tasks t
                                  WHERE t.company_id = q.company_id
                                    AND t.status = 'processing'
                                  LIMIT q.max_in_flight) AS leases) >= q.max_in_flight
                      THEN 'max_in_flight'
                  ELSE 'none' END AS hold,
             o.run_after,
             b.unfinished AS backlog
      FROM company_queues q
      JOIN company_backlogs b ON b.company_id = q.company_id
      CROSS JOIN LATERAL (SELECT t.run_after FROM tasks t
                          WHERE t.company_id = q.company_id AND fairq_runnable(t, now())
                          ORDER BY t.run_after LIMIT 1) AS o
      WHERE q.due_at <= now()) AS w
GROUP BY w.hold
"""

_TABLE_TUPLES = """
/* queue_health.table_tuples */
SELECT s.relname AS table, s.n_live_tup AS live, s.n_dead_tup AS dead
FROM pg_stat_user_tables s
WHERE s.relid = ANY (ARRAY(SELECT to_regclass(name) FROM unnest(%(tables)s::text[]) AS name))
ORDER BY s.relname
"""


def waiting(connection: psycopg.Connection[Any]) -> dict[Hold, Waiting]:
    """Companies with due work, by what holds them (`Hold`), every `Hold` present."""
    result = {hold: Waiting(companies=0, backlog=0, oldest_seconds=0.0) for hold in Hold}
    with driver_errors("queue_health.waiting"), connection.cursor(row_factory=dict_row) as cursor:
        for row in cursor.execute(_WAITING):
            result[Hold(row["hold"])] = Waiting(
                companies=int(row["companies"]),
                backlog=int(row["backlog"]),
                oldest_seconds=float(row["oldest"]),
            )
    return result


def table_tuples(
    connection: psycopg.Connection[Any], tables: tuple[str, ...] = QUEUE_TABLES
) -> list[TableTuples]:
    """Live and dead row versions of each of `tables` that exists (in this search_path)."""
    with (
        driver_errors("queue_health.table_tuples"),
        connection.cursor(row_factory=dict_row) as cursor,
    ):
        rows = cursor.execute(_TABLE_TUPLES, {"tables": list(tables)}).fetchall()
    return [
        TableTuples(table=str(row["table"]), live=int(row["live"]), dead=int(row["dead"]))
        for row in rows
    ]
