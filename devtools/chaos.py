"""The chaos run: SIGKILL worker children while webhook tasks flow; no task may be lost.

`run(ChaosConfig(...))` starts PostgreSQL (`database_url`, whose tasks and companies are
deleted first, else embedded in `.pgdata/chaos`), a local webhook receiver
(`devtools.webhook_receiver`: records every delivery's Idempotency-Key and answers 200, or 503
for `fail_percent` of them), the real API under gunicorn, `supervisors` worker supervisors
(`python -m worker`, `children` each, `STALE_AFTER_SECONDS` = `stale_after`) and
`api_threads` threads that call `POST /workers/process` in a loop. It creates `tasks` webhook
tasks over HTTP (a pool of keep-alive sessions; each create carries an Idempotency-Key, so a
retried create cannot duplicate a task) spread over `companies` companies, while a killer
thread SIGKILLs a random child of a random supervisor every `kill_interval` seconds (±50%;
children found in /proc). Kills stop when every task is finished or after `chaos_seconds`;
then the system drains without kills for up to `drain_timeout` seconds.

Definitions used in the report:
- lost: created (the API answered 201/200 with its id) but not `completed` at the end.
- delivered: the receiver answered 200 to a request carrying the task's id as Idempotency-Key;
  a duplicate is a task delivered more than once (503 answers are refusals, not deliveries).
- held by a killed child: the task was `processing` with `locked_by` of the killed child
  (`host:pid:nonce`), read right after the SIGKILL: its run was cut short (or, rarely, the child's
  last commit was still in flight and it completed anyway).
- re-claimed: `attempts > 1` at the end: it was claimed again after a lease expiry (kill), a
  lease takeover, or a retry (503). Every duplicate must be re-claimed: at-least-once allows
  a second delivery only to a task that ran again.
The report is `ok` when no task is lost, not completed, completed without a delivery, or
unknown. `scripts.chaos` is the command line; `tests/test_chaos.py` runs it scaled down.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import random
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
from sqlalchemy import Engine, text

from devtools import stack
from devtools.webhook_receiver import Receiver
from worker import processing

# How often the main thread looks at the database while waiting.
POLL_SECONDS = 0.5
# Attempts of one create request (connection error or 503) before the run gives up.
CREATE_ATTEMPTS = 6
REQUEST_TIMEOUT_SECONDS = 60.0


class ChaosError(RuntimeError):
    """The run could not be carried out (a process did not start, creates kept failing)."""


@dataclass(frozen=True)
class ChaosConfig:
    """What one chaos run does; see the module docstring for each knob's meaning."""

    tasks: int = 10_000
    companies: int = 20
    supervisors: int = 2
    children: int = 2
    api_threads: int = 4
    create_threads: int = 8
    kill_interval: float = 3.0
    fail_percent: float = 0.0
    delivery_delay: float = 0.0
    stale_after: float = 3.0
    max_attempts: int = 10
    batch_size: int = 100
    chaos_seconds: float = 600.0
    drain_timeout: float = 120.0
    seed: int = 42
    database_url: str | None = None


# -- creating work over HTTP ---------------------------------------------------------------


def _create_one(
    session: requests.Session, base_url: str, company: stack.Company, body: dict[str, Any], key: str
) -> str:
    """POST one task, retrying connection errors and 503 (same key: no duplicate)."""
    url = f"{base_url}/companies/{company.id}/tasks"
    headers = {"Authorization": f"Bearer {company.api_key}", "Idempotency-Key": key}
    problem = ""
    for attempt in range(CREATE_ATTEMPTS):
        try:
            response = session.post(url, json=body, headers=headers, timeout=30)
        except requests.ConnectionError as exc:
            problem = f"connection error: {exc}"
        else:
            if response.status_code in (200, 201):
                return str(response.json()["id"])
            if response.status_code != 503:
                raise ChaosError(f"create answered {response.status_code}: {response.text[:300]}")
            problem = "503"
        time.sleep(0.2 * (attempt + 1))
    raise ChaosError(f"create with key {key} failed {CREATE_ATTEMPTS} times: {problem}")


def create_tasks(
    base_url: str,
    companies: list[stack.Company],
    count: int,
    *,
    webhook_url: str,
    max_attempts: int,
    threads: int,
    prefix: str = "chaos",
) -> list[str]:
    """Create `count` webhook tasks round-robin over `companies`; return their ids.

    `threads` threads, each with its own keep-alive session, share the work. Task `n` posts
    `{"n": n}` to `webhook_url` and carries `Idempotency-Key: <prefix>-<n>`. Raises
    `ChaosError` when a create keeps failing.
    """
    ids: list[str | None] = [None] * count
    errors: list[BaseException] = []

    def work(first: int) -> None:
        try:
            with requests.Session() as session:
                for n in range(first, count, threads):
                    if errors:
                        return
                    body = {
                        "type": "webhook",
                        "payload": {"url": webhook_url, "body": {"n": n}},
                        "max_attempts": max_attempts,
                    }
                    ids[n] = _create_one(
                        session, base_url, companies[n % len(companies)], body, f"{prefix}-{n}"
                    )
        except BaseException as exc:  # reported by the caller, not lost in a thread
            errors.append(exc)

    workers = [
        threading.Thread(target=work, args=(t,), name=f"chaos-create-{t}") for t in range(threads)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if errors:
        raise ChaosError(f"creating tasks failed: {errors[0]}") from errors[0]
    return [task_id for task_id in ids if task_id is not None]


# -- POST /workers/process from threads ----------------------------------------------------


PASS_FIELDS = tuple(f.name for f in dataclasses.fields(processing.PassResult))


@dataclass
class PassTotals:
    """What the API's processing passes reported, summed; `errors` counts failed requests.

    `counts` is keyed by the fields of `worker.processing.PassResult` (the endpoint's body).
    """

    passes: int = 0
    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    errors: int = 0
    statuses: collections.Counter[int] = field(default_factory=collections.Counter)


class ApiPassers:
    """`threads` threads calling `POST /workers/process` until stopped (idle: 0.2 s pause)."""

    def __init__(self, base_url: str, admin_token: str, threads: int) -> None:
        self.totals = PassTotals()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._url = f"{base_url}/workers/process"
        self._token = admin_token
        self._threads = [
            threading.Thread(target=self._run, name=f"chaos-pass-{n}", daemon=True)
            for n in range(threads)
        ]

    def start(self) -> None:
        """Start every thread."""
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Stop and join (a pass in flight finishes first)."""
        self._stop.set()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(REQUEST_TIMEOUT_SECONDS + 5)

    def _run(self) -> None:
        with requests.Session() as session:
            session.headers["Authorization"] = f"Bearer {self._token}"
            while not self._stop.is_set():
                claimed = self._one(session)
                if claimed == 0:
                    self._stop.wait(0.2)

    def _one(self, session: requests.Session) -> int:
        try:
            response = session.post(self._url, timeout=REQUEST_TIMEOUT_SECONDS)
        except requests.RequestException:
            with self._lock:
                self.totals.errors += 1
            return 0
        with self._lock:
            totals = self.totals
            totals.statuses[response.status_code] += 1
            if response.status_code != 200:
                totals.errors += 1
                return 0
            body = response.json()
            totals.passes += 1
            totals.counts.update({name: int(body[name]) for name in PASS_FIELDS})
            return int(body["claimed"])


# -- the killer ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Kill:
    """One SIGKILL: which child, when (seconds into the run), how many tasks it held."""

    pid: int
    at: float
    held: int


# A child's worker id is `host:pid:nonce` (`worker.child.new_worker_id`).
_HELD_BY = text(
    "SELECT id::text FROM tasks WHERE status = 'processing' AND locked_by LIKE :who || ':%'"
)


class Killer:
    """SIGKILLs a random child of a random supervisor every `interval` seconds (±50%).

    Which tasks the dead child held (`locked_by` its `host:pid:nonce`, still `processing`) is read
    twice: right after the kill, and again `recheck_after` seconds later, which catches a
    claim or a batch whose COMMIT was in flight when the child died (the server finishes a
    commit it has received). `recheck_after` must stay below the part of `stale_after` a
    lease can have left, or another worker may have taken the tasks over meanwhile.
    """

    def __init__(
        self,
        supervisors: list[stack.WorkerSupervisor],
        engine: Engine,
        interval: float,
        *,
        rng: random.Random,
        started: float,
        recheck_after: float = 1.0,
    ) -> None:
        self.kills: list[Kill] = []
        self.held: set[str] = set()
        self.errors: list[BaseException] = []
        self._supervisors = supervisors
        self._engine = engine
        self._interval = interval
        self._rng = rng
        self._started = started
        self._recheck_after = recheck_after
        self._rechecks: collections.deque[tuple[float, int]] = collections.deque()
        self._host = socket.gethostname()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-killer", daemon=True)

    def start(self) -> None:
        """Start killing."""
        self._thread.start()

    def stop(self) -> None:
        """Stop killing, do the outstanding re-reads, wait for the thread."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30)

    def _run(self) -> None:
        try:
            next_kill = time.monotonic() + self._next_interval()
            while not self._stop.wait(0.05):
                now = time.monotonic()
                while self._rechecks and self._rechecks[0][0] <= now:
                    self._read_held(self._rechecks.popleft()[1])
                if now >= next_kill:
                    self.kill_one()
                    next_kill = now + self._next_interval()
            while self._rechecks:  # early, but no lease of theirs expired yet either
                self._read_held(self._rechecks.popleft()[1])
        except BaseException as exc:  # reported by the caller
            self.errors.append(exc)

    def _next_interval(self) -> float:
        return self._interval * self._rng.uniform(0.5, 1.5)

    def _read_held(self, pid: int) -> set[str]:
        with self._engine.connect() as conn:
            held = set(conn.execute(_HELD_BY, {"who": f"{self._host}:{pid}"}).scalars())
        self.held |= held
        return held

    def kill_one(self) -> Kill | None:
        """SIGKILL one random live child now; None when no supervisor has one."""
        candidates = [pid for sup in self._supervisors for pid in sup.children()]
        if not candidates:
            return None
        pid = self._rng.choice(candidates)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return None
        held = self._read_held(pid)
        self._rechecks.append((time.monotonic() + self._recheck_after, pid))
        kill = Kill(pid, time.monotonic() - self._started, len(held))
        self.kills.append(kill)
        return kill


# -- the run -------------------------------------------------------------------------------


@dataclass
class ChaosReport:
    """The outcome of one run; `ok` is what the exit status reflects."""

    config: ChaosConfig
    created: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    lost: int = 0
    missing: int = 0
    unknown_tasks: int = 0
    delivered: int = 0
    deliveries: int = 0
    refused: int = 0
    duplicates: int = 0
    duplicate_deliveries: int = 0
    duplicates_held_by_killed: int = 0
    duplicates_reclaimed: int = 0
    duplicates_unexplained: int = 0
    completed_undelivered: int = 0
    unknown_keys: int = 0
    held_by_killed: int = 0
    reclaimed: int = 0
    max_attempts_seen: int = 0
    kills: int = 0
    child_restarts: float = 0.0
    worker_completed: float = 0.0
    worker_lease_lost: float = 0.0
    api: PassTotals = field(default_factory=PassTotals)
    create_seconds: float = 0.0
    chaos_seconds: float = 0.0
    wall_seconds: float = 0.0
    drained: bool = False
    workdir: str = ""

    @property
    def ok(self) -> bool:
        """Nothing lost, everything completed and delivered, nothing unexplained."""
        return (
            self.drained
            and self.lost == 0
            and self.statuses == {"completed": self.created}
            and self.completed_undelivered == 0
            and self.unknown_tasks == 0
            and self.unknown_keys == 0
        )


def unfinished(engine: Engine) -> int:
    """Tasks not yet in a terminal state."""
    with engine.connect() as conn:
        count: int = conn.execute(
            text("SELECT count(*) FROM tasks WHERE status IN ('pending', 'processing')")
        ).scalar_one()
    return count


def wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    """Poll `condition` every `POLL_SECONDS` until true (True) or `timeout` passed (False)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_SECONDS)
    return True


def worker_env(config: ChaosConfig) -> dict[str, str]:
    """Environment of the supervisors: the receiver is on 127.0.0.1, leases expire fast."""
    return {
        "WEBHOOK_ALLOW_PRIVATE": "true",
        "WEBHOOK_TIMEOUT_SECONDS": "10",
        "STALE_AFTER_SECONDS": str(config.stale_after),
        "WORKER_BATCH_SIZE": str(config.batch_size),
        "WORKER_POLL_INTERVAL": "0.2",
        "LOG_LEVEL": "WARNING",  # INFO is a line per task; warnings keep lease-lost lines
    }


def api_env(config: ChaosConfig) -> dict[str, str]:
    """Environment of gunicorn: as the workers', and threads for passes plus creates."""
    return {
        **worker_env(config),
        "GUNICORN_WORKERS": "2",
        "GUNICORN_THREADS": str(max(4, config.api_threads + 4)),
        "GUNICORN_TIMEOUT": "120",
    }


def run(config: ChaosConfig, *, workdir: Path, log: Callable[[str], None] = print) -> ChaosReport:
    """Carry out one chaos run (see the module docstring) and return its report.

    Every process and thread it starts is stopped before it returns or raises.
    """
    report = ChaosReport(config, workdir=str(workdir))
    rng = random.Random(config.seed)
    token = secrets.token_urlsafe(32)
    with ExitStack() as stack_:
        url = stack_.enter_context(stack.database(config.database_url, "chaos"))
        receiver = stack_.enter_context(
            Receiver(config.fail_percent, config.seed, config.delivery_delay)
        )
        api = stack_.enter_context(
            stack.api_server(url, workdir / "api", admin_token=token, env=api_env(config))
        )
        supervisors = [
            stack_.enter_context(
                stack.supervisor(
                    url,
                    workdir / f"worker-{n}",
                    concurrency=config.children,
                    env=worker_env(config),
                )
            )
            for n in range(config.supervisors)
        ]
        engine = stack.script_engine(url)
        stack_.callback(engine.dispose)
        companies = stack.create_companies(api.base_url, token, config.companies)
        log(
            f"chaos: {config.tasks} webhook tasks, {config.companies} companies, "
            f"{config.supervisors} supervisors x {config.children} children, "
            f"{config.api_threads} API process threads, a kill every ~{config.kill_interval:g}s"
        )

        started = time.monotonic()
        passers = ApiPassers(api.base_url, token, config.api_threads)
        stack_.callback(passers.stop)
        killer = Killer(
            supervisors,
            engine,
            config.kill_interval,
            rng=rng,
            started=started,
            recheck_after=config.stale_after / 3,
        )
        stack_.callback(killer.stop)
        passers.start()
        killer.start()

        ids = create_tasks(
            api.base_url,
            companies,
            config.tasks,
            webhook_url=receiver.url,
            max_attempts=config.max_attempts,
            threads=config.create_threads,
        )
        report.create_seconds = time.monotonic() - started
        log(f"chaos: created {len(ids)} tasks in {report.create_seconds:.1f}s; killing on")

        remaining = config.chaos_seconds - (time.monotonic() - started)
        wait_until(lambda: unfinished(engine) == 0, max(0.0, remaining))
        killer.stop()
        report.chaos_seconds = time.monotonic() - started
        log(f"chaos: kills stopped after {report.chaos_seconds:.1f}s; draining")
        report.drained = wait_until(lambda: unfinished(engine) == 0, config.drain_timeout)
        passers.stop()
        report.wall_seconds = time.monotonic() - started
        if killer.errors:
            raise ChaosError(f"the killer failed: {killer.errors[0]!r}") from killer.errors[0]

        for sup in supervisors:
            samples = sup.metrics()
            report.child_restarts += stack.metric_total(samples, "worker_child_restarts_total")
            report.worker_completed += stack.metric_total(samples, "tasks_completed_total")
            report.worker_lease_lost += stack.metric_total(samples, "tasks_lease_lost_total")
        report.api = passers.totals
        report.kills = len(killer.kills)
        _tally(report, ids, _final_rows(engine), receiver.deliveries(), killer.held)
    return report


def _final_rows(engine: Engine) -> dict[str, tuple[str, int]]:
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT id::text, status, attempts FROM tasks")).all()
    return {str(task_id): (str(status), int(attempts)) for task_id, status, attempts in rows}


def _tally(
    report: ChaosReport,
    ids: list[str],
    rows: dict[str, tuple[str, int]],
    deliveries: dict[str, list[int]],
    held: set[str],
) -> None:
    """Fill the report's counts from the final rows, the receiver's log and the kills."""
    created = set(ids)
    report.created = len(created)
    report.statuses = dict(collections.Counter(rows[i][0] for i in created if i in rows))
    report.missing = len(created - rows.keys())
    report.unknown_tasks = len(rows.keys() - created)
    report.lost = sum(1 for i in created if rows.get(i, ("missing", 0))[0] != "completed")
    reclaimed = {i for i in created if i in rows and rows[i][1] > 1}
    report.reclaimed = len(reclaimed)
    report.held_by_killed = len(held & created)
    report.max_attempts_seen = max((rows[i][1] for i in created if i in rows), default=0)

    accepted = {key: statuses.count(200) for key, statuses in deliveries.items()}
    report.deliveries = sum(len(statuses) for statuses in deliveries.values())
    report.refused = report.deliveries - sum(accepted.values())
    report.delivered = sum(1 for i in created if accepted.get(i, 0) > 0)
    report.unknown_keys = len(deliveries.keys() - created)
    duplicates = {key for key, n in accepted.items() if n > 1}
    report.duplicates = len(duplicates)
    report.duplicate_deliveries = sum(accepted[key] - 1 for key in duplicates)
    report.duplicates_held_by_killed = len(duplicates & held)
    report.duplicates_reclaimed = len(duplicates & reclaimed)
    report.duplicates_unexplained = len(duplicates - reclaimed)
    report.completed_undelivered = sum(
        1 for i in created if rows.get(i, ("", 0))[0] == "completed" and accepted.get(i, 0) == 0
    )


def format_report(report: ChaosReport) -> str:
    """The report as `scripts.chaos` prints it."""
    c = report.config
    api = report.api
    lines = [
        "== chaos result ==",
        f"tasks created:              {report.created} (over HTTP, {c.create_threads} "
        f"keep-alive clients, {report.create_seconds:.1f}s)",
        f"final states:               {dict(sorted(report.statuses.items()))}"
        + (f", missing {report.missing}" if report.missing else ""),
        f"lost (not completed):       {report.lost}",
        f"completed, never delivered: {report.completed_undelivered}",
        f"unknown tasks / keys:       {report.unknown_tasks} / {report.unknown_keys}",
        f"kills (SIGKILL to a child): {report.kills} (child restarts counted by the "
        f"supervisors: {report.child_restarts:.0f})",
        f"held by a killed child:     {report.held_by_killed} tasks",
        f"re-claimed (attempts > 1):  {report.reclaimed} tasks "
        f"(max attempts {report.max_attempts_seen})",
        f"deliveries received:        {report.deliveries} ({report.refused} answered 503), "
        f"{report.delivered} tasks delivered",
        f"duplicate deliveries:       {report.duplicates} tasks delivered more than once "
        f"({report.duplicate_deliveries} extra deliveries)",
        f"  of which held by a killed child: {report.duplicates_held_by_killed}",
        f"  of which re-claimed (attempts > 1): {report.duplicates_reclaimed}",
        f"  unexplained (attempts == 1): {report.duplicates_unexplained}",
        f"lease lost (fenced finalize refused): workers {report.worker_lease_lost:.0f}, "
        f"API passes {api.counts['lease_lost']}",
        f"completed by: worker children {report.worker_completed:.0f}, API passes "
        f"{api.counts['completed']} ({api.passes} passes, {api.errors} failed requests)",
        f"wall time:                  {report.wall_seconds:.1f}s (kills for "
        f"{report.chaos_seconds:.1f}s, then drain{'ed' if report.drained else ' TIMED OUT'})",
        f"result:                     {'OK' if report.ok else 'FAILED'}",
    ]
    return "\n".join(lines)
