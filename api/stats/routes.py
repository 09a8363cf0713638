"""/companies/{companyId}/stats and /stats: task statistics, each one `db.tenant_stats` call.

Read in a transaction of their own (`database.transaction()`),
under `STATS_TIMEOUT_MS` per statement: a statistics query that runs past it is a 503 saying
so, with `Retry-After`, never a 500 and never a request that holds a connection for long.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg
from flask import current_app
from flask.views import MethodView
from flask_smorest import abort

from api import auth, database
from api import settings as api_settings
from api.parser import Blueprint
from api.stats.schemas import CompanyStatsSchema, QueueStatsSchema
from db import tenant_stats

blp = Blueprint("stats", __name__, description="Task statistics of a company and of the queue.")

T = TypeVar("T")

# Seconds a client is asked to wait after a statistics timeout: the load that slowed the
# query (a lock, a burst of writes) is seldom gone within a second.
RETRY_AFTER_SECONDS = 5

TIMEOUT_DESCRIPTION = "A statistics query ran past STATS_TIMEOUT_MS; try again later."


def _read(read: Callable[[psycopg.Connection[Any]], T]) -> T:
    """Run `read` in a transaction of its own under the statistics statement timeout."""
    settings = api_settings.current()
    with database.transaction() as connection:
        try:
            with tenant_stats.time_limit(connection, settings.stats_timeout_ms):
                return read(connection)
        except tenant_stats.StatisticsTimeout:
            current_app.logger.warning(
                "statistics query cancelled after %s ms", settings.stats_timeout_ms
            )
            abort(
                503,
                message=f"the statistics query took longer than {settings.stats_timeout_ms} ms "
                "(STATS_TIMEOUT_MS) and was cancelled; try again later",
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            )
            raise AssertionError("unreachable") from None  # abort raises; this satisfies mypy


def _limits() -> tenant_stats.Limits:
    return api_settings.current().stats_limits


@blp.route("/companies/<uuid:company_id>/stats")
class CompanyStats(MethodView):
    """One company's statistics."""

    @blp.doc(operationId="get_company_stats")
    @auth.company_required(allow_admin=True)
    @blp.response(200, CompanyStatsSchema)
    @blp.error(401, "Missing or invalid token.")
    @blp.error(404, "No such company, or not yours.")
    @blp.error(503, TIMEOUT_DESCRIPTION)
    def get(self, company_id: uuid.UUID) -> tenant_stats.CompanyStats:
        """Read a company's task statistics (its own key, or the admin token)."""
        limits = _limits()
        return _read(lambda conn: tenant_stats.company_stats(conn, company_id, limits=limits))


@blp.route("/stats")
class QueueStats(MethodView):
    """The whole queue's statistics."""

    @blp.doc(operationId="get_queue_stats")
    @auth.admin_required
    @blp.response(200, QueueStatsSchema)
    @blp.error(401, "Missing or invalid admin token (a company's key is refused too).")
    @blp.error(503, f"ADMIN_TOKEN is not configured, or: {TIMEOUT_DESCRIPTION}")
    def get(self) -> tenant_stats.QueueStats:
        """Read the whole queue's task statistics and its leading companies (admin only)."""
        limits = _limits()
        return _read(lambda conn: tenant_stats.queue_stats(conn, limits=limits))
