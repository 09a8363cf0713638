"""Time our claim against the query shapes it replaced, side by side (DESIGN §4, §9).

Variants, each claiming batch 100 with at most 10 per company:
- ours: `db.queue.claim` as workers run it (advisory lock + `SET LOCAL jit = off`, then the
  LATERAL top-K driven by the `companies` table), and its claim statement alone;
- window: the global `ROW_NUMBER() OVER (PARTITION BY company_id ...)` over every eligible row;
- distinct: the same LATERAL top-K, driven by `SELECT DISTINCT company_id` over eligible rows;
- floor: lock and update 100 known ids (the ids our claim picks), the cost of the write alone.

Every run is its own transaction, rolled back, and the table is vacuumed (untimed) before each
run so every variant starts from the same visibility map. Variants take turns run by run, so
background load spreads evenly. JIT is off for every variant, so the comparison is between
query shapes. After a warm-up, the median of `--runs` runs is reported with ratios against
the floor and against ours.

Usage:
    PYTHONPATH=. .venv/bin/python scripts/bench_claim.py [--rows 100000] [--million]
        [--runs 9] [--reuse] [--explain]
        [--database-url postgresql+psycopg://postgres@127.0.0.1:5432/fairq_bench]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from db import queue  # noqa: E402  (needs the repository on sys.path)
from scripts import perf_seed  # noqa: E402

BATCH = 100
CAP = 10
STALE = perf_seed.STALE_AFTER_SECONDS
WORKER = "bench:0"

_ELIGIBLE = """
    t.status IN ('pending', 'processing')
    AND ((t.status = 'pending' AND t.run_after <= now())
         OR (t.status = 'processing'
             AND t.locked_at < now() - make_interval(secs => CAST(:stale_after AS float8))
             AND t.attempts < t.max_attempts))
"""

# Lock, update and return exactly as our claim does, so variants differ only in how they
# pick candidates (a `picked (id, rank)` CTE).
_LOCK_AND_UPDATE = f"""
locked AS (
    SELECT t.id, p.rank FROM tasks t JOIN picked p ON p.id = t.id
    WHERE {_ELIGIBLE}
    FOR UPDATE OF t SKIP LOCKED
),
claimed AS (
    UPDATE tasks t
    SET status = 'processing', attempts = t.attempts + 1, lease_token = gen_random_uuid(),
        locked_by = :worker_id, locked_at = now(),
        started_at = coalesce(t.started_at, now()), updated_at = now()
    FROM locked l WHERE t.id = l.id
    RETURNING t.id, t.company_id, t.type, t.payload, t.attempts, t.max_attempts,
              t.lease_token, t.created_at, l.rank
)
SELECT id, company_id, type, payload, attempts, max_attempts, lease_token, created_at
FROM claimed ORDER BY rank, created_at, id
"""

WINDOW_SQL = f"""
WITH ranked AS (
    SELECT t.id, t.created_at,
           row_number() OVER (PARTITION BY t.company_id ORDER BY t.created_at) AS rank
    FROM tasks t
    WHERE {_ELIGIBLE}
),
picked AS (
    SELECT id, rank FROM ranked WHERE rank <= :per_company_cap
    ORDER BY rank, created_at, id LIMIT :batch_size
),
{_LOCK_AND_UPDATE}
"""

DISTINCT_SQL = f"""
WITH busy AS (
    SELECT DISTINCT t.company_id FROM tasks t WHERE {_ELIGIBLE}
),
candidates AS (
    SELECT k.id, k.created_at, k.rank
    FROM busy c
    CROSS JOIN LATERAL (
        SELECT t.id, t.created_at, row_number() OVER (ORDER BY t.created_at) AS rank
        FROM tasks t
        WHERE t.company_id = c.company_id AND {_ELIGIBLE}
        ORDER BY t.created_at
        LIMIT :per_company_cap
    ) k
),
picked AS (
    SELECT id, rank FROM candidates ORDER BY rank, created_at, id LIMIT :batch_size
),
{_LOCK_AND_UPDATE}
"""

FLOOR_SQL = f"""
WITH picked AS (
    SELECT id, 1 AS rank FROM unnest(CAST(:ids AS uuid[])) AS id
),
{_LOCK_AND_UPDATE}
"""

PARAMS: dict[str, Any] = {
    "worker_id": WORKER,
    "batch_size": BATCH,
    "per_company_cap": CAP,
    "stale_after": STALE,
}


@dataclass(frozen=True)
class Variant:
    """A named way to claim one batch inside the caller's transaction."""

    name: str
    run: Callable[[Session], Sequence[Any]]


def _statement(sql: str, extra: dict[str, Any] | None = None) -> Callable[[Session], Sequence[Any]]:
    def run(session: Session) -> Sequence[Any]:
        return session.execute(text(sql), {**PARAMS, **(extra or {})}).all()

    return run


def _ours(session: Session) -> Sequence[Any]:
    return queue.claim(
        session, worker_id=WORKER, batch_size=BATCH, per_company_cap=CAP, stale_after=STALE
    )


def _vacuum(engine: Engine) -> None:
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM tasks"))


def time_once(engine: Engine, variant: Variant) -> float:
    """Milliseconds of one run of `variant`, from a freshly vacuumed table, rolled back."""
    _vacuum(engine)
    with Session(engine) as session:
        # Same settings as our claim applies to itself, untimed: the comparison is between
        # query shapes, not between JIT and no JIT.
        session.execute(text("SELECT set_config('jit', 'off', true)"))
        started = time.perf_counter()
        rows = variant.run(session)
        elapsed = (time.perf_counter() - started) * 1000.0
        session.rollback()
    if len(rows) != BATCH:
        raise SystemExit(f"{variant.name} claimed {len(rows)} rows, expected {BATCH}")
    return elapsed


def time_variants(
    engine: Engine, variants: Sequence[Variant], runs: int, warmup: int
) -> dict[str, list[float]]:
    """Milliseconds of each timed run per variant, after `warmup` untimed runs of each.

    Runs are interleaved round-robin, so load from anything else on the machine falls on
    every variant alike instead of on whichever ran at the time.
    """
    timings: dict[str, list[float]] = {v.name: [] for v in variants}
    for i in range(warmup + runs):
        for variant in variants:
            elapsed = time_once(engine, variant)
            if i >= warmup:
                timings[variant.name].append(elapsed)
    return timings


def ids_claimed(engine: Engine, run: Callable[[Session], Sequence[Any]]) -> list[uuid.UUID]:
    """The ids one run would claim, in claim order (rolled back)."""
    with Session(engine) as session:
        rows = run(session)
        session.rollback()
    return [row[0] if isinstance(row, tuple) else row.id for row in rows]


def explain_ours(engine: Engine) -> str:
    """EXPLAIN ANALYZE of our claim statement, in a rolled-back transaction."""
    with Session(engine) as session:
        session.execute(text("SELECT set_config('jit', 'off', true)"))
        sql = "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) " + str(queue._CLAIM.text)
        plan = "\n".join(str(r[0]) for r in session.execute(text(sql), PARAMS))
        session.rollback()
    return plan


def bench(engine: Engine, rows: int, *, runs: int, warmup: int, reuse: bool, explain: bool) -> str:
    """Seed (unless reusable), time every variant and return the printed table."""
    if not (reuse and perf_seed.current_marker(engine) == perf_seed.seed_marker(rows, 42)):
        print(f"seeding {rows:,} rows ...", flush=True)
        print("  " + perf_seed.seed(engine, rows).describe(), flush=True)
    known = ids_claimed(engine, _ours)
    window_ids = ids_claimed(engine, _statement(WINDOW_SQL))
    variants = [
        Variant("ours: companies LATERAL top-K", _ours),
        # Without the advisory-lock round trip: the statement's own cost.
        Variant("ours, claim statement alone", _statement(str(queue._CLAIM.text))),
        Variant("window: global ROW_NUMBER()", _statement(WINDOW_SQL)),
        Variant("distinct: LATERAL over DISTINCT", _statement(DISTINCT_SQL)),
        Variant("floor: lock+update 100 ids", _statement(FLOOR_SQL, {"ids": known})),
    ]
    medians: dict[str, tuple[float, float, float]] = {}
    for name, timings in time_variants(engine, variants, runs, warmup).items():
        medians[name] = (statistics.median(timings), min(timings), max(timings))
    floor = medians[variants[-1].name][0]
    ours = medians[variants[0].name][0]
    lines = [
        f"rows={rows:,} companies={perf_seed.COMPANIES} batch={BATCH} cap={CAP} "
        f"runs={runs} (+{warmup} warm-up), milliseconds",
        f"{'variant':<34}{'median':>9}{'min':>9}{'max':>9}{'vs floor':>10}{'vs ours':>9}",
    ]
    for name, (median, low, high) in medians.items():
        lines.append(
            f"{name:<34}{median:>9.2f}{low:>9.2f}{high:>9.2f}"
            f"{median / floor:>9.2f}x{median / ours:>8.2f}x"
        )
    same = "yes" if set(known) == set(window_ids) else "NO"
    lines.append(f"ours claims the same batch as the window baseline: {same}")
    if explain:
        lines.extend(["", explain_ours(engine)])
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line of this script."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rows", type=int, default=100_000, help="task rows (default 100000)")
    parser.add_argument("--million", action="store_true", help="also run at 1,000,000 rows")
    parser.add_argument("--runs", type=int, default=9, help="timed runs per variant (min 7)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs per variant")
    parser.add_argument(
        "--reuse", action="store_true", help="keep an existing seed of the same size"
    )
    parser.add_argument("--explain", action="store_true", help="print our claim's plan")
    parser.add_argument(
        "--database-url",
        help="postgresql+psycopg:// URL (created if missing; its tasks are replaced); "
        "default DATABASE_URL, else an embedded server with data in .pgdata/bench",
    )
    args = parser.parse_args(argv)
    if args.runs < 7:
        parser.error("--runs must be at least 7")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark at each requested size and print one table per size."""
    args = parse_args(argv)
    sizes = [args.rows] + ([1_000_000] if args.million and args.rows != 1_000_000 else [])
    with perf_seed.database(args.database_url) as url:
        engine = perf_seed.bench_engine(url)
        try:
            with engine.connect() as conn:
                print(conn.execute(text("SELECT version()")).scalar_one())
            tables = [
                bench(
                    engine,
                    rows,
                    runs=args.runs,
                    warmup=args.warmup,
                    reuse=args.reuse,
                    explain=args.explain,
                )
                for rows in sizes
            ]
        finally:
            engine.dispose()
    print()
    print("\n\n".join(tables))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
