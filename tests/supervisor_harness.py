"""Run the real worker supervisor (`python -m worker`) as a subprocess, and look at it.

Shared by the supervisor, child, metrics and CLI tests. Output goes to files (a PIPE nobody
reads fills up and blocks the process); the metrics port is read from `--metrics-port-file`;
children are found in /proc. `supervisors` stops everything it started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
from sqlalchemy import Engine, text

from devtools.stack import children_of, parse_metrics, worker_children_of

ROOT = Path(__file__).resolve().parent.parent

# Scaled-down windows so the process tests take seconds, not minutes.
FAST_ENV = {
    "STALE_AFTER_SECONDS": "2",
    "SHUTDOWN_TIMEOUT_SECONDS": "10",
    "WORKER_POLL_INTERVAL": "0.2",
    "WORKER_METRICS_PORT": "0",
    "LOG_LEVEL": "INFO",
}


# How long a harness waits, by default, for what a healthy supervisor does within a second or
# two (a port written, children forked and booted): generous, for a 2-core box running the
# suite's two processes and their databases; a passing test never waits it out.
PROCESS_WAIT_SECONDS = 45.0


def wait_for(
    condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.05
) -> Any:
    """Poll `condition` until it returns something truthy; return it, or fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def process_state(pid: int) -> str | None:
    """The state letter of `pid` (R, S, Z, ...), or None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def is_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    return process_state(pid) not in (None, "Z", "X")


@dataclass
class RunningSupervisor:
    """A `python -m worker` subprocess started by the `supervisor` fixture."""

    proc: subprocess.Popen[bytes]
    workdir: Path
    seen_children: set[int] = field(default_factory=set)

    @property
    def pid(self) -> int:
        """The supervisor's pid."""
        return self.proc.pid

    @property
    def multiproc_dir(self) -> Path:
        """Its PROMETHEUS_MULTIPROC_DIR (kept after exit, for post-mortem metrics)."""
        return self.workdir / "prometheus"

    def log(self) -> str:
        """Everything it (and its children) wrote to stderr so far."""
        return (self.workdir / "stderr.log").read_text(errors="replace")

    def stdout(self) -> str:
        """Everything written to stdout so far."""
        return (self.workdir / "stdout.log").read_text(errors="replace")

    def port(self, timeout: float = PROCESS_WAIT_SECONDS) -> int:
        """The metrics port, once the supervisor has written it."""
        path = self.workdir / "metrics.port"

        def read() -> int | None:
            if self.proc.poll() is not None:
                pytest.fail(f"supervisor exited with {self.proc.returncode}:\n{self.log()}")
            return int(path.read_text()) if path.exists() else None

        port: int = wait_for(read, timeout, "the metrics port file")
        return port

    def metrics(self) -> dict[str, float]:
        """One scrape of its /metrics."""
        response = requests.get(f"http://127.0.0.1:{self.port()}/metrics", timeout=5)
        assert response.status_code == 200
        return parse_metrics(response.text)

    def children(self) -> list[int]:
        """Its live worker children right now (its metrics exporter left out)."""
        pids = worker_children_of(self.pid)
        self.seen_children.update(pids)
        return pids

    def wait_children(self, count: int, timeout: float = PROCESS_WAIT_SECONDS) -> list[int]:
        """Wait until it has exactly `count` children; return their pids."""
        pids: list[int] = wait_for(
            lambda: pids if len(pids := self.children()) == count else None,
            timeout,
            f"{count} children of the supervisor (log:\n{self.log()[-3000:]})",
        )
        return pids

    def wait_ready(self, count: int, timeout: float = PROCESS_WAIT_SECONDS) -> list[int]:
        """Wait until `count` children exist and have each logged that they booted."""
        pids = self.wait_children(count, timeout)
        wait_for(
            lambda: all(f"child {pid} ready" in self.log() for pid in pids),
            timeout,
            f"children {pids} to boot",
        )
        return pids

    def send(self, sig: signal.Signals) -> None:
        """Send `sig` to the supervisor."""
        os.kill(self.pid, sig)

    def wait(self, timeout: float) -> int:
        """Wait for the supervisor to exit; return its exit status."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"supervisor still running after {timeout}s:\n{self.log()[-3000:]}")

    def kill_all(self) -> None:
        """SIGKILL the supervisor and every child it ever had (test teardown)."""
        self.seen_children.update(children_of(self.pid))
        for pid in [self.pid, *self.seen_children]:
            if is_alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)


StartSupervisor = Callable[..., RunningSupervisor]


def supervisors(tmp_path: Path, database_url: str) -> Iterator[StartSupervisor]:
    """Body of a fixture: yield `start(*flags, **env)`, which runs `python -m worker`.

    Environment: the test's own, then `FAST_ENV`, then `env` (None removes a variable).
    Every supervisor and child it started is killed at teardown if still alive. The
    `supervisor` fixture (conftest) wraps it.
    """
    started: list[RunningSupervisor] = []

    def start(*flags: str, **env: str | None) -> RunningSupervisor:
        workdir = tmp_path / f"supervisor-{len(started)}"
        workdir.mkdir()
        environment = {
            **os.environ,
            "DATABASE_URL": database_url,
            "PROMETHEUS_MULTIPROC_DIR": str(workdir / "prometheus"),
            **FAST_ENV,
        }
        for key, value in env.items():
            if value is None:
                environment.pop(key, None)
            else:
                environment[key] = value
        with (workdir / "stdout.log").open("wb") as out, (workdir / "stderr.log").open("wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "worker", "--metrics-port-file",
                 str(workdir / "metrics.port"), *flags],
                cwd=ROOT, env=environment, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        running = RunningSupervisor(proc, workdir)
        started.append(running)
        return running

    yield start
    for running in started:
        running.kill_all()


# -- database helpers -----------------------------------------------------------------------


def status_counts(engine: Engine) -> dict[str, int]:
    """How many tasks are in each status."""
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT status, count(*) FROM tasks GROUP BY status")).all()
    return {str(status): int(count) for status, count in rows}


def task_row(engine: Engine, task_id: uuid.UUID) -> dict[str, Any]:
    """One task's columns as a dict."""
    with engine.connect() as conn:
        row = conn.execute(text("SELECT * FROM tasks WHERE id = :id"), {"id": task_id}).one()
    return dict(row._mapping)
