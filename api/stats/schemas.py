"""Response schemas of GET /companies/{companyId}/stats and GET /stats (`db.tenant_stats`)."""

from __future__ import annotations

from marshmallow import Schema, fields

from api.companies.schemas import MAX_PENDING_DESCRIPTION, PAUSED_DESCRIPTION
from db import tenant_stats

_LIMITS = tenant_stats.Limits()

ESTIMATED_DESCRIPTION = (
    "The figures of this object that are estimates, by name (a count in `tasks` as "
    "`tasks.<status>`); every figure not listed is exact. Counting stops at a limit so a "
    "request costs the same whatever the queue's size: unfinished tasks are exact while at "
    f"most {_LIMITS.live:,} are processing, runnable ones while at most {_LIMITS.live:,} are "
    "runnable or at most that many delayed, finished ones while at most "
    f"{_LIMITS.finished:,} are counted; past that, an estimate from a random sample of "
    f"{tenant_stats.SAMPLE_PAGES:,} pages of the task table (never below what was counted) "
    f"or, for the recent windows, from the rate over the newest {_LIMITS.finished:,} "
    "finished tasks."
)
OLDEST_WAIT_DESCRIPTION = (
    "Seconds the oldest runnable task (pending, `run_after` come) has waited: now minus its "
    "`run_after` (its creation, its `run_at`, or the end of its backoff). Null when no task "
    "is runnable. A paused company's tasks wait too."
)


def _count(description: str) -> fields.Integer:
    return fields.Integer(dump_only=True, metadata={"description": description})


class StatusCountsSchema(Schema):
    """Tasks in each status."""

    pending = _count("Waiting to run, runnable now or later.")
    processing = _count("Held by a worker.")
    completed = _count("Finished successfully (kept for TASK_RETENTION_DAYS).")
    failed = _count("Failed for good (kept for TASK_RETENTION_DAYS).")
    cancelled = _count("Cancelled before they ran (kept for TASK_RETENTION_DAYS).")


class FiguresSchema(Schema):
    """The figures of a company or of the queue."""

    as_of = fields.AwareDateTime(
        dump_only=True, metadata={"description": "The database time the figures are of."}
    )
    tasks = fields.Nested(StatusCountsSchema, dump_only=True)
    runnable = _count("Pending tasks whose run_after has come: they may be claimed now.")
    in_flight = _count("Tasks processing now (the same as tasks.processing).")
    oldest_runnable_wait_seconds = fields.Float(
        dump_only=True, allow_none=True, metadata={"description": OLDEST_WAIT_DESCRIPTION}
    )
    completed_last_5m = _count("Tasks completed in the last 5 minutes.")
    failed_last_5m = _count("Tasks failed for good in the last 5 minutes (retries not counted).")
    completed_last_60m = _count("Tasks completed in the last 60 minutes.")
    failed_last_60m = _count("Tasks failed for good in the last 60 minutes (retries not counted).")
    estimated = fields.List(
        fields.String(metadata={"enum": list(tenant_stats.ESTIMABLE)}),
        dump_only=True,
        metadata={"description": ESTIMATED_DESCRIPTION},
    )


class CompanyStatsSchema(FiguresSchema):
    """A company's task statistics."""

    company_id = fields.UUID(dump_only=True)
    name = fields.String(dump_only=True)
    paused = fields.Boolean(dump_only=True, metadata={"description": PAUSED_DESCRIPTION})
    max_pending = fields.Integer(
        dump_only=True, allow_none=True, metadata={"description": MAX_PENDING_DESCRIPTION}
    )


class CompanyRankSchema(Schema):
    """A company in a ranking of GET /stats; its figures are exact."""

    company_id = fields.UUID(dump_only=True)
    name = fields.String(dump_only=True)
    paused = fields.Boolean(dump_only=True, metadata={"description": PAUSED_DESCRIPTION})
    max_pending = fields.Integer(
        dump_only=True, allow_none=True, metadata={"description": MAX_PENDING_DESCRIPTION}
    )
    unfinished = _count("Its backlog: tasks pending or processing (what max_pending limits).")
    oldest_runnable_wait_seconds = fields.Float(
        dump_only=True, allow_none=True, metadata={"description": OLDEST_WAIT_DESCRIPTION}
    )


class QueueStatsSchema(FiguresSchema):
    """The whole queue's task statistics, and the companies that lead it."""

    top_by_backlog = fields.List(
        fields.Nested(CompanyRankSchema),
        dump_only=True,
        metadata={
            "description": f"At most {tenant_stats.TOP_COMPANIES} companies with the most "
            "unfinished tasks, most first (ties by id); none without any."
        },
    )
    top_by_oldest_wait = fields.List(
        fields.Nested(CompanyRankSchema),
        dump_only=True,
        metadata={
            "description": f"At most {tenant_stats.TOP_COMPANIES} companies whose oldest "
            "runnable task has waited longest, longest first (ties by id); only companies "
            "with a runnable task, paused ones included."
        },
    )
