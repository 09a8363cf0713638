"""Build a claim workload of one tenant shape (issue 9): deterministic, seed 42 by default.

The workload: `--companies N` registered companies (weight 1, no in-flight limit), of which
the first `--active M` own `--rows` pending `noop` tasks, spread evenly (task g belongs to
active company `g mod M`) and inserted in creation order over one week of history, so every
company's rows lie among everyone else's on the heap, as in a live queue. A fraction
`--delayed-fraction` (0.2 by default) of them is delayed: created in that week like the
others but runnable only in 1 to 2 days (scheduled with `run_at`, or backed off). Every
other row is runnable since its creation (`run_after = created_at`). No task is
`processing` or finished.

Built in SQL (`INSERT ... SELECT generate_series`): 1M rows in well under a minute. The
rows go through one ordinary INSERT, so the triggers of migration 0003 maintain
`company_queues` as they do for the API: each active company's `due_at` is its earliest
pending `run_after`. The secondary indexes of `tasks` are dropped for that INSERT and
rebuilt after it (much faster than growing them row by row; a built index is packed
tighter than a grown one, which helps every variant of `bench_claim` alike).

Then every company with runnable work is made ready the way a live system does it: by the
claim itself. Each committed `claims.claim` promotes up to `claims.PROMOTE_LIMIT` companies
whose `due_at` has come (joining the ring), so one claim of batch 1 per that many waiting
companies, each followed by `claims.release_tasks` of the task it took (back to `pending`,
attempt undone, place in line kept, as on a worker's shutdown), leaves exactly the state a
live queue is in after its claims have caught up: the ready set is the companies with
runnable work, in the order the claim promoted them, the claim cursor somewhere in it;
companies with only delayed work wait in `ix_company_queues_waiting_due_at` (nothing is
due for the timed claims to promote), and the others have no `due_at`. Using the claim's
own statements keeps this true whatever representation the claim keeps (virtual times, a
ring). VACUUM (ANALYZE) last, untimed.

The schema is the one of the migrations in this working tree: the database is rebuilt from
scratch (schema `public` dropped, `alembic upgrade head`) when they changed since it was
migrated (`--reuse` in `bench_claim` would otherwise time a stale schema).

Timestamps are relative to the database clock at seeding time, so a seed older than a day
has delayed rows coming due: `reusable` refuses it.

Usage (from the repository root):
    .venv/bin/python -m scripts.perf_seed [--companies 50] [--active 50]
        [--rows 100000] [--delayed-fraction 0.2] [--seed 42]
        [--database-url postgresql+psycopg://postgres@127.0.0.1:5432/fairq_bench]

Without `--database-url` or `DATABASE_URL`, an embedded PostgreSQL with its data in
`.pgdata/bench` is started for the run and stopped afterwards.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import Connection, Engine, pool, text
from sqlalchemy.orm import Session

from db import claims
from db.engine import driver_connection, make_engine
from devtools import stack

ROOT = Path(__file__).resolve().parent.parent

# The worker id of the claims that promote the seeded companies (module docstring).
CATCH_UP_WORKER = "perf-seed:catch-up"

# A seed is reused only while its delayed rows are this far from coming due.
REUSE_MARGIN = "1 hour"

_SEED_COMPANIES = """
WITH seeded AS (
    INSERT INTO companies (id, name, created_at)
    SELECT md5('fairq-company-' || i)::uuid, 'company-' || i, now() - interval '30 days'
    FROM generate_series(1, :companies) AS i
    RETURNING id, name, created_at
)
INSERT INTO api_keys (company_id, key_hash, created_at)
SELECT id, encode(sha256(convert_to('perf-seed-key-' || substr(name, 9), 'UTF8')), 'hex'),
       created_at
FROM seeded
"""

# One INSERT, so the statement trigger sees every new row at once (it takes the wake-up
# locks of the 64 buckets and lowers each company's due_at once). setseed() makes random()
# deterministic for the session; ids come from the seed and the row number.
_SEED_TASKS = """
INSERT INTO tasks (id, company_id, type, payload, status, attempts, max_attempts, run_after,
                   created_at, updated_at)
SELECT md5('fairq-task-' || :seed || '-' || g)::uuid,
       md5('fairq-company-' || (1 + (g - 1) % :active))::uuid,
       'noop', '{}'::jsonb, 'pending', 0, 5,
       CASE WHEN delayed THEN now() + interval '1 day' + make_interval(secs => r_delay * 86400)
            ELSE created_at END,
       created_at,
       created_at
FROM (
    SELECT g, random() < :delayed_fraction AS delayed, random() AS r_delay,
           -- Insertion order is creation order, as in a live queue: one week of history.
           now() - make_interval(secs => (:rows - g + 1) * (604800.0 / :rows)) AS created_at
    FROM generate_series(1, :rows) AS g
) AS x
"""

# Companies the claim has yet to promote: their earliest task has come due.
_NOT_YET_PROMOTED = "SELECT count(*) FROM company_queues WHERE NOT ready AND due_at <= now()"

_STATS = """
SELECT (SELECT count(*) FROM tasks) AS total,
       (SELECT count(*) FROM tasks WHERE status = 'pending' AND run_after <= now()) AS runnable,
       (SELECT count(*) FROM tasks WHERE status = 'pending' AND run_after > now()) AS delayed,
       (SELECT count(*) FROM companies) AS companies,
       (SELECT count(*) FROM company_queues WHERE due_at IS NOT NULL) AS with_work,
       (SELECT count(*) FROM company_queues WHERE ready) AS ready,
       (SELECT count(*) FROM company_queues WHERE NOT ready AND due_at IS NOT NULL) AS waiting
"""

# The earliest delayed row: reuse needs it still in the future (module docstring).
_DELAYED_STILL_AHEAD = f"""
SELECT coalesce(min(run_after) > now() + interval '{REUSE_MARGIN}', true)
FROM tasks WHERE status = 'pending' AND run_after > created_at
"""


@dataclass(frozen=True)
class Shape:
    """A tenant shape: how many companies exist, how many have work, how much work."""

    companies: int
    active: int
    rows: int = 100_000
    delayed_fraction: float = 0.2
    seed: int = 42

    def __post_init__(self) -> None:
        if not 1 <= self.active <= self.companies:
            raise ValueError("need 1 <= active <= companies")
        if self.rows < self.active:
            raise ValueError("need at least one row per active company")
        if not 0.0 <= self.delayed_fraction < 1.0:
            raise ValueError("the delayed fraction must be in [0, 1)")

    def describe(self) -> str:
        """The shape in a few words, for table rows."""
        return (
            f"{_companies(self.companies)}, {self.active:,} with work, {self.rows:,} rows"
            f" ({self.delayed_fraction:.0%} delayed)"
        )

    def marker(self) -> str:
        """The table comment that identifies this seed (for `reusable`)."""
        return (
            f"perf_seed companies={self.companies} active={self.active} rows={self.rows} "
            f"delayed_fraction={self.delayed_fraction} seed={self.seed} "
            f"schema={schema_fingerprint()}"
        )


@dataclass(frozen=True)
class SeedStats:
    """What a seeded database holds."""

    total: int
    runnable: int
    delayed: int
    companies: int
    with_work: int
    ready: int
    waiting: int
    seconds: float

    def describe(self) -> str:
        """One line for the console."""
        return (
            f"{self.total:,} rows ({self.runnable:,} runnable, {self.delayed:,} delayed), "
            f"{_companies(self.companies)}: {self.ready:,} ready, {self.waiting:,} waiting "
            f"for delayed work, {self.companies - self.with_work:,} idle"
            + (f"; seeded in {self.seconds:.1f}s" if self.seconds else "")
        )


def _companies(n: int) -> str:
    return "1 company" if n == 1 else f"{n:,} companies"


def schema_fingerprint() -> str:
    """A digest of the migrations in this working tree (they define the schema)."""
    digest = hashlib.sha256()
    for path in sorted((ROOT / "migrations").rglob("*.py")):
        digest.update(path.relative_to(ROOT).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def current_marker(engine: Engine) -> str | None:
    """The seed marker of the database behind `engine`, or None."""
    with engine.connect() as conn:
        value: str | None = conn.execute(
            text("SELECT obj_description('tasks'::regclass, 'pg_class')")
        ).scalar_one()
        return value


def reusable(engine: Engine, shape: Shape) -> bool:
    """Whether the database holds `shape` as seeded, with its delayed rows still ahead."""
    if current_marker(engine) != shape.marker():
        return False
    with engine.connect() as conn:
        return bool(conn.execute(text(_DELAYED_STILL_AHEAD)).scalar_one())


def _seed_tasks(conn: Connection, shape: Shape) -> None:
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
            "rows": shape.rows,
            "seed": shape.seed,
            "active": shape.active,
            "delayed_fraction": shape.delayed_fraction,
        },
    )
    for _, definition in indexes:
        conn.execute(text(definition))


def seed(engine: Engine, shape: Shape) -> SeedStats:
    """Replace every company and task with `shape`'s workload; return its statistics."""
    started = time.perf_counter()
    with engine.begin() as conn:
        # companies cascades to company_queues; the companies trigger recreates its rows.
        conn.execute(text("TRUNCATE companies, tasks CASCADE"))
        # random() in [0, 1) must be deterministic: setseed takes [-1, 1].
        conn.execute(text("SELECT setseed(:s)"), {"s": (shape.seed % 1000) / 1000.0})
        conn.execute(text(_SEED_COMPANIES), {"companies": shape.companies})
        _seed_tasks(conn, shape)
    _catch_up(engine)
    with engine.begin() as conn:
        conn.execute(text(f"COMMENT ON TABLE tasks IS '{shape.marker()}'"))
    # VACUUM sets the visibility map (index-only scans) and ANALYZE gives the planner
    # the real distribution; neither may run inside a transaction block.
    vacuum(engine, analyze=True)
    return stats(engine, time.perf_counter() - started)


def _catch_up(engine: Engine) -> None:
    # One committed claim of batch 1 per PROMOTE_LIMIT waiting companies, its task handed
    # back at once (module docstring). Bounded: a claim that stops promoting ends the loop.
    waiting = _count(engine, _NOT_YET_PROMOTED)
    while waiting:
        with Session(engine) as session:
            batch = claims.claim(
                driver_connection(session, transaction=False),
                worker_id=CATCH_UP_WORKER,
                batch_size=1,
            )
            session.commit()
            claims.release_tasks(driver_connection(session, transaction=False), list(batch))
            session.commit()
        left = _count(engine, _NOT_YET_PROMOTED)
        if left >= waiting:
            raise RuntimeError(f"the claim promotes no more companies ({left} left waiting)")
        waiting = left


def _count(engine: Engine, sql: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(sql)).scalar_one())


def vacuum(engine: Engine, *, analyze: bool = False) -> None:
    """VACUUM every table of the schema, index passes included (whatever the claim touches)."""
    options = "INDEX_CLEANUP ON, ANALYZE" if analyze else "INDEX_CLEANUP ON"
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        tables = conn.execute(
            text("SELECT quote_ident(tablename) FROM pg_tables WHERE schemaname = 'public'")
        ).scalars()
        conn.execute(text(f"VACUUM ({options}) {', '.join(tables)}"))


def stats(engine: Engine, seconds: float = 0.0) -> SeedStats:
    """Count what the database behind `engine` holds now."""
    with engine.connect() as conn:
        row = conn.execute(text(_STATS)).one()
    return SeedStats(
        total=row.total,
        runnable=row.runnable,
        delayed=row.delayed,
        companies=row.companies,
        with_work=row.with_work,
        ready=row.ready,
        waiting=row.waiting,
        seconds=seconds,
    )


def _match_schema(url: str) -> None:
    # The migrations may have been edited in place since this database was migrated
    # (alembic sees the same head revision and does nothing): then start from scratch.
    fingerprint = f"fairq migrations {schema_fingerprint()}"
    engine = stack.script_engine(url, "fairq-bench")
    try:
        with engine.begin() as conn:
            stored = conn.execute(
                text("SELECT obj_description('public'::regnamespace, 'pg_namespace')")
            ).scalar_one()
            if stored == fingerprint:
                return
            print("the migrations changed since this database was migrated: rebuilding it")
            conn.execute(text("DROP SCHEMA public CASCADE"))
            conn.execute(text("CREATE SCHEMA public"))
        stack.migrate(url)
        with engine.begin() as conn:
            conn.execute(text(f"COMMENT ON SCHEMA public IS '{fingerprint}'"))
    finally:
        engine.dispose()


@contextmanager
def database(url: str | None) -> Iterator[str]:
    """Yield a migrated database URL: `url`, `DATABASE_URL`, or the embedded server.

    The database is rebuilt when the migrations changed since it was migrated. The embedded
    server keeps its data in `.pgdata/bench` and is stopped on exit. The rows are kept
    (`bench_claim --reuse` measures an earlier seed).
    """
    with stack.database(url or os.environ.get("DATABASE_URL") or None, "bench", empty=False) as db:
        _match_schema(db)
        yield db


def bench_engine(url: str) -> Engine:
    """An engine for benchmark scripts: one connection, no pool surprises."""
    return make_engine(url, application_name="fairq-bench", poolclass=pool.SingletonThreadPool)


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """`--rows`, `--delayed-fraction` and `--seed` (the shape's size; not its tenants)."""
    parser.add_argument("--rows", type=int, default=100_000, help="pending tasks (default 100000)")
    parser.add_argument(
        "--delayed-fraction",
        type=float,
        default=0.2,
        metavar="F",
        help="fraction of the tasks runnable only in 1 to 2 days (default 0.2)",
    )
    parser.add_argument("--seed", type=int, default=42, help="random seed (default 42)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line of this script."""
    parser = argparse.ArgumentParser(
        prog="python -m scripts.perf_seed", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--companies", type=int, default=50, help="registered (default 50)")
    parser.add_argument("--active", type=int, default=50, help="with work (default 50)")
    add_shape_arguments(parser)
    stack.add_database_url_argument(
        parser,
        "postgresql+psycopg:// URL (created if missing); default DATABASE_URL, else an "
        "embedded server with data in .pgdata/bench",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Seed the workload and print what was built."""
    args = parse_args(argv)
    try:
        shape = Shape(args.companies, args.active, args.rows, args.delayed_fraction, args.seed)
    except ValueError as exc:
        raise SystemExit(f"perf_seed.py: {exc}") from None
    with database(args.database_url) as url:
        engine = bench_engine(url)
        try:
            print(shape.describe())
            print(seed(engine, shape).describe())
        finally:
            engine.dispose()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
