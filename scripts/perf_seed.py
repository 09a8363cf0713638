"""Build the reference claim workload (DESIGN §9): deterministic, seed 42 by default.

The workload: 50 companies; 80% of the rows belong to 20% of them (10 heavy companies);
3% terminal (completed, failed, cancelled), 2% processing (about half of them stale, a few of
those poison pills with no attempts left), 95% pending. A fifth of the pending rows were
retried and carry a backoff `run_after` between 15 minutes ago and 45 minutes ahead, so about
three quarters of those are still delayed. About 82% of all rows are eligible for a claim.
Timestamps are relative to the database clock at seeding time, so a stale seed drifts (delays
expire): reseed before measuring.

`--delayed-backlog N` adds the "one tenant's delayed backlog" scenario: N more pending rows for
one light company, all runnable only tomorrow (scheduled with `run_at`, or every task backed
off because its webhook target is down), created before any other row. In created_at order
they come first, so a claim that scans a company in created_at order and filters
`run_after <= now()` reads all N of them on every claim (the case migration 0002 fixed).

Usage:
    PYTHONPATH=. .venv/bin/python scripts/perf_seed.py [--rows 100000] [--seed 42]
        [--delayed-backlog 0]
        [--database-url postgresql+psycopg://postgres@127.0.0.1:5432/fairq_bench]

Without `--database-url` or `DATABASE_URL`, an embedded PostgreSQL with its data in
`.pgdata/bench` is started for the run and stopped afterwards.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import Connection, Engine, pool, text

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from db.engine import make_engine  # noqa: E402  (needs ROOT on sys.path)
from scripts import stack  # noqa: E402

COMPANIES = 50
HEAVY_COMPANIES = 10  # 20% of the companies ...
HEAVY_SHARE = 0.8  # ... own 80% of the rows
STALE_AFTER_SECONDS = 300.0  # what the benchmark's claim uses; stale rows are far older

# Built with generate_series in one INSERT ... SELECT: about 1M rows in well under a minute.
# setseed() makes random() deterministic for the session; the ids are derived from the seed
# and the row number, so two seeds with the same arguments produce the same rows.
_SEED_COMPANIES = """
INSERT INTO companies (id, name, api_key_hash, created_at)
SELECT md5('fairq-company-' || i)::uuid,
       'company-' || lpad(i::text, 2, '0') || CASE WHEN i <= :heavy THEN '-heavy' ELSE '' END,
       encode(sha256(convert_to('perf-seed-key-' || i, 'UTF8')), 'hex'),
       now() - interval '30 days'
FROM generate_series(1, :companies) AS i
"""

_SEED_TASKS = """
INSERT INTO tasks (id, company_id, type, payload, status, attempts, max_attempts, run_after,
                   lease_token, locked_by, locked_at, last_error,
                   created_at, updated_at, started_at, finished_at)
SELECT md5('fairq-task-' || :seed || '-' || g)::uuid,
       md5('fairq-company-' || company_no)::uuid,
       'noop', '{}'::jsonb,
       status,
       CASE status WHEN 'pending' THEN CASE WHEN retried THEN 1 + (r_kind * 3)::int ELSE 0 END
                   WHEN 'processing' THEN CASE WHEN poison THEN 5 ELSE 1 END
                   ELSE 1 END,
       5,
       CASE WHEN retried THEN now() + make_interval(secs => -900 + r_delay * 3600)
            ELSE created_at END,
       CASE WHEN status = 'processing' THEN md5('lease-' || g)::uuid END,
       CASE WHEN status = 'processing' THEN 'perf-seed:' || (g % 7) END,
       CASE WHEN status <> 'processing' THEN NULL
            WHEN stale THEN now() - interval '1 hour'
            ELSE now() - interval '10 seconds' END,
       CASE WHEN retried OR status = 'failed' THEN 'seeded failure' END,
       created_at,
       created_at,
       CASE WHEN status IN ('processing', 'completed', 'failed') OR retried THEN created_at END,
       CASE WHEN status IN ('completed', 'failed', 'cancelled') THEN created_at END
FROM (
    SELECT g, r_kind, r_delay, created_at,
           CASE WHEN r_company < :heavy_share THEN 1 + floor(r_pick * :heavy)::int
                ELSE :heavy + 1 + floor(r_pick * (:companies - :heavy))::int END AS company_no,
           CASE WHEN r_status < 0.01 THEN 'completed'
                WHEN r_status < 0.02 THEN 'failed'
                WHEN r_status < 0.03 THEN 'cancelled'
                WHEN r_status < 0.05 THEN 'processing'
                ELSE 'pending' END AS status,
           r_status >= 0.05 AND r_kind < 0.2 AS retried,
           r_kind < 0.5 AS stale,
           r_kind < 0.05 AS poison
    FROM (
        SELECT g, random() AS r_company, random() AS r_pick, random() AS r_status,
               random() AS r_kind, random() AS r_delay,
               -- Insertion order is creation order, as in a live queue: one week of history.
               now() - make_interval(secs => (:rows - g + 1) * (604800.0 / :rows)) AS created_at
        FROM generate_series(1, :rows) AS g
    ) AS r
) AS x
"""

# The company that gets the delayed backlog: the last one, a light company (heavy ones come
# first), whose few runnable rows sit behind the whole backlog in created_at order.
BACKLOG_COMPANY = COMPANIES

# N pending rows runnable in 24 to 25 hours, created 8 to 7 days ago (the seeded history spans
# the last 7 days): older than every other row of the company. Same deterministic ids scheme.
# Written in a shuffled order: a tenant's rows created over a day sit among everyone else's
# on the heap, one page per row, not packed together in created_at order as one bulk
# INSERT would leave them (which would make reading them in created_at order look cheap).
_SEED_BACKLOG = """
INSERT INTO tasks (id, company_id, type, payload, status, attempts, max_attempts, run_after,
                   created_at, updated_at)
SELECT md5('fairq-backlog-' || :seed || '-' || g)::uuid,
       md5('fairq-company-' || :company_no)::uuid,
       'noop', '{}'::jsonb, 'pending', 0, 5,
       now() + interval '1 day' + make_interval(secs => g * (3600.0 / :rows)),
       now() - interval '8 days' + make_interval(secs => g * (86400.0 / :rows)),
       now() - interval '8 days' + make_interval(secs => g * (86400.0 / :rows))
FROM generate_series(1, :rows) AS g
ORDER BY md5('fairq-backlog-order-' || g)
"""

_STATS = """
SELECT count(*) AS total,
       count(*) FILTER (WHERE (status = 'pending' AND run_after <= now())
                           OR (status = 'processing'
                               AND locked_at < now() - make_interval(secs => :stale)
                               AND attempts < max_attempts)) AS eligible,
       count(*) FILTER (WHERE status = 'pending') AS pending,
       count(*) FILTER (WHERE status = 'pending' AND run_after > now()) AS delayed,
       count(*) FILTER (WHERE status = 'processing') AS processing,
       count(*) FILTER (WHERE status IN ('completed', 'failed', 'cancelled')) AS terminal
FROM tasks
"""


@dataclass(frozen=True)
class SeedStats:
    """What a seeded database holds."""

    total: int
    eligible: int
    pending: int
    delayed: int
    processing: int
    terminal: int
    seconds: float

    def describe(self) -> str:
        """One line for the console."""
        pct = 100.0 / max(self.total, 1)
        return (
            f"{self.total:,} rows in {self.seconds:.1f}s: eligible {self.eligible * pct:.1f}%, "
            f"pending {self.pending * pct:.1f}% (delayed {self.delayed * pct:.1f}%), "
            f"processing {self.processing * pct:.1f}%, terminal {self.terminal * pct:.1f}%"
        )


def seed_marker(rows: int, seed: int, delayed_backlog: int = 0) -> str:
    """The table comment that identifies a seeded workload (for `--reuse`)."""
    backlog = f" delayed_backlog={delayed_backlog}" if delayed_backlog else ""
    return f"perf_seed rows={rows} seed={seed}{backlog}"


def current_marker(engine: Engine) -> str | None:
    """The seed marker of the database behind `engine`, or None."""
    with engine.connect() as conn:
        value: str | None = conn.execute(
            text("SELECT obj_description('tasks'::regclass, 'pg_class')")
        ).scalar_one()
        return value


def _seed_tasks(conn: Connection, rows: int, seed: int, delayed_backlog: int) -> None:
    # Secondary indexes are dropped for the bulk insert and rebuilt afterwards, which is
    # several times faster than maintaining them row by row. DDL is transactional, so an
    # interrupted seed leaves the indexes in place.
    indexes = conn.execute(
        text(
            "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'tasks' "
            "AND indexname NOT IN (SELECT conname FROM pg_constraint "
            "WHERE conrelid = 'tasks'::regclass)"
        )
    ).all()
    for name, _ in indexes:
        conn.execute(text(f'DROP INDEX "{name}"'))
    conn.execute(
        text(_SEED_TASKS),
        {
            "rows": rows,
            "seed": seed,
            "heavy": HEAVY_COMPANIES,
            "companies": COMPANIES,
            "heavy_share": HEAVY_SHARE,
        },
    )
    if delayed_backlog:
        conn.execute(
            text(_SEED_BACKLOG),
            {"rows": delayed_backlog, "seed": seed, "company_no": BACKLOG_COMPANY},
        )
    for _, definition in indexes:
        conn.execute(text(definition))


def seed(engine: Engine, rows: int, seed: int = 42, delayed_backlog: int = 0) -> SeedStats:
    """Replace every company and task with the reference workload; return its statistics.

    `delayed_backlog`: that many extra pending rows, runnable only tomorrow, for one light
    company (module docstring); 0 for the reference workload alone.
    """
    started = time.perf_counter()
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE companies, tasks"))
        # random() in [0, 1) must be deterministic: setseed takes [-1, 1].
        conn.execute(text("SELECT setseed(:s)"), {"s": (seed % 1000) / 1000.0})
        conn.execute(
            text(_SEED_COMPANIES),
            {"heavy": HEAVY_COMPANIES, "companies": COMPANIES},
        )
        _seed_tasks(conn, rows, seed, delayed_backlog)
        marker = seed_marker(rows, seed, delayed_backlog)
        conn.execute(text(f"COMMENT ON TABLE tasks IS '{marker}'"))
    # VACUUM sets the visibility map (index-only scans) and ANALYZE gives the planner
    # the real distribution; neither may run inside a transaction block.
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM (ANALYZE) companies, tasks"))
    return stats(engine, time.perf_counter() - started)


def stats(engine: Engine, seconds: float = 0.0) -> SeedStats:
    """Count what the database behind `engine` holds now."""
    with engine.connect() as conn:
        row = conn.execute(text(_STATS), {"stale": STALE_AFTER_SECONDS}).one()
    return SeedStats(
        total=row.total,
        eligible=row.eligible,
        pending=row.pending,
        delayed=row.delayed,
        processing=row.processing,
        terminal=row.terminal,
        seconds=seconds,
    )


@contextmanager
def database(url: str | None) -> Iterator[str]:
    """Yield a migrated database URL: `url`, `DATABASE_URL`, or the embedded server.

    The embedded server keeps its data in `.pgdata/bench` and is stopped on exit. The rows
    are kept (`bench_claim --reuse` measures an earlier seed).
    """
    with stack.database(url or os.environ.get("DATABASE_URL") or None, "bench", empty=False) as db:
        yield db


def bench_engine(url: str) -> Engine:
    """An engine for benchmark scripts: one connection, no pool surprises."""
    return make_engine(url, application_name="fairq-bench", poolclass=pool.SingletonThreadPool)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line of this script."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rows", type=int, default=100_000, help="task rows (default 100000)")
    parser.add_argument("--seed", type=int, default=42, help="random seed (default 42)")
    parser.add_argument(
        "--delayed-backlog",
        type=int,
        default=0,
        metavar="N",
        help="add N pending rows runnable only tomorrow for one light company (default 0)",
    )
    stack.add_database_url_argument(
        parser,
        "postgresql+psycopg:// URL (created if missing); default DATABASE_URL, else an "
        "embedded server with data in .pgdata/bench",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Seed the workload and print what was built."""
    args = parse_args(argv)
    with database(args.database_url) as url:
        engine = bench_engine(url)
        try:
            print(seed(engine, args.rows, args.seed, args.delayed_backlog).describe())
        finally:
            engine.dispose()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
