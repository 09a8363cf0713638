"""Weighted fair claim: company weights and in-flight limits, per-company queue state, triggers.

- `companies.weight` (1..1000, default 1) and `companies.max_in_flight` (1..100000 or NULL).
- `company_queues`: one row per company, the claim's view of it (`db.models.CompanyQueue`):
  `due_at`, a lower bound of its earliest pending `run_after`; `ready`, whether the claimer
  serves it; `ring_position`, its place in the deficit-round-robin ring (from the sequence
  `company_ring_positions`). Backfilled here from the pending rows.
- `claim_cursor`: the one row saying where the next claim continues the ring.
- Triggers keep `company_queues` true whatever writes `tasks` (the API, workers, an older
  release during a rolling deploy, an operator's SQL):
  * AFTER INSERT ON companies: the company's `company_queues` row; AFTER UPDATE OF weight,
    max_in_flight: their copies in it (the claim reads them with the ring, without a join).
  * AFTER INSERT ON tasks, per statement: for each company with new pending rows, take the
    company's wake-up lock in shared mode, then lower `due_at` to the earliest new
    `run_after` if it is later (or NULL).
  * AFTER UPDATE ON tasks, per row, only when a row becomes pending or its `run_after`
    moves earlier (retry, release, requeue of an expired lease, API retry): the same.
  The UPDATE writes only when it lowers `due_at`, so a busy company's creates never queue on
  its row. The claimer raises `due_at` (a company found without runnable work) only while
  holding the same lock exclusively (`pg_try_advisory_xact_lock`), and reads the company's
  tasks after taking it: a task whose transaction is still open holds the lock in shared
  mode, so it can never be missed (docs/design.md, "The claim").

On a live table: the new columns have constant defaults (no rewrite); CREATE TRIGGER takes a
SHARE ROW EXCLUSIVE lock on `tasks`, so writes to `tasks` wait for this migration's commit
(the backfill reads one index entry per company), and no task can slip in between the
backfill and the triggers. No index on `tasks` is built: the claim reads the indexes of 0002.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# A company's wake-up lock is pg_advisory_xact_lock(namespace, hashtext(id) & 63): "fqwk" in
# ASCII, and one of 64 buckets, so a statement that touches 20,000 companies takes at most 64
# locks. db/queue.py WAKE_LOCK_NAMESPACE and WAKE_LOCK_BUCKETS must stay equal
# (tests/test_fair_claim.py).
WAKE_LOCK_NAMESPACE = 0x66_71_77_6B
_BUCKET = "hashtext({}::text) & 63"

_NOTE_PENDING_INSERT = f"""
CREATE FUNCTION fairq_note_pending_inserted() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- Shared lock first, then the check: the claimer raises due_at only while holding the
    -- lock exclusively, so it either sees this transaction's tasks or waits it out.
    PERFORM pg_advisory_xact_lock_shared({WAKE_LOCK_NAMESPACE}, n.bucket)
    FROM (SELECT DISTINCT {_BUCKET.format("company_id")} AS bucket
          FROM new_tasks WHERE status = 'pending') n;
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        -- This transaction's snapshot may predate a claimer's settle: locking the row
        -- turns that into a serialization failure (the writer retries), not a lost wake-up.
        PERFORM 1 FROM company_queues q
        WHERE q.company_id IN (SELECT company_id FROM new_tasks WHERE status = 'pending')
        FOR SHARE;
    END IF;
    UPDATE company_queues q
    SET due_at = n.due_at
    FROM (SELECT company_id, min(run_after) AS due_at
          FROM new_tasks WHERE status = 'pending' GROUP BY company_id) n
    WHERE q.company_id = n.company_id
      AND (q.due_at IS NULL OR q.due_at > n.due_at);
    RETURN NULL;
END
$$
"""  # noqa: S608  (constants only, no input)

_NOTE_PENDING_UPDATE = f"""
CREATE FUNCTION fairq_note_pending_updated() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared({WAKE_LOCK_NAMESPACE}, {_BUCKET.format("NEW.company_id")});
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        -- This transaction's snapshot may predate a claimer's settle: locking the row
        -- turns that into a serialization failure (the writer retries), not a lost wake-up.
        PERFORM 1 FROM company_queues q WHERE q.company_id = NEW.company_id FOR SHARE;
    END IF;
    UPDATE company_queues q
    SET due_at = NEW.run_after
    WHERE q.company_id = NEW.company_id
      AND (q.due_at IS NULL OR q.due_at > NEW.run_after);
    RETURN NULL;
END
$$
"""  # noqa: S608  (constants only, no input)

_ADD_COMPANY_QUEUE = """
CREATE FUNCTION fairq_add_company_queue() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO company_queues (company_id, weight, max_in_flight)
    VALUES (NEW.id, NEW.weight, NEW.max_in_flight);
    RETURN NULL;
END
$$
"""

_COPY_COMPANY_LIMITS = """
CREATE FUNCTION fairq_copy_company_limits() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE company_queues
    SET weight = NEW.weight, max_in_flight = NEW.max_in_flight
    WHERE company_id = NEW.id;
    RETURN NULL;
END
$$
"""


def upgrade() -> None:
    op.add_column(
        "companies", sa.Column("weight", sa.Integer(), server_default=sa.text("1"), nullable=False)
    )
    op.add_column("companies", sa.Column("max_in_flight", sa.Integer(), nullable=True))
    op.create_check_constraint(
        op.f("ck_companies_weight_range"), "companies", "weight BETWEEN 1 AND 1000"
    )
    op.create_check_constraint(
        op.f("ck_companies_max_in_flight_range"),
        "companies",
        "max_in_flight BETWEEN 1 AND 100000",
    )
    op.execute("CREATE SEQUENCE company_ring_positions AS bigint")
    op.create_table(
        "company_queues",
        sa.Column("company_id", sa.UUID(), nullable=False),
        sa.Column("due_at", postgresql.TIMESTAMP(timezone=True), nullable=True),
        sa.Column("ready", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column("ring_position", sa.BigInteger(), nullable=True),
        sa.Column("weight", sa.Integer(), server_default=sa.text("1"), nullable=False),
        sa.Column("max_in_flight", sa.Integer(), nullable=True),
        sa.ForeignKeyConstraint(
            ["company_id"],
            ["companies.id"],
            name=op.f("fk_company_queues_company_id_companies"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("company_id", name=op.f("pk_company_queues")),
    )
    op.create_index(
        "ix_company_queues_ring_position",
        "company_queues",
        ["ring_position"],
        postgresql_where=sa.text("ready"),
    )
    op.create_index(
        "ix_company_queues_waiting_due_at",
        "company_queues",
        ["due_at"],
        postgresql_where=sa.text("NOT ready AND due_at IS NOT NULL"),
    )
    op.create_table(
        "claim_cursor",
        sa.Column("id", sa.Boolean(), server_default=sa.text("true"), nullable=False),
        sa.Column("ring_position", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("credit", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.CheckConstraint("id", name=op.f("ck_claim_cursor_single_row")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_claim_cursor")),
    )
    op.execute("INSERT INTO claim_cursor DEFAULT VALUES")
    op.execute(_ADD_COMPANY_QUEUE)
    op.execute(_COPY_COMPANY_LIMITS)
    op.execute(_NOTE_PENDING_INSERT)
    op.execute(_NOTE_PENDING_UPDATE)
    # The triggers before the backfill: from here on every write to tasks waits for commit.
    op.execute(
        "CREATE TRIGGER companies_add_queue AFTER INSERT ON companies "
        "FOR EACH ROW EXECUTE FUNCTION fairq_add_company_queue()"
    )
    op.execute(
        "CREATE TRIGGER companies_copy_limits AFTER UPDATE OF weight, max_in_flight "
        "ON companies FOR EACH ROW EXECUTE FUNCTION fairq_copy_company_limits()"
    )
    op.execute(
        "CREATE TRIGGER tasks_pending_inserted AFTER INSERT ON tasks "
        "REFERENCING NEW TABLE AS new_tasks "
        "FOR EACH STATEMENT EXECUTE FUNCTION fairq_note_pending_inserted()"
    )
    op.execute(
        "CREATE TRIGGER tasks_pending_updated AFTER UPDATE ON tasks FOR EACH ROW "
        "WHEN (NEW.status = 'pending' AND (OLD.status <> 'pending' "
        "OR NEW.run_after < OLD.run_after OR NEW.company_id <> OLD.company_id)) "
        "EXECUTE FUNCTION fairq_note_pending_updated()"
    )
    # One index probe per company (ix_tasks_pending_company_run_after); the claimer promotes
    # every company whose due_at has come.
    op.execute(
        """
        INSERT INTO company_queues (company_id, due_at, weight, max_in_flight)
        SELECT c.id,
               (SELECT t.run_after FROM tasks t
                WHERE t.company_id = c.id AND t.status = 'pending'
                ORDER BY t.run_after LIMIT 1),
               c.weight, c.max_in_flight
        FROM companies c
        """
    )


def downgrade() -> None:
    op.execute("DROP TRIGGER tasks_pending_updated ON tasks")
    op.execute("DROP TRIGGER tasks_pending_inserted ON tasks")
    op.execute("DROP TRIGGER companies_copy_limits ON companies")
    op.execute("DROP TRIGGER companies_add_queue ON companies")
    op.execute("DROP FUNCTION fairq_note_pending_updated()")
    op.execute("DROP FUNCTION fairq_note_pending_inserted()")
    op.execute("DROP FUNCTION fairq_copy_company_limits()")
    op.execute("DROP FUNCTION fairq_add_company_queue()")
    op.drop_table("claim_cursor")
    op.drop_index("ix_company_queues_waiting_due_at", table_name="company_queues")
    op.drop_index("ix_company_queues_ring_position", table_name="company_queues")
    op.drop_table("company_queues")
    op.execute("DROP SEQUENCE company_ring_positions")
    op.drop_constraint(op.f("ck_companies_max_in_flight_range"), "companies", type_="check")
    op.drop_constraint(op.f("ck_companies_weight_range"), "companies", type_="check")
    op.drop_column("companies", "max_in_flight")
    op.drop_column("companies", "weight")
