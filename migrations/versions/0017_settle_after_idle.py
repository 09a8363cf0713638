"""A company that ran short stays in the ring while it is busy (decision 0012).

`fairq_claim` (`db/sql/claim.sql`) settles a company that ran short only once no task of it
was created within the last second; until then it stays ready, its row unwritten. Settling
and promoting back a company fed a steady trickle wrote its `company_queues` row three times a
task, and under a held snapshot every claim read the index entries of those versions.

On a live system: CREATE OR REPLACE FUNCTION of the claim's functions takes no lock on the
tables; a claim of the previous text beside one of this text is harmless (a company settled
early is promoted back by the next create, as before).

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

CLAIM_SQL = Path(__file__).resolve().parents[2] / "db" / "sql" / "claim.sql"
# What migration 0015 ran, which a downgrade puts back.
CLAIM_SQL_0015 = Path(__file__).with_name("0015_claim.sql")


def _run(sql: str) -> None:
    # Several statements and dollar-quoted bodies: the driver sends them as one simple query.
    op.get_bind().connection.driver_connection.execute(sql)  # type: ignore[union-attr]


def upgrade() -> None:
    _run(CLAIM_SQL.read_text())


def downgrade() -> None:
    _run(CLAIM_SQL_0015.read_text())
