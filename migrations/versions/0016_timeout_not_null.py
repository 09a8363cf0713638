"""Every task has its timeout: `tasks.timeout_seconds` NOT NULL, default 60 s.

Tasks stored before migration 0006 have none (NULL), and the worker used to work out their
type's default at each attempt. They get it once, here, as the worker did: `sleep` its
seconds rounded up plus 30, `send_email` 90, every other type 60 (also where a payload does
not read). A row inserted without a timeout (SQL written by hand, not the API, which always
sets the type's) gets the generic 60 s from the column's default.

On a live system: the UPDATE touches only the rows without a timeout (none on a system
created after 0006); SET NOT NULL scans `tasks` once under an ACCESS EXCLUSIVE lock. The
default is a constant: no rewrite.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The types' defaults as they stood at this revision (worker/tasktypes), frozen in SQL; within
# the column's bounds (1 .. 86,400).
_BACKFILL = """
UPDATE tasks
SET timeout_seconds = CASE
    WHEN type = 'sleep' AND jsonb_typeof(payload -> 'seconds') = 'number'
         AND (payload ->> 'seconds')::numeric BETWEEN 0 AND 86000
        THEN ceil((payload ->> 'seconds')::numeric)::int + 30
    WHEN type = 'send_email' THEN 90
    ELSE 60
END
WHERE timeout_seconds IS NULL
"""


def upgrade() -> None:
    op.execute(_BACKFILL)
    op.alter_column(
        "tasks", "timeout_seconds", existing_type=sa.Integer(), nullable=False,
        server_default=sa.text("60"),
    )  # fmt: skip


def downgrade() -> None:
    # The values stay: each is what the worker of 0015 would have used.
    op.alter_column(
        "tasks", "timeout_seconds", existing_type=sa.Integer(), nullable=True, server_default=None
    )
