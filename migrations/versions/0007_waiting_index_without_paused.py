"""The claim's index of waiting companies leaves paused companies out.

`ix_company_queues_waiting_due_at` (`NOT ready AND due_at IS NOT NULL`) would hold a paused
company with due work, and the claim's promotion, which reads it in `due_at` order, would step
over every such company on every claim. Replaced by `ix_company_queues_waiting_unpaused_due_at`
(`NOT ready AND NOT paused AND due_at IS NOT NULL`): a paused company costs the claim nothing,
and resuming it puts it back in the index, where the next claim promotes it.

On a live table: the new index is built `CONCURRENTLY`, outside the migration's transaction,
then the old one is dropped the same way; writes to `company_queues` go on. Until the new
index exists the claim's promotion filter (`NOT paused`) is served by the old one.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.get_context().autocommit_block():
        # A build interrupted earlier leaves an invalid index behind: start over.
        op.execute("DROP INDEX CONCURRENTLY IF EXISTS ix_company_queues_waiting_unpaused_due_at")
        op.create_index(
            "ix_company_queues_waiting_unpaused_due_at",
            "company_queues",
            ["due_at"],
            postgresql_where=sa.text("NOT ready AND NOT paused AND due_at IS NOT NULL"),
            postgresql_concurrently=True,
        )
        op.execute("DROP INDEX CONCURRENTLY IF EXISTS ix_company_queues_waiting_due_at")


def downgrade() -> None:
    with op.get_context().autocommit_block():
        op.create_index(
            "ix_company_queues_waiting_due_at",
            "company_queues",
            ["due_at"],
            postgresql_where=sa.text("NOT ready AND due_at IS NOT NULL"),
            postgresql_concurrently=True,
        )
        op.execute("DROP INDEX CONCURRENTLY IF EXISTS ix_company_queues_waiting_unpaused_due_at")
