"""The queue under pressure: a snapshot held while it drains, and the death spiral (issue 28).

A snapshot held open (a reporting query, a session left idle in transaction) keeps VACUUM
from removing the row versions the queue leaves behind; every claim that reads past them
gets slower. Two modes, fairq and pgqueuer 1.6 side by side (pgqueuer: the optional `bench`
extra; `--no-pgqueuer` to skip it):

`held` (default, with `spiral`): drain `--tasks` noop tasks over each shape of `--companies`
(default 1 and 50) with `--concurrency` worker children at `--batch-size`, once without and
once while another connection holds a REPEATABLE READ transaction that has taken its snapshot
(a query run in it) from just before the tasks are inserted until the drain is over
(`scripts/bench_throughput.py` `run_once` and `SnapshotHolder`). Runs alternate, round
after round (`--runs`); the summary has the medians and the ratio held / without. pgqueuer
drains as many jobs of a no-op entrypoint, with and without the same holder.

`spiral`: creates offered at a fixed rate (`--rate` a second, one task a transaction, the
API's own insert statement `db.queue.create_task` with its NOTIFY, round-robin over
`--spiral-companies` companies, from `--clients` threads) to `--concurrency` children
running noop tasks. After `--warmup` seconds an analytics session starts: a REPEATABLE READ
transaction that runs an aggregate over `tasks` and then stays open until
`--analytics-seconds` have passed (as a query of that length would), then the next one at
once, back to back, for `--pressure` seconds; then the analytics stop, and the creates go on
for at most `--recovery` seconds. Every `--interval` seconds a row: the backlog (unfinished
tasks: pending and processing; pgqueuer: rows of its queue table), the dead tuples of the
queue's tables (`pg_stat_user_tables.n_dead_tup`: fairq `tasks`, `company_queues`,
`company_backlogs`; pgqueuer its queue, log and statistics tables), claim p50 and p99 over
the interval (fairq: the worker's `claim_duration_seconds` histogram, interpolated in its
buckets as Prometheus' `histogram_quantile` does; pgqueuer: each `dequeue` call timed in its
worker), creates accepted and tasks completed a second. Then the time to recover: from the
end of the analytics until the backlog is back at its healthy level (the highest backlog
sampled each second before the analytics started), or `not recovered`.

PostgreSQL: `--database-url`, else an embedded PostgreSQL 16 with its data in
`.pgdata/bench-pressure` (autovacuum on, durable commits), stopped at the end; nothing else
uses it. The box's load average is printed with every result (`uptime`'s figures).

Usage (from the repository root):
    .venv/bin/python -m scripts.bench_pressure [--mode held,spiral] [--tasks 50000]
        [--companies 1,50] [--runs 2] [--concurrency 2] [--batch-size 100]
        [--rate 200] [--warmup 20] [--pressure 90] [--analytics-seconds 60]
        [--recovery 120] [--interval 10] [--spiral-companies 50] [--no-pgqueuer]
        [--database-url postgresql+psycopg://postgres@127.0.0.1:5432/fairq_bench]
The issue's figures: `--mode held --tasks 50000` and `--mode spiral --pressure 600
--analytics-seconds 120 --rate <half the healthy drain>`.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import psycopg
from sqlalchemy import Engine

from db import connector, queue
from devtools import stack
from scripts import bench_throughput as throughput

ROOT = Path(__file__).resolve().parent.parent

# The goals (issue 28, part 1).
GOAL_HELD_RATIO = 0.9
GOAL_COMPLETED_SHARE = 0.9
GOAL_CLAIM_P99_MS = 50.0
GOAL_RECOVERY_SECONDS = 120.0
NOTIFY_CHANNEL = "fairq_tasks"
FAIRQ_TABLES = ("tasks", "company_queues", "company_backlogs")
PGQUEUER_TABLES = ("pgqueuer", "pgqueuer_log", "pgqueuer_statistics")
# What "analytics" runs first in each of its transactions: a report over every task.
ANALYTICS_QUERY = """
SELECT company_id, status, type, count(*), avg(attempts),
       max(coalesce(finished_at, now()) - created_at)
FROM tasks
GROUP BY company_id, status, type
"""


def load() -> str:
    """The box's load averages over 1, 5 and 15 minutes, as `uptime` prints them."""
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def libpq(url: str) -> str:
    """A plain `postgresql://` URL for psycopg."""
    return throughput.libpq_url(url)


# -- mode held -----------------------------------------------------------------------------


@dataclass
class HeldResults:
    """Drains per side and shape: without a held snapshot and with one."""

    plain: dict[str, list[throughput.RunResult]] = field(default_factory=dict)
    held: dict[str, list[throughput.RunResult]] = field(default_factory=dict)


def run_held(url: str, args: argparse.Namespace, tmp: Path) -> list[str]:
    """Mode `held`: drains alternated without and with a held snapshot; the summary lines."""
    engine = throughput.engine_for(url)
    results = HeldResults()
    sides = [f"fairq, {n} compan{'y' if n == 1 else 'ies'}" for n in args.shapes]
    if not args.skip_pgqueuer:
        sides.append(f"pgqueuer ({args.pgqueuer_driver})")
    try:
        for run in range(1, args.runs + 1):
            for side, companies in zip(sides, [*args.shapes, None], strict=False):
                for holding in (False, True):
                    workdir = tmp / f"held-{run}-{companies or 'pgqueuer'}-{int(holding)}"
                    result = drain(engine, url, args, workdir, companies, held=holding)
                    by_side = results.held if holding else results.plain
                    by_side.setdefault(side, []).append(result)
                    print(
                        f"run {run} {side}{', snapshot held' if holding else ''}: "
                        f"{throughput.describe(result)}; {load()}",
                        flush=True,
                    )
    finally:
        engine.dispose()
    lines = [
        f"held snapshot: {args.tasks} noop tasks, {args.concurrency} processes, batch "
        f"{args.batch_size}, medians of {args.runs} runs; {load()}",
        f"  {'side':<24}{'without':>12}{'held':>12}{'held/without':>14}{'claim ms':>10}"
        f"{'held':>7}{'PG us/task':>12}{'held':>7}",
    ]
    for side in sides:
        plain, held = results.plain[side], results.held[side]
        rate, rate_held = (statistics.median(r.rate for r in rs) for rs in (plain, held))
        claim, claim_held = (statistics.median(r.mean_claim_ms for r in rs) for rs in (plain, held))
        db, db_held = (
            throughput._median(r.db_cpu_us_per_task for r in rs) for rs in (plain, held)
        )  # fmt: skip
        ratio = rate_held / rate
        verdict = "" if side.startswith("pgqueuer") else (
            f"  (goal x{GOAL_HELD_RATIO}: {'met' if ratio >= GOAL_HELD_RATIO else 'NOT met'})"
        )  # fmt: skip
        claims = f"{claim:>10.1f}{claim_held:>7.1f}" if claim else f"{'-':>10}{'-':>7}"
        cpu = f"{db or 0:>12.1f}{db_held or 0:>7.1f}"
        lines.append(
            f"  {side:<24}{rate:>8,.0f} t/s{rate_held:>8,.0f} t/s{ratio:>13.2f}x{claims}{cpu}"
            f"{verdict}"
        )
    return lines


def drain(
    engine: Engine,
    url: str,
    args: argparse.Namespace,
    workdir: Path,
    companies: int | None,
    *,
    held: bool,
) -> throughput.RunResult:
    """One drain: fairq over `companies` companies, or pgqueuer (None); `held`: a snapshot."""
    # Held until the drain is over: the holder is closed then, whatever its timer says.
    forever = 24 * 3600.0
    if companies is not None:
        return throughput.run_once(
            engine, url, args, workdir, companies, hold_snapshot=forever if held else None
        )
    holder = throughput.SnapshotHolder(engine, forever) if held else None
    try:
        return throughput.run_pgqueuer_once(engine, url, args, workdir)
    finally:
        if holder is not None:
            holder.close()


# -- mode spiral ---------------------------------------------------------------------------


class Creator:
    """Offers creates at `rate` a second from `clients` threads; counts the accepted ones.

    Each thread has a connection and a schedule of its own (`rate / clients` a second), one
    create a transaction, round-robin over `companies` (fairq: `db.queue.create_task`, the
    API's statement with its NOTIFY) or pgqueuer's own enqueue (its log row, its trigger's
    NOTIFY). Behind schedule a thread does not skip: what it could not send in time is not
    accepted (offered - `accepted`).
    """

    def __init__(
        self, dsn: str, rate: float, companies: Sequence[str], pgqueuer: bool, clients: int
    ) -> None:
        self._dsn = dsn
        self._rate = rate / clients
        self._companies = [uuid.UUID(c) for c in companies]
        self._pgqueuer = pgqueuer
        self._counts = [0] * clients
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)
        ]
        self.stop = threading.Event()

    @property
    def accepted(self) -> int:
        """Creates committed so far."""
        return sum(self._counts)

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def join(self) -> None:
        for thread in self._threads:
            thread.join()

    def _run(self, index: int) -> None:
        if self._pgqueuer:
            asyncio.run(self._run_pgqueuer(index))
            return
        with psycopg.connect(
            self._dsn, autocommit=True, application_name="fairq-bench-create"
        ) as conn:
            for n in self._schedule(index):
                queue.create_task(
                    conn,
                    company_id=self._companies[
                        (n * len(self._counts) + index) % len(self._companies)
                    ],
                    type="noop",
                    payload={},
                    notify_channel=NOTIFY_CHANNEL,
                )
                self._counts[index] += 1

    async def _run_pgqueuer(self, index: int) -> None:
        queries, close = await throughput._pgqueuer_queries(self._dsn, "asyncpg")
        try:
            for _ in self._schedule(index):
                await queries.enqueue(["noop"], [None], [0])
                self._counts[index] += 1
        finally:
            await close()

    def _schedule(self, index: int) -> Iterator[int]:
        """Yield the number of each of this thread's creates at its due time, until `stop`."""
        start = time.monotonic()
        while not self.stop.is_set():
            wait = start + self._counts[index] / self._rate - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            yield self._counts[index]


class Analytics(threading.Thread):
    """Back-to-back REPEATABLE READ transactions of `seconds` each, an aggregate first."""

    def __init__(self, dsn: str, seconds: float) -> None:
        super().__init__(daemon=True)
        self._dsn = dsn
        self._seconds = seconds
        self.stop = threading.Event()
        self.transactions = 0
        self.query_seconds: list[float] = []

    def run(self) -> None:
        with psycopg.connect(self._dsn, application_name="fairq-bench-analytics") as conn:
            conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            while not self.stop.is_set():
                began = time.monotonic()
                conn.execute(ANALYTICS_QUERY).fetchall()  # takes the snapshot
                self.query_seconds.append(time.monotonic() - began)
                # The snapshot stays as long as a query of `seconds` would keep it.
                self.stop.wait(max(0.0, began + self._seconds - time.monotonic()))
                conn.rollback()
                self.transactions += 1


@dataclass(frozen=True)
class Sample:
    """The readings of one moment of a spiral run."""

    at: float
    backlog: int
    dead: dict[str, int]
    accepted: int
    completed: int
    # fairq: cumulative bucket counts (claim_buckets); pgqueuer: every dequeue's ms so far.
    claims: list[float]


@dataclass
class SpiralRun:
    """Rows printed and the verdict figures of one spiral run."""

    side: str
    rows: list[str]
    healthy_backlog: int
    recovery_seconds: float | None
    completed_share: float
    pressure_p99_ms: float | None


def quantile(bounds: Sequence[float], counts: Sequence[float], q: float) -> float | None:
    """`histogram_quantile`: the q-quantile of cumulative `counts` at upper `bounds` (s)."""
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return None
    rank = q * total
    index = bisect.bisect_left(counts, rank)
    if index >= len(bounds):
        return bounds[-1]  # in the +Inf bucket: at least the last bound
    low = bounds[index - 1] if index > 0 else 0.0
    below = counts[index - 1] if index > 0 else 0.0
    inside = counts[index] - below
    return low + (bounds[index] - low) * ((rank - below) / inside if inside else 1.0)


CLAIM_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def claim_buckets(metrics: dict[str, float]) -> list[float]:
    """Cumulative counts of the worker's claim histogram at CLAIM_BOUNDS, then +Inf."""
    found = []
    for bound in (*CLAIM_BOUNDS, "+Inf"):
        label = bound if isinstance(bound, str) else repr(float(bound))
        found.append(stack.metric_total(metrics, f'claim_duration_seconds_bucket{{le="{label}"}}'))
    return found


def percentiles_ms(
    pgqueuer: bool, before: Sample, after: Sample
) -> tuple[float | None, float | None]:
    """Claim p50 and p99 in ms between two samples."""
    if pgqueuer:
        window = sorted(after.claims[len(before.claims) :])
        if not window:
            return None, None
        return (
            window[int(0.5 * (len(window) - 1))],
            window[int(0.99 * (len(window) - 1))],
        )
    counts = [a - b for a, b in zip(after.claims, before.claims, strict=True)]
    p50, p99 = (quantile(CLAIM_BOUNDS, counts, q) for q in (0.5, 0.99))
    return (None if p50 is None else 1000 * p50, None if p99 is None else 1000 * p99)


class Readings:
    """Reads the backlog, dead tuples, completions and claim times of one side."""

    def __init__(
        self, dsn: str, claims: Callable[[], list[float]], completed: Callable[[Probe], int]
    ) -> None:
        self._conn = psycopg.connect(dsn, autocommit=True, application_name="fairq-bench-probe")
        self.pgqueuer = completed is pgqueuer_completed
        self._claims = claims
        self._completed = completed
        self.tables = PGQUEUER_TABLES if self.pgqueuer else FAIRQ_TABLES

    def close(self) -> None:
        self._conn.close()

    def backlog(self) -> int:
        if self.pgqueuer:
            row = self._conn.execute("SELECT count(*) FROM pgqueuer").fetchone()
        else:
            row = self._conn.execute(
                "SELECT coalesce(sum(unfinished), 0) FROM company_backlogs"
            ).fetchone()
        assert row is not None
        return int(row[0])

    def sample(self, creator: Creator) -> Sample:
        dead: dict[str, int] = dict(
            self._conn.execute(
                "SELECT relname, n_dead_tup FROM pg_stat_user_tables WHERE relname = ANY(%s)",
                (list(self.tables),),
            ).fetchall()
        )
        return Sample(
            time.monotonic(), self.backlog(), dead, creator.accepted,
            self._completed(self._conn), self._claims(),
        )  # fmt: skip


def spiral_row(phase: str, readings: Readings, before: Sample, after: Sample, start: float) -> str:
    """One printed row: the readings at `after`, rates and claim times since `before`."""
    seconds = after.at - before.at
    p50, p99 = percentiles_ms(readings.pgqueuer, before, after)
    dead = " ".join(f"{after.dead.get(t, 0):>9,}" for t in readings.tables)

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    return (
        f"  {after.at - start:>6.0f} {phase:<10}{after.backlog:>9,} {dead} {ms(p50):>9} "
        f"{ms(p99):>8} {(after.accepted - before.accepted) / seconds:>9.0f} "
        f"{(after.completed - before.completed) / seconds:>11.0f}"
    )


def run_spiral_side(url: str, args: argparse.Namespace, tmp: Path, pgqueuer: bool) -> SpiralRun:
    """One spiral run of fairq or pgqueuer: offered creates, analytics, recovery."""
    dsn = libpq(url)
    engine = throughput.engine_for(url)
    side = f"pgqueuer ({args.pgqueuer_driver})" if pgqueuer else "fairq"
    workdir = tmp / f"spiral-{'pgqueuer' if pgqueuer else 'fairq'}"
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        throughput.reset(engine)
        companies = throughput.seed_companies(engine, args.spiral_companies)
        if pgqueuer:
            asyncio.run(throughput._pgqueuer_seed(dsn, args.pgqueuer_driver, 0))
        with workers(url, args, workdir, pgqueuer) as (claims, completed):
            readings = Readings(dsn, claims, completed)
            creator = Creator(dsn, args.rate, companies, pgqueuer, args.clients)
            analytics = Analytics(dsn, args.analytics_seconds)
            try:
                return spiral(side, args, readings, creator, analytics)
            finally:
                creator.stop.set()
                analytics.stop.set()
                creator.join()
                if analytics.is_alive():
                    analytics.join()
                readings.close()
    finally:
        engine.dispose()


def spiral(
    side: str, args: argparse.Namespace, readings: Readings, creator: Creator, analytics: Analytics
) -> SpiralRun:
    """Drive the phases of one spiral run, printing its rows as they come.

    A phase ends at the first row at or after its length; the backlog is also read every
    second, for the healthy level (the second half of the warm-up: the workers are up) and
    the moment of recovery.
    """
    header = (
        f"  {'s':>6} {'phase':<10}{'backlog':>9} "
        + " ".join(f"{t[:9]:>9}" for t in readings.tables)
        + f" {'claim p50':>9} {'p99 ms':>8} {'created/s':>9} {'completed/s':>11}"
    )
    print(f"spiral, {side}: offered {args.rate:g} creates/s; dead tuples per table; {load()}")
    print(header, flush=True)
    rows = [header]
    start = time.monotonic()
    creator.start()
    last = readings.sample(creator)
    healthy = 0
    pressure_p99: list[float] = []
    under: tuple[Sample, Sample] | None = None
    recovered_at: float | None = None
    stopped = start
    for phase, seconds in (
        ("warm-up", args.warmup), ("analytics", args.pressure), ("recovery", args.recovery)
    ):  # fmt: skip
        if phase == "analytics":
            analytics.start()
            first = last
        elif phase == "recovery":
            analytics.stop.set()
            analytics.join()
            stopped = time.monotonic()
            under = (first, last)
        phase_end = time.monotonic() + seconds
        while time.monotonic() < phase_end - 0.5:
            row_at = last.at + args.interval
            while time.monotonic() < row_at:
                time.sleep(max(0.0, min(1.0, row_at - time.monotonic())))
                backlog = readings.backlog()
                if phase == "warm-up" and time.monotonic() - start >= args.warmup / 2:
                    healthy = max(healthy, backlog)
                elif phase == "recovery" and recovered_at is None and backlog <= healthy:
                    recovered_at = time.monotonic() - stopped
            now = readings.sample(creator)
            rows.append(spiral_row(phase, readings, last, now, start))
            print(rows[-1], flush=True)
            if phase == "analytics":
                p99 = percentiles_ms(readings.pgqueuer, last, now)[1]
                pressure_p99 += [] if p99 is None else [p99]
            last = now
            if recovered_at is not None:
                break
    assert under is not None
    before, after = under
    offered = args.rate * (after.at - before.at)
    completed = (after.completed - before.completed) / offered
    accepted = (after.accepted - before.accepted) / offered
    recovered = "not recovered" if recovered_at is None else f"{recovered_at:.0f} s"
    worst = max(pressure_p99, default=None)
    rows.append(
        f"  {side}: healthy backlog {healthy:,}; under analytics x{completed:.2f} of the "
        f"offered rate completed (x{accepted:.2f} created), claim p99 at most "
        f"{worst or 0:.1f} ms; recovered in {recovered} after the analytics stopped; "
        f"{analytics.transactions} analytics transactions (aggregate "
        f"{statistics.median(analytics.query_seconds or [0]):.2f} s median); {load()}"
    )
    print(rows[-1], flush=True)
    return SpiralRun(side, rows, healthy, recovered_at, completed, worst)


Probe = psycopg.Connection[tuple[Any, ...]]


def pgqueuer_completed(conn: Probe) -> int:
    """pgqueuer's jobs completed so far (its log's `successful` rows)."""
    row = conn.execute("SELECT count(*) FROM pgqueuer_log WHERE status = 'successful'").fetchone()
    assert row is not None
    return int(row[0])


@contextmanager
def workers(
    url: str, args: argparse.Namespace, workdir: Path, pgqueuer: bool
) -> Iterator[tuple[Callable[[], list[float]], Callable[[Probe], int]]]:
    """Run the side's workers; yield (claim readings, completed so far on a probe)."""
    if not pgqueuer:
        env = {
            "WORKER_BATCH_SIZE": str(args.batch_size),
            "LOG_LEVEL": "WARNING",
            "SHUTDOWN_TIMEOUT_SECONDS": "30",
        }
        with stack.supervisor(url, workdir, concurrency=args.concurrency, env=env) as sup:

            def fairq_completed(conn: Probe) -> int:
                return int(stack.metric_total(sup.metrics(), "tasks_completed_total"))

            yield (lambda: claim_buckets(sup.metrics())), fairq_completed
        return
    argv = [sys.executable, "-m", "scripts.bench_pressure", "--pgqueuer-worker",
            "--batch-size", str(args.batch_size), "--database-url", url]  # fmt: skip
    timings = [workdir / f"dequeue-{i}.txt" for i in range(args.concurrency)]
    procs = []
    for path in timings:
        with (workdir / f"{path.stem}.log").open("w") as err:
            procs.append(subprocess.Popen([*argv, "--timings", str(path)], cwd=ROOT, stderr=err))

    def claims() -> list[float]:
        values: list[float] = []
        for path in timings:
            if path.exists():
                values += [float(x) for x in path.read_text().split()]
        return values

    try:
        yield claims, pgqueuer_completed
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def _pgqueuer_continuous(dsn: str, batch_size: int, timings: Path) -> None:
    """A pgqueuer worker in continuous mode; every dequeue's milliseconds go to `timings`."""
    from pgqueuer import QueueManager
    from pgqueuer.models import Job

    async def noop(job: Job) -> None:
        """Succeed at once, like fairq's `noop`."""

    queries, close = await throughput._pgqueuer_queries(dsn, "asyncpg")
    # Any: pgqueuer is typed only where the bench extra is installed (CI's venv has not).
    dequeue: Any = queries.dequeue
    out = timings.open("a", buffering=1)

    async def timed(*args: object, **kwargs: object) -> object:
        began = time.perf_counter()
        try:
            return await dequeue(*args, **kwargs)
        finally:
            out.write(f"{1000 * (time.perf_counter() - began):.3f}\n")

    cast(Any, queries).dequeue = timed
    manager = QueueManager(queries)
    manager.entrypoint("noop")(noop)
    try:
        await manager.run(batch_size=batch_size)
    finally:
        out.close()
        await close()


def pgqueuer_worker(url: str, batch_size: int, timings: Path) -> int:
    """Entry point of one continuous pgqueuer worker process (`--pgqueuer-worker`)."""
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with suppress(SystemExit, KeyboardInterrupt):
        asyncio.run(_pgqueuer_continuous(libpq(url), batch_size, timings))
    return 0


def run_spiral(url: str, args: argparse.Namespace, tmp: Path) -> list[str]:
    """Mode `spiral`: fairq, then pgqueuer; the summary lines."""
    runs = [run_spiral_side(url, args, tmp, pgqueuer=False)]
    if not args.skip_pgqueuer:
        runs.append(run_spiral_side(url, args, tmp, pgqueuer=True))
    lines = [
        f"death spiral: {args.rate:g} creates/s offered, analytics of {args.analytics_seconds:g} s "
        f"back to back for {args.pressure:g} s, {args.concurrency} processes, batch "
        f"{args.batch_size}, {args.spiral_companies} companies"
    ]
    for run in runs:
        verdicts = []
        if run.side == "fairq":
            verdicts = [
                f"completed x{run.completed_share:.2f} "
                f"({'met' if run.completed_share >= GOAL_COMPLETED_SHARE else 'NOT met'})",
                f"p99 {run.pressure_p99_ms or 0:.1f} ms "
                f"({'met' if (run.pressure_p99_ms or 0) < GOAL_CLAIM_P99_MS else 'NOT met'})",
                "recovery "
                + ("not recovered (NOT met)" if run.recovery_seconds is None else
                   f"{run.recovery_seconds:.0f} s "
                   f"({'met' if run.recovery_seconds <= GOAL_RECOVERY_SECONDS else 'NOT met'})"),
            ]  # fmt: skip
        lines.append(run.rows[-1] + (f"; goals: {', '.join(verdicts)}" if verdicts else ""))
    return lines


# -- command line --------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(
        prog="python -m scripts.bench_pressure", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--mode", default="held,spiral", help="held, spiral or both")
    parser.add_argument("--tasks", type=int, default=50_000, help="held: tasks per drain")
    parser.add_argument("--companies", default="1,50", help="held: comma-separated shapes")
    parser.add_argument("--runs", type=int, default=2, help="held: rounds")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--timeout", type=float, default=600.0, help="held: seconds a drain")
    parser.add_argument("--rate", type=float, default=200.0, help="spiral: creates offered/s")
    parser.add_argument("--warmup", type=float, default=20.0, help="spiral: seconds before")
    parser.add_argument("--pressure", type=float, default=90.0, help="spiral: analytics, s")
    parser.add_argument(
        "--analytics-seconds", type=float, default=60.0,
        help="spiral: how long each analytics transaction keeps its snapshot",
    )  # fmt: skip
    parser.add_argument("--recovery", type=float, default=120.0, help="spiral: seconds at most")
    parser.add_argument("--interval", type=float, default=10.0, help="spiral: seconds a row")
    parser.add_argument("--spiral-companies", type=int, default=50)
    parser.add_argument("--clients", type=int, default=4, help="spiral: creating threads")
    parser.add_argument("--no-pgqueuer", action="store_true", help="fairq only")
    parser.add_argument("--no-checkpoint", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pgqueuer-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--timings", type=Path, help=argparse.SUPPRESS)
    throughput.add_database_arguments(parser)
    args = parser.parse_args(argv)
    args.shapes = [int(n) for n in str(args.companies).split(",") if n.strip()]
    args.modes = [m.strip() for m in str(args.mode).split(",") if m.strip()]
    args.pgqueuer_driver = "asyncpg"
    args.log_level, args.log_format = "WARNING", "text"
    # What `bench_throughput`'s drain reads of its own options: noop tasks, one handler thread
    # a child, the default stale window.
    args.threads, args.sleep, args.stale_after = 1, None, None
    return args


def warn_without_autovacuum(url: str) -> None:
    """Say so when the server's autovacuum is off: then no VACUUM catches up between two
    analytics transactions, and what the benchmark measures is not a queue under pressure
    but one that is never cleaned (a server given with `--database-url` may be set so)."""
    with connector.connect(url, application_name="fairq-bench") as conn:
        row = conn.execute("SELECT current_setting('autovacuum')").fetchone()
    if row is not None and row[0] != "on":
        print(
            "warning: autovacuum is off on this server: dead rows are never removed, and the "
            "figures below are not those of a queue under pressure",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the results."""
    args = parse_args(argv)
    if args.pgqueuer_worker:
        return pgqueuer_worker(args.database_url, args.batch_size, args.timings)
    missing = throughput.pgqueuer_missing()
    args.skip_pgqueuer = args.no_pgqueuer or missing is not None
    if missing and not args.no_pgqueuer:
        print(f"pgqueuer side: {missing}", flush=True)
    lines: list[str] = []
    with (
        throughput.bench_database(
            args.database_url, "pressure", fast_commit=args.fast_commit
        ) as url,
        tempfile.TemporaryDirectory(prefix="fairq-bench-") as tmp,
    ):
        warn_without_autovacuum(url)
        if "held" in args.modes:
            lines += run_held(url, args, Path(tmp))
        if "spiral" in args.modes:
            lines += run_spiral(url, args, Path(tmp))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
