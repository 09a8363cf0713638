"""Run the real system for scripts and process tests: PostgreSQL, the API, worker supervisors.

Used by the scripts (`scripts.load`, the benchmarks), the chaos run (`devtools.chaos`) and the
process tests. Every server listens on 127.0.0.1 only. Processes start in the repository root
(`python -m worker`, `python -m gunicorn ... wsgi:app`), so they import this checkout's
packages without PYTHONPATH. Everything started here is stopped by its context manager, also
when the body raises: the API (gunicorn) and each supervisor run in a process group of their
own (`start_new_session`), which gets SIGTERM, a grace period, then SIGKILL as a whole group,
so no gunicorn worker or worker child outlives the caller. Output goes to files in a working
directory (a PIPE nobody reads fills up and blocks the process).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import psycopg
import requests
from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, pool, text
from sqlalchemy.engine import make_url

from db.engine import make_engine
from devtools.embedded_postgres import EmbeddedPostgres, free_port
from worker import exporter

ROOT = Path(__file__).resolve().parent.parent

# How long a stopped process group gets between SIGTERM and SIGKILL.
STOP_GRACE_SECONDS = 15.0

_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?)\s+(\S+)$")


class StackError(RuntimeError):
    """A process of the stack did not start; the message carries the end of its log."""


def children_of(pid: int) -> list[int]:
    """Live (non-zombie) child pids of `pid`, read from /proc."""
    found: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
            found.append(int(entry.name))
    return sorted(found)


def process_name(pid: int) -> str | None:
    """The name of process `pid` (/proc/<pid>/comm), or None once it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def exporter_of(supervisor: int) -> int | None:
    """The metrics exporter among the children of `supervisor` (by its process name), or None."""
    exporters = [c for c in children_of(supervisor) if process_name(c) == exporter.PROCESS_NAME]
    return exporters[0] if exporters else None


def worker_children_of(pid: int) -> list[int]:
    """Live worker children of supervisor `pid`: its children but its metrics exporter.

    One listing, each child judged by its own name: the exporter has its name from birth
    (`worker.exporter`), so a child forked between two listings cannot pass for a worker.
    """
    return [
        child
        for child in children_of(pid)
        if process_name(child) not in (exporter.PROCESS_NAME, None)
    ]


def parse_metrics(body: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}, labels exactly as exposed."""
    samples: dict[str, float] = {}
    for line in body.splitlines():
        match = _SAMPLE.match(line)
        if match and not line.startswith("#"):
            samples[match.group(1)] = float(match.group(2))
    return samples


def metric_total(samples: Mapping[str, float], name: str) -> float:
    """Sum of every sample of `name`, whatever its labels."""
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt meanwhile, so `finally` blocks stop what we started.

    Only in the main thread (signal handlers cannot be set elsewhere); elsewhere a no-op.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# -- processes -----------------------------------------------------------------------------


@dataclass
class ManagedProcess:
    """A process started in a group of its own, with stdout and stderr in `workdir`."""

    name: str
    proc: subprocess.Popen[bytes]
    workdir: Path

    @property
    def pid(self) -> int:
        """The process (and process group) id."""
        return self.proc.pid

    def running(self) -> bool:
        """True until the process exits."""
        return self.proc.poll() is None

    def log(self) -> str:
        """What it wrote to stderr so far."""
        return (self.workdir / "stderr.log").read_text(errors="replace")

    def stop(self, grace: float = STOP_GRACE_SECONDS) -> int | None:
        """SIGTERM, wait up to `grace` seconds, then SIGKILL the whole group.

        Returns the exit status when it stopped by itself within the grace, else None.
        """
        code: int | None = None
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
            code = self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            # Whatever is left of the group (children of a supervisor that was killed, a
            # gunicorn worker that ignored TERM) dies with it.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            if self.proc.poll() is None:
                self.proc.wait(10)
        return code


def _spawn(name: str, argv: list[str], workdir: Path, env: Mapping[str, str]) -> ManagedProcess:
    workdir.mkdir(parents=True, exist_ok=True)
    with (workdir / "stdout.log").open("wb") as out, (workdir / "stderr.log").open("wb") as err:
        # Fixed argv of our own entry points, no shell.
        proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=dict(env),
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # a group of its own: stop() kills it as a whole
        )
    return ManagedProcess(name, proc, workdir)


def _base_env(database_url: str, workdir: Path, env: Mapping[str, str] | None) -> dict[str, str]:
    return {
        **os.environ,
        "DATABASE_URL": database_url,
        # One directory per process tree (docs/stack-notes.md): the API's and each
        # supervisor's differ.
        "PROMETHEUS_MULTIPROC_DIR": str(workdir / "prometheus"),
        **(env or {}),
    }


@dataclass
class ApiServer(ManagedProcess):
    """gunicorn serving the API on `base_url` (127.0.0.1)."""

    base_url: str = ""

    def wait_ready(self, timeout: float, path: str = "/ready") -> None:
        """Wait until `path` answers 200; raise `StackError` after `timeout` or on exit."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.running():
                raise StackError(
                    f"gunicorn exited with {self.proc.returncode}:\n{self.log()[-3000:]}"
                )
            with contextlib.suppress(requests.RequestException):
                if requests.get(self.base_url + path, timeout=2).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise StackError(f"{path} not 200 after {timeout}s:\n{self.log()[-3000:]}")
            time.sleep(0.1)


@contextmanager
def api_server(
    database_url: str,
    workdir: Path,
    *,
    admin_token: str,
    env: Mapping[str, str] | None = None,
    ready_timeout: float = 60.0,
) -> Iterator[ApiServer]:
    """Run gunicorn with `deploy/gunicorn.conf.py` on a free 127.0.0.1 port until the block ends.

    `env` adds or overrides variables (GUNICORN_WORKERS, STALE_AFTER_SECONDS, ...); the
    caller's own environment is inherited, so GUNICORN_WORKERS/THREADS set there apply.
    Yields once `/ready` answers 200.
    """
    port = free_port()
    environment = _base_env(database_url, workdir, env)
    environment.update(ADMIN_TOKEN=admin_token, GUNICORN_BIND=f"127.0.0.1:{port}")
    argv = [sys.executable, "-m", "gunicorn", "-c", "deploy/gunicorn.conf.py", "wsgi:app"]
    spawned = _spawn("api", argv, workdir, environment)
    server = ApiServer(spawned.name, spawned.proc, workdir, base_url=f"http://127.0.0.1:{port}")
    try:
        server.wait_ready(ready_timeout)
        yield server
    finally:
        server.stop()


@dataclass
class WorkerSupervisor(ManagedProcess):
    """A `python -m worker` supervisor; its metrics port comes from `--metrics-port-file`."""

    def port(self, timeout: float = 30.0) -> int:
        """The metrics port, once written; raise `StackError` if it exits first."""
        path = self.workdir / "metrics.port"
        deadline = time.monotonic() + timeout
        while not path.exists():
            if not self.running() or time.monotonic() > deadline:
                raise StackError(f"supervisor did not start:\n{self.log()[-3000:]}")
            time.sleep(0.05)
        return int(path.read_text())

    def metrics(self) -> dict[str, float]:
        """One scrape of its /metrics."""
        response = requests.get(f"http://127.0.0.1:{self.port()}/metrics", timeout=5)
        response.raise_for_status()
        return parse_metrics(response.text)

    def children(self) -> list[int]:
        """Its live worker children right now (its metrics exporter left out)."""
        return worker_children_of(self.pid)

    def wait_children(self, count: int, timeout: float = 30.0) -> list[int]:
        """Wait until it has `count` live children; return them."""
        deadline = time.monotonic() + timeout
        while len(pids := self.children()) != count:
            if not self.running() or time.monotonic() > deadline:
                raise StackError(f"no {count} children:\n{self.log()[-3000:]}")
            time.sleep(0.05)
        return pids


@contextmanager
def supervisor(
    database_url: str,
    workdir: Path,
    *,
    concurrency: int = 2,
    env: Mapping[str, str] | None = None,
) -> Iterator[WorkerSupervisor]:
    """Run `python -m worker` with `concurrency` children until the block ends.

    Metrics on a free port of 127.0.0.1; `SHUTDOWN_TIMEOUT_SECONDS` 5 unless `env` says
    otherwise. Yields once the metrics port is open and every child exists.
    """
    environment = {
        "WORKER_CONCURRENCY": str(concurrency),
        "SHUTDOWN_TIMEOUT_SECONDS": "5",
        **(env or {}),
    }
    sup = start_supervisor(database_url, workdir, environment)
    try:
        sup.port()
        sup.wait_children(concurrency)
        yield sup
    finally:
        # Past the supervisor's own shutdown timeout, so a graceful stop is not cut short.
        sup.stop(float(environment["SHUTDOWN_TIMEOUT_SECONDS"]) + 5)


def start_supervisor(
    database_url: str, workdir: Path, env: Mapping[str, str] | None = None
) -> WorkerSupervisor:
    """Start `python -m worker` (metrics on a free port) without waiting; the caller stops it.

    `env` adds or overrides variables (WORKER_CONCURRENCY, LOG_LEVEL, ...).
    """
    environment = _base_env(database_url, workdir, None)
    environment["WORKER_METRICS_PORT"] = "0"
    environment.update(env or {})
    argv = [sys.executable, "-m", "worker", "--metrics-port-file", str(workdir / "metrics.port")]
    spawned = _spawn("worker", argv, workdir, environment)
    return WorkerSupervisor(spawned.name, spawned.proc, workdir)


# -- API data ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Company:
    """A company created over the API and its key."""

    id: str
    api_key: str


def create_companies(
    base_url: str, admin_token: str, count: int, prefix: str = "company"
) -> list[Company]:
    """Create `count` companies as the admin; return them with their API keys."""
    found: list[Company] = []
    with requests.Session() as session:
        session.headers["Authorization"] = f"Bearer {admin_token}"
        for n in range(count):
            response = session.post(
                f"{base_url}/companies", json={"name": f"{prefix}-{n}"}, timeout=30
            )
            if response.status_code != 201:
                raise StackError(f"POST /companies answered {response.status_code}")
            body = response.json()
            found.append(Company(str(body["id"]), str(body["api_key"])))
    return found


# -- PostgreSQL ----------------------------------------------------------------------------


def add_database_url_argument(
    parser: argparse.ArgumentParser, help_text: str | None = None
) -> None:
    """`--database-url` (default None: the script starts an embedded server)."""
    parser.add_argument("--database-url", default=None, help=help_text)


def ensure_database(url: str) -> None:
    """Create the database named in `url` when the server does not have it yet."""
    parsed = make_url(url)
    admin = parsed.set(drivername="postgresql", database="postgres")
    with psycopg.connect(admin.render_as_string(hide_password=False), autocommit=True) as conn:
        if not conn.execute(
            "SELECT 1 FROM pg_database WHERE datname = %s", (parsed.database,)
        ).fetchone():
            conn.execute(f'CREATE DATABASE "{parsed.database}"')


def migrate(url: str) -> None:
    """Create the database in `url` if missing, then `alembic upgrade head` it."""
    ensure_database(url)
    cfg = Config(toml_file=str(ROOT / "pyproject.toml"))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    command.upgrade(cfg, "head")


def empty_tables(url: str) -> None:
    """Delete every task and company, and rewind the claim cursor: each run starts from nothing."""
    engine = script_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(
                text("TRUNCATE tasks, company_queues, company_backlogs, api_keys, companies")
            )
            conn.execute(
                text(
                    "SELECT setval('fairq_claim_cursor_position', 0), "
                    "setval('fairq_claim_cursor_credit', 0)"
                )
            )
    finally:
        engine.dispose()


def script_engine(url: str, application_name: str = "fairq-script") -> Engine:
    """An engine whose connections never outlive their use (the server may be stopped)."""
    return make_engine(url, application_name=application_name, poolclass=pool.NullPool)


@contextmanager
def database(
    url: str | None,
    name: str,
    *,
    options: Mapping[str, str] | None = None,
    empty: bool = True,
) -> Iterator[str]:
    """Yield a migrated, emptied database: `url`, else an embedded one in `.pgdata/<name>`.

    The embedded server listens on a free port of 127.0.0.1, with `options` as server
    settings, and is stopped at the end; its data stays for the next run. The database's
    tasks and companies are deleted first unless `empty` is False.
    """
    embedded: EmbeddedPostgres | None = None
    if url is None:
        embedded = EmbeddedPostgres(
            ROOT / ".pgdata" / name,
            free_port(),
            options={"max_connections": "200", **(options or {})},
        )
        embedded.stop()  # a server left by an interrupted run listens on another port
        embedded.start()
        url = embedded.url(f"fairq_{name.replace('-', '_')}")
    elif url.startswith(("postgresql://", "postgres://")):
        url = "postgresql+psycopg://" + url.split("://", 1)[1]
    try:
        migrate(url)
        if empty:
            empty_tables(url)
        yield url
    finally:
        if embedded is not None:
            embedded.stop()
