"""A company's API keys in a table of their own: several at once, each revocable and expiring.

- `api_keys`: `id`, `company_id` (deleted with its company), `key_hash` (SHA-256 hex of the
  key, unique: authentication's lookup), `created_at`, `last_used_at` (set by authentication
  at most once a minute per key), `expires_at` (NULL: never), `revoked_at` (NULL: not
  revoked). A key authenticates while it is neither revoked nor expired (design §3).
- Every company's key moves there (`companies.api_key_hash`, dropped): the keys in use keep
  working, with their company's `created_at` as theirs.

On a live system: run it with the API stopped (an API of the previous release looks keys up
in `companies.api_key_hash`). The copy reads `companies` once; nothing else is locked.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create `api_keys`, move every company's key into it, drop `companies.api_key_hash`."""
    op.create_table(
        "api_keys",
        sa.Column(
            "id",
            postgresql.UUID(as_uuid=True),
            primary_key=True,
            server_default=sa.text("gen_random_uuid()"),
        ),
        sa.Column(
            "company_id",
            postgresql.UUID(as_uuid=True),
            sa.ForeignKey(
                "companies.id", name="fk_api_keys_company_id_companies", ondelete="CASCADE"
            ),
            nullable=False,
        ),
        sa.Column("key_hash", sa.Text(), nullable=False),
        sa.Column(
            "created_at",
            postgresql.TIMESTAMP(timezone=True),
            nullable=False,
            server_default=sa.text("now()"),
        ),
        sa.Column("last_used_at", postgresql.TIMESTAMP(timezone=True)),
        sa.Column("expires_at", postgresql.TIMESTAMP(timezone=True)),
        sa.Column("revoked_at", postgresql.TIMESTAMP(timezone=True)),
        sa.PrimaryKeyConstraint("id", name="pk_api_keys"),
        sa.UniqueConstraint("key_hash", name="uq_api_keys_key_hash"),
    )
    op.create_index("ix_api_keys_company_id", "api_keys", ["company_id"])
    op.execute(
        "INSERT INTO api_keys (company_id, key_hash, created_at) "
        "SELECT id, api_key_hash, created_at FROM companies"
    )
    op.drop_constraint("uq_companies_api_key_hash", "companies", type_="unique")
    op.drop_column("companies", "api_key_hash")


def downgrade() -> None:
    """Give each company back one key: its newest active one, else its newest.

    A company's other keys are lost; a company left without any key gets an unusable
    placeholder hash (the admin issues it a new key after upgrading again).
    """
    op.add_column("companies", sa.Column("api_key_hash", sa.Text()))
    op.execute(
        """
        UPDATE companies c SET api_key_hash = COALESCE(
            (SELECT k.key_hash FROM api_keys k WHERE k.company_id = c.id
             ORDER BY (k.revoked_at IS NULL AND (k.expires_at IS NULL OR k.expires_at > now()))
                      DESC, k.created_at DESC
             LIMIT 1),
            'no key: ' || c.id::text)
        """
    )
    op.alter_column("companies", "api_key_hash", nullable=False)
    op.create_unique_constraint("uq_companies_api_key_hash", "companies", ["api_key_hash"])
    op.drop_index("ix_api_keys_company_id", table_name="api_keys")
    op.drop_table("api_keys")
