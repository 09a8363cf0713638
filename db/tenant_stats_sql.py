"""The SQL statements of the task statistics: what each read of `db.tenant_stats` sends.

One statement per read, each with the comment on its plan and cost that says why it is written
so. `db.tenant_stats` runs them, supplies their parameters (its `Limits` are the caps) and
turns their rows into figures; what each figure reads, and when it is exact, is its docstring.
"""

from __future__ import annotations

# Each statement opens with a comment naming it, as pg_stat_statements, the server's log and
# scripts/bench_stats.py show it.

# A company's live figures in one statement, so one snapshot: pending is unfinished minus
# processing, and both must be read at once. Each capped count reads at most live_limit + 1
# entries of the company's own partial index (index-only: `SELECT FROM` reads no column).
COMPANY_LIVE = """
/* tenant_stats.company_live */
SELECT c.name, c.paused, c.max_pending, now() AS as_of, b.unfinished,
       (SELECT count(*) FROM (SELECT FROM tasks t
                              WHERE t.company_id = c.id AND t.status = 'processing'
                              LIMIT %(live_limit)s + 1) AS p) AS processing,
       (SELECT count(*) FROM (SELECT FROM tasks t
                              WHERE t.company_id = c.id AND fairq_runnable(t, now())
                              LIMIT %(live_limit)s + 1) AS r) AS runnable,
       (SELECT count(*) FROM (SELECT FROM tasks t
                              WHERE t.company_id = c.id AND t.status = 'pending'
                                AND t.run_after > now()
                              LIMIT %(live_limit)s + 1) AS d) AS delayed,
       -- The first entry of the runnable range is the oldest runnable task.
       (SELECT CAST(extract(epoch FROM now() - t.run_after) AS float8) FROM tasks t
        WHERE t.company_id = c.id AND fairq_runnable(t, now())
        ORDER BY t.run_after LIMIT 1) AS oldest_wait
FROM companies c
JOIN company_backlogs b ON b.company_id = c.id
WHERE c.id = %(company_id)s
"""

# A company's newest tasks but its leased ones, at most finished_limit + 1, newest first
# through its listing index (company_id, created_at DESC, id DESC) WHERE status <>
# 'processing': a heap fetch each for status and finished_at. Fewer than that: the company's
# whole history, so every count is exact.
COMPANY_HISTORY = """
/* tenant_stats.company_history */
SELECT count(*) AS scanned,
       count(*) FILTER (WHERE h.status = 'completed') AS completed,
       count(*) FILTER (WHERE h.status = 'failed') AS failed,
       count(*) FILTER (WHERE h.status = 'cancelled') AS cancelled,
       count(*) FILTER (WHERE h.status = 'completed' AND h.finished_at >= now() - %(short_window)s)
           AS completed_last_5m,
       count(*) FILTER (WHERE h.status = 'failed' AND h.finished_at >= now() - %(short_window)s)
           AS failed_last_5m,
       count(*) FILTER (WHERE h.status = 'completed' AND h.finished_at >= now() - %(long_window)s)
           AS completed_last_60m,
       count(*) FILTER (WHERE h.status = 'failed' AND h.finished_at >= now() - %(long_window)s)
           AS failed_last_60m
FROM (SELECT t.status, t.finished_at FROM tasks t
      WHERE t.company_id = %(company_id)s AND t.status <> 'processing'
      ORDER BY t.created_at DESC, t.id DESC
      LIMIT %(finished_limit)s + 1) AS h
"""

# The queue's newest finished tasks (completed or failed), at most finished_limit + 1, newest
# first: a backward scan of ix_tasks_terminal_finished_at (the status list implies its
# predicate) and a heap fetch each for status and company. No window in the scan's condition:
# with one, the planner reads the whole window through a bitmap and sorts it (32,000 rows in
# a busy hour at 1M tasks, 3 times the rows and the time), a cost that grows with the rate;
# without, the index order with the LIMIT is the only cheap plan. A window is counted exactly
# when the scan reached past it (`covers_*`) or read every finished task; else the scan
# covers [reached, now()]. Counts are of `company_id`'s tasks, or of all when it is NULL.
RECENTLY_FINISHED = """
/* tenant_stats.recently_finished */
SELECT count(*) AS scanned,
       CAST(extract(epoch FROM now() - min(f.finished_at)) AS float8) AS covered_seconds,
       count(*) FILTER (WHERE f.mine AND f.status = 'completed'
                          AND f.finished_at >= now() - %(short_window)s) AS completed_last_5m,
       count(*) FILTER (WHERE f.mine AND f.status = 'failed'
                          AND f.finished_at >= now() - %(short_window)s) AS failed_last_5m,
       count(*) FILTER (WHERE f.mine AND f.status = 'completed'
                          AND f.finished_at >= now() - %(long_window)s) AS completed_last_60m,
       count(*) FILTER (WHERE f.mine AND f.status = 'failed'
                          AND f.finished_at >= now() - %(long_window)s) AS failed_last_60m,
       coalesce(bool_or(f.finished_at < now() - %(short_window)s), false) AS covers_short_window,
       coalesce(bool_or(f.finished_at < now() - %(long_window)s), false) AS covers_long_window
FROM (SELECT t.status, t.finished_at,
             CAST(%(company_id)s AS uuid) IS NULL OR t.company_id = CAST(%(company_id)s AS uuid)
                 AS mine
      FROM tasks t
      -- NOT NULL: the index's backward order is DESC NULLS FIRST.
      WHERE t.status IN ('completed', 'failed') AND t.finished_at IS NOT NULL
      ORDER BY t.finished_at DESC
      LIMIT %(finished_limit)s + 1) AS f
"""

# The queue's live figures and finished counts in one statement (one snapshot). Runnable and
# delayed tasks are counted company by company, from the companies that can have them
# (company_queues.due_at is a lower bound of a company's earliest pending run_after: NULL
# when it has none, later than now() when none is due), each through its own index range:
# the scans read only matching entries, at most live_limit + 1 in all. (A plain count over
# the pending index would filter on run_after and could read every delayed entry first.)
# The LIMIT inside the lateral keeps it a per-company probe the planner cannot flatten.
QUEUE_LIVE = """
/* tenant_stats.queue_live */
SELECT now() AS as_of, u.unfinished, p.processing, r.runnable, d.delayed,
       f.scanned AS finished_scanned, f.completed, f.failed, f.cancelled
FROM (SELECT coalesce(sum(b.unfinished), 0) AS unfinished FROM company_backlogs b) AS u,
     (SELECT count(*) AS processing
      FROM (SELECT FROM tasks t WHERE t.status = 'processing'
            LIMIT %(live_limit)s + 1) AS x) AS p,
     (SELECT count(*) AS runnable
      FROM (SELECT FROM company_queues q
            CROSS JOIN LATERAL (SELECT FROM tasks t
                                WHERE t.company_id = q.company_id
                                  AND fairq_runnable(t, now())
                                LIMIT %(live_limit)s + 1) AS e
            WHERE q.due_at <= now()
            LIMIT %(live_limit)s + 1) AS x) AS r,
     (SELECT count(*) AS delayed
      FROM (SELECT FROM company_queues q
            CROSS JOIN LATERAL (SELECT FROM tasks t
                                WHERE t.company_id = q.company_id AND t.status = 'pending'
                                  AND t.run_after > now()
                                LIMIT %(live_limit)s + 1) AS e
            WHERE q.due_at IS NOT NULL
            LIMIT %(live_limit)s + 1) AS x) AS d,
     (SELECT count(*) AS scanned,
             count(*) FILTER (WHERE x.status = 'completed') AS completed,
             count(*) FILTER (WHERE x.status = 'failed') AS failed,
             count(*) FILTER (WHERE x.status = 'cancelled') AS cancelled
      FROM (SELECT t.status FROM tasks t
            WHERE t.status IN ('completed', 'failed', 'cancelled')
            LIMIT %(finished_limit)s + 1) AS x) AS f
"""

# The ranking by backlog: the most unfinished tasks first, ties by id. One pass over
# company_backlogs (a row per company) with a top-N sort, then a probe per listed company.
TOP_BY_BACKLOG = """
/* tenant_stats.top_by_backlog */
SELECT c.id AS company_id, c.name, c.paused, c.max_pending, b.unfinished,
       (SELECT CAST(extract(epoch FROM now() - t.run_after) AS float8) FROM tasks t
        WHERE t.company_id = b.company_id AND fairq_runnable(t, now())
        ORDER BY t.run_after LIMIT 1) AS oldest_wait
FROM (SELECT k.company_id, k.unfinished FROM company_backlogs k
      WHERE k.unfinished > 0
      ORDER BY k.unfinished DESC, k.company_id
      LIMIT %(top)s) AS b
JOIN companies c ON c.id = b.company_id
ORDER BY b.unfinished DESC, b.company_id
"""

# The ranking by oldest runnable wait: one probe per company whose due_at has come (the first
# entry of its runnable range), the earliest first, ties by id; then the listed companies'
# rows. A company whose due_at is stale (its due tasks were claimed) finds nothing and drops
# out.
TOP_BY_OLDEST_WAIT = """
/* tenant_stats.top_by_oldest_wait */
SELECT c.id AS company_id, c.name, c.paused, c.max_pending, b.unfinished,
       CAST(extract(epoch FROM now() - o.run_after) AS float8) AS oldest_wait
FROM (SELECT q.company_id, e.run_after
      FROM company_queues q
      CROSS JOIN LATERAL (SELECT t.run_after FROM tasks t
                          WHERE t.company_id = q.company_id AND fairq_runnable(t, now())
                          ORDER BY t.run_after LIMIT 1) AS e
      WHERE q.due_at <= now()
      ORDER BY e.run_after, q.company_id
      LIMIT %(top)s) AS o
JOIN companies c ON c.id = o.company_id
JOIN company_backlogs b ON b.company_id = o.company_id
ORDER BY o.run_after, o.company_id
"""

# Past a limit, figures are estimated from a sample of `tasks`: about `pages` of its pages
# (`tenant_stats.Limits.sample_pages`) picked at random (TABLESAMPLE SYSTEM: whole pages, each
# with the same chance), whatever the table's size, so at a constant cost
# (`tenant_stats.SAMPLE_PAGES`: ~8 MB, ~10 to 15 ms warm at 1M tasks). It returns the
# company's (or every) sampled row by status, and the percent of the table's pages sampled.
# Unlike the planner's statistics, a sample sees how status, run_after and company go
# together: the planner multiplies their selectivities as if independent, so (every finished
# task's run_after being past) it counts most pending tasks runnable, and it gives a company
# that never finished a task its share of everyone's (scripts/bench_stats.py: 42% too many
# runnable tasks; 105,527 completed for the whale).
SAMPLE = """
/* tenant_stats.sample */
SELECT CAST(least(100, 100.0 * %(pages)s / greatest(pg_relation_size('tasks')
                  / CAST(current_setting('block_size') AS int), 1)) AS float8) AS percent,
       count(*) FILTER (WHERE s.status = 'pending') AS pending,
       count(*) FILTER (WHERE s.runnable) AS runnable,
       count(*) FILTER (WHERE s.status = 'processing') AS processing,
       count(*) FILTER (WHERE s.status = 'completed') AS completed,
       count(*) FILTER (WHERE s.status = 'failed') AS failed,
       count(*) FILTER (WHERE s.status = 'cancelled') AS cancelled
FROM (SELECT t.status, fairq_runnable(t, now()) AS runnable
      -- The same percent as above (TABLESAMPLE takes no subquery).
      FROM tasks t TABLESAMPLE SYSTEM (least(100, 100.0 * %(pages)s / greatest(
               pg_relation_size('tasks') / CAST(current_setting('block_size') AS int), 1)))
      WHERE CAST(%(company_id)s AS uuid) IS NULL
         OR t.company_id = CAST(%(company_id)s AS uuid)) AS s
"""
