"""Time our claim against the claim it replaced and the floor, side by side (DESIGN §4, §9).

Variants, each claiming batch 100 with at most 10 per company:
- ours: `db.queue.claim` as workers run it (advisory lock + `SET LOCAL jit = off`, then the
  per-company "eligible since" merge of two index range scans, driven by `companies`), and its
  claim statement alone;
- before 0002: our claim statement as it was before migration 0002 (one scan per company of
  `ix_tasks_claimable (company_id, created_at)` in created_at order, filtering eligibility row
  by row). Its index is created for the run (untimed, exactly as migration 0001 built it) and
  dropped afterwards, so while timing, every variant's UPDATE maintains both index sets;
- floor: lock and update 100 known ids (the ids our claim picks), the cost of the write alone;
- with `--shapes` also the shapes DESIGN §4 measured first, in our order: window (a global
  `ROW_NUMBER() OVER (PARTITION BY company_id ...)` over every eligible row) and distinct
  (our per-company merge, driven by `SELECT DISTINCT company_id` over eligible rows). Slow:
  seconds per run at 1M rows.

Scenarios: the reference workload at `--rows` (100k by default); with `--delayed-backlog N`
also `--rows` plus N pending rows of one light company runnable only tomorrow, created before
everything else (`scripts/perf_seed.py`); with `--million` also 1M rows.

Every run is its own transaction, rolled back, and the table is vacuumed (untimed) before each
run so every variant starts from the same visibility map. Variants take turns run by run, so
background load spreads evenly; the load average is printed with each table. JIT is off for
every variant, so the comparison is between query shapes. After a warm-up, the median of
`--runs` runs is reported with ratios against the floor and against ours. Our batch is checked
against the window query (the definition, computed by brute force, untimed) and compared with
the batch the claim before 0002 picks (they differ where retried or scheduled tasks are
eligible: the order changed from created_at to eligible since).

Usage:
    PYTHONPATH=. .venv/bin/python scripts/bench_claim.py [--rows 100000] [--million]
        [--delayed-backlog 300000] [--runs 9] [--reuse] [--explain] [--shapes]
        [--database-url postgresql+psycopg://postgres@127.0.0.1:5432/fairq_bench]
"""

from __future__ import annotations

import argparse
import os
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
from scripts import perf_seed, stack  # noqa: E402

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

# When an eligible row became eligible, as our claim orders it (db/queue.py `claim`).
_ELIGIBLE_AT = """
    CASE WHEN t.status = 'pending' THEN t.run_after ELSE t.locked_at END
"""

# Lock, update and return exactly as our claim does, so variants differ only in how they
# pick candidates (a `picked (id, rank, eligible_at)` CTE).
_LOCK_AND_UPDATE = f"""
locked AS (
    SELECT t.id, p.rank, p.eligible_at FROM tasks t JOIN picked p ON p.id = t.id
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
              t.lease_token, t.created_at, l.rank, l.eligible_at
)
SELECT id, company_id, type, payload, attempts, max_attempts, lease_token, created_at
FROM claimed ORDER BY rank, eligible_at, id
"""

WINDOW_SQL = f"""
WITH ranked AS (
    SELECT t.id, {_ELIGIBLE_AT} AS eligible_at,
           row_number() OVER (PARTITION BY t.company_id ORDER BY {_ELIGIBLE_AT}, t.id) AS rank
    FROM tasks t
    WHERE {_ELIGIBLE}
),
picked AS (
    SELECT id, rank, eligible_at FROM ranked WHERE rank <= :per_company_cap
    ORDER BY rank, eligible_at, id LIMIT :batch_size
),
{_LOCK_AND_UPDATE}
"""

_OUR_DRIVER = "    FROM companies c\n    CROSS JOIN LATERAL ("
if _OUR_DRIVER not in str(queue._CLAIM.text):
    raise SystemExit("db.queue._CLAIM no longer has the companies driver this script replaces")
# Our claim with its driver replaced: every company with eligible work, found by a scan.
DISTINCT_SQL = str(queue._CLAIM.text).replace(
    _OUR_DRIVER,
    f"    FROM (SELECT DISTINCT t.company_id AS id FROM tasks t WHERE {_ELIGIBLE}) c\n"
    "    CROSS JOIN LATERAL (",
    1,
)

FLOOR_SQL = f"""
WITH picked AS (
    SELECT id, n AS rank, now() AS eligible_at
    FROM unnest(CAST(:ids AS uuid[])) WITH ORDINALITY AS u(id, n)
),
{_LOCK_AND_UPDATE}
"""

# The claim statement of db/queue.py before migration 0002 (comments shortened), and the
# index it was written for, exactly as migration 0001 created it.
BEFORE_0002_INDEX = "ix_tasks_claimable"
BEFORE_0002_INDEX_DDL = f"""
CREATE INDEX IF NOT EXISTS {BEFORE_0002_INDEX} ON tasks (company_id, created_at)
INCLUDE (status, run_after, locked_at) WHERE status IN ('pending', 'processing')
"""
BEFORE_0002_SQL = """
WITH candidates AS (
    -- Driven by the companies table: one index probe per company.
    SELECT k.id, k.created_at, k.rank
    FROM companies c
    CROSS JOIN LATERAL (
        -- Per-company top-K: an ordered scan of ix_tasks_claimable (company_id, created_at)
        -- that LIMIT stops after per_company_cap eligible rows, filtering the rest.
        SELECT t.id, t.created_at, row_number() OVER (ORDER BY t.created_at) AS rank
        FROM tasks t
        WHERE t.company_id = c.id
          AND (
            (t.status = 'pending' AND t.run_after <= now())
            OR (t.status = 'processing'
                AND t.locked_at < now() - make_interval(secs => CAST(:stale_after AS float8))
                AND t.attempts < t.max_attempts)
          )
        ORDER BY t.created_at
        LIMIT :per_company_cap
    ) k
),
picked AS (
    SELECT id, rank FROM candidates ORDER BY rank, created_at, id LIMIT :batch_size
),
locked AS (
    SELECT t.id, p.rank
    FROM tasks t
    JOIN picked p ON p.id = t.id
    WHERE (t.status = 'pending' AND t.run_after <= now())
       OR (t.status = 'processing'
           AND t.locked_at < now() - make_interval(secs => CAST(:stale_after AS float8))
           AND t.attempts < t.max_attempts)
    FOR UPDATE OF t SKIP LOCKED
),
claimed AS (
    UPDATE tasks t
    SET status = 'processing',
        attempts = t.attempts + 1,
        lease_token = gen_random_uuid(),
        locked_by = :worker_id,
        locked_at = now(),
        started_at = coalesce(t.started_at, now()),
        updated_at = now()
    FROM locked l
    WHERE t.id = l.id
    RETURNING t.id, t.company_id, t.type, t.payload, t.attempts, t.max_attempts,
              t.lease_token, t.created_at, l.rank
)
SELECT id, company_id, type, payload, attempts, max_attempts, lease_token, created_at
FROM claimed
ORDER BY rank, created_at, id
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


@dataclass(frozen=True)
class Scenario:
    """A workload to time every variant on: `rows` reference rows plus a delayed backlog."""

    rows: int
    delayed_backlog: int = 0

    def describe(self) -> str:
        """The scenario as a table heading."""
        backlog = f" + delayed backlog {self.delayed_backlog:,}" if self.delayed_backlog else ""
        return f"rows={self.rows:,}{backlog}"


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


def _ddl(engine: Engine, sql: str) -> None:
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(sql))


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
        session.execute(text("SELECT set_config('jit', 'off', true)"))
        rows = run(session)
        session.rollback()
    return [row[0] if isinstance(row, tuple) else row.id for row in rows]


def explain(engine: Engine, sql: str) -> str:
    """EXPLAIN (ANALYZE, BUFFERS) of a claim statement, in a rolled-back transaction."""
    with Session(engine) as session:
        session.execute(text("SELECT set_config('jit', 'off', true)"))
        plan = "\n".join(
            str(r[0])
            for r in session.execute(text("EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) " + sql), PARAMS)
        )
        session.rollback()
    return plan


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} ({os.cpu_count()} CPUs)"


def bench(
    engine: Engine,
    scenario: Scenario,
    *,
    runs: int,
    warmup: int,
    reuse: bool,
    explain_plans: bool,
    shapes: bool,
) -> str:
    """Seed (unless reusable), time every variant and return the printed table."""
    rows, backlog = scenario.rows, scenario.delayed_backlog
    if not (reuse and perf_seed.current_marker(engine) == perf_seed.seed_marker(rows, 42, backlog)):
        print(f"seeding {scenario.describe()} ...", flush=True)
        print("  " + perf_seed.seed(engine, rows, delayed_backlog=backlog).describe(), flush=True)
    _ddl(engine, BEFORE_0002_INDEX_DDL)
    _ddl(engine, "ANALYZE tasks")
    try:
        known = ids_claimed(engine, _ours)
        definition = ids_claimed(engine, _statement(WINDOW_SQL))
        before = ids_claimed(engine, _statement(BEFORE_0002_SQL))
        variants = [
            Variant("ours: eligible-since merge", _ours),
            # Without the advisory-lock round trip: the statement's own cost.
            Variant("ours, claim statement alone", _statement(str(queue._CLAIM.text))),
            Variant("before 0002, statement alone", _statement(BEFORE_0002_SQL)),
        ]
        if shapes:
            variants += [
                Variant("window: global ROW_NUMBER()", _statement(WINDOW_SQL)),
                Variant("distinct: ours over DISTINCT", _statement(DISTINCT_SQL)),
            ]
        variants.append(
            Variant("floor: lock+update 100 ids", _statement(FLOOR_SQL, {"ids": known}))
        )
        load_before = _load()
        timed = time_variants(engine, variants, runs, warmup)
        load_after = _load()
        plans = (
            [
                "",
                "-- ours, claim statement:",
                explain(engine, str(queue._CLAIM.text)),
                "",
                "-- before 0002:",
                explain(engine, BEFORE_0002_SQL),
            ]
            if explain_plans
            else []
        )
    finally:
        _ddl(engine, f"DROP INDEX IF EXISTS {BEFORE_0002_INDEX}")
    medians = {name: (statistics.median(t), min(t), max(t)) for name, t in timed.items()}
    floor = medians[variants[-1].name][0]
    ours = medians[variants[0].name][0]
    lines = [
        f"{scenario.describe()} companies={perf_seed.COMPANIES} batch={BATCH} cap={CAP} "
        f"runs={runs} (+{warmup} warm-up), milliseconds",
        f"before: {load_before}; after: {load_after}",
        f"{'variant':<34}{'median':>9}{'min':>9}{'max':>9}{'vs floor':>10}{'vs ours':>9}",
    ]
    for name, (median, low, high) in medians.items():
        lines.append(
            f"{name:<34}{median:>9.2f}{low:>9.2f}{high:>9.2f}"
            f"{median / floor:>9.2f}x{median / ours:>8.2f}x"
        )
    same = "yes" if known == definition else "NO"
    lines.append(f"ours claims exactly the batch the window definition picks, in order: {same}")
    common = len(set(known) & set(before))
    lines.append(f"ids in common with the batch before 0002 (created_at order): {common}/{BATCH}")
    lines.extend(plans)
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line of this script."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rows", type=int, default=100_000, help="task rows (default 100000)")
    parser.add_argument("--million", action="store_true", help="also run at 1,000,000 rows")
    parser.add_argument(
        "--delayed-backlog",
        type=int,
        default=0,
        metavar="N",
        help="also run at --rows plus N pending rows of one company runnable only tomorrow",
    )
    parser.add_argument("--runs", type=int, default=9, help="timed runs per variant (min 7)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs per variant")
    parser.add_argument(
        "--reuse", action="store_true", help="keep an existing seed of the same scenario"
    )
    parser.add_argument("--explain", action="store_true", help="print both claims' plans")
    parser.add_argument(
        "--shapes", action="store_true", help="also time the window and distinct shapes (slow)"
    )
    stack.add_database_url_argument(
        parser,
        "postgresql+psycopg:// URL (created if missing; its tasks are replaced); "
        "default DATABASE_URL, else an embedded server with data in .pgdata/bench",
    )
    args = parser.parse_args(argv)
    if args.runs < 7:
        parser.error("--runs must be at least 7")
    if args.delayed_backlog < 0:
        parser.error("--delayed-backlog must not be negative")
    return args


def scenarios(args: argparse.Namespace) -> list[Scenario]:
    """The workloads to run, in order."""
    chosen = [Scenario(args.rows)]
    if args.delayed_backlog:
        chosen.append(Scenario(args.rows, args.delayed_backlog))
    if args.million and args.rows != 1_000_000:
        chosen.append(Scenario(1_000_000))
    return chosen


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark for each scenario and print one table per scenario."""
    args = parse_args(argv)
    with perf_seed.database(args.database_url) as url:
        engine = perf_seed.bench_engine(url)
        try:
            with engine.connect() as conn:
                print(conn.execute(text("SELECT version()")).scalar_one())
            tables = []
            for scenario in scenarios(args):
                tables.append(
                    bench(
                        engine,
                        scenario,
                        runs=args.runs,
                        warmup=args.warmup,
                        reuse=args.reuse,
                        explain_plans=args.explain,
                        shapes=args.shapes,
                    )
                )
                print(tables[-1] + "\n", flush=True)
        finally:
            engine.dispose()
    print()
    print("\n\n".join(tables))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
