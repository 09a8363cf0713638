"""Task statistics of one company and of the whole queue (issue 13): what `GET
/companies/{companyId}/stats`, `GET /stats` and the dashboard show.

Bounded in cost like the queue gauges (`db.statistics`), whose limits, status estimates and
statement timeout these reuse: every figure is exact up to a limit and an estimate past it,
and the record names the estimated figures (`Figures.estimated`), so a client can tell. A
separate module rather than more of `db.statistics`: that one serves Prometheus (floats, no
flags, queue-wide only); this one returns typed records per company and for the queue.

Estimates come from a sample of `tasks` of constant size (`SAMPLE_PAGES` random pages, see
`tenant_stats_sql.SAMPLE`), applied where it can be to an exact count: the runnable share of
the sampled pending tasks times the exact pending count, and so on. On a table of at most that
many pages the sample is the whole table, so small queues get exact "estimates".

What each figure reads, and when it is exact (`Limits`: `live` index entries, `finished`
rows):

- `tasks.pending`, `tasks.processing`, `in_flight`: `company_backlogs.unfinished` (pending +
  processing, kept exact by the triggers of migration 0006), summed over companies for the
  queue, and a capped count of the `processing` index; pending is the difference. Exact while
  processing has at most `live` tasks, far more leases than workers hold (past it: the
  sample's processing share of the unfinished).
- `runnable` (pending with `run_after <= now()`): capped counts of the runnable and of the
  delayed range of `ix_tasks_pending_company_run_after`, company by company; exact while either
  has at most `live` tasks (runnable = pending - delayed), else the sample's runnable share
  of the pending, kept within what the capped counts prove.
- `oldest_runnable_wait_seconds`: now - the earliest `run_after` among due pending tasks, one
  index probe per company; always exact. None when nothing is runnable (not 0, which would
  also be the wait of a task that came due just now; the Prometheus gauge, which cannot be
  null, reports 0). Paused companies count: their tasks wait, and `paused` says why.
- `tasks.completed`, `.failed`, `.cancelled`: a company's newest `finished` tasks through the
  listing index (`ix_tasks_company_listing_unleased`), exact when that is all of them; the queue's
  finished tasks through `ix_tasks_terminal_finished_at`, exact while at most `finished`.
  Past that, never below what was counted: a company's, the sample's rows of the company in
  that status over the fraction sampled; the queue's, the planner's (table size now times the
  status's share at the last ANALYZE, `db.statistics.status_estimates`).
- `completed_last_5m`, ...: tasks completed or failed for good within the window, as they
  stand now (a failed task retried since is pending again). The queue's newest `finished`
  finished tasks through `ix_tasks_terminal_finished_at`: exact for a window they reach past
  (at most that many finished in it), else extrapolated from the rate over the time they
  cover. A company's: exact when its whole history was counted (above) or the queue's window
  was; else the larger of the two partial counts (its history counted is a lower bound; the
  rate is an estimate).
- The rankings (`top_by_backlog`, `top_by_oldest_wait`): exact, from `company_backlogs` (one
  row per company) and `company_queues` (companies whose `due_at`, a lower bound of their
  earliest pending `run_after`, has come: one probe each). These cost O(companies), as the
  gauge of the oldest eligible task does, and nothing per task.

The statements themselves, with what each one's plan costs, are `db.tenant_stats_sql`.

Read-only. Callers own the connection and its transaction and set the statement timeout
(`time_limit`), as for `db.statistics`. Every figure is as of the transaction's `now()`.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from sqlalchemy.exc import OperationalError

from db import connector, errors, statistics, tenant_stats_sql
from db.engine import driver_errors
from db.models import TaskStatus

# How many companies each ranking of `queue_stats` lists.
TOP_COMPANIES = 20

# The windows of the recently finished counts, in seconds (the fields of `RECENT_FIELDS`).
SHORT_WINDOW_SECONDS = 5 * 60
LONG_WINDOW_SECONDS = 60 * 60

# Pages of `tasks` a sample for the estimates reads (`tenant_stats_sql.SAMPLE`): ~8 MB,
# ~15 ms warm.
SAMPLE_PAGES = 1000

# SQLSTATE query_canceled: statement_timeout (or an operator's pg_cancel_backend).
QUERY_CANCELED = "57014"

# The figures `Figures.estimated` may name, as the API's JSON names them.
PENDING = "tasks.pending"
PROCESSING = "tasks.processing"
IN_FLIGHT = "in_flight"
RUNNABLE = "runnable"
FINISHED_STATUSES = (TaskStatus.COMPLETED, TaskStatus.FAILED, TaskStatus.CANCELLED)
RECENT_FIELDS = ("completed_last_5m", "failed_last_5m", "completed_last_60m", "failed_last_60m")
ESTIMABLE = (
    PENDING,
    PROCESSING,
    *(f"tasks.{status.value}" for status in FINISHED_STATUSES),
    RUNNABLE,
    IN_FLIGHT,
    *RECENT_FIELDS,
)


class StatisticsTimeout(Exception):
    """A statistics statement ran past the statement timeout of `time_limit`."""


@dataclass(frozen=True)
class Limits:
    """Where exact counting stops (module docstring); tests pass small ones.

    `live`: index entries per capped count of pending or processing tasks (index-only scans,
    ~0.1 to 0.4 us an entry); `finished`: rows per scan of finished tasks (a heap fetch each,
    up to ~7 us cold), both the queue gauges'; `sample_pages`: pages of `tasks` a sample reads.
    """

    live: int = statistics.LIVE_EXACT_LIMIT
    finished: int = statistics.TERMINAL_EXACT_LIMIT
    sample_pages: int = SAMPLE_PAGES


@dataclass(frozen=True)
class StatusCounts:
    """Tasks in each status."""

    pending: int
    processing: int
    completed: int
    failed: int
    cancelled: int


@dataclass(frozen=True)
class Figures:
    """What the statistics say of a company or of the queue, as of `as_of` (database clock).

    `runnable`: pending tasks whose `run_after` has come; `in_flight`: processing tasks;
    `oldest_runnable_wait_seconds`: how long the oldest runnable task has waited (None: none
    is runnable); `completed_last_5m` ...: tasks that completed, or failed for good, in the
    last 5 or 60 minutes. `estimated`: the names of the figures that are estimates (from
    `ESTIMABLE`, sorted); every other figure is exact.
    """

    as_of: dt.datetime
    tasks: StatusCounts
    runnable: int
    in_flight: int
    oldest_runnable_wait_seconds: float | None
    completed_last_5m: int
    failed_last_5m: int
    completed_last_60m: int
    failed_last_60m: int
    estimated: tuple[str, ...]


@dataclass(frozen=True)
class CompanyStats(Figures):
    """A company's figures, with what says how to read them: paused, and its backlog quota."""

    company_id: uuid.UUID
    name: str
    paused: bool
    max_pending: int | None


@dataclass(frozen=True)
class CompanyRank:
    """A company in a ranking: `unfinished` is its backlog (pending + processing, exact)."""

    company_id: uuid.UUID
    name: str
    paused: bool
    max_pending: int | None
    unfinished: int
    oldest_runnable_wait_seconds: float | None


@dataclass(frozen=True)
class QueueStats(Figures):
    """The whole queue's figures and the companies that lead it (each at most `TOP_COMPANIES`):
    by backlog (most unfinished tasks first) and by oldest runnable wait (longest first).
    """

    top_by_backlog: tuple[CompanyRank, ...]
    top_by_oldest_wait: tuple[CompanyRank, ...]


@contextmanager
def time_limit(connection: psycopg.Connection[Any], timeout_ms: int) -> Iterator[None]:
    """Run the block's statements under `statement_timeout = timeout_ms` (this transaction).

    Raises `StatisticsTimeout` when the server cancels one; the transaction is then aborted
    and must be rolled back.
    """
    statistics.limit_statement_time(connection, timeout_ms)
    try:
        yield
    except OperationalError as exc:
        if getattr(exc.orig, "sqlstate", None) == QUERY_CANCELED:
            raise StatisticsTimeout(f"a statistics query ran past {timeout_ms} ms") from exc
        raise


@dataclass(frozen=True)
class _Sample:
    """What a sample of `tasks` holds (of one company, or of all): rows by status."""

    percent: float
    pending: int
    runnable: int
    processing: int
    by_status: dict[TaskStatus, int]

    def scaled(self, status: TaskStatus) -> float:
        """The rows of `status` in the table: those sampled, over the fraction sampled."""
        return self.by_status[status] * 100.0 / self.percent if self.percent else 0.0


class _Sampler:
    """Takes the sample the first time an estimate needs it, at most once."""

    def __init__(
        self, connection: psycopg.Connection[Any], company_id: uuid.UUID | None, pages: int
    ) -> None:
        self._connection = connection
        self._company_id = company_id
        self._pages = pages
        self._sample: _Sample | None = None

    def __call__(self) -> _Sample:
        if self._sample is None:
            params = {"pages": self._pages, "company_id": self._company_id}
            row = _one(self._connection, tenant_stats_sql.SAMPLE, params, "sample")
            self._sample = _Sample(
                percent=float(row.percent),
                pending=int(row.pending),
                runnable=int(row.runnable),
                processing=int(row.processing),
                by_status={status: int(getattr(row, status.value)) for status in TaskStatus},
            )
        return self._sample


def _windows() -> dict[str, dt.timedelta]:
    return {
        "short_window": dt.timedelta(seconds=SHORT_WINDOW_SECONDS),
        "long_window": dt.timedelta(seconds=LONG_WINDOW_SECONDS),
    }


def _share(part: int, whole: int, exact_whole: int) -> float | None:
    """`exact_whole` x part / whole: a ratio seen in the sample, applied to an exact count."""
    return exact_whole * part / whole if whole else None


def _within(value: float, low: int, high: int) -> int:
    """`value` rounded into [low, high] (high wins when they cross)."""
    return max(min(round(value), high), min(low, high))


@dataclass(frozen=True)
class _Live:
    """The live figures: pending and processing (unfinished split), runnable, flags."""

    pending: int
    processing: int
    runnable: int
    estimated: frozenset[str]


def _live_figures(
    *,
    unfinished: int,
    processing: int,
    runnable: int,
    delayed: int,
    limit: int,
    sample: _Sampler,
) -> _Live:
    """Split the exact `unfinished` count and count the runnable tasks, from capped counts.

    `processing`, `runnable` and `delayed` are counts capped at `limit` + 1. Pending is
    unfinished - processing: exact while processing is within the limit, else processing is
    the sample's share of the unfinished. Runnable is exact when either range stopped short
    of its cap (runnable = pending - delayed), else the sample's share of the pending, within
    what the caps prove: more than `limit` runnable and more than `limit` delayed.
    """
    estimated: set[str] = set()
    if processing > limit:
        drawn = sample()
        share = _share(drawn.processing, drawn.processing + drawn.pending, unfinished)
        processing = _within(limit + 1 if share is None else share, limit + 1, unfinished)
        estimated |= {PROCESSING, IN_FLIGHT, PENDING}
    pending = max(unfinished - processing, 0)
    if runnable <= limit:
        return _Live(pending, processing, runnable, frozenset(estimated))
    if delayed <= limit and PENDING not in estimated:
        return _Live(pending, processing, pending - delayed, frozenset(estimated))
    high = pending if PENDING in estimated else pending - (limit + 1)
    drawn = sample()
    share = _share(drawn.runnable, drawn.pending, pending)
    runnable = _within(pending / 2 if share is None else share, limit + 1, high)
    return _Live(pending, processing, runnable, frozenset(estimated | {RUNNABLE}))


# ---------------------------------------------------------------------------------------------
# A company
# ---------------------------------------------------------------------------------------------


def company_stats(
    connection: psycopg.Connection[Any], company_id: uuid.UUID, *, limits: Limits | None = None
) -> CompanyStats:
    """The figures of `company_id` (module docstring). Raises `errors.NotFound`.

    Reads at most 3 x (`limits.live` + 1) entries of its own indexes and 2 x
    (`limits.finished` + 1) rows, plus one index probe and, past a limit, one sample.
    """
    limits = limits or Limits()
    params = {"company_id": company_id, "live_limit": limits.live}
    with driver_errors("company_live"):
        row = (
            connection.cursor(row_factory=connector.NAMED_ROWS)
            .execute(tenant_stats_sql.COMPANY_LIVE, params)
            .fetchone()
        )
    if row is None:
        raise errors.NotFound("company not found")
    sample = _Sampler(connection, company_id, limits.sample_pages)
    live = _live_figures(
        unfinished=int(row.unfinished),
        processing=int(row.processing),
        runnable=int(row.runnable),
        delayed=int(row.delayed),
        limit=limits.live,
        sample=sample,
    )
    estimated = set(live.estimated)

    history = _one(
        connection,
        tenant_stats_sql.COMPANY_HISTORY,
        {"company_id": company_id, "finished_limit": limits.finished, **_windows()},
        "company_history",
    )
    finished = {status: int(getattr(history, status.value)) for status in FINISHED_STATUSES}
    recent = {name: int(getattr(history, name)) for name in RECENT_FIELDS}
    if history.scanned > limits.finished:
        # Not its whole history: what was counted is a lower bound.
        for status in FINISHED_STATUSES:
            finished[status] = max(finished[status], round(sample().scaled(status)))
            estimated.add(f"tasks.{status.value}")
        queue_recent, inexact = _recently_finished(connection, company_id, limits)
        for name in RECENT_FIELDS:
            if name in inexact:
                recent[name] = max(recent[name], queue_recent[name])
                estimated.add(name)
            else:
                recent[name] = queue_recent[name]

    return CompanyStats(
        as_of=row.as_of,
        tasks=StatusCounts(
            pending=live.pending,
            processing=live.processing,
            completed=finished[TaskStatus.COMPLETED],
            failed=finished[TaskStatus.FAILED],
            cancelled=finished[TaskStatus.CANCELLED],
        ),
        runnable=live.runnable,
        in_flight=live.processing,
        oldest_runnable_wait_seconds=row.oldest_wait,
        estimated=tuple(sorted(estimated)),
        company_id=company_id,
        name=row.name,
        paused=row.paused,
        max_pending=row.max_pending,
        **recent,
    )


def _recently_finished(
    connection: psycopg.Connection[Any], company_id: uuid.UUID | None, limits: Limits
) -> tuple[dict[str, int], set[str]]:
    """Completed and failed counts of the last 5 and 60 minutes, and those that are estimates.

    Of `company_id`'s tasks, or of every task when it is None. A scan that stopped at its
    limit within the hour covers only [reached, now]: the counts in it are scaled by window /
    covered time (a steady rate), except the 5-minute ones when it reached past 5 minutes ago.
    """
    row = _one(
        connection,
        tenant_stats_sql.RECENTLY_FINISHED,
        {"company_id": company_id, "finished_limit": limits.finished, **_windows()},
        "recently_finished",
    )
    counts = {name: int(getattr(row, name)) for name in RECENT_FIELDS}
    if row.scanned <= limits.finished or row.covers_long_window:
        return counts, set()
    # Rows with the same finished_at as the last one read may be left out: at most a batch.
    covered = max(float(row.covered_seconds or 0.0), 1e-3)
    inexact: set[str] = set()
    for name in RECENT_FIELDS:
        short = name.endswith("_5m")
        if short and row.covers_short_window:
            continue
        window = SHORT_WINDOW_SECONDS if short else LONG_WINDOW_SECONDS
        counts[name] = round(counts[name] * max(window / covered, 1.0))
        inexact.add(name)
    return counts, inexact


# ---------------------------------------------------------------------------------------------
# The queue
# ---------------------------------------------------------------------------------------------


def queue_stats(
    connection: psycopg.Connection[Any], *, limits: Limits | None = None, top: int = TOP_COMPANIES
) -> QueueStats:
    """The figures of the whole queue and its two rankings of `top` companies.

    Reads one row per company (`company_backlogs`, and one index probe per company with due
    work), at most 3 x (`limits.live` + 1) index entries and 2 x (`limits.finished` + 1) rows,
    and, past a limit, one sample or the planner's estimates of the statuses.
    """
    limits = limits or Limits()
    row = _one(
        connection,
        tenant_stats_sql.QUEUE_LIVE,
        {"live_limit": limits.live, "finished_limit": limits.finished},
        "queue_live",
    )
    live = _live_figures(
        unfinished=int(row.unfinished),
        processing=int(row.processing),
        runnable=int(row.runnable),
        delayed=int(row.delayed),
        limit=limits.live,
        sample=_Sampler(connection, None, limits.sample_pages),
    )
    estimated = set(live.estimated)

    finished = {status: int(getattr(row, status.value)) for status in FINISHED_STATUSES}
    if row.finished_scanned > limits.finished:
        # Over the limit together: each one's estimate (the status alone: the planner's
        # statistics are right there, as for the gauges), never below what was counted.
        planner = statistics.status_estimates(connection)
        for status in FINISHED_STATUSES:
            finished[status] = max(finished[status], round(planner.get(status, 0.0)))
            estimated.add(f"tasks.{status.value}")

    recent, inexact = _recently_finished(connection, None, limits)
    estimated |= inexact
    by_oldest_wait = top_by_oldest_wait(connection, top)
    return QueueStats(
        as_of=row.as_of,
        tasks=StatusCounts(
            pending=live.pending,
            processing=live.processing,
            completed=finished[TaskStatus.COMPLETED],
            failed=finished[TaskStatus.FAILED],
            cancelled=finished[TaskStatus.CANCELLED],
        ),
        runnable=live.runnable,
        in_flight=live.processing,
        oldest_runnable_wait_seconds=(
            by_oldest_wait[0].oldest_runnable_wait_seconds if by_oldest_wait else None
        ),
        estimated=tuple(sorted(estimated)),
        top_by_backlog=top_by_backlog(connection, top),
        top_by_oldest_wait=by_oldest_wait,
        **recent,
    )


def top_by_backlog(
    connection: psycopg.Connection[Any], top: int = TOP_COMPANIES
) -> tuple[CompanyRank, ...]:
    """The `top` companies with the most unfinished tasks (none without any), most first."""
    return _ranks(_all(connection, tenant_stats_sql.TOP_BY_BACKLOG, {"top": top}, "top_by_backlog"))


def top_by_oldest_wait(
    connection: psycopg.Connection[Any], top: int = TOP_COMPANIES
) -> tuple[CompanyRank, ...]:
    """The `top` companies whose oldest runnable task has waited longest, longest first.

    Only companies with a runnable task; paused ones included (their `paused` says so).
    """
    return _ranks(
        _all(connection, tenant_stats_sql.TOP_BY_OLDEST_WAIT, {"top": top}, "top_by_oldest_wait")
    )


def _one(
    connection: psycopg.Connection[Any], statement: str, params: dict[str, Any], what: str
) -> Any:
    """The one row of `statement` (an aggregate), its columns as attributes."""
    with driver_errors(what):
        row = (
            connection.cursor(row_factory=connector.NAMED_ROWS)
            .execute(statement, params)
            .fetchone()
        )
    assert row is not None
    return row


def _all(
    connection: psycopg.Connection[Any], statement: str, params: dict[str, Any], what: str
) -> list[Any]:
    with driver_errors(what):
        return (
            connection.cursor(row_factory=connector.NAMED_ROWS)
            .execute(statement, params)
            .fetchall()
        )


def _ranks(rows: list[Any]) -> tuple[CompanyRank, ...]:
    return tuple(
        CompanyRank(
            company_id=row.company_id,
            name=row.name,
            paused=row.paused,
            max_pending=row.max_pending,
            unfinished=int(row.unfinished),
            oldest_runnable_wait_seconds=row.oldest_wait,
        )
        for row in rows
    )
