"""The claim floor: a claim reads a company's pending tasks from where they begin (decision 0012).

- `company_queues.claim_floor_at`, `claim_floor_id`: no pending task of the company has a
  `(run_after, id)` below them; NULL (every existing row): no floor yet, the claim reads from
  the beginning until it first raises it.
- `fairq_claim` (`db/sql/claim.sql`) scans `ix_tasks_pending_company_run_after` from the
  floor and raises it, at its end, to the earliest pending task of each company it served,
  under the company's wake-up lock (tried); the pending triggers
  (`db/sql/tasks.sql`) lower it whenever a task becomes pending below it. So the index
  entries of tasks claimed before are not read again, even while a snapshot held elsewhere
  keeps them in the index.

On a live system: the new columns have no default (no rewrite); CREATE OR REPLACE FUNCTION
takes no lock on `tasks`. Run it with the workers stopped (a claim of the previous text and
one of this text may run side by side, but a claim of the previous text does not raise the
floor, and the floor is only a lower bound, so that is harmless either way).

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SQL = Path(__file__).resolve().parents[2] / "db" / "sql"
# What migration 0012 ran, which a downgrade puts back.
TASKS_SQL_0012 = Path(__file__).with_name("0012_tasks.sql")
CLAIM_SQL_0012 = Path(__file__).with_name("0012_claim.sql")
# What this revision installs of `db/sql/claim.sql` (migration 0017 changed it).
CLAIM_SQL_0015 = Path(__file__).with_name("0015_claim.sql")
_CLAIM_FUNCTIONS = (
    "fairq_claim(text, int)",
    "fairq_move_claim_cursor(bigint, int)",
    "fairq_allocate(bigint[], int[], int[], int, int)",
)


def _run(sql: str) -> None:
    # Several statements and dollar-quoted bodies: the driver sends them as one simple query.
    op.get_bind().connection.driver_connection.execute(sql)  # type: ignore[union-attr]


def _replace_claim(sql: str) -> None:
    for function in _CLAIM_FUNCTIONS:
        op.execute(f"DROP FUNCTION {function}")
    _run(sql)


def upgrade() -> None:
    op.add_column(
        "company_queues", sa.Column("claim_floor_at", postgresql.TIMESTAMP(timezone=True))
    )
    op.add_column("company_queues", sa.Column("claim_floor_id", postgresql.UUID(as_uuid=True)))
    _run((SQL / "tasks.sql").read_text())
    _replace_claim(CLAIM_SQL_0015.read_text())


def downgrade() -> None:
    _replace_claim(CLAIM_SQL_0012.read_text())
    _run(TASKS_SQL_0012.read_text())
    op.drop_column("company_queues", "claim_floor_id")
    op.drop_column("company_queues", "claim_floor_at")
