"""The tenant's controls: backlog quota, pause, results and per-task timeouts.

- `companies.max_pending` (1..10,000,000 or NULL = unlimited): the most unfinished tasks
  (`pending` or `processing`) the company may have. `companies.paused`: its tasks are
  accepted and kept but never claimed; copied to `company_queues.paused`, where the claim
  reads it, by the trigger that already copies `weight` and `max_in_flight`. Pausing also
  takes the company out of the ring (`ready = false`); migration 0007 gives the claim an
  index of waiting companies that leaves paused ones out.
- `company_backlogs`: one row per company, `unfinished`, its count of `pending` and
  `processing` tasks, kept by statement-level triggers on `tasks` that read their transition
  tables: one counter update per company per statement, whatever the rows. A statement that
  takes a company's count above its `max_pending` fails with SQLSTATE `FQ429` (message
  `backlog quota exceeded`, DETAIL `company=<id> max_pending=<n> unfinished=<n> adding=<n>`),
  and nothing it wrote stays. TRUNCATE of `tasks` zeroes every count. The counter row's lock
  makes the check race-free: concurrent creates of one company queue on it until the one
  before commits. Rows are locked in
  `company_id` order, so two statements over the same companies cannot deadlock on them.
  Unfinished rather than pending only: the claim (pending -> processing) does not change the
  count, so the claim, serialized across the cluster, writes no counter.
- `tasks.result` (jsonb, what the handler returned) and `tasks.timeout_seconds`
  (1..86,400, NULL for tasks created before this migration: the type's default applies).

On a live table: the new columns have no default or a constant one (no rewrite). CREATE
TRIGGER takes a SHARE ROW EXCLUSIVE lock on `tasks` until commit, so writes to `tasks` wait
for the backfill of `company_backlogs`, which counts the unfinished rows through the partial
indexes on `status = 'pending'` and `status = 'processing'` (about a second per million), and
no task can slip in between the count and the triggers.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ADD_COMPANY_BACKLOG = """
CREATE FUNCTION fairq_add_company_backlog() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO company_backlogs (company_id) VALUES (NEW.id);
    RETURN NULL;
END
$$
"""

# Replaces 0003's function: pausing also takes the company out of the ring at once (the API's
# pause also takes the claimers' lock before it commits: db/companies.py `pause_company`).
_COPY_COMPANY_LIMITS = """
CREATE OR REPLACE FUNCTION fairq_copy_company_limits() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE company_queues
    SET weight = NEW.weight, max_in_flight = NEW.max_in_flight, paused = NEW.paused,
        ready = ready AND NOT NEW.paused
    WHERE company_id = NEW.id;
    RETURN NULL;
END
$$
"""

_COPY_COMPANY_LIMITS_0003 = """
CREATE OR REPLACE FUNCTION fairq_copy_company_limits() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE company_queues
    SET weight = NEW.weight, max_in_flight = NEW.max_in_flight
    WHERE company_id = NEW.id;
    RETURN NULL;
END
$$
"""

# Applies `deltas` (company_id, delta), a query over the trigger's transition tables: locks
# the counters in company_id order, adds, and refuses an increase beyond max_pending. Most
# statements change no count (a claim, a heartbeat): they stop after one pass over the rows.
_APPLY_BACKLOG_DELTAS = """
    SELECT array_agg(d.company_id ORDER BY d.company_id), array_agg(d.delta ORDER BY d.company_id)
    INTO ids, deltas
    FROM ({deltas}) d
    WHERE d.delta <> 0;
    IF ids IS NULL THEN
        RETURN NULL;
    END IF;
    PERFORM 1 FROM company_backlogs b
    WHERE b.company_id = ANY(ids)
    ORDER BY b.company_id
    FOR NO KEY UPDATE;
    WITH moved AS (
        UPDATE company_backlogs b
        SET unfinished = b.unfinished + u.delta
        FROM unnest(ids, deltas) AS u(company_id, delta)
        WHERE b.company_id = u.company_id
        RETURNING b.company_id, b.unfinished, u.delta
    )
    SELECT m.company_id, c.max_pending, m.unfinished, m.delta
    INTO over
    FROM moved m JOIN companies c ON c.id = m.company_id
    WHERE m.delta > 0 AND c.max_pending IS NOT NULL AND m.unfinished > c.max_pending
    LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION USING
            ERRCODE = 'FQ429',
            MESSAGE = 'backlog quota exceeded',
            DETAIL = format('company=%s max_pending=%s unfinished=%s adding=%s',
                            over.company_id, over.max_pending,
                            over.unfinished - over.delta, over.delta);
    END IF;
    RETURN NULL;
"""


def _counting_function(name: str, deltas: str) -> str:
    """CREATE FUNCTION `name`, a statement trigger applying `deltas` to the counters."""
    body = _APPLY_BACKLOG_DELTAS.replace("{deltas}", deltas)
    return (
        f"CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$\n"
        "DECLARE\n    ids uuid[];\n    deltas bigint[];\n    over record;\n"
        f"BEGIN\n{body}END\n$$"
    )


_COUNT_INSERTED = _counting_function(
    "fairq_count_inserted",
    """
    SELECT n.company_id, sum(CAST(n.status IN ('pending', 'processing') AS int)) AS delta
    FROM new_tasks n GROUP BY n.company_id
    """,
)
# No join of the two tables: per company, the new rows counted up and the old ones down.
_COUNT_UPDATED = _counting_function(
    "fairq_count_updated",
    """
    SELECT c.company_id, sum(c.delta) AS delta
    FROM (SELECT n.company_id, CAST(n.status IN ('pending', 'processing') AS int) AS delta
          FROM new_tasks n
          UNION ALL
          SELECT o.company_id, -CAST(o.status IN ('pending', 'processing') AS int)
          FROM old_tasks o) c
    GROUP BY c.company_id
    """,
)
_COUNT_DELETED = _counting_function(
    "fairq_count_deleted",
    """
    SELECT o.company_id, -sum(CAST(o.status IN ('pending', 'processing') AS int)) AS delta
    FROM old_tasks o GROUP BY o.company_id
    """,
)


# TRUNCATE fires no DELETE trigger: an emptied table has no unfinished task.
_ZERO_BACKLOGS = """
CREATE FUNCTION fairq_zero_backlogs() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE company_backlogs SET unfinished = 0 WHERE unfinished <> 0;
    RETURN NULL;
END
$$
"""


def upgrade() -> None:
    op.add_column("companies", sa.Column("max_pending", sa.Integer(), nullable=True))
    op.add_column(
        "companies",
        sa.Column("paused", sa.Boolean(), server_default=sa.text("false"), nullable=False),
    )
    op.create_check_constraint(
        op.f("ck_companies_max_pending_range"),
        "companies",
        "max_pending BETWEEN 1 AND 10000000",
    )
    op.add_column(
        "company_queues",
        sa.Column("paused", sa.Boolean(), server_default=sa.text("false"), nullable=False),
    )
    op.add_column("tasks", sa.Column("result", postgresql.JSONB(), nullable=True))
    op.add_column("tasks", sa.Column("timeout_seconds", sa.Integer(), nullable=True))
    op.create_check_constraint(
        op.f("ck_tasks_timeout_seconds_range"), "tasks", "timeout_seconds BETWEEN 1 AND 86400"
    )
    op.create_table(
        "company_backlogs",
        sa.Column("company_id", sa.UUID(), nullable=False),
        sa.Column("unfinished", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.ForeignKeyConstraint(
            ["company_id"],
            ["companies.id"],
            name=op.f("fk_company_backlogs_company_id_companies"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("company_id", name=op.f("pk_company_backlogs")),
    )
    op.execute(_COPY_COMPANY_LIMITS)
    op.execute("DROP TRIGGER companies_copy_limits ON companies")
    op.execute(
        "CREATE TRIGGER companies_copy_limits AFTER UPDATE OF weight, max_in_flight, paused "
        "ON companies FOR EACH ROW EXECUTE FUNCTION fairq_copy_company_limits()"
    )
    op.execute(_ADD_COMPANY_BACKLOG)
    op.execute(_COUNT_INSERTED)
    op.execute(_COUNT_UPDATED)
    op.execute(_COUNT_DELETED)
    op.execute(_ZERO_BACKLOGS)
    op.execute(
        "CREATE TRIGGER companies_add_backlog AFTER INSERT ON companies "
        "FOR EACH ROW EXECUTE FUNCTION fairq_add_company_backlog()"
    )
    # The triggers before the backfill: from here on every write to tasks waits for commit.
    op.execute(
        "CREATE TRIGGER tasks_count_inserted AFTER INSERT ON tasks "
        "REFERENCING NEW TABLE AS new_tasks "
        "FOR EACH STATEMENT EXECUTE FUNCTION fairq_count_inserted()"
    )
    op.execute(
        "CREATE TRIGGER tasks_count_updated AFTER UPDATE ON tasks "
        "REFERENCING OLD TABLE AS old_tasks NEW TABLE AS new_tasks "
        "FOR EACH STATEMENT EXECUTE FUNCTION fairq_count_updated()"
    )
    op.execute(
        "CREATE TRIGGER tasks_count_deleted AFTER DELETE ON tasks "
        "REFERENCING OLD TABLE AS old_tasks "
        "FOR EACH STATEMENT EXECUTE FUNCTION fairq_count_deleted()"
    )
    op.execute(
        "CREATE TRIGGER tasks_count_truncated AFTER TRUNCATE ON tasks "
        "FOR EACH STATEMENT EXECUTE FUNCTION fairq_zero_backlogs()"
    )
    op.execute(
        """
        INSERT INTO company_backlogs (company_id, unfinished)
        SELECT c.id,
               (SELECT count(*) FROM tasks t WHERE t.company_id = c.id AND t.status = 'pending')
               + (SELECT count(*) FROM tasks t
                  WHERE t.company_id = c.id AND t.status = 'processing')
        FROM companies c
        """
    )


def downgrade() -> None:
    op.execute("DROP TRIGGER tasks_count_truncated ON tasks")
    op.execute("DROP TRIGGER tasks_count_deleted ON tasks")
    op.execute("DROP TRIGGER tasks_count_updated ON tasks")
    op.execute("DROP TRIGGER tasks_count_inserted ON tasks")
    op.execute("DROP TRIGGER companies_add_backlog ON companies")
    op.execute("DROP FUNCTION fairq_zero_backlogs()")
    op.execute("DROP FUNCTION fairq_count_deleted()")
    op.execute("DROP FUNCTION fairq_count_updated()")
    op.execute("DROP FUNCTION fairq_count_inserted()")
    op.execute("DROP FUNCTION fairq_add_company_backlog()")
    op.execute("DROP TRIGGER companies_copy_limits ON companies")
    op.execute(_COPY_COMPANY_LIMITS_0003)
    op.execute(
        "CREATE TRIGGER companies_copy_limits AFTER UPDATE OF weight, max_in_flight "
        "ON companies FOR EACH ROW EXECUTE FUNCTION fairq_copy_company_limits()"
    )
    op.drop_table("company_backlogs")
    op.drop_constraint(op.f("ck_tasks_timeout_seconds_range"), "tasks", type_="check")
    op.drop_column("tasks", "timeout_seconds")
    op.drop_column("tasks", "result")
    op.drop_column("company_queues", "paused")
    op.drop_constraint(op.f("ck_companies_max_pending_range"), "companies", type_="check")
    op.drop_column("companies", "paused")
    op.drop_column("companies", "max_pending")
