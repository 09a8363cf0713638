"""Scale-out through an emulated network round trip, fairq and pgqueuer side by side.

Each shape runs worker "hosts" (one `python -m worker` supervisor each, standing in for a
worker host) of `children` children each, claiming `batch` tasks at a time and running up to
`threads` handlers at once per child (`WORKER_THREADS`), against one PostgreSQL; then the same
shape with pgqueuer 1.6. Every handler sleeps 20 ms (`sleep` tasks, `{"seconds": 0.02}`,
spread over `--companies` companies), so the ideal rate is children x threads / 0.02 s; a
shape short of it is held back by the claim (its lock, its round trips) or by CPU, and the
figures printed are there to tell which (docs/scaling.md).

Shapes (`--shapes`, comma-separated): `[<hosts>h]<children>x<batch>[x<threads>]`, children
per host. `8x1x1`: one host of 8 children, batch 1, one handler at a time per child;
`4h16x10x8`: 4 hosts of 16 children, batch 10, 8 threads. A shape without `x<threads>`
runs once per `--threads` value (default 1,8). The default matrix: 2, 8, 32 and 64 children
on one host and 4 hosts x 16, each with batch 1, 10 and 100.

The network: `--rtt-ms X` puts `devtools.delay_proxy` between every worker process and
PostgreSQL, holding each chunk X/2 ms each way (in user space: `tc netem` is not available
everywhere; the proxy runs under SCHED_FIFO when root). `--rtt-ms 0` runs without it;
`--proxy` keeps it in the path at D = 0, to measure what the proxy itself costs against a
run without. Seeding and measurements connect directly. Before the runs the real round trip
of a `SELECT 1` is measured, direct and through the proxy; each run measures it again under
load (`ping`).

A run (fairq and pgqueuer alike): empty the tables, CHECKPOINT (no timed checkpoint in the
window, and both sides' first writes after one alike), seed enough tasks for the ideal rate
over warm-up and window (x1.2, at most `--max-tasks`), start the workers and wait until every
one is connected and the box is idle (below a quarter of a core busy, at most
`--idle-timeout` seconds, else the run is flagged `box busy`), then start them together:
fairq's booted children wake on the NOTIFY of the seeding transaction; pgqueuer's workers on
a signal, and since a `QueueManager` checks its schema and starts listening only when it
starts running, its warm-up begins once every worker has started a job. After `--warmup`
seconds, measure for `--seconds`, then stop the workers (not drained: the next run empties
the tables):
- tasks/s: tasks finished in the window by the database clock, and the fraction of the
  ideal. `ran out` flags a run whose every task was claimed before the window ended (its
  rate is then a lower bound: raise `--max-tasks`);
- claims/s: claims that took at least one task (fairq: distinct `started_at`, one statement
  timestamp per claim; pgqueuer: distinct timestamps of its `picked` log rows);
- lock waits: every `--sample-ms` the workers' backends in `pg_stat_activity`. Printed: the
  mean number waiting on an advisory lock and on any other heavyweight lock per sample, their
  share of the samples of backends in a transaction (claiming, finalizing), and the three
  most frequent wait events of those backends (`CPU`: none; `Client:ClientRead`: waiting for
  the worker, a round trip);
- CPU in cores (CPU seconds / window, from /proc in clock ticks): the worker processes
  (supervisors and children; pgqueuer's processes), PostgreSQL (all its processes but the
  sampler's backends), the proxy, this benchmark (itself and its sampler's backends), other
  (the box's busy time in /proc/stat less all of those: somebody else's load) and idle. On
  2 cores, idle near 0 says CPU binds; idle left while the rate is short of ideal says a lock
  or the round trips do. The proxy's lateness (how late chunks went out against their due
  time) is printed with it.
Runs alternate fairq and pgqueuer, shape after shape, round after round (`--runs`), so both
see the same machine; the summary has the medians per shape and the ratio fairq / pgqueuer.

pgqueuer 1.6 (the `bench` extra; skipped with a message when it is absent, or with
`--no-pgqueuer`): a database of its own on the same server (`<database>_pgqueuer`, its schema
installed as `pgq install` does), jobs of one `async` entrypoint that awaits
`asyncio.sleep(0.02)`. Per host one process forks `children` workers, each a `QueueManager`
on its own asyncpg connection through the proxy, in continuous mode with `batch_size` =
batch and `max_concurrent_tasks` = 2 x max(batch, threads) (pgqueuer's floor is twice the
batch; without a cap a worker hoards the queue); each runs at most `threads` jobs at once
through a per-process `asyncio.Lock` (threads 1) or `asyncio.Semaphore`
(`concurrency_limit` is cluster-wide, not per process).

PostgreSQL: `--database-url`, else an embedded PostgreSQL 16 with its data in
`.pgdata/bench-scaling` and max_connections 400 (64 children hold 2 connections each,
pgqueuer's workers 1), durable commits unless `--fast-commit`. A shape needing more
connections than the server allows is refused before the first run.

Usage (from the repository root):
    .venv/bin/python -m scripts.bench_scaling [--rtt-ms 2] [--proxy] [--shapes 8x1x1,4h16x10]
        [--threads 1,8] [--runs 3] [--companies 50] [--seconds 5] [--warmup 1]
        [--max-tasks 40000] [--sample-ms 10] [--idle-timeout 30] [--no-pgqueuer]
        [--fast-commit] [--database-url postgresql+psycopg://postgres@127.0.0.1:5432/fairq_bench]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime as dt
import math
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg.rows import TupleRow
from sqlalchemy import Engine, text
from sqlalchemy.engine import make_url

from common.environment import DEFAULT_NOTIFY_CHANNEL
from devtools import delay_proxy, stack
from scripts.bench_throughput import (
    add_database_arguments,
    backend_pids,
    engine_for,
    libpq_url,
    pgqueuer_missing,
    process_cpu,
    reset,
    seed_companies,
)
from worker.settings import WorkerSettings

if TYPE_CHECKING:
    from pgqueuer import Queries

ROOT = Path(__file__).resolve().parent.parent

HANDLER_SECONDS = 0.02
DEFAULT_PLACEMENTS = ((1, 2), (1, 8), (1, 32), (1, 64), (4, 16))  # (hosts, children per host)
DEFAULT_BATCHES = (1, 10, 100)
MAX_CONNECTIONS = 400
FAIRQ_APPLICATION_NAMES = "fairq-worker%"
PGQUEUER_APPLICATION_NAME = "fairq-bench-scaling-pgqueuer"
PGQUEUER_ENTRYPOINT = "sleep"
SAMPLER_APPLICATION_NAME = "fairq-bench-sampler"
# The box counts as idle below this many cores busy (its own processes at rest included).
IDLE_BELOW_CORES = 0.25
# Tasks seeded per run: the ideal rate over warm-up and window, with this margin.
SEED_MARGIN = 1.2
# The sampler pings through the proxy every this many samples.
PING_EVERY_SAMPLES = 10

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# -- shapes --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """`hosts` hosts of `children` worker processes, claiming `batch`, running `threads`."""

    hosts: int
    children: int
    batch: int
    threads: int

    @property
    def processes(self) -> int:
        """Worker processes in all (children of every host)."""
        return self.hosts * self.children

    @property
    def ideal(self) -> float:
        """Tasks per second if every handler slot slept back to back."""
        return self.processes * self.threads / HANDLER_SECONDS

    def __str__(self) -> str:
        hosts = f"{self.hosts}h" if self.hosts > 1 else ""
        return f"{hosts}{self.children}x{self.batch}x{self.threads}"


def parse_shapes(spec: str, threads: Sequence[int]) -> list[Shape]:
    """`8x1x1,4h16x10` -> shapes; one without threads expands to each of `threads`."""
    shapes: list[Shape] = []
    for part in (p.strip().lower() for p in spec.split(",")):
        if not part:
            continue
        hosts_text, _, rest = part.rpartition("h")
        numbers = rest.split("x")
        try:
            hosts = int(hosts_text) if hosts_text else 1
            values = [int(n) for n in numbers]
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad shape {part!r}") from None
        if len(values) not in (2, 3) or min([hosts, *values]) < 1:
            raise argparse.ArgumentTypeError(
                f"bad shape {part!r}: [<hosts>h]<children>x<batch>[x<threads>], each >= 1"
            )
        for n_threads in values[2:] or threads:
            shapes.append(Shape(hosts, values[0], values[1], n_threads))
    return list(dict.fromkeys(shapes))


def default_shapes(threads: Sequence[int]) -> list[Shape]:
    """The default matrix: every placement with every batch size and thread count."""
    return [
        Shape(hosts, children, batch, n)
        for hosts, children in DEFAULT_PLACEMENTS
        for batch in DEFAULT_BATCHES
        for n in threads
    ]


def worker_reads_threads() -> bool:
    """Whether this checkout's worker has a threads setting (`WORKER_THREADS`)."""
    return any("thread" in f.name for f in dataclasses.fields(WorkerSettings))


# -- CPU -----------------------------------------------------------------------------------


def _box_ticks() -> tuple[int, int, int]:
    """(busy, idle, steal) clock ticks of the whole box so far, from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    return user + nice + system + irq + softirq, idle + iowait, steal


def _cpu_by_pid(pids: Sequence[int]) -> dict[int, float]:
    """CPU seconds of each of these processes so far; those gone are left out."""
    found: dict[int, float] = {}
    for pid in pids:
        cpu = process_cpu([pid])
        if cpu is not None:
            found[pid] = cpu
    return found


@dataclass(frozen=True)
class CpuSnapshot:
    """CPU seconds so far: per group of processes (pid -> seconds), the box, this process."""

    groups: dict[str, dict[int, float]]
    box: tuple[int, int, int]
    own: float


def cpu_snapshot(groups: Mapping[str, Sequence[int]]) -> CpuSnapshot:
    """Read every group's processes, the box's ticks and our own CPU now."""
    times = os.times()
    return CpuSnapshot(
        {name: _cpu_by_pid(pids) for name, pids in groups.items()},
        _box_ticks(),
        times.user + times.system,
    )


@dataclass(frozen=True)
class Cpu:
    """Cores used over a window: CPU seconds / seconds. `postgres` None: server not readable."""

    worker: float
    postgres: float | None
    proxy: float
    bench: float
    other: float
    idle: float
    steal: float

    def describe(self) -> str:
        """`workers 0.41, PostgreSQL 0.62, ...` for people."""
        pg = "?" if self.postgres is None else f"{self.postgres:.2f}"
        line = (
            f"workers {self.worker:.2f}, PostgreSQL {pg}, proxy {self.proxy:.2f}, "
            f"bench {self.bench:.2f}, other {self.other:.2f}, idle {self.idle:.2f}"
        )
        return line + (f", steal {self.steal:.2f}" if self.steal >= 0.01 else "")


def cpu_between(before: CpuSnapshot, after: CpuSnapshot, seconds: float) -> Cpu:
    """Cores each group used between two snapshots.

    A process in `after` but not in `before` (a backend connected meanwhile) counts from
    its start; one gone by `after` is lost (none should be: the workers stay connected).
    """

    def used(name: str) -> float:
        start = before.groups.get(name, {})
        return sum(cpu - start.get(pid, 0.0) for pid, cpu in after.groups.get(name, {}).items())

    busy, idle, steal = (a - b for a, b in zip(after.box, before.box, strict=True))
    worker, proxy = used("worker"), used("proxy")
    postgres = used("postgres") if after.groups.get("postgres") else None
    bench = after.own - before.own + used("sampler")
    other = busy / _CLOCK_TICKS - worker - (postgres or 0.0) - proxy - bench
    return Cpu(
        worker / seconds,
        None if postgres is None else postgres / seconds,
        proxy / seconds,
        bench / seconds,
        other / seconds,
        idle / _CLOCK_TICKS / seconds,
        steal / _CLOCK_TICKS / seconds,
    )


def busy_cores(seconds: float = 0.5) -> float:
    """Cores the whole box keeps busy over the next `seconds`."""
    before = _box_ticks()[0]
    time.sleep(seconds)
    return (_box_ticks()[0] - before) / _CLOCK_TICKS / seconds


def wait_idle(timeout: float) -> float | None:
    """Wait until the box is idle; None once it is, its busy cores if `timeout` passed first."""
    deadline = time.monotonic() + timeout
    while True:
        busy = busy_cores()
        if busy < IDLE_BELOW_CORES:
            return None
        if time.monotonic() > deadline:
            return busy


def server_pids(conn: psycopg.Connection[TupleRow]) -> list[int]:
    """Every process of the server `conn` is connected to (postmaster first); [] if unreadable.

    The postmaster is the parent of our backend; its children are the other backends and
    the auxiliary processes (WAL writer, checkpointer, autovacuum).
    """
    row = conn.execute("SELECT pg_backend_pid()").fetchone()
    assert row is not None
    try:
        stat = Path(f"/proc/{row[0]}/stat").read_text()
    except OSError:  # another machine's server
        return []
    if "postgres" not in stat.split(")", 1)[0]:  # a local process that has its pid
        return []
    postmaster = int(stat.rsplit(")", 1)[1].split()[1])
    return [postmaster, *stack.children_of(postmaster)]


# -- the sampler ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Waits:
    """What the workers' backends were doing, sampled over a window.

    Means per sample: `busy` backends in a transaction, of them `advisory` waiting on an
    advisory lock and `other_locks` on another heavyweight lock; `top`: the most frequent
    wait events of busy backends with their share; `ping_ms`: the median `SELECT 1` through
    the proxy meanwhile (None without a proxy).
    """

    samples: int
    busy: float
    advisory: float
    other_locks: float
    top: tuple[tuple[str, float], ...]
    ping_ms: float | None

    @property
    def share(self) -> float:
        """Fraction of busy backend samples that waited on a heavyweight lock."""
        return (self.advisory + self.other_locks) / self.busy if self.busy else 0.0

    def describe(self) -> str:
        """`adv 3.1 + other 0.0 of 7.2 busy (43%)` for people."""
        return (
            f"adv {self.advisory:.1f} + other {self.other_locks:.1f} of {self.busy:.1f} busy "
            f"({100 * self.share:.0f}%)"
        )

    def describe_top(self) -> str:
        """The top wait events, `Lock:advisory 62%, CPU 20%`."""
        return ", ".join(f"{name} {100 * share:.0f}%" for name, share in self.top) or "-"


class Sampler:
    """Samples the workers' backends every `interval` seconds in a thread, over a direct
    connection; pings through the proxy every `PING_EVERY_SAMPLES` samples when given one.
    """

    def __init__(
        self, dsn: str, application_names: str, interval: float, ping_dsn: str | None
    ) -> None:
        self._pattern = application_names
        self._interval = interval
        self._conn = psycopg.connect(
            dsn, autocommit=True, application_name=SAMPLER_APPLICATION_NAME
        )
        self._ping = (
            None
            if ping_dsn is None
            else psycopg.connect(
                ping_dsn, autocommit=True, application_name=SAMPLER_APPLICATION_NAME
            )
        )
        self.backend_pids = [c.info.backend_pid for c in (self._conn, self._ping) if c is not None]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._samples = 0
        self._busy = 0
        self._advisory = 0
        self._other = 0
        self._events: Counter[str] = Counter()
        self._pings: list[float] = []

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._conn.close()
        if self._ping is not None:
            self._ping.close()

    def _run(self) -> None:
        query = (
            "SELECT wait_event_type, wait_event FROM pg_stat_activity "
            "WHERE application_name LIKE %s AND state <> 'idle'"
        )
        deadline = time.monotonic()
        while not self._stop.is_set():
            rows = self._conn.execute(query, (self._pattern,)).fetchall()
            self._samples += 1
            self._busy += len(rows)
            for kind, event in rows:
                if kind == "Lock":
                    if event == "advisory":
                        self._advisory += 1
                    else:
                        self._other += 1
                self._events["CPU" if kind is None else f"{kind}:{event}"] += 1
            if self._ping is not None and self._samples % PING_EVERY_SAMPLES == 0:
                start = time.perf_counter()
                self._ping.execute("SELECT 1").fetchone()
                self._pings.append(1000 * (time.perf_counter() - start))
            deadline += self._interval
            self._stop.wait(max(0.0, deadline - time.monotonic()))

    def waits(self) -> Waits:
        """The window's figures (call after the block)."""
        samples = max(self._samples, 1)
        busy = sum(self._events.values())
        top = tuple((name, n / busy) for name, n in self._events.most_common(3))
        return Waits(
            self._samples,
            self._busy / samples,
            self._advisory / samples,
            self._other / samples,
            top,
            statistics.median(self._pings) if self._pings else None,
        )


def ping(dsn: str, count: int = 200) -> tuple[float, float]:
    """(median, p99) milliseconds of `SELECT 1` on one connection, after a few unmeasured."""
    with psycopg.connect(dsn, autocommit=True, application_name=SAMPLER_APPLICATION_NAME) as conn:
        for _ in range(10):
            conn.execute("SELECT 1").fetchone()
        times = []
        for _ in range(count):
            start = time.perf_counter()
            conn.execute("SELECT 1").fetchone()
            times.append(1000 * (time.perf_counter() - start))
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, int(0.99 * len(times)))]


# -- one run -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One side's run of one shape, measured over its window."""

    side: str
    shape: Shape
    tasks: int
    claims: int
    seconds: float
    seeded: int
    ran_out: bool
    cpu: Cpu
    waits: Waits
    proxy: delay_proxy.ProxyStats | None
    busy_before: float | None  # cores busy when it started, if the box never went idle
    idle_workers: int = 0  # pgqueuer workers that had run no job a minute after the start

    @property
    def rate(self) -> float:
        """Tasks finished per second."""
        return self.tasks / self.seconds

    @property
    def of_ideal(self) -> float:
        """The rate as a fraction of the shape's ideal."""
        return self.rate / self.shape.ideal

    @property
    def claims_per_second(self) -> float:
        """Claims that took at least one task, per second."""
        return self.claims / self.seconds

    def describe(self) -> str:
        """One line for people."""
        line = (
            f"{self.rate:,.0f} tasks/s ({100 * self.of_ideal:.0f}% of {self.shape.ideal:,.0f}), "
            f"{self.claims_per_second:,.0f} claims/s; lock waits {self.waits.describe()}, "
            f"top {self.waits.describe_top()}; CPU cores: {self.cpu.describe()}"
        )
        if self.waits.ping_ms is not None:
            line += f"; ping {self.waits.ping_ms:.2f} ms"
        if self.proxy is not None:
            line += f"; proxy late {self.proxy.late_mean_us:.0f}/{self.proxy.late_p99_us:.0f} us"
        if self.ran_out:
            line += f"; RAN OUT of its {self.seeded:,} tasks (a lower bound)"
        if self.busy_before is not None:
            line += f"; BOX BUSY ({self.busy_before:.2f} cores used before the start)"
        if self.idle_workers:
            line += f"; {self.idle_workers} WORKERS HAD RUN NO JOB a minute after the start"
        return line


@dataclass(frozen=True)
class Window:
    """The measured window: its database-clock bounds and what was measured in it."""

    start: dt.datetime
    end: dt.datetime
    cpu: Cpu
    waits: Waits
    proxy: delay_proxy.ProxyStats | None

    @property
    def seconds(self) -> float:
        """Its length by the database clock."""
        return (self.end - self.start).total_seconds()


@dataclass
class Bench:
    """What every run needs: the options, the databases, the proxy, a clock connection."""

    args: argparse.Namespace
    url: str  # fairq's database, direct
    engine: Engine
    worker_url: str  # fairq's database as the workers reach it (through the proxy)
    pgqueuer_url: str | None  # pgqueuer's database, direct; None: no pgqueuer side
    pgqueuer_worker_url: str | None
    proxy: delay_proxy.RunningProxy | None
    workdir: Path
    clock: psycopg.Connection[TupleRow] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.clock = psycopg.connect(libpq_url(self.url), autocommit=True)

    def now(self) -> dt.datetime:
        """The database clock."""
        row = self.clock.execute("SELECT clock_timestamp()").fetchone()
        assert row is not None
        value = row[0]
        assert isinstance(value, dt.datetime)
        return value

    def seed_count(self, shape: Shape) -> int:
        """Tasks for the ideal rate over warm-up and window, with a margin, capped."""
        args = self.args
        wanted: float = shape.ideal * (args.warmup + args.seconds) * SEED_MARGIN
        wanted += shape.processes * max(shape.batch, shape.threads)  # what the first claims hold
        return min(math.ceil(wanted), int(args.max_tasks))

    def measure(self, worker_pids: Sequence[int], application_names: str) -> Window:
        """Sleep the warm-up, then measure the window."""
        args = self.args
        time.sleep(args.warmup)
        ping_dsn = None if self.proxy is None else libpq_url(self.worker_url)
        with Sampler(libpq_url(self.url), application_names, args.sample_ms / 1000, ping_dsn) as s:
            groups = {
                "worker": list(worker_pids),
                "postgres": [p for p in server_pids(self.clock) if p not in s.backend_pids],
                "sampler": s.backend_pids,
                "proxy": [] if self.proxy is None else [self.proxy.pid],
            }
            if self.proxy is not None:
                self.proxy.reset()
            start, before = self.now(), cpu_snapshot(groups)
            time.sleep(args.seconds)
            groups["postgres"] = [p for p in server_pids(self.clock) if p not in s.backend_pids]
            after, end = cpu_snapshot(groups), self.now()
            proxy = None if self.proxy is None else self.proxy.stats()
        seconds = (end - start).total_seconds()
        return Window(start, end, cpu_between(before, after, seconds), s.waits(), proxy)


def prepare_server(conn: psycopg.Connection[TupleRow]) -> None:
    """CHECKPOINT, so no timed checkpoint falls in the coming window (they are minutes apart).

    Right after a checkpoint every page's first change writes a full-page image: a window
    with a checkpoint in it would pay more WAL than one without. Skipped where not allowed.
    """
    with contextlib.suppress(psycopg.errors.InsufficientPrivilege):
        conn.execute("CHECKPOINT")


def seed_sleep_tasks(engine: Engine, companies: list[str], count: int) -> None:
    """Insert `count` pending 20 ms `sleep` tasks, round-robin over `companies`, oldest first."""
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO tasks (company_id, type, payload, created_at, run_after) "
                "SELECT (CAST(:companies AS uuid[]))[1 + g % :n], 'sleep', "
                "       CAST(:payload AS jsonb), now() + g * interval '1 microsecond', now() "
                "FROM generate_series(0, :count - 1) g"
            ),
            {
                "companies": companies,
                "n": len(companies),
                "count": count,
                "payload": f'{{"seconds": {HANDLER_SECONDS}}}',
            },
        )
        # As the API does: wake the idle children (the insert itself sends no NOTIFY).
        conn.execute(text("SELECT pg_notify(:channel, '')"), {"channel": DEFAULT_NOTIFY_CHANNEL})
    # During the warm-up, as pgqueuer's queue is analyzed after its seeding: autovacuum
    # would do it in the window otherwise.
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("ANALYZE tasks"))


def run_fairq(bench: Bench, shape: Shape, workdir: Path) -> Run:
    """Start the shape's supervisors, wait for their children, seed (which wakes them), measure."""
    args, engine = bench.args, bench.engine
    reset(engine)
    companies = seed_companies(engine, args.companies)
    seeded = bench.seed_count(shape)
    env = {
        "WORKER_CONCURRENCY": str(shape.children),
        "WORKER_MAX_CONCURRENCY": str(max(shape.children, WorkerSettings.max_concurrency)),
        "WORKER_BATCH_SIZE": str(shape.batch),
        "WORKER_THREADS": str(shape.threads),
        "LOG_LEVEL": "WARNING",
        "SHUTDOWN_TIMEOUT_SECONDS": "10",
    }
    # All hosts start at once (each `python -m worker` takes a while to import), and stop so.
    supervisors: list[stack.WorkerSupervisor] = []
    try:
        for h in range(shape.hosts):
            (workdir / f"host{h}").mkdir(parents=True)
            supervisors.append(stack.start_supervisor(bench.worker_url, workdir / f"host{h}", env))
        for sup in supervisors:
            sup.port(timeout=60)
            sup.wait_children(shape.children, timeout=60)
        # A child has booted once its LISTEN connection is open (the last step of its boot).
        deadline = time.monotonic() + 60
        while len(backend_pids(engine, "fairq-worker-listen")) < shape.processes:
            if time.monotonic() > deadline:
                raise RuntimeError(f"children did not boot:\n{supervisors[0].log()[-3000:]}")
            time.sleep(0.05)
        pids = [pid for sup in supervisors for pid in (sup.pid, *sup.children())]
        busy = wait_idle(args.idle_timeout)
        prepare_server(bench.clock)
        seed_sleep_tasks(engine, companies, seeded)
        window = bench.measure(pids, FAIRQ_APPLICATION_NAMES)
        for sup in supervisors:
            if not sup.running():
                raise RuntimeError(f"a supervisor exited:\n{sup.log()[-3000:]}")
    finally:
        for sup in supervisors:
            if sup.running():
                sup.proc.send_signal(signal.SIGTERM)
        for sup in supervisors:
            sup.stop(float(env["SHUTDOWN_TIMEOUT_SECONDS"]) + 5)
    with engine.connect() as conn:
        done, claims, unclaimed = conn.execute(
            text(
                "SELECT count(*) FILTER (WHERE status = 'completed' "
                "                        AND finished_at > :start AND finished_at <= :end), "
                "       count(DISTINCT started_at) FILTER (WHERE started_at > :start "
                "                                          AND started_at <= :end), "
                "       count(*) FILTER (WHERE started_at IS NULL OR started_at > :end) "
                "FROM tasks"
            ),
            {"start": window.start, "end": window.end},
        ).one()
    return Run(
        "fairq", shape, int(done), int(claims), window.seconds, seeded, unclaimed == 0,
        window.cpu, window.waits, window.proxy, busy,
    )  # fmt: skip


# -- pgqueuer ------------------------------------------------------------------------------


async def _pgqueuer_queries(dsn: str) -> tuple[Queries, Any]:
    """pgqueuer's Queries over a new asyncpg connection (autocommit, as pgqueuer requires)."""
    import asyncpg
    from pgqueuer import Queries
    from pgqueuer.db import AsyncpgDriver

    connection = await asyncpg.connect(
        dsn=dsn, server_settings={"application_name": PGQUEUER_APPLICATION_NAME}
    )
    return Queries(AsyncpgDriver(connection)), connection


async def _pgqueuer_seed(dsn: str, count: int) -> str:
    """Install pgqueuer's schema if missing, empty its tables, enqueue `count` jobs.

    Returns the name of its log table.
    """
    queries, connection = await _pgqueuer_queries(dsn)
    try:
        if not await queries.schema_is_installed():
            await queries.install()
        settings = queries.qbe.settings
        tables = ", ".join(
            (settings.queue_table, settings.queue_table_log, settings.statistics_table)
        )
        await queries.driver.execute(f"TRUNCATE {tables}")
        await queries.driver.execute(f"VACUUM ANALYZE {tables}")
        await queries.enqueue([PGQUEUER_ENTRYPOINT] * count, [None] * count, [0] * count)
        await queries.driver.execute(f"ANALYZE {settings.queue_table}")
        return str(settings.queue_table_log)
    finally:
        await connection.close()


async def _pgqueuer_worker(dsn: str, batch: int, threads: int, status_fd: int) -> None:
    """One pgqueuer worker: connect, run from SIGUSR1 until SIGTERM.

    Writes `r` on `status_fd` once connected, `s` when it starts its first job.
    """
    from pgqueuer import QueueManager
    from pgqueuer.models import Job

    queries, connection = await _pgqueuer_queries(dsn)
    manager = QueueManager(queries)
    # Per process: pgqueuer's concurrency_limit would apply to the whole cluster.
    gate = asyncio.Lock() if threads == 1 else asyncio.Semaphore(threads)

    started = False

    async def sleep(job: Job) -> None:
        """Sleep 20 ms, as fairq's `sleep` task, at most `threads` at once in this process."""
        nonlocal started
        if not started:
            started = True
            os.write(status_fd, b"s")
            os.close(status_fd)
        async with gate:
            await asyncio.sleep(HANDLER_SECONDS)

    # Called, not applied as a decorator: without the bench extra pgqueuer's types are Any.
    manager.entrypoint(PGQUEUER_ENTRYPOINT)(sleep)

    go = asyncio.Event()

    def stop() -> None:
        manager.shutdown.set()
        go.set()

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, go.set)
    loop.add_signal_handler(signal.SIGTERM, stop)
    os.write(status_fd, b"r")
    await go.wait()
    try:
        if not manager.shutdown.is_set():
            await manager.run(batch_size=batch, max_concurrent_tasks=2 * max(batch, threads))
    finally:
        with contextlib.suppress(Exception):
            await connection.close()


def _run_loop(coroutine: Coroutine[Any, Any, None]) -> None:
    try:
        import uvloop  # a dependency of pgqueuer; its own benchmark runs on it
    except ImportError:
        asyncio.run(coroutine)
    else:
        uvloop.run(coroutine)


def _stop_children(pids: Sequence[int], grace: float) -> None:
    """SIGTERM these children, reap them, SIGKILL those left after `grace` seconds."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    alive = set(pids)
    while alive:
        pid, _ = os.waitpid(-1, os.WNOHANG)
        if pid:
            alive.discard(pid)
        elif time.monotonic() > deadline:
            for pid in alive:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            deadline = math.inf
        else:
            time.sleep(0.05)


def _read_bytes(fd: int, count: int, timeout: float) -> int:
    """Read up to `count` bytes from `fd` within `timeout` seconds; return how many came."""
    got, deadline = 0, time.monotonic() + timeout
    while got < count:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            break
        data = os.read(fd, count - got)
        if not data:  # every worker has exited
            break
        got += len(data)
    return got


def pgqueuer_host(url: str, children: int, batch: int, threads: int) -> int:
    """One pgqueuer "host" (`--pgqueuer-host`): fork `children` workers and drive them.

    Prints `ready <pid>...` once every worker is connected; `go` on stdin starts them
    (SIGUSR1), and it prints `started <n>` once each has started a job (n: how many had
    after a minute); `stop` or EOF stops them (SIGTERM, SIGKILL after 2 s); prints `stopped`.
    """
    dsn = libpq_url(url)
    import pgqueuer  # noqa: F401  (imported once here, before the fork, not in every worker)

    status_read, status_write = os.pipe()
    pids: list[int] = []
    for _ in range(children):
        pid = os.fork()
        if pid == 0:
            os.close(status_read)
            code = 1
            try:
                _run_loop(_pgqueuer_worker(dsn, batch, threads, status_write))
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    os.close(status_write)
    ready = _read_bytes(status_read, children, timeout=120)
    if ready == children:
        print("ready", *pids, flush=True)
        if sys.stdin.readline().strip() == "go":
            for pid in pids:
                os.kill(pid, signal.SIGUSR1)
            print("started", _read_bytes(status_read, children, timeout=60), flush=True)
            sys.stdin.readline()  # "stop", or EOF
    # Not drained: what they do after the window is not measured, and the next run empties
    # the tables. A short grace, then SIGKILL.
    _stop_children(pids, grace=2.0)
    print("stopped", flush=True)
    return 0 if ready == children else 1


def run_pgqueuer(bench: Bench, shape: Shape, workdir: Path) -> Run:
    """Seed pgqueuer's queue, start the shape's hosts, start them together, measure."""
    args = bench.args
    assert bench.pgqueuer_url is not None
    assert bench.pgqueuer_worker_url is not None
    dsn = libpq_url(bench.pgqueuer_url)
    seeded = bench.seed_count(shape)
    prepare_server(bench.clock)
    log_table = asyncio.run(_pgqueuer_seed(dsn, seeded))
    workdir.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable, "-m", "scripts.bench_scaling", "--pgqueuer-host",
        "--children", str(shape.children), "--batch", str(shape.batch),
        "--pgqueuer-threads", str(shape.threads), "--database-url", bench.pgqueuer_worker_url,
    ]  # fmt: skip
    hosts: list[subprocess.Popen[str]] = []

    def tell(line: str) -> None:
        for proc in hosts:
            assert proc.stdin is not None
            proc.stdin.write(line + "\n")
            proc.stdin.flush()

    def hear(word: str, timeout: float = 120) -> list[str]:
        answers, deadline = [], time.monotonic() + timeout
        for proc in hosts:
            assert proc.stdout is not None
            # One line per word: nothing waits in the pipe's buffer beyond it.
            readable, _, _ = select.select(
                [proc.stdout], [], [], max(0.0, deadline - time.monotonic())
            )
            answer = proc.stdout.readline().split() if readable else []
            if not answer or answer[0] != word:
                logs = "\n".join(p.read_text()[-1500:] for p in workdir.glob("host*.log"))
                raise RuntimeError(f"a pgqueuer host did not say {word!r}:\n{logs}")
            answers.extend(answer[1:])
        return answers

    try:
        for h in range(shape.hosts):
            with (workdir / f"host{h}.log").open("w") as err:
                proc = subprocess.Popen(
                    argv, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                    text=True, start_new_session=True,
                )  # fmt: skip
                hosts.append(proc)
        pids = [proc.pid for proc in hosts] + [int(p) for p in hear("ready")]
        busy = wait_idle(args.idle_timeout)
        tell("go")
        # The warm-up starts once every worker has run a job: a pgqueuer worker checks its
        # schema and starts listening when it starts running (fairq's children did so before
        # the tasks came).
        idle_workers = shape.processes - sum(int(n) for n in hear("started"))
        window = bench.measure(pids, PGQUEUER_APPLICATION_NAME)
        tell("stop")
        hear("stopped")
    finally:
        for proc in hosts:
            if proc.poll() is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(35)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FILTER (WHERE status = 'successful' AND in_window), "
            "       count(DISTINCT created) FILTER (WHERE status = 'picked' AND in_window), "
            "       count(DISTINCT job_id) FILTER (WHERE status = 'picked' AND created <= %(end)s) "
            "FROM (SELECT *, created > %(start)s AND created <= %(end)s AS in_window "
            f"      FROM {log_table}) log",
            {"start": window.start, "end": window.end},
        ).fetchone()
    assert row is not None
    done, claims, picked = (int(str(v)) for v in row)
    return Run(
        "pgqueuer", shape, done, claims, window.seconds, seeded, picked >= seeded,
        window.cpu, window.waits, window.proxy, busy, idle_workers,
    )  # fmt: skip


# -- the whole benchmark -------------------------------------------------------------------


def _median(values: Iterator[float]) -> float:
    return statistics.median(list(values))


def _median_cores(results: Sequence[Run], name: str) -> str:
    values = [getattr(r.cpu, name) for r in results]
    return "?" if None in values else f"{statistics.median(values):.2f}"


def summarize(
    shapes: Sequence[Shape], runs: Mapping[tuple[str, Shape], list[Run]], sides: Sequence[str]
) -> list[str]:
    """Two tables of medians per shape: rates and the ratio, then lock waits and CPU."""
    both = len(sides) == 2
    lines = ["", "| shape | ideal |" + "".join(f" {s} tasks/s | {s} claims/s |" for s in sides)]
    lines[-1] += " fairq / pgqueuer |" if both else ""
    lines.append("|---" * (2 + 2 * len(sides) + both) + "|")
    for shape in shapes:
        row = f"| {shape} | {shape.ideal:,.0f} |"
        rates = {}
        for side in sides:
            results = runs[side, shape]
            rates[side] = _median(r.rate for r in results)
            flags = "*" if any(r.ran_out for r in results) else ""
            flags += "!" if any(r.busy_before is not None for r in results) else ""
            row += (
                f" {rates[side]:,.0f}{flags} ({100 * _median(r.of_ideal for r in results):.0f}%) "
                f"| {_median(r.claims_per_second for r in results):,.0f} |"
            )
        if both:
            row += f" x{rates['fairq'] / rates['pgqueuer']:.2f} |" if rates["pgqueuer"] else " - |"
        lines.append(row)
    lines.append("(%: of the ideal; *: ran out of tasks, a lower bound; !: box busy before a run)")
    lines.append("")
    lines.append(
        "| shape | side | lock waits per sample | top waits | workers | PostgreSQL | proxy "
        "| bench | other | idle | ping under load | proxy late mean/p99 |"
    )
    lines.append("|---" * 12 + "|")
    for shape in shapes:
        for side in sides:
            results = runs[side, shape]
            middle = sorted(results, key=lambda r: r.rate)[len(results) // 2]
            busy = _median(r.waits.busy for r in results)
            advisory = _median(r.waits.advisory for r in results)
            other = _median(r.waits.other_locks for r in results)
            share = (advisory + other) / busy if busy else 0.0
            pings = [r.waits.ping_ms for r in results if r.waits.ping_ms is not None]
            late = [r.proxy for r in results if r.proxy is not None]
            cores = " | ".join(
                _median_cores(results, name)
                for name in ("worker", "postgres", "proxy", "bench", "other", "idle")
            )
            lines.append(
                f"| {shape} | {side} | adv {advisory:.1f} + other {other:.1f} of {busy:.1f} busy "
                f"({100 * share:.0f}%) | {middle.waits.describe_top()} | {cores} "
                f"| {f'{statistics.median(pings):.2f} ms' if pings else '-'} | "
                + (
                    f"{_median(p.late_mean_us for p in late):.0f}/"
                    f"{_median(p.late_p99_us for p in late):.0f} us |"
                    if late
                    else "- |"
                )
            )
    lines.append("(CPU in cores; top waits: of the run with the median rate)")
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(
        prog="python -m scripts.bench_scaling", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--rtt-ms", type=float, default=0.0, help="added round trip (proxy D = X/2)"
    )
    parser.add_argument(
        "--proxy", action="store_true", help="keep the proxy in the path at --rtt-ms 0 (its cost)"
    )
    parser.add_argument("--shapes", help="[<hosts>h]<children>x<batch>[x<threads>],...")
    parser.add_argument("--threads", default="1,8", help="thread counts of shapes without one")
    parser.add_argument("--runs", type=int, default=3, help="rounds (runs per shape and side)")
    parser.add_argument("--companies", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=5.0, help="measured window per run")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds before the window")
    parser.add_argument("--max-tasks", type=int, default=40_000, help="tasks seeded at most")
    parser.add_argument("--sample-ms", type=float, default=10.0, help="pg_stat_activity period")
    parser.add_argument(
        "--idle-timeout", type=float, default=30.0, help="seconds to wait for an idle box"
    )
    parser.add_argument("--no-pgqueuer", action="store_true", help="skip the pgqueuer side")
    parser.add_argument("--pgqueuer-host", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--children", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--pgqueuer-threads", type=int, default=1, help=argparse.SUPPRESS)
    add_database_arguments(parser)
    args = parser.parse_args(argv)
    if args.pgqueuer_host:
        return args
    try:
        threads = [int(n) for n in str(args.threads).split(",") if n.strip()]
        args.shape_list = (
            parse_shapes(args.shapes, threads) if args.shapes else default_shapes(threads)
        )
    except (argparse.ArgumentTypeError, ValueError) as exc:
        parser.error(str(exc))
    if args.rtt_ms < 0 or args.runs < 1 or args.seconds <= 0 or args.warmup < 0:
        parser.error("--rtt-ms and --warmup must be >= 0, --runs >= 1, --seconds > 0")
    return args


@contextlib.contextmanager
def maybe_proxy(url: str, args: argparse.Namespace) -> Iterator[delay_proxy.RunningProxy | None]:
    """The delay proxy to `url`'s server when the options ask for one, else None."""
    if args.rtt_ms == 0 and not args.proxy:
        yield None
        return
    parsed = make_url(url)
    target = (parsed.host or "127.0.0.1", parsed.port or 5432)
    with delay_proxy.running(target, args.rtt_ms / 2) as proxy:
        yield proxy


def through(url: str, proxy: delay_proxy.RunningProxy | None) -> str:
    """`url` with the proxy's address instead of the server's (unchanged without a proxy)."""
    if proxy is None:
        return url
    return make_url(url).set(host=proxy.host, port=proxy.port).render_as_string(hide_password=False)


def check_connections(url: str, shapes: Sequence[Shape]) -> None:
    """Refuse shapes the server has too few connections for, before any run."""
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        row = conn.execute("SHOW max_connections").fetchone()
    assert row is not None
    available = int(str(row[0])) - 10  # room for the benchmark's own and superusers'
    # Two per fairq child; pgqueuer's workers hold one each, and the sides never run together.
    needed = max(2 * s.processes for s in shapes)
    if needed > available:
        raise SystemExit(
            f"the server allows {available + 10} connections, a shape needs {needed} + 10: "
            "raise max_connections, or leave out --database-url (the embedded server has "
            f"{MAX_CONNECTIONS})"
        )


def main(argv: list[str] | None = None) -> int:
    """Run every shape `--runs` times, both sides alternating, and print the medians."""
    args = parse_args(argv)
    if args.pgqueuer_host:
        return pgqueuer_host(args.database_url, args.children, args.batch, args.pgqueuer_threads)
    shapes: list[Shape] = args.shape_list
    skip = "skipped (--no-pgqueuer)" if args.no_pgqueuer else pgqueuer_missing()
    sides = ["fairq"] if skip else ["fairq", "pgqueuer"]
    if skip:
        print(f"pgqueuer side: {skip}", flush=True)
    if any(s.threads > 1 for s in shapes) and not worker_reads_threads():
        print(
            "note: this worker has no WORKER_THREADS setting: its children run one task at a "
            "time whatever the shape's threads (the ideal still counts them)",
            flush=True,
        )
    # Seeding, start-up (a tenth of a second per worker process) and stopping, roughly.
    seconds = sum(args.warmup + args.seconds + 8 + 0.1 * s.processes for s in shapes)
    print(
        f"{len(shapes)} shapes x {len(sides)} sides x {args.runs} runs: about "
        f"{math.ceil(seconds * len(sides) * args.runs / 60)} min on an idle box (a busy one "
        f"adds up to --idle-timeout per run); load average {os.getloadavg()[0]:.2f} on "
        f"{os.cpu_count()} cores",
        flush=True,
    )
    options = {"max_connections": str(MAX_CONNECTIONS)}
    if args.fast_commit:
        options["synchronous_commit"] = "off"
    results: dict[tuple[str, Shape], list[Run]] = {(s, p): [] for s in sides for p in shapes}
    with (
        stack.database(args.database_url, "bench-scaling", options=options, empty=False) as url,
        tempfile.TemporaryDirectory(prefix="fairq-bench-scaling-") as tmp,
        maybe_proxy(url, args) as proxy,
    ):
        check_connections(url, shapes)
        pgqueuer_url = None
        if not skip:
            parsed = make_url(url)
            pgqueuer_url = parsed.set(database=f"{parsed.database}_pgqueuer").render_as_string(
                hide_password=False
            )
            stack.ensure_database(pgqueuer_url)
        direct = ping(libpq_url(url))
        line = f"SELECT 1 round trip: direct {direct[0]:.2f} ms (p99 {direct[1]:.2f})"
        if proxy is not None:
            proxied = ping(libpq_url(through(url, proxy)))
            line += (
                f", through the proxy (D = {args.rtt_ms / 2:g} ms) {proxied[0]:.2f} ms "
                f"(p99 {proxied[1]:.2f})"
            )
        print(line, flush=True)
        bench = Bench(
            args, url, engine_for(url), through(url, proxy), pgqueuer_url,
            None if pgqueuer_url is None else through(pgqueuer_url, proxy), proxy, Path(tmp),
        )  # fmt: skip
        try:
            for run in range(1, args.runs + 1):
                for shape in shapes:
                    for side in sides:
                        workdir = bench.workdir / f"{run}-{shape}-{side}"
                        runner = run_fairq if side == "fairq" else run_pgqueuer
                        result = runner(bench, shape, workdir)
                        results[side, shape].append(result)
                        print(f"run {run} {shape} {side}: {result.describe()}", flush=True)
        finally:
            bench.engine.dispose()
            bench.clock.close()
    rtt = f"+{args.rtt_ms:g} ms round trip" if proxy is not None else "no proxy"
    if proxy is not None and args.rtt_ms == 0:
        rtt = "proxy at D = 0"
    print(
        f"\n{rtt}; 20 ms sleep tasks over {args.companies} companies; window {args.seconds:g} s "
        f"after {args.warmup:g} s; {args.runs} run(s) per shape and side"
    )
    print("\n".join(summarize(shapes, results, sides)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
