"""Load test of the real API: concurrent keep-alive clients create and read tasks.

Starts PostgreSQL (embedded in `.pgdata/load` with durable defaults, or `--database-url`,
whose tasks and companies are deleted first) and the API under gunicorn
(`deploy/gunicorn.conf.py`; GUNICORN_WORKERS and GUNICORN_THREADS from the environment),
creates `--companies` companies, then runs `--clients` client threads, each with its own
`requests.Session` (keep-alive), for `--seconds` seconds per phase after a `--warmup`:

- 50% creates of a `noop` task; half of them carry an Idempotency-Key, and 10% of those repeat
  one of the client's earlier keys with the same body (a replay: 200, not 201);
- 35% `GET /companies/{id}/tasks/{task_id}` of a task the client created;
- 15% `GET /companies/{id}/tasks?limit=20` (the newest page).

Phase 1 runs the API alone. Phase 2 runs the same load while a worker supervisor
(`--children` children) drains the backlog phase 1 left and what phase 2 adds. For each
phase it prints requests/s and client-side p50/p95/p99 latency per endpoint (route template),
every non-2xx answer by endpoint and status, the CPU each part used (from /proc), and the
tasks completed, side by side. Client threads share the machine with the server: on a
small box the numbers describe the whole system, not the API alone (the header says so).

Usage (from the repository root):
    .venv/bin/python -m scripts.load [--clients 16] [--seconds 30] [--warmup 3]
        [--companies 20] [--children 2] [--database-url postgresql+psycopg://...]
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import random
import secrets
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import requests
from sqlalchemy import Engine, text

from devtools import stack

ROOT = Path(__file__).resolve().parent.parent

CREATE = "POST /companies/{company_id}/tasks"
READ = "GET /companies/{company_id}/tasks/{task_id}"
LIST = "GET /companies/{company_id}/tasks"
ROUTES = (CREATE, READ, LIST)
PERCENTILES = (0.50, 0.95, 0.99)
REQUEST_TIMEOUT_SECONDS = 30.0
# A client remembers this many of its tasks and keys to read or replay.
MEMORY = 1000
# The CPU meter's readings of the whole machine (/proc/stat) and of every process on it,
# which tell foreign load and kernel time (loopback TCP) apart from ours.
MACHINE = "machine"
ALL_PROCESSES = "all processes"


@dataclass
class Tally:
    """What the clients saw in one phase: latencies and statuses per endpoint."""

    latencies: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    statuses: dict[str, collections.Counter[str]] = field(
        default_factory=lambda: collections.defaultdict(collections.Counter)
    )
    created: int = 0
    replayed: int = 0

    def merge(self, other: Tally) -> None:
        """Add another client's tally to this one."""
        for route, values in other.latencies.items():
            self.latencies[route].extend(values)
        for route, counter in other.statuses.items():
            self.statuses[route].update(counter)
        self.created += other.created
        self.replayed += other.replayed


@dataclass
class PhaseResult:
    """One measured phase: the merged tally, its length, CPU seconds by part, tasks done."""

    name: str
    seconds: float
    tally: Tally
    cpu: dict[str, float | None]
    completed: int
    backlog_after: int


class Client:
    """One simulated tenant-side client: a keep-alive session and the tasks it created."""

    def __init__(self, base_url: str, companies: list[stack.Company], seed: int) -> None:
        self.base_url = base_url
        self.companies = companies
        self.rng = random.Random(seed)
        self.name = f"c{seed}"
        self.session = requests.Session()
        self.tasks: collections.deque[tuple[stack.Company, str]] = collections.deque(maxlen=MEMORY)
        self.keys: collections.deque[tuple[stack.Company, str]] = collections.deque(maxlen=MEMORY)
        self._serial = 0

    def close(self) -> None:
        """Close the session."""
        self.session.close()

    def run(self, until: float, tally: Tally) -> None:
        """Send requests back to back until `time.monotonic()` reaches `until`."""
        while time.monotonic() < until:
            roll = self.rng.random()
            if roll < 0.50 or not self.tasks:
                self._create(tally)
            elif roll < 0.85:
                company, task_id = self.rng.choice(self.tasks)
                self._send(tally, READ, "GET", f"/companies/{company.id}/tasks/{task_id}", company)
            else:
                company = self.rng.choice(self.companies)
                self._send(tally, LIST, "GET", f"/companies/{company.id}/tasks?limit=20", company)

    def _create(self, tally: Tally) -> None:
        headers: dict[str, str] = {}
        replay = False
        company = self.rng.choice(self.companies)
        if self.rng.random() < 0.5:
            if self.keys and self.rng.random() < 0.10:
                company, key = self.rng.choice(self.keys)
                replay = True
            else:
                self._serial += 1
                key = f"load-{self.name}-{self._serial}"
                self.keys.append((company, key))
            headers["Idempotency-Key"] = key
        response = self._send(
            tally,
            CREATE,
            "POST",
            f"/companies/{company.id}/tasks",
            company,
            json={"type": "noop", "payload": {}},
            headers=headers,
        )
        if response is not None and response.status_code in (200, 201):
            if response.status_code == 201:
                tally.created += 1
                self.tasks.append((company, str(response.json()["id"])))
            elif replay:
                tally.replayed += 1

    def _send(
        self,
        tally: Tally,
        route: str,
        method: str,
        path: str,
        company: stack.Company,
        *,
        json: object = None,
        headers: dict[str, str] | None = None,
    ) -> requests.Response | None:
        all_headers = {"Authorization": f"Bearer {company.api_key}", **(headers or {})}
        started = time.perf_counter()
        try:
            response = self.session.request(
                method,
                self.base_url + path,
                json=json,
                headers=all_headers,
                timeout=REQUEST_TIMEOUT_SECONDS,
            )
        except requests.RequestException as exc:
            tally.statuses[route][type(exc).__name__] += 1
            return None
        tally.latencies[route].append(time.perf_counter() - started)
        tally.statuses[route][str(response.status_code)] += 1
        return response


def drive(clients: list[Client], seconds: float) -> Tally:
    """Run every client in its own thread for `seconds`; return the merged tally."""
    until = time.monotonic() + seconds
    tallies = [Tally() for _ in clients]
    errors: list[BaseException] = []

    def work(client: Client, tally: Tally) -> None:
        try:
            client.run(until, tally)
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)

    threads = [
        threading.Thread(target=work, args=(c, t), name=f"load-{c.name}")
        for c, t in zip(clients, tallies, strict=True)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + REQUEST_TIMEOUT_SECONDS + 10)
    if errors:
        raise RuntimeError(f"a client failed: {errors[0]!r}") from errors[0]
    merged = Tally()
    for tally in tallies:
        merged.merge(tally)
    return merged


# -- CPU accounting from /proc -------------------------------------------------------------

_TICKS = os.sysconf("SC_CLK_TCK")


def _tree(pid: int) -> list[int]:
    found = [pid]
    for child in stack.children_of(pid):
        found.extend(_tree(child))
    return found


def _cpu_ticks(pid: int | str) -> int:
    """utime + stime + cutime + cstime of `pid` (reaped children included), 0 if gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return sum(int(v) for v in fields[11:15])


def tree_cpu_seconds(pid: int | None) -> float | None:
    """CPU seconds of `pid` and its live descendants so far (None: unknown)."""
    if pid is None:
        return None
    return sum(_cpu_ticks(member) for member in _tree(pid)) / _TICKS


def all_processes_cpu_seconds() -> float:
    """CPU seconds of every live process, each with its reaped children's.

    Every process descends from pid 1, so an exited process's time reappears in its reaper's
    children's total: the sum only grows, and its growth over a phase is what all processes
    used during it.
    """
    entries = (e.name for e in Path("/proc").iterdir() if e.name.isdigit())
    return sum(_cpu_ticks(name) for name in entries) / _TICKS


@dataclass
class CpuMeter:
    """CPU seconds used by each part of the system between `start()` and `stop()`."""

    parts: dict[str, Callable[[], float | None]]
    _start: dict[str, float | None] = field(default_factory=dict)

    def start(self) -> None:
        """Take the starting readings."""
        self._start = {name: read() for name, read in self.parts.items()}

    def stop(self, seconds: float) -> dict[str, float | None]:
        """Cores used by each part since `start()` (CPU seconds / wall seconds)."""
        used: dict[str, float | None] = {}
        for name, read in self.parts.items():
            now, before = read(), self._start.get(name)
            used[name] = None if now is None or before is None else (now - before) / seconds
        return used


def machine_busy_seconds() -> float:
    """CPU seconds all processes of the machine spent busy (not idle, not in I/O wait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / _TICKS  # up to steal; guest time is inside user


def postmaster_pid(name: str) -> int | None:
    """The pid of the embedded server in `.pgdata/<name>`, if it runs."""
    try:
        return int((ROOT / ".pgdata" / name / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


# -- phases and the report -----------------------------------------------------------------


def completed_count(engine: Engine) -> tuple[int, int]:
    """(completed, pending or processing) tasks right now."""
    with engine.connect() as conn:
        row = conn.execute(
            text(
                "SELECT count(*) FILTER (WHERE status = 'completed'), "
                "       count(*) FILTER (WHERE status IN ('pending', 'processing')) FROM tasks"
            )
        ).one()
    return int(row[0]), int(row[1])


def run_phase(
    name: str, clients: list[Client], seconds: float, meter: CpuMeter, engine: Engine
) -> PhaseResult:
    """Measure one phase of `seconds`."""
    done_before, _ = completed_count(engine)
    meter.start()
    started = time.monotonic()
    tally = drive(clients, seconds)
    elapsed = time.monotonic() - started
    cpu = meter.stop(elapsed)
    done_after, backlog = completed_count(engine)
    return PhaseResult(name, elapsed, tally, cpu, done_after - done_before, backlog)


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (0 for an empty one)."""
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


def _row(result: PhaseResult, route: str | None) -> str:
    if route is None:
        values = sorted(v for vs in result.tally.latencies.values() for v in vs)
    else:
        values = sorted(result.tally.latencies.get(route, []))
    rate = len(values) / result.seconds
    p50, p95, p99 = (1000 * percentile(values, q) for q in PERCENTILES)
    return f"{rate:7.0f} {p50:6.1f} {p95:6.1f} {p99:6.1f}"


def format_report(header: str, results: list[PhaseResult]) -> str:
    """Both phases side by side: per endpoint, non-2xx answers, CPU, tasks."""
    width = 42
    lines = [header, ""]
    lines.append(" " * width + "".join(f"  {r.name:<28}" for r in results))
    lines.append(
        f"{'endpoint':<{width}}"
        + "".join(f"  {'req/s':>7} {'p50':>6} {'p95':>6} {'p99':>6}" for _ in results)
        + "   (latency ms)"
    )
    for route in (*ROUTES, None):
        label = route or "all"
        lines.append(f"{label:<{width}}" + "".join(f"  {_row(r, route)}" for r in results))
    lines.append("")
    lines.append("non-2xx answers and client errors (endpoint: status x count):")
    for result in results:
        bad = [
            f"{route} {status} x{count}"
            for route, counter in sorted(result.tally.statuses.items())
            for status, count in sorted(counter.items())
            if not status.startswith("2")
        ]
        lines.append(f"  {result.name}: {', '.join(bad) if bad else 'none'}")
    lines.append("")
    for result in results:
        ours = {k: v for k, v in result.cpu.items() if k not in (MACHINE, ALL_PROCESSES)}
        cpu = ", ".join(
            f"{part} {'n/a' if cores is None else f'{cores:.2f}'}" for part, cores in ours.items()
        )
        machine, processes = result.cpu.get(MACHINE), result.cpu.get(ALL_PROCESSES)
        if machine is not None and processes is not None:
            other = max(0.0, processes - sum(cores or 0.0 for cores in ours.values()))
            kernel = max(0.0, machine - processes)
            cpu += (
                f"; whole machine {machine:.2f} (other processes {other:.2f}, "
                f"kernel and interrupts {kernel:.2f})"
            )
        lines.append(f"CPU cores used, {result.name}: {cpu}")
    for result in results:
        lines.append(
            f"tasks, {result.name}: {result.tally.created} created (201), "
            f"{result.tally.replayed} idempotent replays (200), "
            f"{result.completed} completed ({result.completed / result.seconds:.0f}/s), "
            f"{result.backlog_after} pending at the end"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(
        prog="python -m scripts.load",
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--clients", type=int, default=16, help="client threads")
    parser.add_argument("--seconds", type=float, default=30.0, help="length of each phase")
    parser.add_argument("--warmup", type=float, default=3.0, help="unmeasured load first")
    parser.add_argument("--companies", type=int, default=20)
    parser.add_argument("--children", type=int, default=2, help="worker children in phase 2")
    parser.add_argument("--seed", type=int, default=1)
    stack.add_database_url_argument(
        parser,
        "PostgreSQL to use (its tasks and companies are deleted); default: embedded in "
        ".pgdata/load",
    )
    return parser.parse_args(argv)


@contextmanager
def _clients(
    base_url: str, companies: list[stack.Company], count: int, seed: int
) -> Iterator[list[Client]]:
    clients = [Client(base_url, companies, seed * 1000 + n) for n in range(count)]
    try:
        yield clients
    finally:
        for client in clients:
            client.close()


def main(argv: list[str] | None = None) -> int:
    """Run both phases and print the report."""
    args = parse_args(argv)
    token = secrets.token_urlsafe(32)
    workers = os.environ.get("GUNICORN_WORKERS", "2")
    threads = os.environ.get("GUNICORN_THREADS", "4")
    with (
        stack.sigterm_as_interrupt(),
        tempfile.TemporaryDirectory(prefix="fairq-load-") as tmp,
        ExitStack() as running,
    ):
        workdir = Path(tmp)
        url = running.enter_context(stack.database(args.database_url, "load"))
        api = running.enter_context(stack.api_server(url, workdir / "api", admin_token=token))
        engine = stack.script_engine(url)
        running.callback(engine.dispose)
        companies = stack.create_companies(api.base_url, token, args.companies)
        clients = running.enter_context(_clients(api.base_url, companies, args.clients, args.seed))
        pg_pid = postmaster_pid("load") if args.database_url is None else None
        parts: dict[str, Callable[[], float | None]] = {
            "clients": time.process_time,
            "gunicorn": lambda: stack_cpu(api),
            "postgres": lambda: tree_cpu_seconds(pg_pid),
            MACHINE: machine_busy_seconds,
            ALL_PROCESSES: all_processes_cpu_seconds,
        }
        drive(clients, args.warmup)
        api_only = run_phase("API only", clients, args.seconds, CpuMeter(dict(parts)), engine)

        sup = running.enter_context(
            stack.supervisor(url, workdir / "worker", concurrency=args.children)
        )
        parts["worker"] = lambda: stack_cpu(sup)
        draining = run_phase(
            f"API + worker ({args.children} children)",
            clients,
            args.seconds,
            CpuMeter(dict(parts)),
            engine,
        )
    database = "from --database-url" if args.database_url else "embedded 16, durable defaults"
    header = (
        f"fairq load: {args.clients} client threads (requests.Session keep-alive) for "
        f"{args.seconds:g} s per phase after {args.warmup:g} s warm-up; gunicorn {workers} "
        f"workers x {threads} threads; PostgreSQL {database}.\n"
        f"This box has {os.cpu_count()} cores, shared by the clients, gunicorn, PostgreSQL "
        "and (phase 2) the worker: the clients compete with the server for CPU."
    )
    print(format_report(header, [api_only, draining]), flush=True)
    return 0


def stack_cpu(process: stack.ManagedProcess) -> float | None:
    """CPU seconds of a started process and its live descendants."""
    return tree_cpu_seconds(process.pid) if process.running() else None


if __name__ == "__main__":
    sys.exit(main())
