-- The claim, inside PostgreSQL: one call, one round trip, claimers in parallel.
--
-- `fairq_claim(worker_id, batch_size)` is the whole claim (db/claims.py `claim` sends it and
-- commits). `fairq_allocate(...)` is its deficit round robin, kept as a function of its own
-- so that a property test compares it with the reference model in Python
-- (db/fair_share.py `allocate`). Design: docs/design.md "The claim"; decision 0007.
--
-- Locks, in the order a claim takes them:
--   1. pg_advisory_xact_lock_shared(claims)          held to commit; a pause takes it
--      exclusively (db/companies.py `pause_company`), so it waits for the claims in flight
--      and every later claim reads the ring after the pause.
--   2. pg_advisory_xact_lock(reservation), in a subtransaction that always ends rolled
--      back, which releases it: held only while the claimer reads the ring from the cursor,
--      shares its batch and moves the cursor, never while any task is claimed. The cursor
--      lives in two sequences, which are not transactional: the next claimer sees it moved
--      at once, without waiting for this claim's commit.
--   3. pg_advisory_xact_lock(limits, bucket)         only for companies with a max_in_flight,
--      held to commit: their count of leases and their claim cannot interleave with another
--      claimer's. Waited for in the first round, in bucket order; later rounds only try.
--   4. task rows, FOR UPDATE SKIP LOCKED, and the wake-up locks of settled companies (tried,
--      never waited for): no claimer waits for another's rows.
-- The magic numbers are ASCII: "fairqcl" (claims, also db/claims.py CLAIM_LOCK_KEY),
-- "fairqrs" (reservation), "fqlm" (limits), "fqwk" (wake-up, db/sql/tasks.sql).
--
-- Changing this file needs a migration that re-runs it (db/sql/README.md).

CREATE OR REPLACE FUNCTION fairq_allocate(
    ring_positions bigint[], weights int[], headrooms int[], slots int, credit int,
    OUT tasks int[], OUT turns int[], OUT first_turns int[],
    OUT cursor_position bigint, OUT cursor_credit int)
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
-- Share `slots` tasks among contenders listed in ring order from the cursor (arrays in
-- parallel; headroom NULL: no limit). `credit` is what the first contender has left of an
-- interrupted turn (0: a full turn, its weight). Deficit round robin with unit-cost tasks
-- and the weight as quantum (Shreedhar and Varghese, 1995): turns in ring order, up to
-- `weight` tasks a turn, a company at its headroom sits out the rest. `tasks[i]` is
-- contender i's share, `turns[i]` the place of its first turn (-1: none), `first_turns[i]`
-- that turn's quantum; the cursor is where the last turn stopped and what is left of it.
-- The same as db/fair_share.py `allocate`, step for step (tests/test_claim_function.py).
DECLARE
    n int := coalesce(cardinality(ring_positions), 0);
    queue int[];
    pos int := 1;
    quantum int := greatest(credit, 0);
    next_turn int := 0;
    remaining int := slots;
    i int;
    room int;
    give int;
BEGIN
    tasks := array_fill(0, ARRAY[n]);
    turns := array_fill(-1, ARRAY[n]);
    first_turns := array_fill(0, ARRAY[n]);
    cursor_position := CASE WHEN n > 0 THEN ring_positions[1] - 1 ELSE 0 END;
    cursor_credit := 0;
    queue := ARRAY(SELECT g FROM generate_series(1, n) g
                   WHERE headrooms[g] IS NULL OR headrooms[g] > 0 ORDER BY g);
    WHILE remaining > 0 AND cardinality(queue) > 0 LOOP
        i := queue[pos];
        IF quantum = 0 THEN
            quantum := weights[i];
        END IF;
        IF turns[i] < 0 THEN
            turns[i] := next_turn;
            first_turns[i] := quantum;
            next_turn := next_turn + 1;
        END IF;
        room := CASE WHEN headrooms[i] IS NULL THEN remaining ELSE headrooms[i] - tasks[i] END;
        give := least(quantum, room, remaining);
        tasks[i] := tasks[i] + give;
        remaining := remaining - give;
        quantum := quantum - give;
        cursor_position := ring_positions[i];
        cursor_credit := 0;
        IF headrooms[i] IS NOT NULL AND tasks[i] >= headrooms[i] THEN
            -- At its limit: its turn ends without credit, and it sits out the rest.
            queue := queue[:pos - 1] || queue[pos + 1:];
            quantum := 0;
        ELSIF quantum > 0 THEN
            -- The batch is full in the middle of its turn: the next batch goes on with it.
            cursor_credit := quantum;
            EXIT;
        ELSE
            pos := pos + 1;
        END IF;
        IF cardinality(queue) > 0 THEN
            pos := (pos - 1) % cardinality(queue) + 1;
        END IF;
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION fairq_move_claim_cursor(ring_position bigint, credit int)
RETURNS void
LANGUAGE plpgsql VOLATILE
-- With the owner's rights: setval needs UPDATE on a sequence, which a role with the usual
-- rights of an application (DML on the tables, USAGE and SELECT on the sequences) lacks.
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
-- Move the claim cursor: the company whose turn stopped, and what is left of that turn.
BEGIN
    PERFORM setval('fairq_claim_cursor_position', ring_position),
            setval('fairq_claim_cursor_credit', credit);
END
$$;

CREATE OR REPLACE FUNCTION fairq_claim(worker_id text, batch_size int)
RETURNS TABLE (id uuid, company_id uuid, type text, payload jsonb, attempts int,
               max_attempts int, lease_token uuid, created_at timestamptz,
               timeout_seconds int)
LANGUAGE plpgsql VOLATILE
-- JIT compiles for longer than a claim runs; and no plan may depend on statistics (a burst
-- of inserts that ANALYZE had not seen made a planner hash-join the whole backlog): every
-- statement is pinned to nested loops over index ranges, planned once per session.
SET jit = off
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_sort = off
SET enable_incremental_sort = off
SET plan_cache_mode = force_generic_plan
AS $$
-- Claim up to `batch_size` runnable tasks, weighted-fair across companies, in the order
-- round robin serves them; each row moves to `processing` with a new lease token and one
-- more attempt. Fewer only when no more runnable task is allowed. Call it in READ COMMITTED
-- and commit right after. Rows: the columns of db/claims.py `ClaimedTask`, in its order.
#variable_conflict use_column
DECLARE
    claimed int := 0;
    wanted int;
    -- Companies that gave less than their share in an earlier round: not asked again.
    exhausted uuid[] := '{}';
    -- Limit buckets this transaction holds.
    held int[] := '{}';
    first_round boolean := true;
    at_position bigint;
    at_credit int;
    contenders record;
    share record;
    limited int[];
    got bigint;
    settled uuid[];
    -- Companies that got tasks: their claim floor moves past them (below).
    served uuid[] := '{}';
    -- This round's companies drawn to join them.
    lucky uuid[];
    short uuid[];
    -- The clock, read after each wait: statement_timestamp() is the caller's statement's
    -- start, before the waits for the locks above.
    now_ts timestamptz;
BEGIN
    IF batch_size IS NULL OR batch_size < 1 THEN
        RAISE EXCEPTION 'batch_size must be at least 1, not %', batch_size
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF worker_id IS NULL THEN
        -- A lease must name its holder: db/workers.py `take_back_leases` takes back a dead
        -- worker's.
        RAISE EXCEPTION 'worker_id must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        -- Each statement below must see what committed before its locks were granted.
        RAISE EXCEPTION 'fairq_claim runs under READ COMMITTED, not %',
            current_setting('transaction_isolation')
            USING ERRCODE = 'invalid_transaction_state';
    END IF;
    PERFORM pg_advisory_xact_lock_shared(28817553143980908);
    WHILE claimed < batch_size LOOP
        wanted := batch_size - claimed;
        now_ts := clock_timestamp();
        -- Companies whose earliest task has come due (scheduled, backed off, or just
        -- created) join the ring at its end, before this claim reads it. SKIP LOCKED: a row
        -- a writer or another claimer holds is promoted by a later claim.
        UPDATE company_queues q
        SET ready = true, ring_position = nextval('company_ring_positions')
        FROM (
            SELECT w.company_id
            FROM company_queues w
            -- Paused companies stay out (ix_company_queues_waiting_unpaused_due_at).
            WHERE NOT w.ready AND NOT w.paused AND w.due_at IS NOT NULL
              AND w.due_at <= now_ts
            ORDER BY w.due_at
            LIMIT 1000
            FOR UPDATE SKIP LOCKED
        ) due
        WHERE q.company_id = due.company_id;
        BEGIN
            -- The reservation: the only section claimers pass one at a time. Its lock is
            -- taken in this block's subtransaction, which always ends rolled back (below):
            -- that releases the lock, whatever ends the block, a cancel included, with no
            -- statement left to run. Variables and the sequences keep what it set.
            PERFORM pg_advisory_xact_lock(28817553143984755);
            SELECT p.last_value, k.last_value INTO at_position, at_credit
            FROM fairq_claim_cursor_position p, fairq_claim_cursor_credit k;
            WITH ring AS (
                -- The ring from the cursor: the rest of this lap (the companies just
                -- promoted at its end), then the lap's start. Each part is an index range in
                -- order; the Append reads them one after the other only as far as the LIMIT
                -- needs.
                (SELECT r.company_id, r.ring_position, 1 AS lap, r.weight, r.max_in_flight,
                        r.claim_floor_at, r.claim_floor_id
                 FROM company_queues r
                 WHERE r.ready AND NOT r.paused
                   AND r.ring_position >= at_position + CASE WHEN at_credit > 0 THEN 0 ELSE 1 END
                 ORDER BY r.ring_position)
                UNION ALL
                (SELECT r.company_id, r.ring_position, 2 AS lap, r.weight, r.max_in_flight,
                        r.claim_floor_at, r.claim_floor_id
                 FROM company_queues r
                 WHERE r.ready AND NOT r.paused
                   AND r.ring_position < at_position + CASE WHEN at_credit > 0 THEN 0 ELSE 1 END
                 ORDER BY r.ring_position)
            ),
            headed AS (
                SELECT s.company_id, s.ring_position, s.lap, s.weight, s.max_in_flight,
                       s.claim_floor_at, s.claim_floor_id, h.headroom
                FROM ring s
                CROSS JOIN LATERAL (
                    -- How many more leases it may hold: counted only for a company with a
                    -- limit, at most max_in_flight index entries, in the order of its own
                    -- index (company_id, locked_at, id), so no plan reads others' leases.
                    -- A first reading: the claim counts again under the company's lock.
                    SELECT CASE WHEN s.max_in_flight IS NULL THEN NULL
                                ELSE s.max_in_flight - CAST((
                                    SELECT count(*) FROM (
                                        SELECT 1 FROM tasks t
                                        WHERE t.company_id = s.company_id
                                          AND t.status = 'processing'
                                        ORDER BY t.locked_at, t.id
                                        LIMIT s.max_in_flight) held_leases) AS int)
                           END AS headroom
                    OFFSET 0
                ) h
                -- A company at its limit is passed over, not dropped: it stays in the ring.
                WHERE (h.headroom IS NULL OR h.headroom > 0)
                  AND NOT (s.company_id = ANY(exhausted))
                LIMIT wanted
            )
            SELECT array_agg(company_id ORDER BY lap, ring_position) AS ids,
                   array_agg(ring_position ORDER BY lap, ring_position) AS positions,
                   array_agg(weight ORDER BY lap, ring_position) AS weights,
                   array_agg(headroom ORDER BY lap, ring_position) AS headrooms,
                   array_agg(max_in_flight ORDER BY lap, ring_position) AS limits,
                   array_agg(claim_floor_at ORDER BY lap, ring_position) AS floor_ats,
                   array_agg(claim_floor_id ORDER BY lap, ring_position) AS floor_ids
            INTO contenders
            FROM headed;
            IF contenders.ids IS NOT NULL THEN
                -- The interrupted turn goes on only if its company is still first in line.
                share := fairq_allocate(
                    contenders.positions, contenders.weights, contenders.headrooms, wanted,
                    CASE WHEN contenders.positions[1] = at_position THEN at_credit ELSE 0 END);
                PERFORM fairq_move_claim_cursor(share.cursor_position, share.cursor_credit);
            END IF;
            RAISE SQLSTATE 'FQRSV';
        EXCEPTION WHEN SQLSTATE 'FQRSV' THEN
            NULL;  -- the reservation's end: its lock is released
        END;
        EXIT WHEN contenders.ids IS NULL;

        -- Companies with a limit: their lock, before the statement that counts and claims.
        -- The first round waits, in bucket order (no two claimers wait for each other in a
        -- cycle); later rounds only try, and a bucket not had gets nothing this claim.
        limited := ARRAY(
            SELECT DISTINCT hashtext(contenders.ids[g]::text) & 63
            FROM generate_series(1, cardinality(contenders.ids)) g
            WHERE share.tasks[g] > 0 AND contenders.limits[g] IS NOT NULL
              AND NOT ((hashtext(contenders.ids[g]::text) & 63) = ANY(held))
            ORDER BY 1);
        IF cardinality(limited) > 0 THEN
            IF first_round THEN
                PERFORM pg_advisory_xact_lock(1718709357, b) FROM unnest(limited) b;
                held := held || limited;
            ELSE
                held := held || ARRAY(SELECT b FROM unnest(limited) b
                                      WHERE pg_try_advisory_xact_lock(1718709357, b));
            END IF;
        END IF;
        first_round := false;
        now_ts := clock_timestamp();

        RETURN QUERY
            WITH allotted AS (
                -- Each company's share, its first turn's place in the batch and size, its
                -- weight; for a company with a limit, clipped to what it may hold now: this
                -- statement's snapshot comes after its lock, so no claim of it is in flight.
                SELECT s.company_id, s.turn, s.first_turn, s.weight,
                       coalesce(s.floor_at, '-infinity') AS floor_at,
                       coalesce(s.floor_id, '00000000-0000-0000-0000-000000000000') AS floor_id,
                       CASE WHEN s.max_in_flight IS NULL THEN s.n
                            WHEN NOT ((hashtext(s.company_id::text) & 63) = ANY(held)) THEN 0
                            ELSE greatest(0, least(s.n, s.max_in_flight - (
                                SELECT count(*) FROM (
                                    SELECT 1 FROM tasks t
                                    WHERE t.company_id = s.company_id
                                      AND t.status = 'processing'
                                    ORDER BY t.locked_at, t.id
                                    LIMIT s.max_in_flight) held_leases)))
                       END AS n
                FROM unnest(contenders.ids, share.tasks, share.turns, share.first_turns,
                            contenders.weights, contenders.limits, contenders.floor_ats,
                            contenders.floor_ids)
                     AS s(company_id, n, turn, first_turn, weight, max_in_flight, floor_at,
                          floor_id)
                WHERE s.n > 0
            ),
            locked AS (
                -- Each company's longest-waiting runnable tasks, locked: a range scan of
                -- ix_tasks_pending_company_run_after from the company's claim floor (no
                -- pending task lies below it: the entries of tasks claimed before are not
                -- read again, even while a held snapshot keeps them in the index) that
                -- stops after its share; rows not yet due are never read; id breaks ties.
                -- SKIP LOCKED: a row another claimer or the API holds is passed over. READ
                -- COMMITTED re-checks the quals on the newest version of a row changed
                -- after the snapshot.
                SELECT x.id, x.run_after, a.company_id, a.turn, a.first_turn, a.weight
                FROM allotted a
                CROSS JOIN LATERAL (
                    SELECT t.id, t.run_after
                    FROM tasks t
                    WHERE t.company_id = a.company_id
                      AND fairq_runnable(t, now_ts)
                      AND (t.run_after, t.id) >= (a.floor_at, a.floor_id)
                    ORDER BY t.run_after, t.id
                    LIMIT a.n
                    FOR UPDATE OF t SKIP LOCKED
                ) x
            ),
            claimed AS (
                UPDATE tasks t
                SET status = 'processing',
                    attempts = t.attempts + 1,            -- crashes count too (poison pills)
                    lease_token = gen_random_uuid(),      -- the fencing token of this attempt
                    locked_by = worker_id,
                    -- After the waits above: a lease must not start shortened by them.
                    locked_at = now_ts,                   -- lease start; heartbeat refreshes
                    started_at = coalesce(t.started_at, now_ts),
                    updated_at = now_ts
                FROM locked l
                WHERE t.id = l.id
                RETURNING t.id, t.company_id, t.type, t.payload, t.attempts, t.max_attempts,
                          t.lease_token, t.created_at, t.timeout_seconds,
                          l.turn, l.first_turn, l.weight, l.run_after
            )
            -- In the order round robin serves them: by round (the first turn, then a
            -- weight's worth of tasks a round), then turn.
            SELECT c.id, c.company_id, c.type, c.payload, c.attempts, c.max_attempts,
                   c.lease_token, c.created_at, c.timeout_seconds
            FROM (SELECT c.*, row_number() OVER (PARTITION BY c.company_id
                                                 ORDER BY c.run_after, c.id) AS rank
                  FROM claimed c) c
            ORDER BY CASE WHEN c.rank <= c.first_turn THEN 0
                          ELSE 1 + (c.rank - c.first_turn - 1) / c.weight END,
                     c.turn, c.run_after, c.id;
        GET DIAGNOSTICS got = ROW_COUNT;
        claimed := claimed + got;
        -- A company served n tasks has its floor raised with probability n / 32: about one
        -- raise per 32 tasks claimed of it, so a scan reads about 32 entries of claimed
        -- tasks at most, and the company's row gains one version per 32 tasks, not one a
        -- claim (each is read by every claim's ring while a snapshot is held). n is what it
        -- got, not its share: a company fed a trickle gets a task or two of a large share.
        IF got < (SELECT sum(x) FROM unnest(share.tasks) x) THEN
            -- Fewer than allotted: those companies had less runnable work than their share
            -- (or were at their limit); the rest of the batch goes to the next companies.
            -- What each got is read back from its leases of this round: this clock and this
            -- claimer (a worker id claims one batch at a time) name them.
            SELECT coalesce(array_agg(c.company_id) FILTER (WHERE c.n > c.got), '{}'),
                   coalesce(array_agg(c.company_id) FILTER (WHERE random() * 32 < c.got), '{}')
            INTO short, lucky
            FROM (SELECT s.company_id, s.n, (
                      SELECT count(*) FROM (
                          SELECT 1 FROM tasks t
                          WHERE t.company_id = s.company_id AND t.status = 'processing'
                            AND t.locked_at = now_ts AND t.locked_by = worker_id
                          -- The order of the company's own lease index: no plan reads others'.
                          ORDER BY t.locked_at, t.id
                          LIMIT s.n) got_leases) AS got
                  FROM unnest(contenders.ids, share.tasks) AS s(company_id, n)
                  WHERE s.n > 0) c;
            IF cardinality(short) = 0 THEN
                -- Another claim of the same worker id in the same microsecond: no telling
                -- who got what, so none of this round's companies is asked again, and each
                -- counts as served its share.
                short := ARRAY(SELECT s.company_id
                               FROM unnest(contenders.ids, share.tasks) AS s(company_id, n)
                               WHERE s.n > 0);
                lucky := ARRAY(SELECT s.company_id
                               FROM unnest(contenders.ids, share.tasks) AS s(company_id, n)
                               WHERE s.n > 0 AND random() * 32 < s.n);
            END IF;
            exhausted := exhausted || short;
        ELSE
            lucky := ARRAY(SELECT s.company_id
                           FROM unnest(contenders.ids, share.tasks) AS s(company_id, n)
                           WHERE s.n > 0 AND random() * 32 < s.n);
        END IF;
        served := served || ARRAY(SELECT x FROM unnest(lucky) x WHERE NOT (x = ANY(served)));
        -- Otherwise every share was met, and the batch is full or another round may fill
        -- it (companies beyond this round's ring read, companies at their limit passed).
        -- Each round claims a task or excludes a company: the loop ends.
    END LOOP;

    IF cardinality(served) > 0 OR cardinality(exhausted) > 0 THEN
        -- Settle the companies that ran short, and raise the claim floor of every company
        -- served, each under its wake-up lock, tried and never waited for: a writer holding
        -- it is making a task pending (below the floor, maybe), so the company stays as it
        -- is, ready and with its floor, until a later claim.
        -- A company that ran short but had a task created within the last second stays
        -- as it is too, ready, and costs no write: its next task will most likely come
        -- before it would be promoted again. Settling it and promoting it back would write
        -- its row three times a task (the wake-up, the promotion, the settle), and while a
        -- snapshot is held elsewhere every claim's promotion and ring reads walk the index
        -- entries of those versions (decision 0012). A company idle for a second is settled
        -- by the next claim that finds it short.
        settled := ARRAY(
            SELECT e.company_id
            FROM (SELECT DISTINCT x AS company_id FROM unnest(served || exhausted) x) e
            JOIN (SELECT DISTINCT hashtext(x::text) & 63 AS bucket
                  FROM unnest(served || exhausted) x) b
              ON b.bucket = hashtext(e.company_id::text) & 63
            WHERE pg_try_advisory_xact_lock(1718712171, b.bucket));
        now_ts := clock_timestamp();
        -- A new statement, so a snapshot taken after the locks: it sees every task committed
        -- by a writer that held one before us, and the tasks other claimers hold but have
        -- not committed are still pending in it. A row another transaction holds (another
        -- claimer's settle, a pause) is skipped and left as it is.
        UPDATE company_queues q
        SET due_at = CASE WHEN s.short THEN d.due_at ELSE q.due_at END,
            -- A company paused by plain SQL meanwhile stays out of the ring.
            ready = CASE WHEN s.short THEN coalesce(d.due_at <= now_ts, false) AND NOT q.paused
                         ELSE q.ready END,
            -- The earliest pending task's place. None: a day before the end of time (a
            -- value every client can read in any time zone), and the triggers lower it when
            -- a task becomes pending (db/sql/tasks.sql).
            claim_floor_at = coalesce(d.due_at, '9999-12-30 00:00:00+00'),
            claim_floor_id = coalesce(d.id, 'ffffffff-ffff-ffff-ffff-ffffffffffff')
        FROM (SELECT w.company_id, w.company_id = ANY(exhausted) AND NOT r.recent AS short,
                     coalesce(w.claim_floor_at, '-infinity') AS floor_at,
                     coalesce(w.claim_floor_id, '00000000-0000-0000-0000-000000000000')
                         AS floor_id
              FROM company_queues w
              CROSS JOIN LATERAL (
                  -- A task created within the last second, read from the newest entry of
                  -- ix_tasks_company_listing_unleased (the tasks just claimed are processing,
                  -- not in it).
                  SELECT EXISTS (SELECT 1 FROM tasks t
                                 WHERE t.company_id = w.company_id
                                   AND t.status <> 'processing'
                                   AND t.created_at > now_ts - interval '1 second') AS recent
              ) r
              WHERE w.company_id = ANY(settled)
                -- Nothing to write: short, recently busy, and no floor to raise.
                AND (w.company_id = ANY(served) OR NOT r.recent)
              FOR NO KEY UPDATE OF w SKIP LOCKED) s
        LEFT JOIN LATERAL (
            -- The earliest pending task, from the company's claim floor in its pending range
            -- (ordered as ix_tasks_pending_company_run_after, which no other index is).
            SELECT t.run_after AS due_at, t.id
            FROM tasks t
            WHERE t.company_id = s.company_id AND t.status = 'pending'
              AND (t.run_after, t.id) >= (s.floor_at, s.floor_id)
            ORDER BY t.run_after, t.id
            LIMIT 1
        ) d ON true
        WHERE q.company_id = s.company_id;
    END IF;
END
$$;
