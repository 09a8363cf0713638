"""The functions and triggers in db/sql, and the runnable predicate written once.

- `db/sql/*.sql` holds the text of every function and trigger the database runs, grouped by
  table (`tasks.sql`: what happens on INSERT, UPDATE, DELETE and TRUNCATE of `tasks`;
  `companies.sql`; `claim.sql`); this revision ran the three files (since 0015, its copies of
  `tasks.sql` and `claim.sql` beside it; db/sql/README.md).
- `fairq_runnable(task, as_of)`: a task a worker may claim at `as_of` (`pending` and due), a
  SQL function the planner inlines; the claim (`fairq_claim`) and the figures of runnable
  work call it, so their plans are those of the predicate written out.

Every other function and trigger the files define is the one migrations 0003 to 0011 left,
text for text: running them replaces them with themselves. Decision 0009.

On a live system: CREATE OR REPLACE TRIGGER takes a SHARE ROW EXCLUSIVE lock on `tasks` and
`companies` until commit (writes wait a moment); a claim running meanwhile finishes with the
body it started with.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# What this revision ran: `companies.sql` is still the live file; `tasks.sql` and `claim.sql`
# as they were here, frozen when migration 0015 changed them (db/sql/README.md).
SQL_FILES = [
    Path(__file__).with_name("0012_tasks.sql"),
    Path(__file__).resolve().parents[2] / "db" / "sql" / "companies.sql",
    Path(__file__).with_name("0012_claim.sql"),
]
# The claim functions as 0011 created them, which call no fairq_runnable.
CLAIM_SQL_0011 = Path(__file__).with_name("0011_claim_in_the_server.sql")


def _run(sql: str) -> None:
    """Run a file's statements: several, with dollar-quoted bodies, as one simple query."""
    op.get_bind().connection.driver_connection.execute(sql)  # type: ignore[union-attr]


def upgrade() -> None:
    for path in SQL_FILES:
        _run(path.read_text())


def downgrade() -> None:
    op.execute("DROP FUNCTION fairq_claim(text, int)")
    op.execute("DROP FUNCTION fairq_move_claim_cursor(bigint, int)")
    op.execute("DROP FUNCTION fairq_allocate(bigint[], int[], int[], int, int)")
    _run(CLAIM_SQL_0011.read_text())
    op.execute("DROP FUNCTION fairq_runnable(tasks, timestamptz)")
