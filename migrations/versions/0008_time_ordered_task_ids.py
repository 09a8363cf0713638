"""Task ids in creation-time order: UUID version 7 (RFC 9562) instead of random (version 4).

- `fairq_uuidv7()`: 48 bits of Unix time in milliseconds (`clock_timestamp()`), then the
  version (7), then random bits from `gen_random_uuid()` with its variant; PostgreSQL 15 and
  16 have no `uuidv7()` of their own.
- `tasks.id` defaults to it, and the batch create asks for it (`db.queue`).

Why: every status change writes a new row version, and each adds an entry to the primary
key. With random ids a batch's hundred entries land on a hundred leaf pages of the whole
key range; with time-ordered ids tasks created together sit together, so a claim and its
completion touch a few pages (docs/decisions/0002, "Measurements": a claim and a completion
of 100 tasks 8-20% cheaper). Ids stay unguessable in practice (74 random bits) and tell no
more than `created_at`, which the API shows anyway.

On a live table: setting a column default is a catalog change (no rewrite, no scan); rows
already there keep their ids.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Bytes 1-6 from the clock; bits 52 and 53 turn version 4's 0100 into version 7's 0111.
_UUIDV7 = """
CREATE FUNCTION fairq_uuidv7() RETURNS uuid
LANGUAGE sql VOLATILE PARALLEL SAFE AS $$
    SELECT CAST(encode(
        set_bit(set_bit(
            overlay(uuid_send(gen_random_uuid())
                    PLACING substring(int8send(
                        CAST(floor(extract(epoch FROM clock_timestamp()) * 1000) AS bigint))
                        FROM 3)
                    FROM 1 FOR 6),
            52, 1), 53, 1),
        'hex') AS uuid)
$$
"""


def upgrade() -> None:
    op.execute(_UUIDV7)
    op.execute("ALTER TABLE tasks ALTER COLUMN id SET DEFAULT fairq_uuidv7()")


def downgrade() -> None:
    op.execute("ALTER TABLE tasks ALTER COLUMN id SET DEFAULT gen_random_uuid()")
    op.execute("DROP FUNCTION fairq_uuidv7()")
