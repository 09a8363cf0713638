"""Companies and tasks with the claim, stale-lease, listing and retention indexes.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TSTZ = postgresql.TIMESTAMP(timezone=True)


def upgrade() -> None:
    op.create_table(
        "companies",
        sa.Column("id", sa.UUID(), server_default=sa.text("gen_random_uuid()"), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("api_key_hash", sa.Text(), nullable=False),
        sa.Column("created_at", TSTZ, server_default=sa.text("now()"), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_companies"),
        sa.UniqueConstraint("api_key_hash", name="uq_companies_api_key_hash"),
    )
    op.create_table(
        "tasks",
        sa.Column("id", sa.UUID(), server_default=sa.text("gen_random_uuid()"), nullable=False),
        sa.Column("company_id", sa.UUID(), nullable=False),
        sa.Column("type", sa.Text(), nullable=False),
        sa.Column("payload", postgresql.JSONB(), nullable=False),
        sa.Column("status", sa.Text(), server_default=sa.text("'pending'"), nullable=False),
        sa.Column("idempotency_key", sa.Text(), nullable=True),
        sa.Column("request_hash", sa.Text(), nullable=True),
        sa.Column("attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("max_attempts", sa.Integer(), server_default=sa.text("5"), nullable=False),
        sa.Column("run_after", TSTZ, server_default=sa.text("now()"), nullable=False),
        sa.Column("lease_token", sa.UUID(), nullable=True),
        sa.Column("locked_by", sa.Text(), nullable=True),
        sa.Column("locked_at", TSTZ, nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("created_at", TSTZ, server_default=sa.text("now()"), nullable=False),
        sa.Column("updated_at", TSTZ, server_default=sa.text("now()"), nullable=False),
        sa.Column("started_at", TSTZ, nullable=True),
        sa.Column("finished_at", TSTZ, nullable=True),
        # op.f(): these are final names; the "ck" naming convention of the target metadata
        # (applied by op.create_table) would otherwise prefix them again (ck_tasks_ck_tasks_...).
        sa.CheckConstraint(
            "status IN ('pending', 'processing', 'completed', 'failed', 'cancelled')",
            name=op.f("ck_tasks_status"),
        ),
        sa.CheckConstraint(
            "max_attempts BETWEEN 1 AND 50", name=op.f("ck_tasks_max_attempts_range")
        ),
        sa.CheckConstraint("attempts >= 0", name=op.f("ck_tasks_attempts_non_negative")),
        sa.CheckConstraint(
            "jsonb_typeof(payload) = 'object'", name=op.f("ck_tasks_payload_is_object")
        ),
        sa.ForeignKeyConstraint(
            ["company_id"],
            ["companies.id"],
            name="fk_tasks_company_id_companies",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name="pk_tasks"),
        sa.UniqueConstraint(
            "company_id", "idempotency_key", name="uq_tasks_company_id_idempotency_key"
        ),
    )
    op.create_index(
        "ix_tasks_claimable",
        "tasks",
        ["company_id", "created_at"],
        postgresql_include=["status", "run_after", "locked_at"],
        postgresql_where=sa.text("status IN ('pending', 'processing')"),
    )
    op.create_index(
        "ix_tasks_processing_locked_at",
        "tasks",
        ["locked_at"],
        postgresql_where=sa.text("status = 'processing'"),
    )
    op.create_index(
        "ix_tasks_company_listing",
        "tasks",
        ["company_id", sa.text("created_at DESC"), sa.text("id DESC")],
    )
    op.create_index(
        "ix_tasks_terminal_finished_at",
        "tasks",
        ["finished_at"],
        postgresql_where=sa.text("status IN ('completed', 'failed', 'cancelled')"),
    )


def downgrade() -> None:
    op.drop_table("tasks")
    op.drop_table("companies")
