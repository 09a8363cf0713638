"""API metrics (design §7): HTTP requests by route template, and queue gauges at scrape time.

Under gunicorn, `PROMETHEUS_MULTIPROC_DIR` is set by the entrypoint before anything imports
`prometheus_client`, and `/metrics` aggregates every gunicorn worker's files. Outside gunicorn
(tests, `flask run`) each app gets its own registry, so building two apps in one process does
not leave the second one uninstrumented (docs/stack-notes.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import psycopg
from flask import Flask, Request
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_flask_exporter import PrometheusMetrics
from sqlalchemy.exc import SQLAlchemyError

from db import queue_health, statistics
from worker import tasktypes
from worker.metrics import FilesCollector, TaskMetrics

log = logging.getLogger("fairq.api.metrics")

# The `url_rule` label of a request no route matched (404, or 405 for a method the path
# does not take): one fixed value, as a raw path would grow with every probe and typo.
UNMATCHED_RULE = "<unmatched>"

_TASK_METRICS = "fairq.task_metrics"
_AUTH_FAILURES = "fairq.auth_failures"

AUTH_FAILURES_HELP = (
    "Failed authentications: surface `api` (a bearer token that is neither the admin token nor "
    "an active API key) or `dashboard` (a wrong login); outcome `invalid` (answered 401) or "
    "`throttled` (answered 429: too many failures from the client's address, api.throttle)."
)


def url_rule(request: Request) -> str:
    """The route template that matched `request`, else `UNMATCHED_RULE`.

    The exporter's `group_by="url_rule"` gives route templates, but "None" when no route
    matched; a callable's `__name__` is the label's name, so this one keeps `url_rule`.
    """
    rule = request.url_rule
    return UNMATCHED_RULE if rule is None else rule.rule


TASKS_BY_STATUS_HELP = (
    "Tasks currently in each status. Exact while a live status (pending, processing) has at "
    f"most {statistics.LIVE_EXACT_LIMIT:,} tasks and the finished ones (completed, failed, "
    f"cancelled) together at most {statistics.TERMINAL_EXACT_LIMIT:,}; above that, an estimate "
    "from the planner's statistics (table size now times the status's share at the last "
    "ANALYZE)."
)

OLDEST_XMIN_HOLDER_HELP = (
    "Seconds since the start of the transaction holding back cleanup on this database: of the "
    "sessions on it (idle in transaction included) and its prepared transactions, the one "
    "with the oldest snapshot (xmin) or transaction id, aged from its xact_start (its PREPARE "
    "for a prepared one); 0 if none. While it stays open VACUUM cannot remove the queue's dead "
    "rows and claims slow down. Not covered: replication slots' xmin, and other roles' "
    "sessions unless the API's role has pg_read_all_stats."
)

OLDEST_ELIGIBLE_HELP = (
    "Age of the oldest pending task that may run now (now - run_after), in seconds, paused "
    "companies and companies at their max_in_flight included. Deprecated: alert on "
    "oldest_runnable_pending_age_seconds instead; removed in the next release."
)

OLDEST_RUNNABLE_HELP = (
    "Age of the oldest due pending task (now - run_after) of the companies neither paused nor "
    "at their max_in_flight, in seconds; 0 if none: work waiting because workers are short."
)

OLDEST_HELD_HELP = (
    "Age of the oldest due pending task (now - run_after) of the companies held back by their "
    "own pause (reason=paused) or limit (reason=max_in_flight: its leases >= max_in_flight), "
    "in seconds; 0 if none."
)

DUE_COMPANIES_HELP = (
    "Companies with a due pending task, by what holds them: none (waiting for a worker), "
    "paused, or max_in_flight (leases >= max_in_flight at the scrape)."
)

DUE_BACKLOG_HELP = (
    "Unfinished tasks (pending, due or not, plus processing) of the companies with a due "
    "pending task, by what holds those companies, as due_companies."
)

TABLE_DEAD_HELP = (
    "Dead row versions of a queue table (pg_stat_user_tables.n_dead_tup): left by claims and "
    "finalizations, removed by VACUUM unless a snapshot holds them. Approximate."
)

TABLE_LIVE_HELP = "Live rows of a queue table (pg_stat_user_tables.n_live_tup). Approximate."


class QueueCollector(Collector):
    """`tasks_by_status{status}`, the waiting work split by what holds it
    (`oldest_runnable_pending_age_seconds`, `oldest_held_pending_age_seconds{reason}`,
    `due_companies{reason}`, `due_backlog_tasks{reason}`; and the deprecated
    `oldest_eligible_pending_age_seconds`), and the spiral's predictors from the database
    (`oldest_xmin_holder_age_seconds`, `queue_table_dead_tuples{table}`,
    `queue_table_live_tuples{table}`), read per scrape.

    The queries (`db.statistics`, bounded in cost whatever the table's size) run under
    `statement_timeout` (`timeout_ms`); on any database error the collector yields nothing,
    so `/metrics` still answers 200 with the HTTP metrics. `live_limit` and `terminal_limit`
    cap the exact counts, as `TASKS_BY_STATUS_HELP` says.
    """

    def __init__(
        self,
        connect: Callable[[], AbstractContextManager[psycopg.Connection[Any]]],
        timeout_ms: int,
        *,
        live_limit: int = statistics.LIVE_EXACT_LIMIT,
        terminal_limit: int = statistics.TERMINAL_EXACT_LIMIT,
    ) -> None:
        self._connect = connect
        self._timeout_ms = int(timeout_ms)
        self._live_limit = live_limit
        self._terminal_limit = terminal_limit

    def describe(self) -> list[Metric]:
        """Nothing: otherwise registering the collector would run the queries."""
        return []

    def collect(self) -> Iterator[Metric]:
        """Yield the queue gauges, or nothing when the database is slow or down."""
        try:
            with self._connect() as conn, conn.transaction():
                statistics.limit_statement_time(conn, self._timeout_ms)
                counts = statistics.tasks_by_status(
                    conn, live_limit=self._live_limit, terminal_limit=self._terminal_limit
                )
                holder = statistics.oldest_xmin_holder_age(conn)
                waiting = queue_health.waiting(conn)
                tables = queue_health.table_tuples(conn)
        except SQLAlchemyError as exc:
            log.warning("queue metrics skipped: %s", exc.__class__.__name__)
            return
        by_status = GaugeMetricFamily("tasks_by_status", TASKS_BY_STATUS_HELP, labels=["status"])
        for status, value in counts.items():
            by_status.add_metric([status.value], value)
        yield by_status
        yield from _waiting_metrics(waiting)
        yield GaugeMetricFamily(
            "oldest_xmin_holder_age_seconds", OLDEST_XMIN_HOLDER_HELP, value=holder
        )
        dead = GaugeMetricFamily("queue_table_dead_tuples", TABLE_DEAD_HELP, labels=["table"])
        live = GaugeMetricFamily("queue_table_live_tuples", TABLE_LIVE_HELP, labels=["table"])
        for table in tables:
            dead.add_metric([table.table], table.dead)
            live.add_metric([table.table], table.live)
        yield dead
        yield live


def _waiting_metrics(waiting: dict[queue_health.Hold, queue_health.Waiting]) -> Iterator[Metric]:
    """The gauges of the due work by what holds it (`db.queue_health.waiting`)."""
    yield GaugeMetricFamily(
        "oldest_runnable_pending_age_seconds",
        OLDEST_RUNNABLE_HELP,
        value=waiting[queue_health.Hold.NONE].oldest_seconds,
    )
    held = GaugeMetricFamily("oldest_held_pending_age_seconds", OLDEST_HELD_HELP, labels=["reason"])
    for hold in queue_health.HELD:
        held.add_metric([hold.value], waiting[hold].oldest_seconds)
    yield held
    companies = GaugeMetricFamily("due_companies", DUE_COMPANIES_HELP, labels=["reason"])
    backlog = GaugeMetricFamily("due_backlog_tasks", DUE_BACKLOG_HELP, labels=["reason"])
    for hold, figures in waiting.items():
        companies.add_metric([hold.value], figures.companies)
        backlog.add_metric([hold.value], figures.backlog)
    yield companies
    yield backlog
    yield GaugeMetricFamily(
        "oldest_eligible_pending_age_seconds",
        OLDEST_ELIGIBLE_HELP,
        value=max(figures.oldest_seconds for figures in waiting.values()),
    )


class _Metrics(PrometheusMetrics):  # type: ignore[misc]  # untyped library
    """The exporter with our queue collector added to every scrape."""

    def __init__(
        self, app: Flask, queue: QueueCollector, metrics_dir: Path | None, **kw: Any
    ) -> None:
        self._queue = queue
        self._metrics_dir = metrics_dir
        super().__init__(app, **kw)

    def generate_metrics(
        self, accept_header: str | None = None, names: list[str] | None = None
    ) -> tuple[str, str]:
        """Render HTTP metrics (all processes under gunicorn) plus the queue gauges."""
        from prometheus_client.exposition import choose_encoder  # noqa: PLC0415

        registry = CollectorRegistry(auto_describe=False)
        if self._metrics_dir is not None:
            # Not MultiProcessCollector: a gunicorn worker creating its file has not sized it
            # yet, and reading it then fails the whole scrape (FilesCollector passes over it).
            registry.register(FilesCollector(self._metrics_dir))
        else:
            registry.register(_Forward(self.registry))
        registry.register(self._queue)
        encoder, content_type = choose_encoder(accept_header or "")
        return encoder(registry).decode("utf-8"), content_type


class _Forward(Collector):
    """Expose another registry's metrics through a fresh per-scrape registry."""

    def __init__(self, source: CollectorRegistry) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        """Everything the source registry collects."""
        yield from self._source.collect()


def init_app(
    app: Flask,
    connect: Callable[[], AbstractContextManager[psycopg.Connection[Any]]],
    *,
    timeout_ms: int,
    metrics_dir: Path | None,
) -> None:
    """Instrument `app` and serve `/metrics` on it.

    `metrics_dir`: `PROMETHEUS_MULTIPROC_DIR` (gunicorn), so scrapes aggregate the metric
    files of every worker process there instead of this process's registry; None: this
    process's registry.
    """
    # A registry of our own even in multiprocess mode: values go to the files either way,
    # and a second app in one process must not collide in the global registry.
    registry = CollectorRegistry()
    metrics = _Metrics(
        app,
        QueueCollector(connect, timeout_ms),
        metrics_dir,
        path="/metrics",
        # Route templates, never raw paths: a path label would grow with every task id.
        group_by=url_rule,
        registry=registry,
        default_labels={},
    )
    app.extensions["fairq.metrics"] = metrics
    # The worker's task counters, for the passes POST /workers/process runs in this process:
    # same names and labels, so dashboards and alerts sum the API's tasks with the workers'.
    app.extensions[_TASK_METRICS] = TaskMetrics(tasktypes.names(), registry=registry)
    app.extensions[_AUTH_FAILURES] = Counter(
        "auth_failures_total", AUTH_FAILURES_HELP, ["surface", "outcome"], registry=registry
    )


def task_metrics(app: Flask) -> TaskMetrics:
    """The task counters of `app`'s process, the observer of its processing passes."""
    metrics: TaskMetrics = app.extensions[_TASK_METRICS]
    return metrics


def auth_failures(app: Flask) -> Counter:
    """`auth_failures_total{surface,outcome}` of `app`'s process (api.throttle counts)."""
    counter: Counter = app.extensions[_AUTH_FAILURES]
    return counter
