"""The company listing index leaves `processing` tasks out.

Every status change adds an entry to each index whose predicate holds for the new row
version; in the listing index a claim's entry is a duplicate of the task's pending one,
written while every other claimer waits on the claimers' lock (decision 0002, "Follow-up:
the listing index leaves leased tasks out"). `ix_tasks_company_listing_unleased` is the same
key `WHERE status <> 'processing'`: a claim adds no listing entry, and
`db.queue.list_tasks` merges a company's leases in from
`ix_tasks_processing_company_locked_at`.

What it costs: no index of `tasks` covers all of a company's rows any more, so deleting a
company (its tasks go by `ON DELETE CASCADE`) reads the table sequentially. fairq has no API
that deletes a company; an operator who does it by SQL pays one scan of `tasks` per company.

On a live table: the new index is built `CONCURRENTLY`, outside the migration's transaction,
then the old one is dropped the same way; writes to `tasks` go on. Until the old one is gone
the listing reads either.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_LISTING_KEY: list[str | sa.TextClause] = [
    "company_id",
    sa.text("created_at DESC"),
    sa.text("id DESC"),
]


def upgrade() -> None:
    with op.get_context().autocommit_block():
        # A build interrupted earlier leaves an invalid index behind: start over.
        op.execute("DROP INDEX CONCURRENTLY IF EXISTS ix_tasks_company_listing_unleased")
        op.create_index(
            "ix_tasks_company_listing_unleased",
            "tasks",
            _LISTING_KEY,
            postgresql_where=sa.text("status <> 'processing'"),
            postgresql_concurrently=True,
        )
        op.execute("DROP INDEX CONCURRENTLY IF EXISTS ix_tasks_company_listing")


def downgrade() -> None:
    with op.get_context().autocommit_block():
        op.execute("DROP INDEX CONCURRENTLY IF EXISTS ix_tasks_company_listing")
        op.create_index(
            "ix_tasks_company_listing", "tasks", _LISTING_KEY, postgresql_concurrently=True
        )
        op.execute("DROP INDEX CONCURRENTLY IF EXISTS ix_tasks_company_listing_unleased")
