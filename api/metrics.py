"""API metrics (DESIGN §7): HTTP requests by route template, and queue gauges at scrape time.

Under gunicorn, `PROMETHEUS_MULTIPROC_DIR` is set by the entrypoint before anything imports
`prometheus_client`, and `/metrics` aggregates every gunicorn worker's files. Outside gunicorn
(tests, `flask run`) each app gets its own registry, so building two apps in one process does
not leave the second one uninstrumented (STACK.md).
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

from db.models import TaskStatus

log = logging.getLogger("fairq.api.metrics")

# Route templates, never raw paths: a path label would grow with every task id.
GROUP_BY = "url_rule"


class QueueCollector(Collector):
    """`tasks_by_status{status}` and `oldest_eligible_pending_age_seconds`, read per scrape.

    The queries run under `statement_timeout` (`timeout_ms`); on any database error the
    collector yields nothing, so `/metrics` still answers 200 with the HTTP metrics.
    """

    def __init__(self, engine: Engine, timeout_ms: int) -> None:
        self._engine = engine
        self._timeout_ms = int(timeout_ms)

    def describe(self) -> list[Metric]:
        """Nothing: otherwise registering the collector would run the queries."""
        return []

    def collect(self) -> Iterator[Metric]:
        """Yield the queue gauges, or nothing when the database is slow or down."""
        try:
            with self._engine.connect() as conn, conn.begin():
                conn.execute(text(f"SET LOCAL statement_timeout = {self._timeout_ms}"))
                counts: dict[str, int] = dict(
                    conn.execute(text("SELECT status, count(*) FROM tasks GROUP BY status")).all()
                )
                # Only runnable work counts as waiting: delayed and backed-off tasks do not.
                oldest = conn.execute(
                    text(
                        "SELECT coalesce(extract(epoch FROM now() - min(run_after)), 0) "
                        "FROM tasks WHERE status = 'pending' AND run_after <= now()"
                    )
                ).scalar_one()
        except SQLAlchemyError as exc:
            log.warning("queue metrics skipped: %s", exc.__class__.__name__)
            return
        by_status = GaugeMetricFamily(
            "tasks_by_status", "Tasks currently in each status.", labels=["status"]
        )
        for status in TaskStatus:
            by_status.add_metric([status.value], float(counts.get(status.value, 0)))
        yield by_status
        yield GaugeMetricFamily(
            "oldest_eligible_pending_age_seconds",
            "Age of the oldest pending task that may run now (now - run_after), in seconds.",
            value=float(oldest),
        )


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
