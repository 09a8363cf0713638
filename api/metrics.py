"""API metrics (design §7): HTTP requests by route template, and queue gauges at scrape time.

Under gunicorn, `PROMETHEUS_MULTIPROC_DIR` is set by the entrypoint before anything imports
`prometheus_client`, and `/metrics` aggregates every gunicorn worker's files. Outside gunicorn
(tests, `flask run`) each app gets its own registry, so building two apps in one process does
not leave the second one uninstrumented (docs/stack-notes.md).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from flask import Flask
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from prometheus_flask_exporter import PrometheusMetrics
from sqlalchemy import Engine, text
from sqlalchemy.exc import SQLAlchemyError

from db.models import TERMINAL_STATUSES, TaskStatus

log = logging.getLogger("fairq.api.metrics")

# Route templates, never raw paths: a path label would grow with every task id.
GROUP_BY = "url_rule"


# Exact counts stop at these many rows per status; above, the planner's estimate is reported.
# A count reads every row it counts (an index-only scan of a partial index for pending and
# processing, ~0.1 to 0.4 us per row here; heap fetches through ix_tasks_terminal_finished_at for
# finished tasks, ~7 us per row cold), so an uncapped count grows with the backlog and the
# history and, at ~10M rows, outlasts the statement timeout and takes every queue gauge with it.
LIVE_EXACT_LIMIT = 100_000  # pending, processing: each counted on its own
TERMINAL_EXACT_LIMIT = 10_000  # completed, failed, cancelled: counted together

TASKS_BY_STATUS_HELP = (
    "Tasks currently in each status. Exact while a live status (pending, processing) has at "
    f"most {LIVE_EXACT_LIMIT:,} tasks and the finished ones (completed, failed, cancelled) "
    f"together at most {TERMINAL_EXACT_LIMIT:,}; above that, an estimate from the planner's "
    "statistics (table size now times the status's share at the last ANALYZE)."
)

# Capped exact counts: LIMIT stops each scan after limit + 1 rows, so a result above the
# limit means "more than the limit", at a bounded cost. `SELECT FROM` reads no columns, so
# pending and processing are counted index-only from their partial indexes (or a short seq
# scan when the status is most of the table: the planner stops it at the LIMIT too).
_CAPPED_COUNTS = text(
    """
SELECT 'pending' AS status,
       (SELECT count(*) FROM (SELECT FROM tasks WHERE status = 'pending'
                              LIMIT :live_limit + 1) AS p) AS n
UNION ALL
SELECT 'processing',
       (SELECT count(*) FROM (SELECT FROM tasks WHERE status = 'processing'
                              LIMIT :live_limit + 1) AS p)
UNION ALL
-- Finished tasks together (ix_tasks_terminal_finished_at covers exactly them), one row per
-- status present among the first terminal_limit + 1 found.
SELECT status, count(*)
FROM (SELECT status FROM tasks WHERE status IN ('completed', 'failed', 'cancelled')
      LIMIT :terminal_limit + 1) AS f
GROUP BY status
"""
)

# What the planner would assume (estimate_rel_size): rows per page at the last ANALYZE times
# the pages the table has now, so growth since then counts; times each status's frequency
# among the most common values of that ANALYZE. No rows while the table was never analyzed
# (reltuples < 0). Reads only catalogs and the relation's size: constant cost.
_ESTIMATES = text(
    """
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
)

# Only runnable work counts as waiting: delayed and backed-off tasks do not. One probe per
# company into ix_tasks_pending_company_run_after (company_id, run_after, id): its first entry
# at or before now() is the company's oldest runnable task, so the cost is O(companies), not
# O(pending), and rows due tomorrow are never read.
_OLDEST_ELIGIBLE = text(
    """
SELECT coalesce(extract(epoch FROM now() - min(o.run_after)), 0)
FROM companies c
CROSS JOIN LATERAL (
    SELECT t.run_after
    FROM tasks t
    WHERE t.company_id = c.id AND t.status = 'pending' AND t.run_after <= now()
    ORDER BY t.run_after
    LIMIT 1
) AS o
"""
)


class QueueCollector(Collector):
    """`tasks_by_status{status}` and `oldest_eligible_pending_age_seconds`, read per scrape.

    Both cost about the same at 10M rows as at 10k (design §7: they must not vanish behind the
    statement timeout as the table grows): the oldest eligible task is one index probe per
    company; counts are exact up to `live_limit` rows per live status and `terminal_limit`
    finished rows, and above that the planner's estimate, as `TASKS_BY_STATUS_HELP` says.
    The queries run under `statement_timeout` (`timeout_ms`); on any database error the
    collector yields nothing, so `/metrics` still answers 200 with the HTTP metrics.
    """

    def __init__(
        self,
        engine: Engine,
        timeout_ms: int,
        *,
        live_limit: int = LIVE_EXACT_LIMIT,
        terminal_limit: int = TERMINAL_EXACT_LIMIT,
    ) -> None:
        self._engine = engine
        self._timeout_ms = int(timeout_ms)
        self._live_limit = live_limit
        self._terminal_limit = terminal_limit

    def describe(self) -> list[Metric]:
        """Nothing: otherwise registering the collector would run the queries."""
        return []

    def collect(self) -> Iterator[Metric]:
        """Yield the queue gauges, or nothing when the database is slow or down."""
        try:
            with self._engine.connect() as conn, conn.begin():
                conn.execute(text(f"SET LOCAL statement_timeout = {self._timeout_ms}"))
                counts: dict[str, int] = dict(
                    conn.execute(
                        _CAPPED_COUNTS,
                        {"live_limit": self._live_limit, "terminal_limit": self._terminal_limit},
                    ).all()
                )
                over = self._over_limit(counts)
                estimates: dict[str, float] = dict(conn.execute(_ESTIMATES).all()) if over else {}
                oldest = conn.execute(_OLDEST_ELIGIBLE).scalar_one()
        except SQLAlchemyError as exc:
            log.warning("queue metrics skipped: %s", exc.__class__.__name__)
            return
        by_status = GaugeMetricFamily("tasks_by_status", TASKS_BY_STATUS_HELP, labels=["status"])
        for status in TaskStatus:
            value = float(counts.get(status.value, 0))
            if status.value in over:
                # More than the limit for sure (the capped count says so); the estimate can
                # be stale or missing (never analyzed), so it never reports less than that.
                value = max(value, round(float(estimates.get(status.value, 0.0))))
            by_status.add_metric([status.value], value)
        yield by_status
        yield GaugeMetricFamily(
            "oldest_eligible_pending_age_seconds",
            "Age of the oldest pending task that may run now (now - run_after), in seconds.",
            value=float(oldest),
        )

    def _over_limit(self, counts: dict[str, int]) -> set[str]:
        """The statuses whose capped count stopped at its limit: those get estimates."""
        live = (TaskStatus.PENDING.value, TaskStatus.PROCESSING.value)
        over = {status for status in live if counts.get(status, 0) > self._live_limit}
        terminal = {status.value for status in TERMINAL_STATUSES}
        if sum(counts.get(status, 0) for status in terminal) > self._terminal_limit:
            over |= terminal
        return over


class _Metrics(PrometheusMetrics):  # type: ignore[misc]  # untyped library
    """The exporter with our queue collector added to every scrape."""

    def __init__(self, app: Flask, queue: QueueCollector, multiprocess: bool, **kw: Any) -> None:
        self._queue = queue
        self._multiprocess = multiprocess
        super().__init__(app, **kw)

    def generate_metrics(
        self, accept_header: str | None = None, names: list[str] | None = None
    ) -> tuple[str, str]:
        """Render HTTP metrics (all processes under gunicorn) plus the queue gauges."""
        from prometheus_client.exposition import choose_encoder  # noqa: PLC0415

        registry = CollectorRegistry(auto_describe=False)
        if self._multiprocess:
            MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
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


def init_app(app: Flask, engine: Engine, *, timeout_ms: int, multiprocess: bool) -> None:
    """Instrument `app` and serve `/metrics` on it.

    `multiprocess`: `PROMETHEUS_MULTIPROC_DIR` is set (gunicorn), so scrapes aggregate the
    metric files of every worker process instead of this process's registry.
    """
    # A registry of our own even in multiprocess mode: values go to the files either way,
    # and a second app in one process must not collide in the global registry.
    registry = CollectorRegistry()
    metrics = _Metrics(
        app,
        QueueCollector(engine, timeout_ms),
        multiprocess,
        path="/metrics",
        group_by=GROUP_BY,
        registry=registry,
        default_labels={},
    )
    app.extensions["fairq.metrics"] = metrics
