"""Drain throughput of the real worker supervisor, side by side with pgqueuer (design §9).

A fairq run empties the tables, inserts `--tasks` pending `noop` tasks spread evenly over the
companies of one shape (`--companies`, default 1, 50 and 2,000), starts `python -m worker`
with `--concurrency` children and waits until every task is completed. A pgqueuer run (when
the optional `bench` extra is installed: `pip install -e '.[bench]'`) enqueues as many jobs
of a no-op entrypoint into pgqueuer's own tables in the same database, starts `--concurrency`
processes that each run a `QueueManager` in drain mode with the same `--batch-size`, and
waits until they exit. pgqueuer has no tenants: its figure is the one reference for every
shape. Runs are interleaved, round after round (fairq with each shape, each followed by a
pgqueuer run), so both sides see the same load on the machine.

Throughput, the same definition on both sides, from the database clock, so process start-up
is not counted: tasks / (last finish - first start). fairq: max(`finished_at`) -
min(`started_at`) of the tasks; pgqueuer: the last `successful` row of its log table minus
the first `picked` one. Also printed: the CPU time the worker processes used per task
(start-up included; less disturbed by other load than the rate), and for fairq the mean
claim time from the supervisor's metrics. The summary has the median of each, and the ratios
the goal is stated in: fairq / pgqueuer per shape, and 1 company / 50 companies.

Per completed task, on both sides: WAL bytes and commits, with their fairq / pgqueuer ratios
and the goals at batch 100 (at most 2 KiB of WAL and 0.05 commits a task). WAL:
`pg_wal_lsn_diff` of `pg_current_wal_lsn()` from just before the drain starts (the tasks
inserted) to its end (every task finished). That is the whole cluster's WAL: exact on the
embedded server (the default), while on a shared server (`--database-url`) other databases'
writes count too, and the summary says so (with their commits seen meanwhile). Commits:
`xact_commit` of the benchmark's database in `pg_stat_database`, from the same start until
the workers' server connections have closed (a backend publishes its counters at most once a
second while it runs, and at its exit), so the workers' idle wait and their shutdown count
too, as do autovacuum's and the benchmark's own few (its polling reads roll back). Before each
side seeds its tasks a CHECKPOINT (`--no-checkpoint` to skip) puts the next timed one minutes
away: pages first written after a checkpoint need no full-page image, so the drain's WAL has
almost none; a run during which a checkpoint happened anyway says so.

`--hold-snapshot SECONDS` adds, right after each fairq run, the same run while another
connection holds a REPEATABLE READ transaction that has taken its snapshot: opened just before
the tasks are inserted, ended after SECONDS or when the drain is over, whichever comes first.
Until it ends VACUUM cannot remove the dead row versions the drain leaves behind (each task's
claim and completion), as with a session left idle in transaction; the summary has each
shape's rate and mean claim time with and without it, and the ratio. Each held run also prints
what the API's `oldest_xmin_holder_age_seconds` gauge read at the end of the drain.

PostgreSQL: `--database-url`, else an embedded PostgreSQL 16 with its data in
`.pgdata/bench-throughput` (durable defaults: fsync and synchronous_commit on, unless
`--fast-commit`), stopped at the end. pgqueuer talks to it through asyncpg, its fastest
driver (`--pgqueuer-driver psycopg` for the psycopg one).

Usage (from the repository root):
    .venv/bin/python -m scripts.bench_throughput [--tasks 20000]
        [--companies 1,50,2000] [--runs 3] [--concurrency 2] [--batch-size 100]
        [--log-level WARNING] [--log-format text] [--no-pgqueuer] [--fast-commit]
        [--hold-snapshot SECONDS] [--no-checkpoint]
        [--database-url postgresql+psycopg://postgres@127.0.0.1:5432/fairq_bench]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Connection, Engine, text
from sqlalchemy.engine import make_url

from db import statistics as queue_statistics
from db.engine import driver_connection
from devtools import stack

ROOT = Path(__file__).resolve().parent.parent

if TYPE_CHECKING:
    from pgqueuer import Queries

# The goal of issue 9 on the reference box (README "Performance").
GOAL_VS_PGQUEUER = 1.25
GOAL_LONE_VS_50 = 0.9
# Per completed task at batch 100 (issue 9's cost goals).
GOAL_WAL_BYTES = 2048
GOAL_COMMITS = 0.05
GOAL_BATCH = 100
PGQUEUER_ENTRYPOINT = "noop"
PGQUEUER_APPLICATION_NAME = "fairq-bench-pgqueuer"
SEEDER_APPLICATION_NAME = "fairq-bench-seed"

Closer = Callable[[], Awaitable[None]]


@contextmanager
def bench_database(url: str | None, name: str, *, fast_commit: bool) -> Iterator[str]:
    """Yield a migrated database URL: `url`, else an embedded server in `.pgdata/bench-<name>`."""
    options = {"synchronous_commit": "off"} if fast_commit else None
    # empty=False: `reset` empties the tables before every run anyway.
    with stack.database(url, f"bench-{name}", options=options, empty=False) as db:
        yield db


def engine_for(url: str) -> Engine:
    """An engine whose connections never outlive their use (the server may be stopped)."""
    return stack.script_engine(url, application_name="fairq-bench")


def add_database_arguments(parser: argparse.ArgumentParser) -> None:
    """`--fast-commit` and `--database-url`, shared by the benchmarks."""
    parser.add_argument(
        "--fast-commit", action="store_true",
        help="embedded server only: synchronous_commit=off (commits skip the WAL flush wait)",
    )  # fmt: skip
    stack.add_database_url_argument(parser)


def reset(engine: Engine) -> None:
    """Empty the tables and refresh statistics, so every run starts alike."""
    with engine.begin() as conn:
        # CASCADE: company_queues (and whatever else references companies) goes too.
        conn.execute(text("TRUNCATE tasks, companies CASCADE"))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE tasks, companies"))


def seed_companies(engine: Engine, count: int) -> list[str]:
    """Insert `count` companies; return their ids."""
    with engine.begin() as conn:
        return [
            str(company_id)
            for company_id in conn.execute(
                text(
                    "INSERT INTO companies (name) SELECT 'bench-' || g "
                    "FROM generate_series(1, :n) g RETURNING id"
                ),
                {"n": count},
            ).scalars()
        ]


def seed_tasks(
    engine: Engine, companies: list[str], count: int, sleep_seconds: float | None = None
) -> None:
    """Insert `count` pending tasks, round-robin over `companies`, oldest first.

    `noop` tasks, or with `sleep_seconds` `sleep` tasks of that length.
    """
    task_type, payload = "noop", "{}"
    if sleep_seconds is not None:
        task_type, payload = "sleep", json.dumps({"seconds": sleep_seconds})
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO tasks (company_id, type, payload, created_at, run_after) "
                "SELECT (CAST(:companies AS uuid[]))[1 + g % :n], :type, CAST(:payload AS jsonb), "
                "       now() + g * interval '1 microsecond', now() "
                "FROM generate_series(0, :count - 1) g"
            ),
            {
                "companies": companies, "n": len(companies), "count": count,
                "type": task_type, "payload": payload,
            },
        )  # fmt: skip
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("ANALYZE tasks"))


def completed(engine: Engine) -> int:
    """How many tasks are completed."""
    with engine.connect() as conn:
        return count_completed(conn)


def count_completed(conn: Connection) -> int:
    """How many tasks are completed, read on `conn` in a transaction rolled back."""
    try:
        return int(
            conn.execute(text("SELECT count(*) FROM tasks WHERE status = 'completed'")).scalar_one()
        )
    finally:
        conn.rollback()


class SnapshotHolder:
    """A REPEATABLE READ transaction holding its snapshot until `seconds` pass or `close()`.

    Its snapshot is taken when it opens: the row versions deleted or updated after that
    stay in the heap and the indexes (VACUUM may not remove them) while it is open.
    """

    def __init__(self, engine: Engine, seconds: float) -> None:
        self._lock = threading.Lock()
        self._conn: Connection | None = engine.connect().execution_options(
            isolation_level="REPEATABLE READ"
        )
        self._conn.execute(text("SELECT count(*) FROM tasks")).scalar_one()
        self._timer = threading.Timer(seconds, self.close)
        self._timer.daemon = True
        self._timer.start()

    def close(self) -> None:
        """End the transaction (if still open) and close its connection."""
        self._timer.cancel()
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.rollback()
            conn.close()


def holder_gauge(conn: Connection) -> float:
    """What the API's `oldest_xmin_holder_age_seconds` would say now (read, rolled back)."""
    try:
        return queue_statistics.oldest_xmin_holder_age(driver_connection(conn, transaction=False))
    finally:
        conn.rollback()


@dataclass(frozen=True)
class RunResult:
    """One drain: tasks, seconds from first start to last finish, CPU used, claims seen.

    CPU seconds are those of the worker processes (fairq: the supervisor and its children)
    and of their PostgreSQL backends while they drained, start-up excluded; `None` when the
    server's processes cannot be read (a server on another machine).
    """

    tasks: int
    seconds: float
    cpu_seconds: float
    db_cpu_seconds: float | None
    claims: float = 0.0
    claim_seconds: float = 0.0
    # With --hold-snapshot: the holder gauge at the end of the drain, while it was held.
    holder_gauge: float | None = None
    # The server's counters over the drain (`DrainCounters`); None if it could not read them.
    counters: DrainCounters | None = None

    @property
    def rate(self) -> float:
        """Tasks per second."""
        return self.tasks / self.seconds

    @property
    def cpu_us_per_task(self) -> float:
        """CPU microseconds the worker processes spent per task."""
        return 1e6 * self.cpu_seconds / self.tasks

    @property
    def db_cpu_us_per_task(self) -> float | None:
        """CPU microseconds their PostgreSQL backends spent per task."""
        return None if self.db_cpu_seconds is None else 1e6 * self.db_cpu_seconds / self.tasks

    @property
    def mean_claim_ms(self) -> float:
        """Mean duration of one claim transaction (lock wait included), in milliseconds."""
        return 1000 * self.claim_seconds / self.claims if self.claims else 0.0

    @property
    def wal_per_task(self) -> float | None:
        """WAL bytes written per task over the drain (the whole cluster's)."""
        return None if self.counters is None else self.counters.wal_bytes / self.tasks

    @property
    def commits_per_task(self) -> float | None:
        """Transactions committed in the benchmark's database per task."""
        return None if self.counters is None else self.counters.commits / self.tasks


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu(pids: Sequence[int]) -> float | None:
    """CPU seconds (user + system) these processes used so far, from /proc; None if unreadable."""
    total = 0.0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None
        fields = stat.rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime
    return total


def backends_cpu(pids: Sequence[int], before: dict[int, float]) -> float | None:
    """CPU seconds these server processes used since `before` (pid to CPU seconds then).

    A process not in `before` (a connection opened during the run, after a lost one or by
    a pool that connects lazily) counts from its start.
    """
    total = 0.0
    for pid in pids:
        cpu = process_cpu([pid])
        if cpu is None:
            return None
        total += cpu - before.get(pid, 0.0)
    return total


def backends_cpu_before(pids: Sequence[int]) -> dict[int, float]:
    """CPU seconds each of these server processes used so far."""
    return {pid: process_cpu([pid]) or 0.0 for pid in pids}


def backend_pids(engine: Engine, application_name: str) -> list[int]:
    """The server processes of this database's connections with this application_name pattern."""
    with engine.connect() as conn:
        return backend_pids_on(conn, application_name)


def backend_pids_on(conn: Connection, application_name: str) -> list[int]:
    """`backend_pids`, read on `conn` in a transaction rolled back."""
    try:
        return list(
            conn.execute(
                text(
                    "SELECT pid FROM pg_stat_activity "
                    "WHERE datname = current_database() AND application_name LIKE :name"
                ),
                {"name": application_name},
            ).scalars()
        )
    finally:
        conn.rollback()


def _delta(after: float | None, before: float | None) -> float | None:
    return None if after is None or before is None else after - before


# -- WAL and commits -----------------------------------------------------------------------

# The cluster's WAL position, this database's commits, the other databases' (a shared server
# writes their WAL too) and the checkpoints so far. `{checkpoints}`: a query of the server's
# version (`pg_stat_checkpointer` replaced those columns of `pg_stat_bgwriter` in 17).
_COUNTERS = """
SELECT pg_current_wal_lsn()::text AS lsn,
       (SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()) AS commits,
       (SELECT coalesce(sum(xact_commit), 0) FROM pg_stat_database
        WHERE datname <> current_database()) AS other_commits,
       ({checkpoints}) AS checkpoints
"""
_CHECKPOINTS_16 = "SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter"
_CHECKPOINTS_17 = "SELECT num_timed + num_requested FROM pg_stat_checkpointer"


@dataclass(frozen=True)
class ServerCounters:
    """The server's cumulative counters at one moment (`server_counters`)."""

    lsn: str
    commits: int
    other_commits: int
    checkpoints: int


@dataclass(frozen=True)
class DrainCounters:
    """What the server counted over one drain (module docstring: what each one spans)."""

    wal_bytes: int
    commits: int
    other_commits: int
    checkpoints: int


def server_counters(probe: Connection) -> ServerCounters:
    """Read the WAL position, the commits (this database's, the others') and checkpoints.

    On `probe`, the connection a run keeps open for its readings, in a transaction rolled
    back: a new connection would count a commit of its own (a backend's start commits one),
    and so would a read in autocommit.
    """
    try:
        version = int(probe.execute(text("SHOW server_version_num")).scalar_one())
        checkpoints = _CHECKPOINTS_17 if version >= 170000 else _CHECKPOINTS_16
        row = probe.execute(text(_COUNTERS.format(checkpoints=checkpoints))).one()
    finally:
        probe.rollback()
    return ServerCounters(row.lsn, int(row.commits), int(row.other_commits), int(row.checkpoints))


def wal_bytes_since(probe: Connection, lsn: str) -> int:
    """WAL bytes the cluster wrote since `lsn` (`pg_wal_lsn_diff`)."""
    try:
        return int(
            probe.execute(
                text("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), CAST(:lsn AS pg_lsn))"),
                {"lsn": lsn},
            ).scalar_one()
        )
    finally:
        probe.rollback()


def drain_counters(probe: Connection, before: ServerCounters, wal_bytes: int) -> DrainCounters:
    """The counters since `before`, read now; `wal_bytes` was read at the drain's end."""
    after = server_counters(probe)
    return DrainCounters(
        wal_bytes,
        after.commits - before.commits,
        after.other_commits - before.other_commits,
        after.checkpoints - before.checkpoints,
    )


def wait_disconnected(probe: Connection, application_name: str, timeout: float = 30.0) -> None:
    """Wait until no server process of this database has this application_name pattern.

    A backend publishes its statistics (`xact_commit`) at its exit at the latest, before it
    leaves `pg_stat_activity`; while it runs, at most once a second.
    """
    deadline = time.monotonic() + timeout
    while backend_pids_on(probe, application_name):
        if time.monotonic() > deadline:
            raise RuntimeError(f"connections {application_name!r} still open after {timeout}s")
        time.sleep(0.02)


def seeder_for(url: str) -> Engine:
    """An engine for what a run does before its drain, under an application_name of its own.

    Its connections' commits (each connection's start counts one) must be counted before the
    drain's: `wait_disconnected(probe, SEEDER_APPLICATION_NAME)` waits for them. No pool, so
    nothing to dispose of.
    """
    return stack.script_engine(url, application_name=SEEDER_APPLICATION_NAME)


def checkpoint(seeder: Engine, args: argparse.Namespace) -> None:
    """CHECKPOINT, unless `--no-checkpoint` (module docstring: why)."""
    if args.no_checkpoint:
        return
    with seeder.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("CHECKPOINT"))


def worker_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment of the supervisor a fairq run starts."""
    env = {
        "WORKER_CONCURRENCY": str(args.concurrency),
        "WORKER_BATCH_SIZE": str(args.batch_size),
        "LOG_LEVEL": args.log_level,
        "LOG_FORMAT": args.log_format,
        "SHUTDOWN_TIMEOUT_SECONDS": "30",
        "WORKER_THREADS": str(args.threads),
    }
    if args.stale_after is not None:
        env["STALE_AFTER_SECONDS"] = str(args.stale_after)
    return env


def run_once(
    engine: Engine,
    url: str,
    args: argparse.Namespace,
    workdir: Path,
    companies: int,
    *,
    hold_snapshot: float | None = None,
) -> RunResult:
    """Start a supervisor, let it boot, then seed `companies` companies' tasks and drain them.

    `hold_snapshot`: seconds to hold a REPEATABLE READ snapshot from just before the seeding
    (`SnapshotHolder`), at most until the drain is over.
    """
    reset(engine)
    companies_ids = seed_companies(engine, companies)
    env = worker_env(args)
    seeder = seeder_for(url)
    # Every reading while the children run goes through `probe` (see `server_counters`).
    with engine.connect() as probe:
        with stack.supervisor(url, workdir, concurrency=args.concurrency, env=env) as sup:
            # A child has booted once its LISTEN connection is open (the last step of its boot).
            deadline = time.monotonic() + 60
            while len(backend_pids_on(probe, "fairq-worker-listen")) < args.concurrency:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"children did not boot:\n{sup.log()[-3000:]}")
                time.sleep(0.05)
            checkpoint(seeder, args)
            processes = [sup.pid, *sup.children()]
            backends = backend_pids_on(probe, "fairq-worker%")
            start = sup.metrics()
            cpu, db_before = process_cpu(processes), backends_cpu_before(backends)
            holder = None if hold_snapshot is None else SnapshotHolder(engine, hold_snapshot)
            gauge = None
            try:
                seed_tasks(seeder, companies_ids, args.tasks, args.sleep)
                wait_disconnected(probe, SEEDER_APPLICATION_NAME)
                counters = server_counters(probe)
                # As the API does: wake the idle children (one commit of the drain's count).
                probe.execute(text("SELECT pg_notify('fairq_tasks', '')"))
                probe.commit()
                deadline = time.monotonic() + args.timeout
                while count_completed(probe) < args.tasks:
                    if not sup.running():
                        raise RuntimeError(f"supervisor exited:\n{sup.log()[-3000:]}")
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"not drained after {args.timeout}s")
                    time.sleep(0.05)
                wal_bytes = wal_bytes_since(probe, counters.lsn)
                if holder is not None:
                    gauge = holder_gauge(probe)
            finally:
                if holder is not None:
                    holder.close()
            # The children's connections as they are now: a pass may have opened another.
            cpu = _delta(process_cpu(processes), cpu)
            db_cpu = backends_cpu(backend_pids_on(probe, "fairq-worker%"), db_before)
            end = sup.metrics()
        # The supervisor has stopped; once its children's connections are gone, all their
        # commits are counted.
        wait_disconnected(probe, "fairq-worker%")
        drained = drain_counters(probe, counters, wal_bytes)
    if cpu is None:
        raise RuntimeError("a worker process exited while draining")
    with engine.connect() as conn:
        seconds = conn.execute(
            text("SELECT extract(epoch FROM max(finished_at) - min(started_at)) FROM tasks")
        ).scalar_one()

    def grew(name: str) -> float:
        return end.get(name, 0.0) - start.get(name, 0.0)

    return RunResult(
        args.tasks,
        float(seconds),
        cpu,
        db_cpu,
        grew("claim_duration_seconds_count"),
        grew("claim_duration_seconds_sum"),
        gauge,
        drained,
    )


# -- pgqueuer ------------------------------------------------------------------------------


def pgqueuer_missing() -> str | None:
    """Why the pgqueuer side cannot run (not installed), or None."""
    if importlib.util.find_spec("pgqueuer") is None:
        return "pgqueuer is not installed (pip install -e '.[bench]'): fairq side only"
    return None


def default_pgqueuer_driver() -> str:
    """asyncpg when installed (pgqueuer's fastest driver), else psycopg."""
    return "asyncpg" if importlib.util.find_spec("asyncpg") is not None else "psycopg"


def libpq_url(url: str) -> str:
    """A SQLAlchemy URL as a plain `postgresql://` URL for asyncpg or psycopg."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


async def _pgqueuer_queries(dsn: str, driver: str) -> tuple[Queries, Closer]:
    """Queries over one new autocommit connection (pgqueuer requires autocommit), its closer."""
    from pgqueuer import Queries

    if driver == "asyncpg":
        import asyncpg
        from pgqueuer.db import AsyncpgDriver

        connection = await asyncpg.connect(
            dsn=dsn, server_settings={"application_name": PGQUEUER_APPLICATION_NAME}
        )
        return Queries(AsyncpgDriver(connection)), connection.close
    import psycopg
    from pgqueuer.db import PsycopgDriver

    aconnection = await psycopg.AsyncConnection.connect(
        dsn, autocommit=True, application_name=PGQUEUER_APPLICATION_NAME
    )
    return Queries(PsycopgDriver(aconnection)), aconnection.close


async def _pgqueuer_seed(dsn: str, driver: str, count: int) -> None:
    """Install pgqueuer's schema if missing, empty its tables, enqueue `count` no-op jobs."""
    queries, close = await _pgqueuer_queries(dsn, driver)
    try:
        if not await queries.schema_is_installed():
            await queries.install()
        settings = queries.qbe.settings
        tables = (settings.queue_table, settings.queue_table_log, settings.statistics_table)
        await queries.driver.execute(f"TRUNCATE {', '.join(tables)}")
        # As `reset` does for fairq's tables, so both sides start from fresh statistics.
        await queries.driver.execute(f"VACUUM ANALYZE {', '.join(tables)}")
        await queries.enqueue([PGQUEUER_ENTRYPOINT] * count, [None] * count, [0] * count)
        await queries.driver.execute(f"ANALYZE {settings.queue_table}")
    finally:
        await close()


async def _pgqueuer_seconds(dsn: str, driver: str) -> tuple[int, float]:
    """(jobs that succeeded, seconds from the first pick to the last success)."""
    queries, close = await _pgqueuer_queries(dsn, driver)
    try:
        [row] = await queries.driver.fetch(
            "SELECT count(*) FILTER (WHERE status = 'successful') AS done, "
            "extract(epoch FROM max(created) FILTER (WHERE status = 'successful') "
            "                  - min(created) FILTER (WHERE status = 'picked')) AS seconds "
            f"FROM {queries.qbe.settings.queue_table_log}"
        )
        return int(str(row["done"])), float(str(row["seconds"]))
    finally:
        await close()


async def _pgqueuer_drain(dsn: str, driver: str, batch_size: int) -> None:
    """One pgqueuer worker: a QueueManager in drain mode whose only entrypoint does nothing.

    Connects, then says `ready` on stdout and waits for a line on stdin, so every process of
    a run starts draining together; once drained, says `drained` and waits for another line
    before it disconnects, so its CPU and its server process's can be read.
    """
    from pgqueuer import QueueManager
    from pgqueuer.models import Job
    from pgqueuer.types import QueueExecutionMode

    async def noop(job: Job) -> None:
        """Succeed at once, like fairq's `noop`."""

    queries, close = await _pgqueuer_queries(dsn, driver)
    manager = QueueManager(queries)
    manager.entrypoint(PGQUEUER_ENTRYPOINT)(noop)
    loop = asyncio.get_running_loop()
    print("ready", flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)
    try:
        await manager.run(batch_size=batch_size, mode=QueueExecutionMode.drain)
        print("drained", flush=True)
        await loop.run_in_executor(None, sys.stdin.readline)
    finally:
        await close()


def pgqueuer_worker(url: str, driver: str, batch_size: int) -> int:
    """Entry point of one pgqueuer worker process (`--pgqueuer-worker`)."""
    logging.basicConfig(level=logging.WARNING)  # as fairq's side runs at --log-level WARNING
    coroutine = _pgqueuer_drain(libpq_url(url), driver, batch_size)
    try:
        import uvloop  # a dependency of pgqueuer; its own benchmark runs on it
    except ImportError:
        asyncio.run(coroutine)
    else:
        uvloop.run(coroutine)
    return 0


def seed_pgqueuer(url: str, args: argparse.Namespace) -> None:
    """CHECKPOINT (unless `--no-checkpoint`), then empty pgqueuer's tables and enqueue."""
    checkpoint(seeder_for(url), args)
    asyncio.run(_pgqueuer_seed(libpq_url(url), args.pgqueuer_driver, args.tasks))


def run_pgqueuer_once(
    engine: Engine, url: str, args: argparse.Namespace, workdir: Path
) -> RunResult:
    """Enqueue, drain with `--concurrency` pgqueuer processes started together, measure."""
    dsn = libpq_url(url)
    seed_pgqueuer(url, args)
    workdir.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable, "-m", "scripts.bench_throughput", "--pgqueuer-worker",
        "--pgqueuer-driver", args.pgqueuer_driver, "--batch-size", str(args.batch_size),
        "--database-url", url,
    ]  # fmt: skip
    procs: list[subprocess.Popen[str]] = []

    def tell_all(line: str) -> None:
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write(line + "\n")
            proc.stdin.flush()

    def hear_all(line: str) -> None:
        deadline = time.monotonic() + args.timeout
        for proc in procs:
            assert proc.stdout is not None
            # A worker that fails or hangs shows in its log; readline returns "" on exit.
            if proc.stdout.readline().strip() != line or time.monotonic() > deadline:
                raise RuntimeError(f"pgqueuer worker did not say {line!r}: {_tail(workdir)}")

    # Every reading while the workers run goes through `probe` (see `server_counters`).
    probe = engine.connect()
    try:
        # The seeding's commits (its connection's) are counted before the drain's.
        wait_disconnected(probe, SEEDER_APPLICATION_NAME)
        wait_disconnected(probe, PGQUEUER_APPLICATION_NAME)
        for index in range(args.concurrency):
            with (workdir / f"pgqueuer-{index}.log").open("w") as err:
                proc = subprocess.Popen(
                    argv, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    stderr=err, text=True,
                )  # fmt: skip
                procs.append(proc)
        hear_all("ready")
        processes = [proc.pid for proc in procs]
        backends = backend_pids_on(probe, PGQUEUER_APPLICATION_NAME)
        cpu, db_before = process_cpu(processes), backends_cpu_before(backends)
        counters = server_counters(probe)
        tell_all("go")
        hear_all("drained")
        wal_bytes = wal_bytes_since(probe, counters.lsn)
        cpu = _delta(process_cpu(processes), cpu)
        db_cpu = backends_cpu(backend_pids_on(probe, PGQUEUER_APPLICATION_NAME), db_before)
        tell_all("exit")
        for proc in procs:
            if proc.wait(30) != 0:
                raise RuntimeError(
                    f"pgqueuer worker exited with {proc.returncode}: {_tail(workdir)}"
                )
        # Once the workers' connections are gone, all their commits are counted.
        wait_disconnected(probe, PGQUEUER_APPLICATION_NAME)
        drained = drain_counters(probe, counters, wal_bytes)
    finally:
        probe.close()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if cpu is None:
        raise RuntimeError("a pgqueuer worker exited while draining")
    done, seconds = asyncio.run(_pgqueuer_seconds(dsn, args.pgqueuer_driver))
    if done != args.tasks:
        raise RuntimeError(f"pgqueuer completed {done} of {args.tasks} jobs: {_tail(workdir)}")
    return RunResult(args.tasks, seconds, cpu, db_cpu, counters=drained)


def _tail(workdir: Path) -> str:
    return "\n".join(p.read_text()[-1500:] for p in sorted(workdir.glob("pgqueuer-*.log")))


# -- the side-by-side run ------------------------------------------------------------------


def describe(result: RunResult) -> str:
    """One run as printed."""
    line = (
        f"{result.tasks} tasks in {result.seconds:.3f} s = {result.rate:,.0f} tasks/s "
        f"(CPU per task: worker {result.cpu_us_per_task:.1f} us"
    )
    if result.db_cpu_us_per_task is not None:
        line += f", PostgreSQL {result.db_cpu_us_per_task:.1f} us"
    if result.claims:
        line += f"; {result.claims:.0f} claims, mean claim {result.mean_claim_ms:.1f} ms"
    if result.holder_gauge is not None:
        line += f"; holder gauge at the end {result.holder_gauge:.1f} s"
    line += ")"
    counters = result.counters
    if counters is not None:
        line += (
            f"; per task: WAL {counters.wal_bytes / result.tasks:,.0f} B, "
            f"{counters.commits / result.tasks:.4f} commits"
        )
        if counters.checkpoints:
            line += " (a checkpoint ran meanwhile: full-page images included)"
        if counters.other_commits:
            line += f" (other databases committed {counters.other_commits} meanwhile)"
    return line


def summarize(
    fairq: dict[int, list[RunResult]],
    pgqueuer: list[RunResult],
    args: argparse.Namespace,
    held: dict[int, list[RunResult]] | None = None,
) -> list[str]:
    """The medians, the ratios the goal is stated in, and whether each goal is met.

    `held`: the runs with a snapshot held (`--hold-snapshot`), per shape, compared with the
    plain ones.
    """

    def median_rate(results: Sequence[RunResult]) -> float:
        return statistics.median(r.rate for r in results)

    def median_cpu(results: Sequence[RunResult]) -> str:
        text = (
            f"CPU per task: worker {statistics.median(r.cpu_us_per_task for r in results):.1f} us"
        )
        db = [r.db_cpu_us_per_task for r in results if r.db_cpu_us_per_task is not None]
        return text + (f", PostgreSQL {statistics.median(db):.1f} us" if db else "")

    reference = median_rate(pgqueuer) if pgqueuer else None
    lines = [
        f"medians ({args.tasks} noop tasks, {args.concurrency} processes, batch "
        f"{args.batch_size}, log level {args.log_level}, {args.runs} runs each):"
    ]
    if reference is not None:
        lines.append(
            f"  pgqueuer ({args.pgqueuer_driver}, {len(pgqueuer)} runs): "
            f"{reference:,.0f} tasks/s ({median_cpu(pgqueuer)})"
        )
    for companies, results in fairq.items():
        rate = median_rate(results)
        line = (
            f"  fairq, {companies} compan{'y' if companies == 1 else 'ies'}: {rate:,.0f} "
            f"tasks/s ({median_cpu(results)})"
        )
        if reference is not None:
            ratio = rate / reference
            verdict = "met" if ratio >= GOAL_VS_PGQUEUER else "NOT met"
            line += f"; x{ratio:.2f} pgqueuer (goal x{GOAL_VS_PGQUEUER}: {verdict})"
        lines.append(line)
    if 1 in fairq and 50 in fairq:
        ratio = median_rate(fairq[1]) / median_rate(fairq[50])
        verdict = "met" if ratio >= GOAL_LONE_VS_50 else "NOT met"
        lines.append(
            f"  1 company / 50 companies: x{ratio:.2f} (goal x{GOAL_LONE_VS_50}: {verdict})"
        )
    for companies, results in (held or {}).items():
        plain, rate = median_rate(fairq[companies]), median_rate(results)
        claim_ms = statistics.median(r.mean_claim_ms for r in results)
        plain_claim_ms = statistics.median(r.mean_claim_ms for r in fairq[companies])
        lines.append(
            f"  fairq, {companies} compan{'y' if companies == 1 else 'ies'}, snapshot held "
            f"{args.hold_snapshot:g} s: {rate:,.0f} tasks/s, mean claim {claim_ms:.1f} ms "
            f"({median_cpu(results)}); x{rate / plain:.2f} of {plain:,.0f} tasks/s without "
            f"(mean claim {plain_claim_ms:.1f} ms)"
        )
    return lines + per_task_costs(fairq, pgqueuer, args)


def _median(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def per_task_costs(
    fairq: dict[int, list[RunResult]], pgqueuer: list[RunResult], args: argparse.Namespace
) -> list[str]:
    """Per completed task, medians: WAL, commits and CPU, fairq / pgqueuer, and the goals."""
    columns: tuple[tuple[str, Callable[[RunResult], float | None], str], ...] = (
        ("WAL bytes", lambda r: r.wal_per_task, "{:,.0f}"),
        ("commits", lambda r: r.commits_per_task, "{:.4f}"),
        ("CPU worker us", lambda r: r.cpu_us_per_task, "{:.1f}"),
        ("CPU PostgreSQL us", lambda r: r.db_cpu_us_per_task, "{:.1f}"),
    )

    def medians(results: Sequence[RunResult]) -> list[float | None]:
        return [_median(get(r) for r in results) for _, get, _ in columns]

    def row(label: str, values: Sequence[float | None], formats: Sequence[str]) -> str:
        cells = "".join(
            f"{'-' if v is None else f.format(v):>{len(name) + 3}}"
            for (name, _, _), v, f in zip(columns, values, formats, strict=True)
        )
        return f"  {label:<34}{cells}"

    lines = [
        "per completed task, medians:".ljust(36)
        + "".join(f"{name:>{len(name) + 3}}" for name, _, _ in columns)
    ]
    reference = medians(pgqueuer) if pgqueuer else None
    if reference is not None:
        lines.append(
            row(f"pgqueuer ({args.pgqueuer_driver})", reference, [f for _, _, f in columns])
        )
    goal = f"goals at batch {GOAL_BATCH}: WAL at most {GOAL_WAL_BYTES:,} B, {GOAL_COMMITS} commits"
    for companies, results in fairq.items():
        ours = medians(results)
        lines.append(
            row(
                f"fairq, {companies} compan{'y' if companies == 1 else 'ies'}",
                ours,
                [f for _, _, f in columns],
            )
        )
        if reference is not None:
            ratios = [
                None if a is None or not b else a / b for a, b in zip(ours, reference, strict=True)
            ]
            lines.append(row("  fairq / pgqueuer", ratios, ["x{:.2f}"] * len(columns)))
        wal, commits = ours[0], ours[1]
        if args.batch_size != GOAL_BATCH or wal is None or commits is None:
            continue
        verdicts = (
            f"WAL {'met' if wal <= GOAL_WAL_BYTES else 'NOT met'}, "
            f"commits {'met' if commits <= GOAL_COMMITS else 'NOT met'}"
        )
        lines.append(f"    {goal}: {verdicts}")
    if args.batch_size != GOAL_BATCH:
        lines.append(f"  ({goal}; this run is at batch {args.batch_size})")
    runs = [r for results in fairq.values() for r in results] + list(pgqueuer)
    counted = [r.counters for r in runs if r.counters is not None]
    if args.database_url is None:
        lines.append("  WAL: this benchmark's own embedded server, which nothing else writes to")
    else:
        others = sum(c.other_commits for c in counted)
        lines.append(
            "  WAL: the whole server's (--database-url): other databases' writes count too; "
            f"they committed {others:,} transactions during these drains"
        )
    checkpoints = sum(1 for c in counted if c.checkpoints)
    if checkpoints:
        lines.append(
            f"  {checkpoints} of {len(counted)} drains saw a checkpoint: their WAL includes "
            "full-page images"
        )
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(
        prog="python -m scripts.bench_throughput", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument(
        "--companies", default="1,50,2000",
        help="comma-separated shapes: how many companies the tasks are spread over",
    )  # fmt: skip
    parser.add_argument("--runs", type=int, default=3, help="rounds (runs per shape)")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1, help="WORKER_THREADS of each child")
    parser.add_argument(
        "--sleep", type=float, metavar="SECONDS",
        help="`sleep` tasks of SECONDS instead of noop ones: batches held long enough for "
        "the workers' heartbeats to count (fairq only: use with --no-pgqueuer)",
    )  # fmt: skip
    parser.add_argument(
        "--stale-after", type=float, metavar="SECONDS",
        help="STALE_AFTER_SECONDS of the workers (their heartbeat: a fifth of it)",
    )  # fmt: skip
    parser.add_argument(
        "--log-level", default="WARNING",
        help="LOG_LEVEL of the worker (INFO logs a line per task, which costs throughput)",
    )  # fmt: skip
    parser.add_argument("--log-format", default="text", choices=("text", "json"))
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run at most")
    parser.add_argument(
        "--no-pgqueuer", action="store_true", help="skip the pgqueuer side even if installed"
    )
    parser.add_argument(
        "--pgqueuer-driver", choices=("asyncpg", "psycopg"), default=default_pgqueuer_driver()
    )
    parser.add_argument("--pgqueuer-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--no-checkpoint", action="store_true",
        help="no CHECKPOINT before each side seeds its tasks (a shared server's other users)",
    )  # fmt: skip
    parser.add_argument(
        "--hold-snapshot", type=float, metavar="SECONDS",
        help="also run each fairq shape while a REPEATABLE READ snapshot is held for SECONDS "
        "from just before the drain (at most until it ends), and compare",
    )  # fmt: skip
    add_database_arguments(parser)
    args = parser.parse_args(argv)
    args.shapes = [int(n) for n in str(args.companies).split(",") if n.strip()]
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the results."""
    args = parse_args(argv)
    if args.pgqueuer_worker:
        return pgqueuer_worker(args.database_url, args.pgqueuer_driver, args.batch_size)
    skip = "skipped (--no-pgqueuer)" if args.no_pgqueuer else pgqueuer_missing()
    if skip:
        print(f"pgqueuer side: {skip}", flush=True)
    fairq: dict[int, list[RunResult]] = {n: [] for n in args.shapes}
    held: dict[int, list[RunResult]] | None = (
        None if args.hold_snapshot is None else {n: [] for n in args.shapes}
    )
    pgqueuer: list[RunResult] = []
    with (
        bench_database(args.database_url, "throughput", fast_commit=args.fast_commit) as url,
        tempfile.TemporaryDirectory(prefix="fairq-bench-") as tmp,
    ):
        engine = engine_for(url)
        try:
            for run in range(1, args.runs + 1):
                for companies in args.shapes:
                    workdir = Path(tmp) / f"run-{run}-{companies}"
                    result = run_once(engine, url, args, workdir, companies)
                    fairq[companies].append(result)
                    print(f"run {run} fairq, {companies} companies: {describe(result)}", flush=True)
                    if held is not None:
                        result = run_once(
                            engine, url, args, workdir.with_name(workdir.name + "-held"),
                            companies, hold_snapshot=args.hold_snapshot,
                        )  # fmt: skip
                        held[companies].append(result)
                        print(
                            f"run {run} fairq, {companies} companies, snapshot held: "
                            f"{describe(result)}",
                            flush=True,
                        )
                    if skip:
                        continue
                    result = run_pgqueuer_once(engine, url, args, workdir / "pgqueuer")
                    pgqueuer.append(result)
                    print(f"run {run} pgqueuer: {describe(result)}", flush=True)
        finally:
            engine.dispose()
    print("\n".join(summarize(fairq, pgqueuer, args, held)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
