-- The claim floor: where a company's pending tasks begin, so a claim need not read the index
-- entries of the tasks claimed before (decision 0012).
--
-- `company_queues.(claim_floor_at, claim_floor_id)`: no pending task of the company has a
-- `(run_after, id)` below it (NULL: no floor, the scan starts at the beginning). The claim
-- scans ix_tasks_pending_company_run_after from it, and raises it to the earliest pending
-- task of each company it served, under the company's wake-up lock taken exclusively
-- (db/sql/claim.sql, its last statement). These triggers lower it, under the same lock
-- taken shared, whenever a task becomes pending below it: the claimer either sees that
-- task (the writer committed before its lock) or the writer waits for the claimer's commit
-- and lowers the floor it raised. They also lower `due_at`, as migration 0003's did.
-- The wake-up lock: pg_advisory_xact_lock(1718712171 ("fqwk"), hashtext(company_id) & 63),
-- db/queue.py WAKE_LOCK_NAMESPACE and WAKE_LOCK_BUCKETS.

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
