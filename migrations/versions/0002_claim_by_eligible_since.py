"""Claim candidates by "eligible since": per-company pending and stale-lease indexes.

The claim used to walk `ix_tasks_claimable (company_id, created_at) WHERE status IN
('pending', 'processing')` in created_at order and filter `run_after <= now()` and stale leases
row by row, so a company with many rows that are pending but not yet runnable (scheduled for
later, or all backed off because their webhook target is down), or with many live leases, made
every claim walk past all of them while holding the global claim lock (300,000 delayed rows in
one company of 50: 150 to 580 ms per claim instead of 5 to 8; `scripts/bench_claim.py
--delayed-backlog 300000`). The claim now reads each company's candidates as two index range
scans that stop after `per_company_cap` entries, and orders them by "eligible since"
(`db.queue.claim` says how that differs from created_at order):

- `ix_tasks_pending_company_run_after (company_id, run_after, id) WHERE status = 'pending'`,
  range `run_after <= now()`;
- `ix_tasks_processing_company_locked_at (company_id, locked_at, id) WHERE status =
  'processing'`, range `locked_at < now() - stale_after`.

`ix_tasks_claimable` serves nothing any more and is dropped. `ix_tasks_processing_locked_at`
stays: the poison-pill sweep (`fail_lost_tasks`) scans stale leases across all companies.

The indexes are built inside the migration's transaction (`CREATE INDEX`, which blocks writes
to `tasks` while it runs: 3 s at 3M rows, 7 s at 10M on the benchmark box): fine at our scale.
On a large production table, build them with `CREATE INDEX CONCURRENTLY` in a separate,
non-transactional migration (`op.get_context().autocommit_block()`), and drop the old one
`CONCURRENTLY` after the new claim is deployed.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "ix_tasks_pending_company_run_after",
        "tasks",
        ["company_id", "run_after", "id"],
        postgresql_where=sa.text("status = 'pending'"),
        postgresql_concurrently=False,
    )
    op.create_index(
        "ix_tasks_processing_company_locked_at",
        "tasks",
        ["company_id", "locked_at", "id"],
        postgresql_where=sa.text("status = 'processing'"),
        postgresql_concurrently=False,
    )
    op.drop_index("ix_tasks_claimable", table_name="tasks")


def downgrade() -> None:
    # 0001's claim index, exactly as 0001 created it.
    op.create_index(
        "ix_tasks_claimable",
        "tasks",
        ["company_id", "created_at"],
        postgresql_include=["status", "run_after", "locked_at"],
        postgresql_where=sa.text("status IN ('pending', 'processing')"),
        postgresql_concurrently=False,
    )
    op.drop_index("ix_tasks_processing_company_locked_at", table_name="tasks")
    op.drop_index("ix_tasks_pending_company_run_after", table_name="tasks")
