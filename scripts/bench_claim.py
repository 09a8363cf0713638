"""Time our claim against the previous claim and the floor, per tenant shape (issue 9).

Variants, each claiming a batch of 100 in a transaction that is rolled back afterwards:
- ours: `db.claims.claim(conn, worker_id=..., batch_size=100)` exactly as workers run it,
  whatever statements it sends, timed as a whole; the only thing of `db.claims` the timings
  use, so they measure whatever the claim is. By statement (`--no-breakdown` skips it): the
  time of each statement it sends through a psycopg cursor is recorded too, at the driver (a
  cursor class that logs each execute: a few microseconds), each named after the constant of
  `db.claims` that holds its SQL, else after its first words; a claim that sends none that
  way gets no breakdown, and the output says so;
- previous: the claim of commit f2958cf, embedded below (its lock statement, then one
  statement: per-company top-K driven by the `companies` table, at most 10 per company,
  pending work merged with stale leases), with its parameters (cap 10, stale after 300 s),
  through the SQLAlchemy session as it ran; it reads only the indexes of migration 0002,
  which still exist;
- floor: lock (`FOR UPDATE SKIP LOCKED`) and update the 100 ids ours picks, with the SET
  list of our claim, in one statement sent straight to psycopg: the cost of the write alone.

Shapes (`scripts.perf_seed`: `--rows` pending noop tasks spread evenly over the companies
with work, `--delayed-fraction` of them runnable only tomorrow, every company with runnable
work made ready by the claim itself): 1 company; 50 companies, all with work; 2,000, all
with work; 20,000 registered, 200 with work; 20,000, all with work. `--companies N --active
M` runs one shape instead; `--million` runs them at 1,000,000 rows too. The goal: ours at
most 1.5x the floor in every shape, at 100k and at 1M rows.

Method: each shape is seeded (or reused with `--reuse` when the database holds it already:
it holds one shape, the last one seeded, so that pays off when one shape is run again),
VACUUM ANALYZEd, then checked untimed in each mode (ours claims min(100, runnable) tasks,
the previous claim min(100, the sum over companies of min(10, eligible)), the floor every
id it is given, in order). Each timed run is one transaction, rolled back, on a freshly
vacuumed database (every variant starts from the same visibility map); the variants of
every mode take turns run by run, a different one first each round, so background load
falls on all alike. After
`--warmup` rounds, the median of `--runs` is reported, with the ratios to the floor, the
batch sizes and the load average.

Two modes, side by side in the same rounds (each variant in each, the floor and the previous
claim included), each on a connection of its own made as a worker child makes its engine
(`db.engine.make_engine` with the worker's statement timeout):
- prepared, as a worker with `DATABASE_POOL_MODE=session` (the default): a worker commits
  its claims, so psycopg prepares each statement on its sixth execution (`prepare_threshold`
  5) and PostgreSQL may then settle on a generic plan (after five custom ones). psycopg
  forgets its prepared statements on rollback, so here ROLLBACK goes to the libpq connection
  underneath (`rollback`), and the ten warm-up rounds reach that steady state;
- unprepared, as a worker with `DATABASE_POOL_MODE=transaction` (behind a transaction pooler,
  PgBouncer's `pool_mode = transaction`, where a statement prepared by name on one server
  connection is unknown on the next): `transaction_pooling=True`, so `prepare_threshold=None`
  (and no startup options): every statement is parsed and planned on every call.
`--prepared` or `--unprepared` runs one mode only. Each mode has its table, then one table
has the ratio ours / floor of both, per shape.

`--stale-statistics`: instead of the shapes, the claim on statistics that predate a burst of
inserts. For 1 and 50 companies: 10 tasks each, ANALYZE, autovacuum off on the queue tables,
then `--burst` (500,000) more pending tasks, and ours is timed before and after an ANALYZE
(the goal: at most 2x; a planner that trusted the old statistics once hash-joined the whole
backlog, 360-400 ms a claim instead of 1.6 ms).

`--explain`: EXPLAIN (ANALYZE, BUFFERS) of every statement ours ran (as recorded by
statement), replayed with the very parameters it used (unprepared: planning time included),
and of the previous claim, then each prepared statement's count of generic and custom plans
(prepared mode). Timings are printed, never asserted; a failed check makes the exit status 1.

Usage (from the repository root):
    .venv/bin/python -m scripts.bench_claim [--companies N --active M]
        [--rows 100000] [--million] [--delayed-fraction 0.2] [--runs 11] [--warmup 10]
        [--prepared | --unprepared] [--no-breakdown] [--reuse] [--explain] [--seed 42]
        [--stale-statistics [--burst 500000]]
        [--database-url postgresql+psycopg://postgres@127.0.0.1:5432/fairq_bench]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

import psycopg
from psycopg.abc import Params, Query
from sqlalchemy import Engine, TextClause, event, pool, text
from sqlalchemy.orm import Session

from db import claims
from db import engine as db_engine
from db.engine import driver_connection
from devtools import stack
from scripts import perf_seed
from worker import processing

BATCH = 100
WORKER = "bench:0"
MILLION = 1_000_000
# (registered companies, companies with work): the table of issue 9.
SHAPES = ((1, 1), (50, 50), (2_000, 2_000), (20_000, 200), (20_000, 20_000))
GOAL = 1.5  # ours / floor, at most

# The previous claim's parameters, as workers ran it.
PREVIOUS_CAP = 10
PREVIOUS_STALE_AFTER = 300.0
PREVIOUS_PARAMS: dict[str, Any] = {
    "worker_id": WORKER,
    "batch_size": BATCH,
    "per_company_cap": PREVIOUS_CAP,
    "stale_after": PREVIOUS_STALE_AFTER,
}

# The previous claim (db/queue.py at f2958cf, comments shortened): the lock statement,
# then the claim statement.
PREVIOUS_LOCK = text("SELECT pg_advisory_xact_lock(:key), set_config('jit', 'off', true)")
PREVIOUS_LOCK_KEY = 0x66_61_69_72_71_63_6C
PREVIOUS_CLAIM = text(
    """
WITH candidates AS (
    -- Driven by the companies table: two index probes per company.
    SELECT k.id, k.eligible_at, k.rank
    FROM companies c
    CROSS JOIN LATERAL (
        -- Per-company top-K by "eligible since": a Merge Append of two LIMITed index
        -- range scans (runnable pending work, stale leases).
        SELECT e.id, e.eligible_at,
               row_number() OVER (ORDER BY e.eligible_at, e.id) AS rank
        FROM (
            (
                SELECT t.id, t.run_after AS eligible_at
                FROM tasks t
                WHERE t.company_id = c.id
                  AND t.status = 'pending'
                  AND t.run_after <= now()
                ORDER BY t.run_after, t.id
                LIMIT :per_company_cap
            )
            UNION ALL
            (
                SELECT t.id, t.locked_at AS eligible_at
                FROM tasks t
                WHERE t.company_id = c.id
                  AND t.status = 'processing'
                  AND t.locked_at < now() - make_interval(secs => CAST(:stale_after AS float8))
                  AND t.attempts < t.max_attempts
                ORDER BY t.locked_at, t.id
                LIMIT :per_company_cap
            )
        ) e
        ORDER BY e.eligible_at, e.id
        LIMIT :per_company_cap
    ) k
),
picked AS (
    SELECT id, eligible_at, rank FROM candidates ORDER BY rank, eligible_at, id
    LIMIT :batch_size
),
locked AS (
    SELECT t.id, p.rank, p.eligible_at
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
        locked_at = statement_timestamp(),
        started_at = coalesce(t.started_at, statement_timestamp()),
        updated_at = statement_timestamp()
    FROM locked l
    WHERE t.id = l.id
    RETURNING t.id, t.company_id, t.type, t.payload, t.attempts, t.max_attempts,
              t.lease_token, t.created_at, l.rank, l.eligible_at
)
SELECT id, company_id, type, payload, attempts, max_attempts, lease_token, created_at
FROM claimed
ORDER BY rank, eligible_at, id
"""
)

# What the previous claim can take: min(cap, eligible) of each company, at most a batch.
PREVIOUS_EXPECTED = text(
    """
SELECT least(CAST(:batch_size AS bigint), coalesce(sum(n), 0))
FROM (
    SELECT least(count(*), CAST(:per_company_cap AS bigint)) AS n
    FROM tasks t
    WHERE (t.status = 'pending' AND t.run_after <= now())
       OR (t.status = 'processing'
           AND t.locked_at < now() - make_interval(secs => CAST(:stale_after AS float8))
           AND t.attempts < t.max_attempts)
    GROUP BY t.company_id
) per_company
"""
)

_PREPARED = """
SELECT generic_plans AS generic, custom_plans AS custom,
       left(regexp_replace(statement, '\\s+', ' ', 'g'), 90) AS statement
FROM pg_prepared_statements ORDER BY prepare_time
"""

RUNNABLE = text("SELECT count(*) FROM tasks WHERE status = 'pending' AND run_after <= now()")

# Lock and update known ids the way our claim does (its eligibility re-check, SKIP LOCKED,
# its SET list), returning the same columns in the given order. Sent straight to psycopg,
# as our claim sends its statements: the floor carries no SQLAlchemy overhead.
FLOOR = """
WITH locked AS (
    SELECT t.id, u.n
    FROM unnest(CAST(%(ids)s AS uuid[])) WITH ORDINALITY AS u(id, n)
    JOIN tasks t ON t.id = u.id
    WHERE t.status = 'pending' AND t.run_after <= now()
    FOR UPDATE OF t SKIP LOCKED
),
claimed AS (
    UPDATE tasks t
    SET status = 'processing',
        attempts = t.attempts + 1,
        lease_token = gen_random_uuid(),
        locked_by = %(worker_id)s,
        locked_at = statement_timestamp(),
        started_at = coalesce(t.started_at, statement_timestamp()),
        updated_at = statement_timestamp()
    FROM locked l
    WHERE t.id = l.id
    RETURNING t.id, t.company_id, t.type, t.payload, t.attempts, t.max_attempts,
              t.lease_token, t.created_at, l.n
)
SELECT id, company_id, type, payload, attempts, max_attempts, lease_token, created_at
FROM claimed
ORDER BY n
"""

# Run before every variant, untimed: it opens the transaction, and no variant's time
# includes JIT compilation (ours and the previous claim turn it off themselves too).
_BEGIN = text("SELECT set_config('jit', 'off', true)")


@dataclass(frozen=True)
class Executed:
    """One statement sent to the server while recording: its name, time, query and values."""

    name: str
    ms: float
    query: str
    params: Params | None


class TimedCursor(psycopg.Cursor[Any]):
    """A psycopg cursor that logs each statement it runs while `StatementClock` records.

    At the driver, so it sees the claim's statements whether they go through SQLAlchemy or
    straight to psycopg (the claim sends them to its session's psycopg connection).
    """

    log: ClassVar[list[Executed] | None] = None
    names: ClassVar[dict[str, str]] = {}  # SQL -> name, filled by StatementClock

    def execute(
        self,
        query: Query,
        params: Params | None = None,
        *,
        prepare: bool | None = None,
        binary: bool | None = None,
    ) -> Self:
        """Execute as psycopg does, and log the time it took."""
        started = time.perf_counter()
        try:
            # Typed Any: the overloads of the base split Query in two; this takes both.
            base: Any = super()
            base.execute(query, params, prepare=prepare, binary=binary)
            return self
        finally:
            log = TimedCursor.log
            if log is not None and isinstance(query, str):
                ms = (time.perf_counter() - started) * 1000.0
                log.append(Executed(statement_name(query), ms, query, params))


def statement_name(query: str) -> str:
    """The name of the constant that holds `query`, else its first words, quoted."""
    name = TimedCursor.names.get(query)
    if name is not None:
        return name
    words = " ".join(query.split())
    return repr(words if len(words) <= 40 else words[:39] + "…")


class StatementClock:
    """Times every statement sent through some engines' connections, while `record` is active.

    Statements are named after the constant of `db.claims` (or of this script) that holds
    them, whatever those are: raw SQL strings as they are, `text()` clauses as SQLAlchemy
    compiles them.
    """

    def __init__(self, engines: Sequence[Engine]) -> None:
        named: dict[str, object] = {
            name: value
            for name, value in vars(claims).items()
            if name.lstrip("_").isupper() and isinstance(value, str | TextClause)
        }
        named |= {"PREVIOUS_LOCK": PREVIOUS_LOCK, "PREVIOUS_CLAIM": PREVIOUS_CLAIM, "FLOOR": FLOOR}
        for name, value in named.items():
            sql = (
                str(value.compile(dialect=engines[0].dialect))
                if isinstance(value, TextClause)
                else value
            )
            TimedCursor.names[str(sql)] = name.lstrip("_").lower()
        for engine in engines:
            event.listen(engine, "connect", _use_timed_cursor)
            engine.dispose()  # connections made before this listener get no timed cursor

    @contextmanager
    def record(self) -> Iterator[list[Executed]]:
        """Collect the statements executed inside the block, in order."""
        log: list[Executed] = []
        TimedCursor.log = log
        try:
            yield log
        finally:
            TimedCursor.log = None


def _use_timed_cursor(dbapi_connection: Any, connection_record: Any) -> None:
    dbapi_connection.cursor_factory = TimedCursor


@dataclass(frozen=True)
class Mode:
    """How the claiming connection sends statements: prepared by psycopg, or not (pooled)."""

    name: str
    engine: Engine
    prepared: bool

    def describe(self) -> str:
        """What this mode is, in the words of the worker's settings."""
        if self.prepared:
            return (
                "prepared: psycopg prepares each statement on its sixth execution "
                "(prepare_threshold 5), as on a worker's connection (DATABASE_POOL_MODE="
                "session); the floor and the previous claim prepared alike"
            )
        return (
            "unprepared: prepare_threshold=None and no startup options, as a worker under "
            "transaction pooling (DATABASE_POOL_MODE=transaction): every statement parsed and "
            "planned on every call; the floor and the previous claim unprepared alike"
        )


MODES = ("prepared", "unprepared")


def mode_engine(url: str, *, prepared: bool) -> Engine:
    """An engine made as a worker child makes its own (`worker.child`), with one connection.

    The same `db.engine.make_engine` call: the worker's statement timeout, and
    `transaction_pooling` (`DATABASE_POOL_MODE=transaction`) unless `prepared`, which sets
    `prepare_threshold=None` and sends no startup options. One connection, kept
    (`SingletonThreadPool`): psycopg's prepared statements last from run to run.
    """
    return db_engine.make_engine(
        url,
        application_name=f"fairq-bench-{'prepared' if prepared else 'unprepared'}",
        statement_timeout_ms=processing.WORKER_STATEMENT_TIMEOUT_MS,
        transaction_pooling=not prepared,
        poolclass=pool.SingletonThreadPool,
    )


@dataclass(frozen=True)
class Variant:
    """A named way to claim one batch inside the caller's transaction; returns the rows."""

    name: str
    run: Callable[[Session], Sequence[Any]]


def _ours(session: Session) -> Sequence[Any]:
    return claims.claim(
        driver_connection(session, transaction=False), worker_id=WORKER, batch_size=BATCH
    )


OURS = Variant("ours", _ours)
VARIANTS = ("ours", "previous", "floor")


def _previous(session: Session) -> Sequence[Any]:
    session.execute(PREVIOUS_LOCK, {"key": PREVIOUS_LOCK_KEY})
    return session.execute(PREVIOUS_CLAIM, PREVIOUS_PARAMS).all()


def _floor(ids: list[uuid.UUID]) -> Callable[[Session], Sequence[Any]]:
    def run(session: Session) -> Sequence[Any]:
        return _driver(session).execute(FLOOR, {"ids": ids, "worker_id": WORKER}).fetchall()

    return run


@dataclass(frozen=True)
class Timed:
    """One run: milliseconds, rows claimed, and the statements it executed."""

    ms: float
    rows: Sequence[Any]
    statements: list[Executed]


@dataclass
class Measured:
    """What one mode measured on one shape: per variant the timings, and ours per statement."""

    batches: dict[str, int]
    failures: list[str]
    ms: dict[str, list[float]] = field(default_factory=lambda: {v: [] for v in VARIANTS})
    # statement name -> (milliseconds per run summed over its executions, executions per run)
    statements: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    # per run of ours that recorded statements: milliseconds outside them (Python, the driver)
    outside: list[float] = field(default_factory=list)

    def median(self, variant: str) -> float:
        """Median milliseconds of `variant`."""
        return statistics.median(self.ms[variant])

    def ratio(self) -> float:
        """Median of ours over median of the floor."""
        return self.median("ours") / self.median("floor")

    def add(self, variant: str, timed: Timed) -> None:
        """Count one timed run of `variant` (of ours, each statement's share too)."""
        self.ms[variant].append(timed.ms)
        if variant != "ours" or not timed.statements:
            return
        per_run: dict[str, tuple[float, int]] = {}
        for executed in timed.statements:
            ms, n = per_run.get(executed.name, (0.0, 0))
            per_run[executed.name] = (ms + executed.ms, n + 1)
        for name, value in per_run.items():
            self.statements.setdefault(name, []).append(value)
        self.outside.append(timed.ms - sum(ms for ms, _ in per_run.values()))


@dataclass
class Result:
    """What one shape measured, per mode."""

    shape: perf_seed.Shape
    modes: dict[str, Measured] = field(default_factory=dict)
    load: str = ""

    def failures(self) -> list[str]:
        """Every failed check, named by its mode."""
        return [f"{mode}: {f}" for mode, m in self.modes.items() for f in m.failures]


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def _scalar(engine: Engine, statement: TextClause, params: dict[str, Any] | None = None) -> int:
    with engine.connect() as conn:
        return int(conn.execute(statement, params or {}).scalar_one())


def _checks(engine: Engine, batches: dict[str, Timed], floor_ids: list[uuid.UUID]) -> list[str]:
    """Untimed: each variant claimed what it should. Returns the failures."""
    runnable = _scalar(engine, RUNNABLE)
    expected = {
        "ours": min(BATCH, runnable),
        "previous": _scalar(engine, PREVIOUS_EXPECTED, PREVIOUS_PARAMS),
        "floor": len(floor_ids),
    }
    failures = [
        f"{name} claimed {len(batches[name].rows)} tasks, expected {want}"
        for name, want in expected.items()
        if len(batches[name].rows) != want
    ]
    ours = [row.id for row in batches["ours"].rows]
    if len(set(ours)) != len(ours):
        failures.append("ours returned a task twice")
    floor = [row[0] for row in batches["floor"].rows]  # psycopg tuples
    if floor != floor_ids:
        failures.append("the floor did not claim exactly the ids ours picked")
    return failures


def _driver(session: Session) -> psycopg.Connection[Any]:
    driver = session.connection().connection.driver_connection
    assert isinstance(driver, psycopg.Connection)
    return driver


def rollback(session: Session, *, keep_prepared: bool) -> None:
    """Roll the session's transaction back; with `keep_prepared`, below psycopg.

    psycopg forgets its prepared statements on `rollback()` (and deallocates them), so a
    benchmark that rolls back through it parses and plans every statement on every run,
    while a worker, which commits, runs the claim's statements prepared from its sixth
    claim on (psycopg's `prepare_threshold`), with a generic plan once PostgreSQL finds one
    as cheap (after five custom plans). ROLLBACK sent on the libpq connection leaves
    psycopg's cache alone (server-side prepared statements outlive a rollback), and
    psycopg's own `rollback()` then finds no transaction to end.
    """
    if keep_prepared:
        result = _driver(session).pgconn.exec_(b"ROLLBACK")
        if result.status != psycopg.pq.ExecStatus.COMMAND_OK:
            raise RuntimeError(f"ROLLBACK failed: {result.error_message.decode()}")
    session.rollback()


@dataclass
class Bench:
    """How to time: the engines, the statement clock, and the method's settings.

    `admin` seeds, vacuums, checks and replays EXPLAIN; each mode's engine only claims.
    `clock`: None with `--no-breakdown` (statements not recorded).
    """

    admin: Engine
    modes: Sequence[Mode]
    clock: StatementClock | None
    runs: int
    warmup: int
    reuse: bool
    explain: bool

    def record(self) -> AbstractContextManager[list[Executed]]:
        """The statements executed inside the block (none recorded without a clock)."""
        return self.clock.record() if self.clock is not None else nullcontext([])

    def run_once(self, mode: Mode, variant: Variant) -> Timed:
        """One run of `variant` from a freshly vacuumed database, in a transaction rolled back."""
        perf_seed.vacuum(self.admin)
        with Session(mode.engine) as session:
            session.execute(_BEGIN)
            with self.record() as statements:
                started = time.perf_counter()
                rows = variant.run(session)
                elapsed = (time.perf_counter() - started) * 1000.0
            rollback(session, keep_prepared=mode.prepared)
        return Timed(elapsed, rows, statements)

    def explain_plans(self, statements: Sequence[Executed]) -> str:
        """EXPLAIN (ANALYZE, BUFFERS) of each statement, replayed in order, rolled back.

        EXPLAIN ANALYZE executes the statement, so each one sees what the ones before it
        did, as in the run the statements were recorded from (which started from the same
        state: the database is vacuumed first here too). Not prepared: planning included.
        """
        perf_seed.vacuum(self.admin)
        out: list[str] = []
        with Session(self.admin) as session:
            session.execute(_BEGIN)
            driver = _driver(session)
            for executed in statements:
                plan = driver.execute(
                    "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) " + executed.query,
                    executed.params,
                    prepare=False,
                ).fetchall()
                out.append(f"-- {executed.name}")
                out.extend(str(row[0]) for row in plan)
            session.rollback()
        return "\n".join(out)

    def prepared(self, mode: Mode) -> str:
        """The prepared statements of `mode`'s connection: plans of each kind, first words."""
        with mode.engine.connect() as conn:
            rows = conn.execute(text(_PREPARED)).all()
        return "\n".join(f"  {r.generic:>5} {r.custom:>6}  {r.statement}" for r in rows)

    def first_runs(self, mode: Mode) -> tuple[list[Variant], dict[str, Timed], Measured]:
        """Untimed: each variant once in `mode`, checked; the floor gets the ids ours took."""
        first = {"ours": self.run_once(mode, OURS)}
        ids = [row.id for row in first["ours"].rows]
        variants = [OURS, Variant("previous", _previous), Variant("floor", _floor(ids))]
        for variant in variants[1:]:
            first[variant.name] = self.run_once(mode, variant)
        measured = Measured(
            {name: len(timed.rows) for name, timed in first.items()},
            _checks(self.admin, first, ids),
        )
        served = Counter(row.company_id for row in first["ours"].rows)
        print(
            f"  {mode.name}: ours took {len(ids)} tasks from {len(served)} "
            f"compan{'y' if len(served) == 1 else 'ies'} "
            f"({min(served.values(), default=0)} to {max(served.values(), default=0)} each), "
            f"previous {measured.batches['previous']}, floor {measured.batches['floor']}: "
            + (
                "checks ok"
                if not measured.failures
                else "CHECKS FAILED: " + "; ".join(measured.failures)
            ),
            flush=True,
        )
        return variants, first, measured

    def shape(self, shape: perf_seed.Shape) -> Result:
        """Seed (unless reusable), check and time every variant in every mode on `shape`."""
        print(f"== {shape.describe()}", flush=True)
        if self.reuse and perf_seed.reusable(self.admin, shape):
            print("  reusing the seed: " + perf_seed.stats(self.admin).describe(), flush=True)
        else:
            print("  seeded: " + perf_seed.seed(self.admin, shape).describe(), flush=True)
        perf_seed.vacuum(self.admin, analyze=True)

        result = Result(shape)
        turns: list[tuple[Mode, Variant]] = []
        firsts: dict[str, dict[str, Timed]] = {}
        for mode in self.modes:
            variants, firsts[mode.name], result.modes[mode.name] = self.first_runs(mode)
            turns.extend((mode, variant) for variant in variants)

        for i in range(self.warmup + self.runs):
            # Each round starts with another variant (of another mode): none always runs
            # right after VACUUM's own kind of work, or right after another variant's.
            k = i % len(turns)
            for mode, variant in turns[k:] + turns[:k]:
                timed = self.run_once(mode, variant)
                if i >= self.warmup:
                    result.modes[mode.name].add(variant.name, timed)
        result.load = _load()
        for mode in self.modes:
            measured = result.modes[mode.name]
            for name in VARIANTS:
                t = measured.ms[name]
                print(
                    f"  {mode.name:<10} {name:<9} median {statistics.median(t):8.2f} ms  "
                    f"(min {min(t):.2f}, max {max(t):.2f})",
                    flush=True,
                )
            print(
                f"  {mode.name:<10} ours by statement: {self.statement_cells(measured)}",
                flush=True,
            )

        if self.explain:
            mode = self.modes[0]
            for name in ("ours", "previous"):
                print(f"  EXPLAIN ANALYZE, {name}, statement by statement:", flush=True)
                print(self.explain_plans(firsts[mode.name][name].statements), flush=True)
            for mode in self.modes:
                if mode.prepared:
                    print("  prepared statements of the prepared connection (generic, custom):")
                    print(self.prepared(mode), flush=True)
        return result

    def statement_cells(self, measured: Measured) -> str:
        """Ours by statement: median ms of each (xN: executions per claim), and the rest."""
        if self.clock is None:
            return "skipped (--no-breakdown)"
        if not measured.statements:
            return (
                "skipped: ours sent no statement through a psycopg cursor's execute, "
                "nothing to time at the driver"
            )
        cells = []
        runs = len(measured.ms["ours"])
        for name, values in measured.statements.items():
            ms = statistics.median(v[0] for v in values)
            times = max(v[1] for v in values)
            cell = f"{name} {ms:.2f}" + (f" (x{times})" if times > 1 else "")
            # A statement that runs only in some claims (the settle step) says how many.
            cells.append(cell + (f" [{len(values)}/{runs} runs]" if len(values) < runs else ""))
        cells.append(f"outside statements {statistics.median(measured.outside):.2f}")
        return "; ".join(cells)

    def table(self, results: Sequence[Result], mode: Mode) -> str:
        """One row per shape: medians, ratios to the floor, batch sizes, load average."""
        lines = [
            f"{'shape':<44}{'ours':>8}{'previous':>10}{'floor':>8}{'ours/floor':>12}"
            f"{'prev/floor':>12}{'(mins)':>8}  {'batch o/p/f':<13}load (1 5 15 min)",
        ]
        for r in results:
            m = r.modes[mode.name]
            ours, previous, floor = m.median("ours"), m.median("previous"), m.median("floor")
            batches = "/".join(str(m.batches[n]) for n in VARIANTS)
            over = "*" if ours / floor > GOAL else " "
            # Minimum over minimum: what is left when background load missed both runs.
            mins = min(m.ms["ours"]) / min(m.ms["floor"])
            lines.append(
                f"{shape_label(r.shape):<44}{ours:>8.2f}{previous:>10.2f}{floor:>8.2f}"
                f"{ours / floor:>10.2f}x{over}{previous / floor:>11.2f}x{mins:>7.2f}x  "
                f"{batches:<13}{r.load}"
            )
        lines.append("")
        lines.append("ours by statement, median ms (xN: executions per claim):")
        for r in results:
            cells = self.statement_cells(r.modes[mode.name])
            lines.append(f"  {shape_label(r.shape):<42}{cells}")
        return "\n".join(lines)


def side_by_side(results: Sequence[Result], modes: Sequence[Mode]) -> str:
    """One row per shape: ours / floor in each mode, and what not preparing costs each."""
    header = f"{'shape':<44}" + "".join(f"{m.name + ' o/f':>16}" for m in modes)
    compare = len(modes) == len(MODES)  # both ran
    if compare:
        header += f"{'ours u/p':>12}{'floor u/p':>12}"
    lines = [header]
    for r in results:
        line = f"{shape_label(r.shape):<44}"
        for mode in modes:
            ratio = r.modes[mode.name].ratio()
            line += f"{ratio:>14.2f}x{'*' if ratio > GOAL else ' '}"
        if compare:
            prepared, unprepared = (r.modes[m.name] for m in modes)
            for name in ("ours", "floor"):
                line += f"{unprepared.median(name) / prepared.median(name):>11.2f}x"
        lines.append(line)
    return "\n".join(lines)


def shape_label(shape: perf_seed.Shape) -> str:
    """A shape as the issue's table names it."""
    if shape.companies == 1:
        return "1 company"
    with_work = "all" if shape.active == shape.companies else f"{shape.active:,}"
    return f"{shape.companies:,} companies, {with_work} with work"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line of this script."""
    parser = argparse.ArgumentParser(
        prog="python -m scripts.bench_claim",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    parser.add_argument("--companies", type=int, metavar="N", help="registered companies")
    parser.add_argument("--active", type=int, metavar="M", help="companies with work")
    perf_seed.add_shape_arguments(parser)
    parser.add_argument("--million", action="store_true", help="also run at 1,000,000 rows")
    parser.add_argument("--runs", type=int, default=11, help="timed runs per variant (11)")
    parser.add_argument(
        "--warmup",
        type=int,
        default=10,
        help="untimed rounds first (10: statements prepared, generic plans chosen)",
    )
    only = parser.add_mutually_exclusive_group()
    only.add_argument(
        "--prepared",
        action="store_true",
        help="only the prepared mode (a worker's default: psycopg prepares statements)",
    )
    only.add_argument(
        "--unprepared",
        action="store_true",
        help="only the unprepared mode (a worker with DATABASE_POOL_MODE=transaction: "
        "prepare_threshold=None, every statement parsed and planned on every call)",
    )
    parser.add_argument(
        "--no-breakdown",
        action="store_true",
        help="do not record ours statement by statement (no per-statement table)",
    )
    parser.add_argument(
        "--reuse", action="store_true", help="keep a seed of the same shape if the database has one"
    )
    parser.add_argument(
        "--explain", action="store_true", help="print EXPLAIN ANALYZE of ours and the previous"
    )
    parser.add_argument(
        "--stale-statistics",
        action="store_true",
        help="time ours after a burst of inserts that ANALYZE has not seen, then after ANALYZE",
    )
    parser.add_argument(
        "--burst", type=int, default=500_000, help="tasks inserted after ANALYZE (500000)"
    )
    stack.add_database_url_argument(
        parser,
        "postgresql+psycopg:// URL (created if missing; its tasks are replaced); "
        "default DATABASE_URL, else an embedded server with data in .pgdata/bench",
    )
    args = parser.parse_args(argv)
    if (args.companies is None) != (args.active is None):
        parser.error("--companies and --active go together")
    if args.runs < 3 or args.warmup < 0:
        parser.error("--runs must be at least 3 and --warmup not negative")
    if args.explain and args.no_breakdown:
        parser.error(
            "--explain replays the statements the breakdown records: not with --no-breakdown"
        )
    args.modes = [
        name for name in MODES if not (args.prepared or args.unprepared) or getattr(args, name)
    ]
    try:
        args.shapes = shapes(args)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def shapes(args: argparse.Namespace) -> list[perf_seed.Shape]:
    """The shapes to run, in order: every size, each with every tenant shape."""
    tenants = SHAPES if args.companies is None else ((args.companies, args.active),)
    sizes = [args.rows] + ([MILLION] if args.million and args.rows != MILLION else [])
    return [
        perf_seed.Shape(companies, active, rows, args.delayed_fraction, args.seed)
        for rows in sizes
        for companies, active in tenants
    ]


def _time_ours(mode: Mode, runs: int, warmup: int) -> tuple[float, int]:
    """Median milliseconds of ours over `runs` rolled-back claims, and the last batch size."""
    times: list[float] = []
    batch: Sequence[Any] = ()
    with Session(mode.engine) as session:
        for i in range(warmup + runs):
            session.connection()
            started = time.perf_counter()
            batch = _ours(session)
            elapsed = (time.perf_counter() - started) * 1000.0
            rollback(session, keep_prepared=mode.prepared)
            if i >= warmup:
                times.append(elapsed)
    return statistics.median(times), len(batch)


def stale_statistics(admin: Engine, modes: Sequence[Mode], args: argparse.Namespace) -> list[str]:
    """Ours after a burst of inserts on old statistics, and after ANALYZE: a line per mode."""
    lines = []
    for companies in (1, 50):
        with admin.begin() as conn:
            # The claim's cursor is left where it is, whatever holds it: the ring wraps.
            conn.execute(
                text("TRUNCATE tasks, company_queues, company_backlogs, api_keys, companies")
            )
            for table_name in ("tasks", "company_queues"):
                conn.execute(text(f"ALTER TABLE {table_name} SET (autovacuum_enabled = false)"))
            conn.execute(
                text(
                    "INSERT INTO companies (name) "
                    "SELECT 'stale ' || g FROM generate_series(1, :n) g"
                ),
                {"n": companies},
            )
            conn.execute(
                text(
                    "INSERT INTO tasks (company_id, type, payload) "
                    "SELECT c.id, 'noop', '{}' FROM companies c, generate_series(1, 10)"
                )
            )
        with admin.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT").execute(text("VACUUM ANALYZE"))
        with admin.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO tasks (company_id, type, payload) "
                    "SELECT c.id, 'noop', '{}' FROM companies c, generate_series(1, :n)"
                ),
                {"n": args.burst // companies},
            )
        before = {mode.name: _time_ours(mode, args.runs, args.warmup) for mode in modes}
        with admin.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT").execute(text("ANALYZE"))
        after = {mode.name: _time_ours(mode, args.runs, args.warmup) for mode in modes}
        with admin.begin() as conn:
            for table_name in ("tasks", "company_queues"):
                conn.execute(text(f"ALTER TABLE {table_name} RESET (autovacuum_enabled)"))
        for mode in modes:
            (stale, got_stale), (fresh, got_fresh) = before[mode.name], after[mode.name]
            lines.append(
                f"{companies:>2} compan{'y' if companies == 1 else 'ies'}, {mode.name:<10}: "
                f"stale statistics {stale:6.2f} ms, after ANALYZE {fresh:6.2f} ms, "
                f"ratio {stale / fresh:.2f}x (goal at most 2x); batches {got_stale}/{got_fresh}"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    """Run every shape in every mode, then print one table per size and mode, and the ratios."""
    args = parse_args(argv)
    with perf_seed.database(args.database_url) as url:
        admin = perf_seed.bench_engine(url)
        modes = [
            Mode(name, mode_engine(url, prepared=name == "prepared"), name == "prepared")
            for name in args.modes
        ]
        try:
            if args.stale_statistics:
                lines = stale_statistics(admin, modes, args)
                print(f"{args.burst:,} pending tasks inserted after ANALYZE saw 10 per company")
                print("\n".join(lines))
                return 0
            bench = Bench(
                admin,
                modes,
                None if args.no_breakdown else StatementClock([m.engine for m in modes]),
                runs=args.runs,
                warmup=args.warmup,
                reuse=args.reuse,
                explain=args.explain,
            )
            with admin.connect() as conn:
                version = conn.execute(text("SELECT version()")).scalar_one()
            load_before = _load()
            results = [bench.shape(shape) for shape in args.shapes]
        finally:
            for engine in (admin, *(m.engine for m in modes)):
                engine.dispose()
    print()
    print(version)
    print(
        f"batch {BATCH}; previous claim: cap {PREVIOUS_CAP}, stale after "
        f"{PREVIOUS_STALE_AFTER:.0f} s; median of {args.runs} runs (+{args.warmup} warm-up "
        f"rounds), milliseconds; * = ours above {GOAL}x the floor; (mins): ours/floor "
        "of the fastest runs"
    )
    print(f"load average before {load_before}, after {_load()} ({os.cpu_count()} CPUs)")
    for rows in dict.fromkeys(r.shape.rows for r in results):
        sized = [r for r in results if r.shape.rows == rows]
        fraction = sized[0].shape.delayed_fraction
        print(f"\n{rows:,} pending tasks, {fraction:.0%} of them delayed")
        for mode in modes:
            print(f"\n{mode.describe()}")
            print(bench.table(sized, mode))
        print(
            "\nours / floor, median over median, per mode"
            + (" (u/p: unprepared over prepared, each variant's median)" if len(modes) > 1 else "")
        )
        print(side_by_side(sized, modes))
    failures = [f"{shape_label(r.shape)}: {f}" for r in results for f in r.failures()]
    if failures:
        print("\nCHECKS FAILED:\n  " + "\n  ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
