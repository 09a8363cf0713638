"""The insert's backlog count: one statement when the inserted rows are of one company.

`fairq_count_inserted()` (migration 0006) keeps its contract: `company_backlogs.unfinished`
goes up by the statement's `pending` and `processing` rows, and a statement that takes a
company's count above its `max_pending` fails with SQLSTATE `FQ429` (message `backlog quota
exceeded`, DETAIL `company=<id> max_pending=<n> unfinished=<n> adding=<n>`, `unfinished`
being the count before the statement). What changes is how:

- Rows of one company (every create and batch of the API): one UPDATE of the company's
  counter row, which aggregates the transition table itself and returns the new count, then
  a read of the company's `max_pending` in a statement of its own, after the counter's lock
  (a quota changed while the insert waited is the one checked, as under 0006). The counter's
  row lock is the only one the statement takes, so the check is race-free as before
  (concurrent creates queue on that row until the one before commits, and READ COMMITTED
  re-reads the row they waited for), and a single row is trivially locked in `company_id`
  order. Neither statement has parameters, so PL/pgSQL keeps one generic plan for each.
- Rows of several companies, rows none of which count, or no rows: 0006's statements
  unchanged (aggregate per company, lock the counters in `company_id` order, update, check).

Why: 0006's three statements passed the companies and their deltas as PL/pgSQL arrays, so
two of them had parameters, and where the plan cache found custom plans cheaper it planned
both again at every create (decision 0006, "Follow-up: the create's count in one
statement").

On a live table: CREATE OR REPLACE FUNCTION takes no lock on `tasks`; the trigger's calls
after the commit run the new body.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The function this revision installs, complete. First, rows of one company: its counter's
# UPDATE is the whole count. Every row is compared with the first one's company; nothing is
# updated when the rows are of several companies, when none counts, or when there are none
# (bool_and of no rows is NULL). The quota is read by a statement of its own, whose snapshot
# comes after the counter's lock: a quota changed while this insert waited for the one before
# it is the quota checked. NULL (no quota) never compares greater. Then, for every other
# insert, 0006's statements unchanged.
COUNT_INSERTED = """\
CREATE OR REPLACE FUNCTION fairq_count_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    quota integer;
    ids uuid[];
    deltas bigint[];
    over record;
BEGIN

    WITH added AS (
        SELECT bool_and(n.company_id = (SELECT f.company_id FROM new_tasks f LIMIT 1)) AS alone,
               count(*) FILTER (WHERE n.status IN ('pending', 'processing')) AS delta
        FROM new_tasks n
    )
    UPDATE company_backlogs b
    SET unfinished = b.unfinished + a.delta
    FROM added a
    WHERE a.alone AND a.delta <> 0
      AND b.company_id = (SELECT f.company_id FROM new_tasks f LIMIT 1)
    RETURNING b.company_id, b.unfinished, a.delta
    INTO over;
    IF FOUND THEN
        SELECT c.max_pending INTO quota
        FROM companies c
        WHERE c.id = (SELECT f.company_id FROM new_tasks f LIMIT 1);
        IF over.unfinished > quota THEN
            RAISE EXCEPTION USING
                ERRCODE = 'FQ429',
                MESSAGE = 'backlog quota exceeded',
                DETAIL = format('company=%s max_pending=%s unfinished=%s adding=%s',
                                over.company_id, quota,
                                over.unfinished - over.delta, over.delta);
        END IF;
        RETURN NULL;
    END IF;

    SELECT array_agg(d.company_id ORDER BY d.company_id), array_agg(d.delta ORDER BY d.company_id)
    INTO ids, deltas
    FROM (
    SELECT n.company_id, sum(CAST(n.status IN ('pending', 'processing') AS int)) AS delta
    FROM new_tasks n GROUP BY n.company_id
    ) d
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
END
$$"""

# 0006's function, which the downgrade puts back (a copy: a migration's text never changes).
COUNT_INSERTED_0006 = """\
CREATE OR REPLACE FUNCTION fairq_count_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    ids uuid[];
    deltas bigint[];
    over record;
BEGIN

    SELECT array_agg(d.company_id ORDER BY d.company_id), array_agg(d.delta ORDER BY d.company_id)
    INTO ids, deltas
    FROM (
    SELECT n.company_id, sum(CAST(n.status IN ('pending', 'processing') AS int)) AS delta
    FROM new_tasks n GROUP BY n.company_id
    ) d
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
END
$$"""


def upgrade() -> None:
    op.execute(COUNT_INSERTED)


def downgrade() -> None:
    op.execute(COUNT_INSERTED_0006)
