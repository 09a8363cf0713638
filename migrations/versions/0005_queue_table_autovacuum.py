"""Autovacuum and autoanalyze settings for the queue's tables.

The defaults suit tables that mostly grow: vacuum after 20% of the rows are dead, analyze after
10% changed. A queue's tables churn instead. Every task is updated two or three times in its
life (claim, completion, retries), each a non-HOT update (`status` is in partial-index
predicates) that leaves a dead row version and index entries behind; the claim's index range
scans step over those until vacuum removes them, and a table holding a long history waits for
millions of them before the 20% mark. So for `tasks`: vacuum and analyze after 1% of the rows
plus 5,000 (a few seconds of a busy queue's work, and not every few rows of an idle one), and
after inserts too (sets visibility-map bits of history pages, so later vacuums skip them).
`company_queues` and `claim_cursor` are small and rewritten by every claim: vacuum them by a
fixed count of dead rows, whatever their size. The claim does not depend on statistics (its
plan is pinned, design §4), so autoanalyze here serves the API's listings and the operator.

`ALTER TABLE ... SET (...)` takes a SHARE UPDATE EXCLUSIVE lock: reads and writes go on.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Table -> its storage parameters.
SETTINGS: dict[str, dict[str, str]] = {
    "tasks": {
        "autovacuum_vacuum_scale_factor": "0.01",
        "autovacuum_vacuum_threshold": "5000",
        "autovacuum_vacuum_insert_scale_factor": "0.01",
        "autovacuum_vacuum_insert_threshold": "5000",
        "autovacuum_analyze_scale_factor": "0.01",
        "autovacuum_analyze_threshold": "5000",
    },
    "company_queues": {
        "autovacuum_vacuum_scale_factor": "0",
        "autovacuum_vacuum_threshold": "1000",
        "autovacuum_analyze_scale_factor": "0",
        "autovacuum_analyze_threshold": "1000",
    },
    "claim_cursor": {
        "autovacuum_vacuum_scale_factor": "0",
        "autovacuum_vacuum_threshold": "1000",
    },
}


def upgrade() -> None:
    for table, settings in SETTINGS.items():
        values = ", ".join(f"{name} = {value}" for name, value in settings.items())
        op.execute(f"ALTER TABLE {table} SET ({values})")


def downgrade() -> None:
    for table, settings in SETTINGS.items():
        op.execute(f"ALTER TABLE {table} RESET ({', '.join(settings)})")
