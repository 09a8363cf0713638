"""Noisy neighbour: one company floods, many trickle; waits and weighted shares, side by side.

What: the fairness the claim buys, measured end to end through the real API and the real
worker supervisor, against a plain oldest-first queue run on the same workload and machine.

How: PostgreSQL (`--database-url`, else an embedded PostgreSQL 16 in `.pgdata/fairness`),
migrated; the API under gunicorn (`deploy/gunicorn.conf.py`, LOG_LEVEL `--log-level`). Each
side ("fairq": `python -m worker` with `--children` children and WORKER_BATCH_SIZE
`--batch-size`; "oldest-first": as many forked processes of a minimal worker loop defined
here, which claims `--batch-size` pending tasks globally in `run_after, id` order with
`FOR UPDATE SKIP LOCKED` (over an index of its own on pending `(run_after, id)`, created for
its side only), sets the columns the real claim and completion set, and runs `noop` and
`sleep` itself) runs two phases, each on emptied tables:

1. Weighted shares. Three companies get weights 1, 2 and 4 (`PATCH /companies/{id}`; if
   that answers 404 or 405, by SQL, and the output says so), then `--share-backlog` `noop`
   tasks each, created through the API interleaved across the three, before the workers
   start. Then the workers drain them. Each company's share of the first
   `--share-window` claimed tasks (by `started_at`; the whole last claim is included, since
   a claim gives its batch one `started_at`) is printed against the ideal 1/7, 2/7, 4/7,
   with the deviation in percent of the ideal.
2. Flood. With the workers running, a flooder company creates `--flood` `sleep` tasks of
   `--flood-sleep` seconds as fast as `--flood-clients` keep-alive client threads can (or
   at `--flood-rate`) (through `POST /companies/{id}/task-batches` when the API has it, else one
   `POST /companies/{id}/tasks` each; a probe decides and the output says which), while
   `--quiet` companies create `noop` tasks in turn at `--quiet-rate` tasks/s in total on an
   absolute schedule, until the flood has been created and fully claimed. The flood's tasks
   sleep so that the workers drain slower than the API creates (2 children x 1/0.02 s is
   at most 100 tasks/s; the API creates 200 to 350 a second on a 2-core box): the
   flooder's backlog exists while the quiet companies trickle. Its peak is printed; a flood
   that never backed up measures nothing. When everything has started, the wait
   `started_at - created_at` of every task (database clock: the API transaction's start to
   the claim) gives p50/p95/p99 for the flooder and for the quiet companies. Since a
   batch's tasks run one after another, a quiet task claimed in the same batch as flood
   tasks starts when the claim does, so the best a fair claim can give a quiet company is
   about one batch's run time (here 100 x 0.02 s) divided among the children.

Prints each phase's facts as it goes (creation and drain rates, peak backlog, non-2xx
answers, CPU cores used by the clients, the API, the workers, PostgreSQL when it runs on this
machine, and the whole machine), then one table: flooder and quiet waits and the three
shares, for fairq and for oldest-first, and their ratio (fairq / oldest-first); with
`--runs` > 1, the medians. No timing is asserted. The clients share the machine with
the system under test. A fair claim is work-conserving: the flooder's waits depend on its
own backlog, so on how fast the API created the flood on that side; compare them across
sides only when the printed creation rates match, or pin the rate with `--flood-rate`.
`--quick` (2,000 flood tasks, 20 quiet companies at 10/s, backlogs of 600) takes about a
minute; the full size, bound by how fast the API creates 50,000 tasks one request at a time
and by the drain, takes about 10 minutes per side. Everything listens on 127.0.0.1; each
wait is bounded by `--timeout` (unfinished tasks are reported, not waited for; the exit
status is then 1), and every process started is stopped at the end.

Usage (from the repository root):
    .venv/bin/python -m scripts.bench_fairness [--quick] [--flood 50000] [--quiet 200]
        [--quiet-rate 20] [--flood-sleep 0.02] [--flood-clients 8] [--flood-rate 0]
        [--share-backlog 3000] [--share-window 3000] [--children 2] [--batch-size 100] [--runs 1]
        [--sides fairq,oldest-first] [--timeout 900] [--log-level WARNING]
        [--database-url postgresql+psycopg://postgres@127.0.0.1:5432/fairq_bench_fairness]
"""

from __future__ import annotations

import argparse
import collections
import math
import multiprocessing
import multiprocessing.synchronize
import secrets
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import psycopg
import requests
from sqlalchemy import Engine, text
from sqlalchemy.engine import make_url

from devtools import stack
from scripts import load

FAIRQ = "fairq"
OLDEST_FIRST = "oldest-first"
SIDES = (FAIRQ, OLDEST_FIRST)
WEIGHTS = (1, 2, 4)
PERCENTILES = (0.50, 0.95, 0.99)
REQUEST_TIMEOUT_SECONDS = 30.0
# Tasks per request on the batch-create endpoint, when the API has one.
BATCH_CREATE_SIZE = 100
# How often the main loop samples the backlog and checks the workers.
SAMPLE_SECONDS = 0.5
# Full-size and --quick defaults of the sizes (an option given explicitly wins).
FULL = {
    "flood": 50_000,
    "quiet": 200,
    "quiet_rate": 20.0,
    "share_backlog": 3000,
    "share_window": 3000,
    "timeout": 900.0,
}
QUICK = {
    "flood": 2000,
    "quiet": 20,
    "quiet_rate": 10.0,
    "share_backlog": 600,
    "share_window": 600,
    "timeout": 120.0,
}
# The oldest-first reference's own index (a real oldest-first queue would have one), created
# for its side only and dropped afterwards; dropped at start too, after an interrupted run.
OLDEST_FIRST_INDEX = "bench_fairness_oldest_first"


class BenchError(RuntimeError):
    """The benchmark cannot go on (a worker died, the API refused, a client thread failed)."""


# -- the database ----------------------------------------------------------------------------


def reset(engine: Engine, url: str) -> None:
    """Empty the tables (`stack.empty_tables`) and refresh statistics: phases start alike."""
    stack.empty_tables(url)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE tasks, companies"))


def set_oldest_first_index(engine: Engine, present: bool) -> None:
    """Create or drop the oldest-first reference's index on pending tasks."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        if present:
            conn.execute(
                text(
                    f"CREATE INDEX IF NOT EXISTS {OLDEST_FIRST_INDEX} ON tasks (run_after, id) "
                    "WHERE status = 'pending'"
                )
            )
        else:
            conn.execute(text(f"DROP INDEX IF EXISTS {OLDEST_FIRST_INDEX}"))


def pending(engine: Engine, company_id: str | None = None) -> int:
    """Pending tasks of `company_id`, or of everyone."""
    with engine.connect() as conn:
        if company_id is None:
            query = text("SELECT count(*) FROM tasks WHERE status = 'pending'")
            return int(conn.execute(query).scalar_one())
        query = text(
            "SELECT count(*) FROM tasks WHERE status = 'pending' "
            "AND company_id = CAST(:company AS uuid)"
        )
        return int(conn.execute(query, {"company": company_id}).scalar_one())


@dataclass(frozen=True)
class Waits:
    """created-to-started waits (seconds) of one group of tasks."""

    started: int
    not_started: int
    p50: float
    p95: float
    p99: float


def waits(engine: Engine, company_ids: Sequence[str]) -> Waits:
    """p50/p95/p99 of `started_at - created_at` over the started tasks of these companies."""
    with engine.connect() as conn:
        row = conn.execute(
            text(
                "SELECT count(started_at), count(*) - count(started_at), "
                "       percentile_disc(CAST(:qs AS float8[])) WITHIN GROUP "
                "           (ORDER BY CAST(extract(epoch FROM started_at - created_at) AS float8)) "
                "FROM tasks WHERE company_id = ANY(CAST(:companies AS uuid[]))"
            ),
            {"qs": list(PERCENTILES), "companies": list(company_ids)},
        ).one()
    values = list(row[2] or [math.nan] * len(PERCENTILES))
    return Waits(int(row[0]), int(row[1]), *(float(v) for v in values))


def drain_rate(engine: Engine, company_id: str) -> float:
    """Tasks of `company_id` per second between its first start and its last finish."""
    with engine.connect() as conn:
        row = conn.execute(
            text(
                "SELECT count(*), extract(epoch FROM max(finished_at) - min(started_at)) "
                "FROM tasks WHERE company_id = CAST(:company AS uuid) AND finished_at IS NOT NULL"
            ),
            {"company": company_id},
        ).one()
    return int(row[0]) / float(row[1]) if row[1] else math.nan


def window_counts(engine: Engine, window: int) -> tuple[dict[str, int], int]:
    """Tasks claimed per company among the first `window` by `started_at`; and the window.

    A claim gives its whole batch one `started_at`, so the claim that holds the
    `window`-th task counts whole: the window returned may be slightly larger.
    """
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "WITH edge AS (SELECT started_at FROM tasks WHERE started_at IS NOT NULL "
                "              ORDER BY started_at, id OFFSET :skip LIMIT 1) "
                "SELECT CAST(company_id AS text), count(*) FROM tasks "
                "WHERE started_at <= (SELECT started_at FROM edge) GROUP BY company_id"
            ),
            {"skip": window - 1},
        ).all()
    counts = {str(company): int(n) for company, n in rows}
    return counts, sum(counts.values())


# -- the API ---------------------------------------------------------------------------------


@dataclass
class Api:
    """The running API: its URL, the admin token, and how tasks and weights get there."""

    base_url: str
    admin_token: str
    batch_create: bool = False
    notes: list[str] = field(default_factory=list)

    def create_companies(self, count: int, prefix: str) -> list[stack.Company]:
        """`count` new companies (admin)."""
        return stack.create_companies(self.base_url, self.admin_token, count, prefix)

    def set_weight(self, engine: Engine, company: stack.Company, weight: int) -> str:
        """Give `company` this weight; return how ("PATCH" or why SQL was used)."""
        response = requests.patch(
            f"{self.base_url}/companies/{company.id}",
            json={"weight": weight},
            headers={"Authorization": f"Bearer {self.admin_token}"},
            timeout=REQUEST_TIMEOUT_SECONDS,
        )
        if response.status_code in (404, 405):
            with engine.begin() as conn:
                conn.execute(
                    text("UPDATE companies SET weight = :w WHERE id = CAST(:id AS uuid)"),
                    {"w": weight, "id": company.id},
                )
            return f"SQL UPDATE (PATCH /companies/{{id}} answered {response.status_code})"
        if response.status_code != 200:
            raise BenchError(
                f"PATCH /companies/{{id}} answered {response.status_code}: {response.text[:300]}"
            )
        return "PATCH /companies/{id}"

    def probe_batch_create(self, company: stack.Company) -> None:
        """Find out whether `POST /companies/{id}/task-batches` exists; remember and say so."""
        response = requests.post(
            f"{self.base_url}/companies/{company.id}/task-batches",
            json={"tasks": [{"type": "noop", "payload": {}}]},
            headers={"Authorization": f"Bearer {company.api_key}"},
            timeout=REQUEST_TIMEOUT_SECONDS,
        )
        self.batch_create = response.status_code in (200, 201)
        if self.batch_create:
            how = f"POST /companies/{{id}}/task-batches, {BATCH_CREATE_SIZE} tasks per request"
        else:
            how = (
                "POST /companies/{id}/tasks, one task per request (task-batches answered "
                f"{response.status_code})"
            )
        self.notes.append(f"tasks created with {how}")


class Statuses:
    """Non-2xx answers and client errors seen by a group of threads (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: collections.Counter[str] = collections.Counter()

    def add(self, status: str) -> None:
        """Count one bad answer."""
        with self._lock:
            self.counts[status] += 1

    def describe(self) -> str:
        """'none', or 'status x count, ...'."""
        if not self.counts:
            return "none"
        return ", ".join(f"{status} x{n}" for status, n in sorted(self.counts.items()))


def post_tasks(
    session: requests.Session,
    api: Api,
    company: stack.Company,
    body: dict[str, Any],
    *,
    count: int,
    statuses: Statuses,
) -> int:
    """Create `count` tasks of `company` in one request (batch) or `count` single ones.

    Returns how many were created; failures are counted in `statuses`, not retried.
    """
    headers = {"Authorization": f"Bearer {company.api_key}"}
    requests_to_send: list[tuple[str, object, int]]
    if api.batch_create:
        url = f"{api.base_url}/companies/{company.id}/task-batches"
        requests_to_send = [(url, {"tasks": [body] * count}, count)]
    else:
        url = f"{api.base_url}/companies/{company.id}/tasks"
        requests_to_send = [(url, body, 1)] * count
    created = 0
    for target, payload, tasks in requests_to_send:
        try:
            response = session.post(
                target, json=payload, headers=headers, timeout=REQUEST_TIMEOUT_SECONDS
            )
        except requests.RequestException as exc:
            statuses.add(type(exc).__name__)
            continue
        if response.status_code in (200, 201):
            created += tasks
        else:
            statuses.add(str(response.status_code))
    return created


class Creator:
    """Client threads that create `total` tasks in chunks, as fast as they can or at `rate`.

    `pick(n)` names the company and body of the n-th chunk: one company for a flood, or
    the companies in turn for the interleaved backlogs of the shares phase. With a `rate`
    (tasks per second), the task numbered k is sent no earlier than start + k / rate.
    """

    def __init__(
        self,
        api: Api,
        total: int,
        clients: int,
        pick: Callable[[int], tuple[stack.Company, dict[str, Any]]],
        rate: float | None = None,
    ) -> None:
        self.api = api
        self.total = total
        self.pick = pick
        self.rate = rate
        self.chunk = BATCH_CREATE_SIZE if api.batch_create else 1
        self.statuses = Statuses()
        self.created = 0
        self.started = 0.0
        self.seconds = 0.0
        self._next = 0
        self._lock = threading.Lock()
        self._errors: list[BaseException] = []
        self._threads = [
            threading.Thread(target=self._work, name=f"creator-{n}") for n in range(clients)
        ]
        self._done = threading.Event()

    def start(self) -> None:
        """Start every client thread."""
        self.started = time.monotonic()
        for thread in self._threads:
            thread.start()

    def done(self) -> bool:
        """True once every client thread has finished."""
        return not any(thread.is_alive() for thread in self._threads)

    def join(self) -> None:
        """Wait for the threads; raise what one of them raised."""
        for thread in self._threads:
            thread.join()
        if self._errors:
            raise BenchError(f"a client thread failed: {self._errors[0]!r}") from self._errors[0]

    def stop(self) -> None:
        """Make the threads stop after their current request."""
        self._done.set()

    def _take(self) -> tuple[int, int] | None:
        with self._lock:
            if self._next >= self.total or self._done.is_set():
                return None
            start = self._next
            self._next = min(self.total, start + self.chunk)
            return start, self._next - start

    def _work(self) -> None:
        try:
            with requests.Session() as session:
                while (taken := self._take()) is not None:
                    start, count = taken
                    if self.rate:
                        due = self.started + start / self.rate
                        if self._done.wait(max(0.0, due - time.monotonic())):
                            return
                    company, body = self.pick(start // self.chunk)
                    made = post_tasks(
                        session, self.api, company, body, count=count, statuses=self.statuses
                    )
                    with self._lock:
                        self.created += made
                        self.seconds = time.monotonic() - self.started
        except BaseException as exc:  # reported by join(), not lost in the thread
            self._errors.append(exc)


class Trickle:
    """Quiet companies creating `noop` tasks in turn at `rate` per second in total.

    An absolute schedule (the n-th task at start + n / rate, for company n mod len), spread
    over a few threads so that one slow answer does not hold the others back; a thread that
    fell behind sends at once, and the largest lag is reported.
    """

    def __init__(self, api: Api, companies: list[stack.Company], rate: float) -> None:
        self.api = api
        self.companies = companies
        self.rate = rate
        self.threads = max(1, min(8, math.ceil(rate / 5)))
        self.statuses = Statuses()
        self.sent = 0
        self.max_lag = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._errors: list[BaseException] = []
        self._start = 0.0
        self._workers = [
            threading.Thread(target=self._work, args=(n,), name=f"trickle-{n}")
            for n in range(self.threads)
        ]

    def start(self) -> None:
        """Start sending."""
        self._start = time.monotonic()
        for thread in self._workers:
            thread.start()

    def stop(self) -> None:
        """Stop sending and wait for the threads; raise what one of them raised."""
        self._stop.set()
        for thread in self._workers:
            thread.join()
        if self._errors:
            raise BenchError(f"a trickle thread failed: {self._errors[0]!r}") from self._errors[0]

    def _work(self, offset: int) -> None:
        body = {"type": "noop", "payload": {}}
        try:
            with requests.Session() as session:
                n = offset
                while True:
                    due = self._start + n / self.rate
                    if self._stop.wait(max(0.0, due - time.monotonic())):
                        return
                    lag = time.monotonic() - due
                    company = self.companies[n % len(self.companies)]
                    made = post_tasks(
                        session, self.api, company, body, count=1, statuses=self.statuses
                    )
                    with self._lock:
                        self.sent += made
                        self.max_lag = max(self.max_lag, lag)
                    n += self.threads
        except BaseException as exc:  # reported by stop(), not lost in the thread
            self._errors.append(exc)


# -- the workers -----------------------------------------------------------------------------


class Workers(Protocol):
    """A running set of worker processes."""

    def check(self) -> None:
        """Raise `BenchError` if one of them died."""

    def cpu_seconds(self) -> float | None:
        """CPU seconds they used so far (None: unknown)."""

    def log_tail(self) -> str:
        """The end of what they logged ('' when they log nothing)."""


@dataclass
class RealWorkers:
    """The real supervisor."""

    sup: stack.WorkerSupervisor

    def check(self) -> None:
        """Raise if the supervisor exited."""
        if not self.sup.running():
            raise BenchError(f"the supervisor exited:\n{self.sup.log()[-3000:]}")

    def log_tail(self) -> str:
        """The end of the supervisor's stderr."""
        return self.sup.log()[-3000:]

    def cpu_seconds(self) -> float | None:
        """The supervisor's and its live children's."""
        return load.tree_cpu_seconds(self.sup.pid) if self.sup.running() else None


@dataclass
class OldestFirstWorkers:
    """Forked processes running `oldest_first_loop`."""

    processes: Sequence[multiprocessing.process.BaseProcess]

    def check(self) -> None:
        """Raise if a process exited."""
        for process in self.processes:
            if not process.is_alive():
                raise BenchError(f"oldest-first worker exited with {process.exitcode}")

    def log_tail(self) -> str:
        """Nothing: they do not log."""
        return ""

    def cpu_seconds(self) -> float | None:
        """Every process's."""
        return sum(load.tree_cpu_seconds(p.pid) or 0.0 for p in self.processes if p.pid)


_OLDEST_FIRST_CLAIM = """
WITH picked AS (
    -- The whole queue in one line: oldest runnable first, whoever it belongs to.
    SELECT id FROM tasks
    WHERE status = 'pending' AND run_after <= now()
    ORDER BY run_after, id
    LIMIT %(batch_size)s
    FOR UPDATE SKIP LOCKED
)
UPDATE tasks t
SET status = 'processing',
    attempts = t.attempts + 1,
    lease_token = gen_random_uuid(),
    locked_by = %(worker_id)s,
    locked_at = statement_timestamp(),
    started_at = coalesce(t.started_at, statement_timestamp()),
    updated_at = statement_timestamp()
FROM picked
WHERE t.id = picked.id
RETURNING t.id, t.lease_token, t.type, t.payload
"""

_OLDEST_FIRST_COMPLETE = """
UPDATE tasks t
SET status = 'completed', finished_at = now(), updated_at = now(), last_error = NULL,
    lease_token = NULL, locked_by = NULL, locked_at = NULL
FROM unnest(%(ids)s::uuid[], %(tokens)s::uuid[]) AS held(id, token)
WHERE t.id = held.id AND t.status = 'processing' AND t.lease_token = held.token
"""


def oldest_first_loop(
    dsn: str, worker_id: str, batch_size: int, stop: multiprocessing.synchronize.Event
) -> None:
    """Claim oldest-first batches, run `noop`/`sleep`, complete; until `stop` is set.

    Runs in a forked process with its own connection. Idle, it waits for the API's NOTIFY
    at most 50 ms (one lost while a claim runs costs no more than that).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us through `stop`
    with psycopg.connect(dsn, autocommit=True, application_name="fairq-bench-oldest") as conn:
        conn.execute("LISTEN fairq_tasks")
        while not stop.is_set():
            with conn.transaction():
                rows = conn.execute(
                    _OLDEST_FIRST_CLAIM, {"batch_size": batch_size, "worker_id": worker_id}
                ).fetchall()
            if not rows:
                for _ in conn.notifies(timeout=0.05, stop_after=1):
                    pass
                continue
            for _task_id, _token, task_type, payload in rows:
                if task_type == "sleep":
                    time.sleep(float(payload["seconds"]))
            with conn.transaction():
                conn.execute(
                    _OLDEST_FIRST_COMPLETE,
                    {"ids": [r[0] for r in rows], "tokens": [r[1] for r in rows]},
                )


@contextmanager
def oldest_first_workers(url: str, processes: int, batch_size: int) -> Iterator[Workers]:
    """Run `processes` forked `oldest_first_loop`s until the block ends."""
    dsn = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    context = multiprocessing.get_context("fork")
    stop = context.Event()
    started = [
        context.Process(
            target=oldest_first_loop,
            args=(dsn, f"oldest-first-{n}", batch_size, stop),
            name=f"oldest-first-{n}",
            daemon=True,
        )
        for n in range(processes)
    ]
    for process in started:
        process.start()
    try:
        yield OldestFirstWorkers(started)
    finally:
        stop.set()
        for process in started:
            process.join(stack.STOP_GRACE_SECONDS)
            if process.is_alive():
                process.kill()
                process.join(10)


@contextmanager
def workers(side: str, url: str, workdir: Path, args: argparse.Namespace) -> Iterator[Workers]:
    """The side's workers, running until the block ends."""
    if side == FAIRQ:
        env = {"WORKER_BATCH_SIZE": str(args.batch_size), "LOG_LEVEL": args.log_level}
        with stack.supervisor(url, workdir, concurrency=args.children, env=env) as sup:
            yield RealWorkers(sup)
    else:
        with oldest_first_workers(url, args.children, args.batch_size) as pool:
            yield pool


# -- the phases ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bench:
    """What every phase works with: the database, the API and the options."""

    engine: Engine
    url: str
    api: Api
    args: argparse.Namespace
    server: stack.ManagedProcess
    postgres_pid: int | None


@dataclass
class SharesResult:
    """Phase 1: each weight's share of the window, and what happened."""

    shares: dict[int, float]
    window: int
    notes: list[str]


@dataclass
class FloodResult:
    """Phase 2: the waits of each group, and what happened."""

    flooder: Waits
    quiet: Waits
    notes: list[str]


def wait_until(
    done: Callable[[], bool], pool: Workers, deadline: float, what: str, every: float
) -> bool:
    """Poll `done` every `every` seconds; False when `deadline` passed first."""
    while not done():
        pool.check()
        if time.monotonic() > deadline:
            tail = pool.log_tail()
            print(f"  timed out waiting for {what}", flush=True)
            if tail:
                print(f"  the workers' log ends with:\n{tail}", flush=True)
            return False
        time.sleep(every)
    return True


def shares_phase(bench: Bench, side: str, workdir: Path) -> SharesResult:
    """Backlogs for weights 1, 2, 4 first, then drain; shares of the first claims."""
    engine, api, args = bench.engine, bench.api, bench.args
    reset(engine, bench.url)
    companies = api.create_companies(len(WEIGHTS), f"{side}-weight")
    how = {
        api.set_weight(engine, company, w) for company, w in zip(companies, WEIGHTS, strict=True)
    }
    body = {"type": "noop", "payload": {}}
    creator = Creator(
        api,
        args.share_backlog * len(WEIGHTS),
        args.flood_clients,
        lambda n: (companies[n % len(companies)], body),
    )
    creator.start()
    creator.join()
    notes = [
        f"weights set by {', '.join(sorted(how))}",
        f"backlogs: {creator.created} tasks created in {creator.seconds:.1f} s "
        f"({creator.created / creator.seconds:,.0f}/s), non-2xx: {creator.statuses.describe()}",
    ]
    started = time.monotonic()
    with workers(side, bench.url, workdir, args) as pool:
        wait_until(lambda: pending(engine) == 0, pool, started + args.timeout, "the backlogs", 0.1)
    counts, window = window_counts(engine, args.share_window)
    notes.append(f"drained in {time.monotonic() - started:.1f} s (worker start included)")
    per_weight = {w: counts.get(c.id, 0) for c, w in zip(companies, WEIGHTS, strict=True)}
    short = [w for w, n in per_weight.items() if n >= args.share_backlog]
    if short:
        notes.append(
            f"WARNING: weight {short} ran out of backlog inside the window: raise --share-backlog"
        )
    if not window:
        notes.append(f"WARNING: fewer than {args.share_window} tasks were claimed")
    return SharesResult(
        {w: n / window if window else math.nan for w, n in per_weight.items()}, window, notes
    )


def flood_phase(bench: Bench, side: str, workdir: Path) -> FloodResult:
    """The flood and the trickle at once, with the workers running; waits per group."""
    engine, api, args = bench.engine, bench.api, bench.args
    reset(engine, bench.url)
    (flooder,) = api.create_companies(1, f"{side}-flooder")
    quiet = api.create_companies(args.quiet, f"{side}-quiet")
    body = {"type": "sleep", "payload": {"seconds": args.flood_sleep}}
    creator = Creator(
        api, args.flood, args.flood_clients, lambda n: (flooder, body), args.flood_rate or None
    )
    trickle = Trickle(api, quiet, args.quiet_rate)
    peak = 0
    started = time.monotonic()
    deadline = started + args.timeout
    with workers(side, bench.url, workdir, args) as pool:
        meter = cpu_meter(bench, pool)
        meter.start()
        # Threads only after the fork of the oldest-first workers.
        creator.start()
        trickle.start()
        try:

            def flood_claimed() -> bool:
                nonlocal peak
                backlog = pending(engine, flooder.id)
                peak = max(peak, backlog)
                return creator.done() and backlog == 0

            claimed = wait_until(
                flood_claimed, pool, deadline, "the flood to be claimed", SAMPLE_SECONDS
            )
            claimed_after = time.monotonic() - started
            cores = meter.stop(time.monotonic() - started)
        finally:
            creator.stop()
            creator.join()
            trickle.stop()
        wait_until(lambda: pending(engine) == 0, pool, deadline, "the quiet tasks", 0.1)
    flood_waits = waits(engine, [flooder.id])
    quiet_waits = waits(engine, [c.id for c in quiet])
    notes = [
        f"flood: {creator.created} sleep({args.flood_sleep:g} s) tasks created in "
        f"{creator.seconds:.1f} s ({creator.created / creator.seconds:,.0f}/s), drained at "
        f"{drain_rate(engine, flooder.id):,.0f}/s, peak backlog {peak:,}, "
        + ("all claimed" if claimed else "still not all claimed (timeout)")
        + f" {claimed_after:.1f} s after the start; non-2xx: {creator.statuses.describe()}",
        f"quiet: {trickle.sent} noop tasks from {len(quiet)} companies at "
        f"{args.quiet_rate:g}/s (largest lag behind schedule {1000 * trickle.max_lag:.0f} ms); "
        f"non-2xx: {trickle.statuses.describe()}",
    ]
    notes.append(
        "CPU cores used until the flood was claimed: "
        + ", ".join(f"{k} {'n/a' if v is None else f'{v:.2f}'}" for k, v in cores.items())
    )
    if peak < args.flood / 10:
        notes.append(
            f"WARNING: the flood hardly backed up (peak {peak}): raise --flood-sleep or --flood"
        )
    for name, group in (("flooder", flood_waits), ("quiet", quiet_waits)):
        if group.not_started:
            notes.append(f"WARNING: {group.not_started} {name} tasks never started (timeout)")
    return FloodResult(flood_waits, quiet_waits, notes)


def postmaster_of(engine: Engine) -> int | None:
    """The pid of the server's postmaster when it runs on this machine (a backend's parent)."""
    with engine.connect() as conn:
        backend = int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())
        try:
            stat = Path(f"/proc/{backend}/stat").read_text()
        except OSError:  # another machine, or another pid namespace
            return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def cpu_meter(bench: Bench, pool: Workers) -> load.CpuMeter:
    """CPU of the clients (this process), the API, the workers, PostgreSQL, the machine."""
    server = bench.server
    parts: dict[str, Callable[[], float | None]] = {
        "clients": time.process_time,
        "API": lambda: load.tree_cpu_seconds(server.pid) if server.running() else None,
        "workers": pool.cpu_seconds,
    }
    if bench.postgres_pid is not None:
        # With --database-url, the whole server: other databases' work counts too.
        name = "PostgreSQL (whole server)" if bench.args.database_url else "PostgreSQL"
        parts[name] = lambda: load.tree_cpu_seconds(bench.postgres_pid)
    parts["whole machine"] = load.machine_busy_seconds
    return load.CpuMeter(parts)


@dataclass
class SideResult:
    """Both phases of one side in one run."""

    shares: SharesResult
    flood: FloodResult

    @property
    def warned(self) -> bool:
        """True when a phase timed out or measured nothing meaningful."""
        return any(n.startswith("WARNING") for n in (*self.shares.notes, *self.flood.notes))


def run_side(bench: Bench, side: str, workdir: Path) -> SideResult:
    """Both phases for one side; the oldest-first index exists only meanwhile."""
    set_oldest_first_index(bench.engine, side == OLDEST_FIRST)
    try:
        shares = shares_phase(bench, side, workdir / "shares")
        for note in shares.notes:
            print(f"  shares: {note}", flush=True)
        flood = flood_phase(bench, side, workdir / "flood")
        for note in flood.notes:
            print(f"  {note}", flush=True)
    finally:
        set_oldest_first_index(bench.engine, False)
    return SideResult(shares, flood)


# -- the report ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One line of the table: a label and how to read the figure from a side's result."""

    label: str
    read: Callable[[SideResult], float]
    kind: str  # "seconds" or "share"
    ideal: float = 0.0


def rows() -> list[Row]:
    """The table's rows, in order."""
    found: list[Row] = []
    for group in ("flooder", "quiet"):
        for name in ("p50", "p95", "p99"):

            def read(result: SideResult, group: str = group, name: str = name) -> float:
                waits_of = result.flood.flooder if group == "flooder" else result.flood.quiet
                return float(getattr(waits_of, name))

            found.append(Row(f"{group} wait {name} (s)", read, "seconds"))
    total = sum(WEIGHTS)
    for weight in WEIGHTS:

        def share(result: SideResult, weight: int = weight) -> float:
            return result.shares.shares[weight]

        found.append(
            Row(f"share, weight {weight} (ideal {100 * weight / total:.1f}%)", share, "share",
                weight / total)
        )  # fmt: skip
    return found


def cell(row: Row, value: float | None) -> str:
    """One figure: seconds, or a share with its deviation from the ideal."""
    if value is None or math.isnan(value):
        return "n/a"
    if row.kind == "seconds":
        return f"{value:.3f}"
    deviation = 100 * (value - row.ideal) / row.ideal
    return f"{100 * value:.1f}% ({deviation:+.1f}%)"


def format_table(results: dict[str, list[SideResult]]) -> str:
    """Rows: waits and shares; columns: fairq, oldest-first, ratio (medians over runs)."""
    width = 34
    lines = [f"{'':<{width}} {FAIRQ:>17} {OLDEST_FIRST:>17} {'ratio':>8}"]
    for row in rows():
        medians: dict[str, float | None] = {}
        for side in SIDES:
            values = [row.read(r) for r in results.get(side, [])]
            medians[side] = statistics.median(values) if values else None
        fair, oldest = medians[FAIRQ], medians[OLDEST_FIRST]
        ratio = "n/a"
        if fair is not None and oldest and not math.isnan(fair) and not math.isnan(oldest):
            ratio = f"{fair / oldest:.3g}"
        lines.append(
            f"{row.label:<{width}} {cell(row, fair):>17} {cell(row, oldest):>17} {ratio:>8}"
        )
    windows = sorted({r.shares.window for side in results.values() for r in side})
    lines.append(
        "ratio = fairq / oldest-first; waits: created_at to started_at; shares: of the first "
        f"{'/'.join(str(w) for w in windows)} claimed tasks (deviation from the ideal)"
    )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(
        prog="python -m scripts.bench_fairness",
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="small sizes: about a minute")
    parser.add_argument("--flood", type=int, help=f"flood tasks (default {FULL['flood']})")
    parser.add_argument("--quiet", type=int, help=f"quiet companies (default {FULL['quiet']})")
    parser.add_argument(
        "--quiet-rate", type=float,
        help=f"quiet tasks per second, all companies together (default {FULL['quiet_rate']:g})",
    )  # fmt: skip
    parser.add_argument(
        "--flood-sleep", type=float, default=0.02,
        help="seconds each flood task sleeps: the workers must drain slower than the API creates",
    )  # fmt: skip
    parser.add_argument("--flood-clients", type=int, default=8, help="flooder client threads")
    parser.add_argument(
        "--flood-rate", type=float, default=0.0,
        help="at most this many flood tasks per second (0: as fast as the clients can); a "
        "rate the box sustains gives both sides the same backlog when other load varies",
    )  # fmt: skip
    parser.add_argument(
        "--share-backlog", type=int,
        help=f"tasks per weighted company (default {FULL['share_backlog']})",
    )  # fmt: skip
    parser.add_argument(
        "--share-window", type=int,
        help=f"first claimed tasks the shares are taken over (default {FULL['share_window']})",
    )  # fmt: skip
    parser.add_argument("--children", type=int, default=2, help="worker processes per side")
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--runs", type=int, default=1, help="runs per side; the table: medians")
    parser.add_argument(
        "--sides", default=",".join(SIDES), help="which sides to run, comma-separated"
    )
    parser.add_argument(
        "--timeout", type=float, help=f"seconds per phase at most (default {FULL['timeout']:g})"
    )
    parser.add_argument("--log-level", default="WARNING", help="LOG_LEVEL of API and worker")
    stack.add_database_url_argument(
        parser,
        "PostgreSQL to use (its tasks and companies are deleted); default: embedded in "
        ".pgdata/fairness",
    )
    args = parser.parse_args(argv)
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if unknown := set(args.sides) - set(SIDES):
        parser.error(f"unknown sides {sorted(unknown)}; choose from {', '.join(SIDES)}")
    # The heaviest company (4/7 of the claims) must stay backlogged through the window.
    if args.share_window * WEIGHTS[-1] / sum(WEIGHTS) > args.share_backlog:
        parser.error("--share-window is too large for --share-backlog (weight 4 runs dry)")
    if args.quiet < 1 or args.flood < 1 or args.quiet_rate <= 0 or args.flood_rate < 0:
        parser.error(
            "--flood, --quiet and --quiet-rate must be positive, --flood-rate not negative"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    """Run every side and phase, then print the table."""
    args = parse_args(argv)
    token = secrets.token_urlsafe(32)
    results: dict[str, list[SideResult]] = {}
    with (
        stack.sigterm_as_interrupt(),
        tempfile.TemporaryDirectory(prefix="fairq-fairness-") as tmp,
        ExitStack() as running,
    ):
        workdir = Path(tmp)
        url = running.enter_context(stack.database(args.database_url, "fairness"))
        engine = stack.script_engine(url, application_name="fairq-bench")
        running.callback(engine.dispose)
        set_oldest_first_index(engine, False)
        server = running.enter_context(
            stack.api_server(
                url, workdir / "api", admin_token=token, env={"LOG_LEVEL": args.log_level}
            )
        )
        api = Api(server.base_url, token)
        postgres = load.postmaster_pid("fairness") if args.database_url is None else None
        postgres = postgres or postmaster_of(engine)
        bench = Bench(engine, url, api, args, server, postgres)
        (probe,) = api.create_companies(1, "probe")
        api.probe_batch_create(probe)
        database = "from --database-url" if args.database_url else "embedded 16"
        print(
            f"fairq fairness: {args.flood:,} flood tasks "
            f"({f'at most {args.flood_rate:g}/s' if args.flood_rate else 'as fast as possible'}, "
            f"{args.flood_clients} clients), {args.quiet} quiet companies at "
            f"{args.quiet_rate:g} tasks/s, weights {WEIGHTS} with {args.share_backlog} tasks "
            f"each; {args.children} worker processes, batch {args.batch_size}; PostgreSQL "
            f"{database}; {'; '.join(api.notes)}",
            flush=True,
        )
        for run in range(1, args.runs + 1):
            for side in args.sides:
                print(f"{side}, run {run}:", flush=True)
                result = run_side(bench, side, workdir / f"{side}-{run}")
                results.setdefault(side, []).append(result)
    print()
    print(format_table(results), flush=True)
    if any(r.warned for side in results.values() for r in side):
        print("incomplete: see the WARNING lines above", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
