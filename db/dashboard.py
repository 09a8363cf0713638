"""The operator's dashboard's own statements: the companies listing, the finished-per-minute
series, the workers holding leases, and one task as an operator sees it (issue 14).

Bounded in cost like the queue gauges (`db.statistics`): no statement reads a number of rows
that grows with the backlog or the history. What each reads:

- per company, what one index probe or a row gives: the backlog is
  `company_backlogs.unfinished` (exact, kept by triggers), the oldest runnable wait the first
  entry of `ix_tasks_pending_company_run_after` at or before now (skipped for a company with
  no backlog), the tasks in flight an index-only count over
  `ix_tasks_processing_company_locked_at` (every lease held: as many as the fleet holds);
- what finished recently: the newest `RECENT_FINISHED_LIMIT` entries of
  `ix_tasks_terminal_finished_at` within the window, never more (a heap fetch each). Past
  that many finished tasks the window is shortened to the minutes read in full, and its
  `Window` says so; a rollup per minute kept at finalization would be exact at any rate;
- the companies listing sorts every company (their rows, plus one probe each when sorted by
  oldest wait) and reads the rest for its page only: O(companies), as the oldest-eligible
  gauge is;
- a company's latest failures: its newest `FAILURE_SCAN_LIMIT` tasks at most.

Read-only; callers own the connection and its transaction and set the statement timeout
(`db.tenant_stats.time_limit`), as for `db.statistics` and `db.tenant_stats`.
"""

from __future__ import annotations

import datetime as dt
import enum
import uuid
from dataclasses import dataclass
from typing import Any, NamedTuple

import psycopg

from db import connector, errors
from db.engine import driver_errors
from db.queue import TaskRecord

# The newest finished tasks read for "in the last hour" figures: 0.1 to 0.2 s of index scan
# with heap fetches at 1M tasks (tests/test_dashboard.py, bounded cost). A busier hour is
# covered by its latest minutes only.
RECENT_FINISHED_LIMIT = 100_000
# The window of "in the last hour" figures, in minutes.
RECENT_MINUTES = 60
# Lease holders listed at most (ordered by the oldest heartbeat first): a fleet larger than
# this is summarized by its counts.
LEASE_HOLDERS_LIMIT = 200
# A page of the companies listing at most.
MAX_PAGE_SIZE = 200


class CompanySort(enum.StrEnum):
    """What the companies listing is ordered by (ties: company id)."""

    NAME = "name"
    BACKLOG = "backlog"
    OLDEST_WAIT = "oldest_wait"
    IN_FLIGHT = "in_flight"
    FAILED = "failed"
    WEIGHT = "weight"
    MAX_IN_FLIGHT = "max_in_flight"
    MAX_PENDING = "max_pending"
    PAUSED = "paused"
    CREATED = "created"


# Sort key -> (its expression in the ranking over every company, its column in the page).
# Whitelisted: never client text. Oldest wait is handled apart (`_listing_statement`). A NULL
# limit is unlimited, the largest: PostgreSQL's default NULL order (last ascending, first
# descending) is that, so the limits need no NULLS clause.
_SORT_SQL: dict[CompanySort, tuple[str, str]] = {
    CompanySort.NAME: ("c.name", "l.name"),
    CompanySort.BACKLOG: ("b.unfinished", "l.backlog"),
    CompanySort.IN_FLIGHT: ("coalesce(p.in_flight, 0)", "l.in_flight"),
    CompanySort.FAILED: ("coalesce(f.failed, 0)", "l.failed"),
    CompanySort.WEIGHT: ("c.weight", "l.weight"),
    CompanySort.MAX_IN_FLIGHT: ("c.max_in_flight", "l.max_in_flight"),
    CompanySort.MAX_PENDING: ("c.max_pending", "l.max_pending"),
    CompanySort.PAUSED: ("c.paused", "l.paused"),
    CompanySort.CREATED: ("c.created_at", "l.created_at"),
}


@dataclass(frozen=True)
class Window:
    """The stretch of time "recent" figures cover: `since` to the database's `now`.

    `complete` is False when more than `RECENT_FINISHED_LIMIT` tasks finished in the
    intended window: then `since` is later than `now - RECENT_MINUTES`, at the start of the
    oldest minute read in full.
    """

    since: dt.datetime
    now: dt.datetime
    complete: bool

    @property
    def minutes(self) -> int:
        """How many minutes the window covers, rounded up."""
        return max(1, -int(-(self.now - self.since).total_seconds() // 60))


class CompanyRow(NamedTuple):
    """One row of the companies listing.

    `backlog`: unfinished (pending or processing) tasks, exact; `oldest_wait_seconds`: since
    the oldest runnable pending task became runnable (None: nothing runnable); `in_flight`:
    `processing` tasks; `failed`: tasks that failed for good within the listing's `Window`.
    """

    id: uuid.UUID
    name: str
    created_at: dt.datetime
    weight: int
    max_in_flight: int | None
    max_pending: int | None
    paused: bool
    backlog: int
    in_flight: int
    failed: int
    oldest_wait_seconds: float | None


@dataclass(frozen=True)
class CompanyPage:
    """One page of the companies listing, and how many companies match in all."""

    rows: list[CompanyRow]
    total: int
    window: Window


# The newest finished tasks within the window, at most :recent_limit (+1, to tell "more");
# ix_tasks_terminal_finished_at read backwards from now. Used by the listing and the series.
_RECENT = """
recent AS MATERIALIZED (
    SELECT r.company_id, r.status, r.finished_at
    FROM tasks r
    WHERE r.status IN ('completed', 'failed', 'cancelled')
      AND r.finished_at >= date_trunc('minute', now())
                           - make_interval(mins => CAST(%(minutes)s AS int) - 1)
    ORDER BY r.finished_at DESC
    LIMIT CAST(%(recent_limit)s AS int) + 1
),
coverage AS MATERIALIZED (
    -- Read in full from the minute after the oldest one read, when the limit cut it.
    SELECT count(*) > %(recent_limit)s AS cut,
           date_trunc('minute', min(finished_at)) + interval '1 minute' AS cut_since
    FROM recent
)"""

# The braces are filled by `_listing_statement` from fixed text (`_SORT_SQL`, `_OLDEST_PROBE`),
# never from a client's. The probe for the oldest runnable task runs for every company only
# when the listing sorts by it (in `listed`); else for the page's rows only (after it).
_LIST_COMPANIES = """
WITH {recent},
failures AS (
    SELECT f.company_id, count(*) AS failed
    FROM recent f, coverage v
    WHERE f.status = 'failed' AND (NOT v.cut OR f.finished_at >= v.cut_since)
    GROUP BY f.company_id
),
flight AS (
    -- Index-only over ix_tasks_processing_company_locked_at: every lease held, no more.
    SELECT p.company_id, count(*) AS in_flight
    FROM tasks p
    WHERE p.status = 'processing'
    GROUP BY p.company_id
),
listed AS (
    SELECT c.id, c.name, c.created_at, c.weight, c.max_in_flight, c.max_pending, c.paused,
           b.unfinished AS backlog,
           coalesce(p.in_flight, 0) AS in_flight,
           coalesce(f.failed, 0) AS failed
           {oldest_column}
    FROM companies c
    JOIN company_backlogs b ON b.company_id = c.id
    LEFT JOIN flight p ON p.company_id = c.id
    LEFT JOIN failures f ON f.company_id = c.id
    {oldest_join}
    WHERE CAST(%(search)s AS text) IS NULL
       OR c.name ILIKE '%%' || CAST(%(search)s AS text) || '%%' ESCAPE '\\'
       OR CAST(c.id AS text) = lower(CAST(%(search)s AS text))
    ORDER BY {order}, c.id
    LIMIT %(limit)s OFFSET %(offset)s
)
SELECT l.id, l.name, l.created_at, l.weight, l.max_in_flight, l.max_pending, l.paused,
       l.backlog, l.in_flight, l.failed,
       extract(epoch FROM now() - o.run_after) AS oldest_wait_seconds,
       (SELECT v.cut FROM coverage v) AS cut,
       (SELECT v.cut_since FROM coverage v) AS cut_since,
       now() AS now
FROM listed l
{page_oldest_join}
ORDER BY {outer_order}, l.id
""".replace("{recent}", _RECENT)

# The company's oldest runnable task: one probe of ix_tasks_pending_company_run_after,
# skipped for a company with no unfinished task.
_OLDEST_PROBE = """
LEFT JOIN LATERAL (
    SELECT t.run_after
    FROM tasks t
    WHERE t.company_id = {company}.id AND fairq_runnable(t, now())
    ORDER BY t.run_after
    LIMIT 1
) o ON {backlog} > 0"""

_COUNT_COMPANIES = """
SELECT count(*)
FROM companies c
WHERE CAST(%(search)s AS text) IS NULL
   OR c.name ILIKE '%%' || CAST(%(search)s AS text) || '%%' ESCAPE '\\'
   OR CAST(c.id AS text) = lower(CAST(%(search)s AS text))
"""


def _like_escaped(text: str) -> str:
    """`text` matched literally by ILIKE (ESCAPE '\\'): its wildcards escaped."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def _listing_statement(sort: CompanySort, descending: bool) -> str:
    if sort is CompanySort.OLDEST_WAIT:
        # The longest wait is the earliest run_after: a descending wait is ascending time.
        # Companies with nothing runnable (NULL) come last either way.
        order = f"o.run_after {'ASC' if descending else 'DESC'} NULLS LAST"
        return _LIST_COMPANIES.format(
            oldest_column=", o.run_after AS oldest_runnable",
            oldest_join=_OLDEST_PROBE.format(company="c", backlog="b.unfinished"),
            order=order,
            page_oldest_join="CROSS JOIN LATERAL (SELECT l.oldest_runnable AS run_after) o",
            outer_order=order,
        )
    ranked, column = _SORT_SQL[sort]
    direction = "DESC" if descending else "ASC"
    return _LIST_COMPANIES.format(
        oldest_column="",
        oldest_join="",
        order=f"{ranked} {direction}",
        page_oldest_join=_OLDEST_PROBE.format(company="l", backlog="l.backlog"),
        outer_order=f"{column} {direction}",
    )


def list_companies(
    connection: psycopg.Connection[Any],
    *,
    sort: CompanySort = CompanySort.OLDEST_WAIT,
    descending: bool = True,
    search: str | None = None,
    limit: int = 50,
    offset: int = 0,
    recent_limit: int = RECENT_FINISHED_LIMIT,
) -> CompanyPage:
    """One page of companies with their backlog, oldest wait, in flight and recent failures.

    `search`: a part of the name (case-insensitive, taken literally) or a whole company id.
    Sorted by `sort` (descending: largest first; for `OLDEST_WAIT`, the longest wait first),
    then by id; companies with nothing runnable come last when sorting by wait. Two
    statements: the page and the count of matching companies.
    """
    if not 1 <= limit <= MAX_PAGE_SIZE:
        raise ValueError(f"limit must be 1..{MAX_PAGE_SIZE}")
    params: dict[str, Any] = {
        "search": _like_escaped(search.strip()) if search and search.strip() else None,
        "limit": limit,
        "offset": offset,
        "minutes": RECENT_MINUTES,
        "recent_limit": recent_limit,
    }
    rows_of = connection.cursor(row_factory=connector.NAMED_ROWS)
    with driver_errors("list_companies"):
        result = rows_of.execute(_listing_statement(sort, descending), params).fetchall()
        counted = connection.execute(_COUNT_COMPANIES, {"search": params["search"]}).fetchone()
    assert counted is not None  # count(*) returns one row
    total = counted[0]
    rows = [CompanyRow._make((*row[:10], _seconds(row[10]))) for row in result]
    if result:
        window = _window(result[0].now, cut=result[0].cut, cut_since=result[0].cut_since)
    else:
        window = _window(now(connection), cut=False, cut_since=None)
    return CompanyPage(rows=rows, total=int(total), window=window)


def _seconds(value: Any) -> float | None:
    return None if value is None else max(0.0, float(value))


def now(connection: psycopg.Connection[Any]) -> dt.datetime:
    """The database's clock: `now()` (the transaction's start)."""
    with driver_errors("now"):
        row = connection.execute("SELECT now()").fetchone()
    assert row is not None
    now: dt.datetime = row[0]
    return now


def _window(now: dt.datetime, *, cut: bool, cut_since: dt.datetime | None) -> Window:
    start = now.replace(second=0, microsecond=0) - dt.timedelta(minutes=RECENT_MINUTES - 1)
    if cut and cut_since is not None:
        return Window(since=max(start, cut_since), now=now, complete=False)
    return Window(since=start, now=now, complete=True)


class MinuteCounts(NamedTuple):
    """Tasks finished in one minute (`minute`, its start), by outcome."""

    minute: dt.datetime
    completed: int
    failed: int


@dataclass(frozen=True)
class FinishedSeries:
    """Completed and failed tasks per minute, oldest minute first: one entry per whole
    minute of `window` (zeros included), which ends where the current minute starts."""

    minutes: list[MinuteCounts]
    window: Window


# One statement, one snapshot: the coverage row, with each minute that had a finish.
_FINISHED_PER_MINUTE = """
WITH {recent}
SELECT v.cut, v.cut_since, now() AS now, m.minute, m.completed, m.failed
FROM coverage v
LEFT JOIN LATERAL (
    SELECT date_trunc('minute', r.finished_at) AS minute,
           count(*) FILTER (WHERE r.status = 'completed') AS completed,
           count(*) FILTER (WHERE r.status = 'failed') AS failed
    FROM recent r
    WHERE NOT v.cut OR r.finished_at >= v.cut_since
    GROUP BY 1
) m ON true
""".replace("{recent}", _RECENT)


def finished_per_minute(
    connection: psycopg.Connection[Any], *, recent_limit: int = RECENT_FINISHED_LIMIT
) -> FinishedSeries:
    """Completed and failed tasks per minute, over the `RECENT_MINUTES` whole minutes before
    the current one (a minute still counting would show as a drop).

    Reads at most `recent_limit` finished tasks (module docstring): past that, the series
    covers the latest minutes read in full and its `window` is not `complete`.
    """
    params = {"minutes": RECENT_MINUTES + 1, "recent_limit": recent_limit}
    with driver_errors("finished_per_minute"):
        rows = (
            connection.cursor(row_factory=connector.NAMED_ROWS)
            .execute(_FINISHED_PER_MINUTE, params)
            .fetchall()
        )
    cut, cut_since, now = rows[0].cut, rows[0].cut_since, rows[0].now
    counted = {
        row.minute: (int(row.completed), int(row.failed)) for row in rows if row.minute is not None
    }
    current = now.replace(second=0, microsecond=0)
    since = current - dt.timedelta(minutes=RECENT_MINUTES)
    if cut:
        since = min(max(since, cut_since), current)
    minutes = []
    minute = since
    while minute < current:
        completed, failed = counted.get(minute, (0, 0))
        minutes.append(MinuteCounts(minute, completed, failed))
        minute += dt.timedelta(minutes=1)
    window = Window(since=since, now=current, complete=not cut)
    return FinishedSeries(minutes=minutes, window=window)


class LeaseHolder(NamedTuple):
    """A worker holding leases now: its `locked_by` (`host:pid` for a child), how many
    tasks it holds, and the age in seconds of its oldest heartbeat (`locked_at`)."""

    locked_by: str
    tasks: int
    oldest_heartbeat_seconds: float


@dataclass(frozen=True)
class LeaseHolders:
    """The holders with the oldest heartbeats first, at most `LEASE_HOLDERS_LIMIT`, and the
    totals over all of them (`holders` workers hold `tasks` leases)."""

    listed: list[LeaseHolder]
    holders: int
    tasks: int


# Every processing row: as many as the fleet holds (children x batch size), whatever the
# backlog; ix_tasks_processing_locked_at gives them. A row claimed before `locked_by` was
# recorded cannot exist (the claim sets both), but NULL is grouped as its own holder.
_LEASE_HOLDERS = """
SELECT coalesce(t.locked_by, '(unknown)') AS locked_by, count(*) AS tasks,
       greatest(extract(epoch FROM now() - min(t.locked_at)), 0) AS oldest,
       count(*) OVER () AS holders, sum(count(*)) OVER () AS leases
FROM tasks t
WHERE t.status = 'processing'
GROUP BY t.locked_by
ORDER BY min(t.locked_at), 1
LIMIT %(limit)s
"""


def lease_holders(
    connection: psycopg.Connection[Any], *, limit: int = LEASE_HOLDERS_LIMIT
) -> LeaseHolders:
    """The workers holding leases now, the oldest heartbeat first (a stuck one on top)."""
    with driver_errors("lease_holders"):
        rows = (
            connection.cursor(row_factory=connector.NAMED_ROWS)
            .execute(_LEASE_HOLDERS, {"limit": limit})
            .fetchall()
        )
    listed = [LeaseHolder(row.locked_by, int(row.tasks), float(row.oldest)) for row in rows]
    if not rows:
        return LeaseHolders(listed=[], holders=0, tasks=0)
    return LeaseHolders(listed=listed, holders=int(rows[0].holders), tasks=int(rows[0].leases))


class TaskDetail(NamedTuple):
    """A task as the operator sees it: what the API shows (`record`), and who holds its
    lease now (`locked_by`) since its last heartbeat (`locked_at`), if anyone."""

    record: TaskRecord
    locked_by: str | None
    locked_at: dt.datetime | None


_TASK_DETAIL = """
SELECT {columns}, locked_by, locked_at
FROM tasks
WHERE id = %(id)s AND company_id = %(company_id)s
""".replace("{columns}", ", ".join(TaskRecord._fields))


def task_detail(
    connection: psycopg.Connection[Any], company_id: uuid.UUID, task_id: uuid.UUID
) -> TaskDetail:
    """The company's task with its lease. Raises `errors.NotFound`."""
    with driver_errors("task_detail"):
        row = connection.execute(_TASK_DETAIL, {"id": task_id, "company_id": company_id}).fetchone()
    if row is None:
        raise errors.NotFound("task not found")
    fields = len(TaskRecord._fields)
    return TaskDetail(TaskRecord._make(row[:fields]), row[fields], row[fields + 1])


# A company's newest tasks read at most, looking for its latest failures.
FAILURE_SCAN_LIMIT = 10_000

# The company's newest tasks through its listing index (company_id, created_at DESC, id DESC)
# WHERE status <> 'processing', at most :scan of them (a heap fetch each), and of those the
# failed ones, newest first.
_RECENT_FAILURES = """
SELECT {columns}
FROM (SELECT {columns}
      FROM tasks t
      WHERE t.company_id = %(company_id)s AND t.status <> 'processing'
      ORDER BY t.created_at DESC, t.id DESC
      LIMIT %(scan)s) AS t
WHERE t.status = 'failed'
ORDER BY t.created_at DESC, t.id DESC
LIMIT %(limit)s
""".replace("{columns}", ", ".join(f"t.{name}" for name in TaskRecord._fields))


def recent_failures(
    connection: psycopg.Connection[Any],
    company_id: uuid.UUID,
    *,
    limit: int = 10,
    scan: int = FAILURE_SCAN_LIMIT,
) -> list[TaskRecord]:
    """The company's failed tasks among its newest `scan` tasks, newest first, at most `limit`.

    Bounded: a company whose last `scan` tasks all succeeded shows none here, however many
    older failures it has (`queue.list_tasks` with `status='failed'` finds them all, at the
    cost of reading its history).
    """
    params = {"company_id": company_id, "scan": scan, "limit": limit}
    with driver_errors("recent_failures"):
        rows = connection.execute(_RECENT_FAILURES, params).fetchall()
    return [TaskRecord._make(row) for row in rows]
