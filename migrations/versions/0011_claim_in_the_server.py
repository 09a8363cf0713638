"""The claim runs inside PostgreSQL, and claimers run in parallel (decision 0007).

- `fairq_claim(worker_id, batch_size)` and `fairq_allocate(...)`: the claim and its deficit
  round robin as PL/pgSQL functions, loaded from `db/sql/claim.sql` (with
  `fairq_move_claim_cursor`, which sets the cursor with its owner's rights); a worker sends one
  statement and its commit. No client round trip is left inside a section other claimers
  wait for.
- The claim cursor moves from the one-row table `claim_cursor` to two sequences,
  `fairq_claim_cursor_position` and `fairq_claim_cursor_credit`: a claimer moves the cursor
  under an advisory lock it releases before claiming any task, and a sequence's
  new value is seen by the next claimer at once, not at this claim's commit. The table's row
  is carried over.

On a live system: run it with the workers stopped (a worker of the previous release reads
`claim_cursor`, which is gone). CREATE FUNCTION and CREATE SEQUENCE take no lock on `tasks`.

The functions' text as this revision created them is `0011_claim.sql` beside this file
(`db/sql/claim.sql` is the live text, which migration 0015 changed): an upgrade through 0011
creates what 0011 created, and a downgrade from 0015 restores it.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

CLAIM_SQL = Path(__file__).resolve().with_name("0011_claim.sql")


def upgrade() -> None:
    for name, column in (("position", "ring_position"), ("credit", "credit")):
        op.execute(
            f"CREATE SEQUENCE fairq_claim_cursor_{name} AS bigint MINVALUE 0 START 0 NO CYCLE"
        )
        carried = f"SELECT greatest({column}, 0) FROM claim_cursor"  # noqa: S608  (constants only)
        op.execute(f"SELECT setval('fairq_claim_cursor_{name}', ({carried}))")
    op.drop_table("claim_cursor")
    # Several statements and dollar-quoted bodies: the driver sends them as one simple query.
    op.get_bind().connection.driver_connection.execute(CLAIM_SQL.read_text())  # type: ignore[union-attr]


def downgrade() -> None:
    op.execute("DROP FUNCTION fairq_claim(text, int)")
    op.execute("DROP FUNCTION fairq_move_claim_cursor(bigint, int)")
    op.execute("DROP FUNCTION fairq_allocate(bigint[], int[], int[], int, int)")
    op.create_table(
        "claim_cursor",
        sa.Column("id", sa.Boolean(), server_default=sa.text("true"), nullable=False),
        sa.Column("ring_position", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("credit", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.CheckConstraint("id", name=op.f("ck_claim_cursor_single_row")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_claim_cursor")),
    )
    op.execute(
        "INSERT INTO claim_cursor (ring_position, credit) "
        "SELECT p.last_value, k.last_value "
        "FROM fairq_claim_cursor_position p, fairq_claim_cursor_credit k"
    )
    # Migration 0005's settings for the table.
    op.execute(
        "ALTER TABLE claim_cursor SET "
        "(autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000)"
    )
    op.execute("DROP SEQUENCE fairq_claim_cursor_credit")
    op.execute("DROP SEQUENCE fairq_claim_cursor_position")
