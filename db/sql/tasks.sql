-- The table `tasks`: what PostgreSQL itself does when tasks are written, and the functions
-- the statements read tasks with.
--
--   INSERT    tasks_count_inserted    backlog counts; a statement beyond a company's
--                                     max_pending fails with SQLSTATE FQ429 (decision 0006)
--             tasks_pending_inserted  wake-up: lowers the company's due_at (design §4)
--   UPDATE    tasks_count_updated     backlog counts, as INSERT
--             tasks_pending_updated   wake-up, for a row that becomes pending or comes due
--                                     earlier
--   DELETE    tasks_count_deleted     backlog counts
--   TRUNCATE  tasks_count_truncated   every backlog count to 0
--
-- The claim (pending -> processing) is db/sql/claim.sql; the rest of the state machine's
-- transitions are statements of db/queue.py (the API's), db/claims.py (the worker's, fenced
-- by the lease) and db/workers.py (the sweep), and fire the triggers above like any writer.
--
-- Changing this file needs a migration that re-runs it (db/sql/README.md).

-- A task's id, the column's default: RFC 9562 version 7, so tasks created together sit
-- together in the primary key. Bytes 1-6 from the clock (Unix milliseconds); bits 52 and 53
-- turn gen_random_uuid()'s version 4 (0100) into version 7 (0111). Migration 0008.
CREATE OR REPLACE FUNCTION fairq_uuidv7() RETURNS uuid
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
$$;

-- Runnable: a task a worker may claim at `as_of`, as far as the task says (its company may
-- still hold it back: paused, or at its max_in_flight; the claim reads those in
-- company_queues). The one home of this predicate: the claim and every figure of runnable
-- work use it. A SQL function the planner inlines: a statement that calls it is planned as
-- if the two comparisons were written in it, so its partial index
-- (ix_tasks_pending_company_run_after, WHERE status = 'pending') and its range on run_after
-- serve it as before; hence IMMUTABLE and not STRICT, which inlining requires here.
CREATE OR REPLACE FUNCTION fairq_runnable(task tasks, as_of timestamptz) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT task.status = 'pending' AND task.run_after <= as_of
$$;

-- Wake-up (migration 0003; design §4, "The claim"). A company's wake-up lock is
-- pg_advisory_xact_lock(1718712171, hashtext(company_id) & 63): "fqwk" in ASCII, and one of
-- 64 buckets, so a statement that touches 20,000 companies takes at most 64 locks
-- (db/claims.py WAKE_LOCK_NAMESPACE and WAKE_LOCK_BUCKETS). The writer holds it shared to
-- commit; the claimer raises due_at only while holding it exclusively, and reads the
-- company's tasks after taking it, so a task whose transaction is still open is never missed.
-- The UPDATE writes only when it lowers due_at: a busy company's creates never queue on its
-- row.
-- The same triggers keep the claim floor (decision 0012): `company_queues.(claim_floor_at,
-- claim_floor_id)`, below which no pending task of the company lies (NULL: no floor). The
-- claim scans the company's pending range from it and raises it under the wake-up lock taken
-- exclusively (db/sql/claim.sql); these lower it, under the lock taken shared, whenever a
-- task becomes pending below it, so the claimer either sees that task or the writer waits
-- for its commit and lowers the floor it raised. A held snapshot elsewhere keeps the index
-- entries of claimed tasks; the floor keeps claims from reading them again.
CREATE OR REPLACE FUNCTION fairq_note_pending_inserted() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- Shared lock first, then the check: the claimer raises due_at and the floor only while
    -- holding the lock exclusively, so it either sees this transaction's tasks or waits it
    -- out.
    PERFORM pg_advisory_xact_lock_shared(1718712171, n.bucket)
    FROM (SELECT DISTINCT hashtext(company_id::text) & 63 AS bucket
          FROM new_tasks WHERE status = 'pending') n;
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        -- This transaction's snapshot may predate a claimer's settle: locking the row
        -- turns that into a serialization failure (the writer retries), not a lost wake-up.
        PERFORM 1 FROM company_queues q
        WHERE q.company_id IN (SELECT company_id FROM new_tasks WHERE status = 'pending')
        FOR SHARE;
    END IF;
    -- Each company's first new pending task in claim order; writes only what it lowers.
    UPDATE company_queues q
    SET due_at = CASE WHEN q.due_at IS NULL OR q.due_at > n.run_after THEN n.run_after
                      ELSE q.due_at END,
        claim_floor_at = CASE WHEN (q.claim_floor_at, q.claim_floor_id) > (n.run_after, n.id)
                              THEN n.run_after ELSE q.claim_floor_at END,
        claim_floor_id = CASE WHEN (q.claim_floor_at, q.claim_floor_id) > (n.run_after, n.id)
                              THEN n.id ELSE q.claim_floor_id END
    FROM (SELECT DISTINCT ON (company_id) company_id, run_after, id
          FROM new_tasks WHERE status = 'pending'
          ORDER BY company_id, run_after, id) n
    WHERE q.company_id = n.company_id
      AND (q.due_at IS NULL OR q.due_at > n.run_after
           OR (q.claim_floor_at, q.claim_floor_id) > (n.run_after, n.id));
    RETURN NULL;
END
$$;

CREATE OR REPLACE TRIGGER tasks_pending_inserted AFTER INSERT ON tasks
REFERENCING NEW TABLE AS new_tasks
FOR EACH STATEMENT EXECUTE FUNCTION fairq_note_pending_inserted();
CREATE OR REPLACE FUNCTION fairq_note_pending_updated() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared(1718712171, hashtext(NEW.company_id::text) & 63);
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        -- This transaction's snapshot may predate a claimer's settle: locking the row
        -- turns that into a serialization failure (the writer retries), not a lost wake-up.
        PERFORM 1 FROM company_queues q WHERE q.company_id = NEW.company_id FOR SHARE;
    END IF;
    UPDATE company_queues q
    SET due_at = CASE WHEN q.due_at IS NULL OR q.due_at > NEW.run_after THEN NEW.run_after
                      ELSE q.due_at END,
        claim_floor_at = CASE WHEN (q.claim_floor_at, q.claim_floor_id) > (NEW.run_after, NEW.id)
                              THEN NEW.run_after ELSE q.claim_floor_at END,
        claim_floor_id = CASE WHEN (q.claim_floor_at, q.claim_floor_id) > (NEW.run_after, NEW.id)
                              THEN NEW.id ELSE q.claim_floor_id END
    WHERE q.company_id = NEW.company_id
      AND (q.due_at IS NULL OR q.due_at > NEW.run_after
           OR (q.claim_floor_at, q.claim_floor_id) > (NEW.run_after, NEW.id));
    RETURN NULL;
END
$$;

CREATE OR REPLACE TRIGGER tasks_pending_updated AFTER UPDATE ON tasks FOR EACH ROW
WHEN (NEW.status = 'pending' AND (OLD.status <> 'pending'
      OR NEW.run_after < OLD.run_after OR NEW.company_id <> OLD.company_id))
EXECUTE FUNCTION fairq_note_pending_updated();

-- Backlog counts (migration 0006; decision 0006): `company_backlogs.unfinished` is the
-- company's count of pending and processing tasks, kept by statement-level triggers that read
-- the statement's transition tables, so one counter update per company per statement,
-- whatever the rows. A statement that takes a company's count above its max_pending fails
-- with SQLSTATE FQ429 (message `backlog quota exceeded`, DETAIL `company=<id> max_pending=<n>
-- unfinished=<n> adding=<n>`, `unfinished` being the count before the statement), and nothing
-- it wrote stays. The counter row's lock makes the check race-free: concurrent creates of one
-- company queue on it until the one before commits. The claim (pending -> processing) changes
-- no count, so the claim writes no counter.
--
-- Each function below but the insert's one-company path runs the same statements over its
-- own query of (company_id, delta): lock the changed counters in company_id order (two
-- statements over the same companies cannot deadlock on them), add, refuse an increase beyond
-- max_pending. Most statements change no count (a heartbeat, a claim): they stop after one
-- pass over the rows.
--
-- The insert first tries rows of one company (every create and batch of the API; migration
-- 0010): one UPDATE of its counter, which aggregates the transition table itself, then a read
-- of its max_pending in a statement of its own, after the counter's lock (a quota changed
-- while the insert waited is the one checked). Neither has parameters, so PL/pgSQL keeps one
-- generic plan for each. Rows of several companies, rows none of which count, or no rows:
-- nothing is updated (bool_and of no rows is NULL), and the general statements follow.
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
$$;

CREATE OR REPLACE TRIGGER tasks_count_inserted AFTER INSERT ON tasks
REFERENCING NEW TABLE AS new_tasks
FOR EACH STATEMENT EXECUTE FUNCTION fairq_count_inserted();

-- No join of the two tables: per company, the new rows counted up and the old ones down.
CREATE OR REPLACE FUNCTION fairq_count_updated() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    ids uuid[];
    deltas bigint[];
    over record;
BEGIN

    SELECT array_agg(d.company_id ORDER BY d.company_id), array_agg(d.delta ORDER BY d.company_id)
    INTO ids, deltas
    FROM (
    SELECT c.company_id, sum(c.delta) AS delta
    FROM (SELECT n.company_id, CAST(n.status IN ('pending', 'processing') AS int) AS delta
          FROM new_tasks n
          UNION ALL
          SELECT o.company_id, -CAST(o.status IN ('pending', 'processing') AS int)
          FROM old_tasks o) c
    GROUP BY c.company_id
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
$$;

CREATE OR REPLACE TRIGGER tasks_count_updated AFTER UPDATE ON tasks
REFERENCING OLD TABLE AS old_tasks NEW TABLE AS new_tasks
FOR EACH STATEMENT EXECUTE FUNCTION fairq_count_updated();
CREATE OR REPLACE FUNCTION fairq_count_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    ids uuid[];
    deltas bigint[];
    over record;
BEGIN

    SELECT array_agg(d.company_id ORDER BY d.company_id), array_agg(d.delta ORDER BY d.company_id)
    INTO ids, deltas
    FROM (
    SELECT o.company_id, -sum(CAST(o.status IN ('pending', 'processing') AS int)) AS delta
    FROM old_tasks o GROUP BY o.company_id
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
$$;

CREATE OR REPLACE TRIGGER tasks_count_deleted AFTER DELETE ON tasks
REFERENCING OLD TABLE AS old_tasks
FOR EACH STATEMENT EXECUTE FUNCTION fairq_count_deleted();

-- TRUNCATE fires no DELETE trigger: an emptied table has no unfinished task.
CREATE OR REPLACE FUNCTION fairq_zero_backlogs() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE company_backlogs SET unfinished = 0 WHERE unfinished <> 0;
    RETURN NULL;
END
$$;

CREATE OR REPLACE TRIGGER tasks_count_truncated AFTER TRUNCATE ON tasks
FOR EACH STATEMENT EXECUTE FUNCTION fairq_zero_backlogs();
