"""A row per worker process with a heartbeat: the one answer to "is this lease's holder alive"
(decision 0010).

`workers` (id = the `locked_by` its leases carry, host, pid, started_at, heartbeat_at). The
sweep takes back the leases of workers whose heartbeat is stale; leases no longer have a
heartbeat of their own (`locked_at` stays the claim's time).

On a live system: workers of the previous release heartbeat their leases and register no row;
the sweep takes back a lease whose holder has no row once its `locked_at` is older than the
stale window, so their long tasks would be taken over. Stop the old workers first.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "workers",
        sa.Column("id", sa.Text(), nullable=False),
        sa.Column("host", sa.Text(), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column(
            "started_at",
            postgresql.TIMESTAMP(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column(
            "heartbeat_at",
            postgresql.TIMESTAMP(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_workers")),
    )


def downgrade() -> None:
    op.drop_table("workers")
