"""`make run` (`python -m scripts.run_local`) as a real process, signalled like a terminal does.

Each run keeps its state (`.run/`, `.pgdata/dev`) in a directory of its own under `.pgdata/`
(`--state-dir`; inside the checkout, so that under root the embedded server's unprivileged user
can reach it) and listens on free ports, so a developer's own `make run` is never touched.
Ctrl-C is SIGINT to the run's process group, as a terminal sends it. Every process a run
starts inherits a marker variable; after the run, no process may carry it any more.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests

from devtools.embedded_postgres import EmbeddedPostgres, free_ports
from tests import pg

MARKER = "FAIRQ_RUN_LOCAL_TEST"
BANNER = "fairq is running on"
STATE_PREFIX = "run-local-"
# The ports `make run` takes, each its own (`scripts/run_local.py`).
PORT_VARIABLES = ("PORT", "WORKER_METRICS_PORT", "EMBEDDED_PG_PORT")


def processes_with(marker: str) -> list[tuple[int, str]]:
    """(pid, command line) of every live process whose environment carries `marker`."""
    needle = f"{MARKER}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # gone meanwhile, or another user's
            continue
        if state not in ("Z", "X"):
            found.append((int(entry.name), cmdline))
    return found


def postmasters_of(datadir: Path) -> list[int]:
    """Pids of live processes started with `-D datadir` (a postmaster of that directory)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"-D" in args and str(datadir).encode() in args:
            found.append(int(entry.name))
    return found


def port_free(port: int) -> bool:
    """True when a server could listen on 127.0.0.1:`port` now."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def wait_for(condition: Callable[[], object], timeout: float, what: str) -> None:
    """Poll `condition` every 10 ms until true; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


@dataclass
class Run:
    """One `python -m scripts.run_local`, a process group of its own like a shell's job."""

    proc: subprocess.Popen[bytes]
    marker: str
    state_dir: Path
    out: Path
    err: Path
    ports: dict[str, int] = field(default_factory=dict)

    @property
    def datadir(self) -> Path:
        """Its embedded server's data directory."""
        return self.state_dir / ".pgdata" / "dev"

    def stdout(self) -> str:
        """What it printed so far."""
        return self.out.read_text(errors="replace")

    def stderr(self) -> str:
        """What it and its children wrote to stderr so far."""
        return self.err.read_text(errors="replace")

    def ctrl_c(self) -> None:
        """SIGINT to its whole foreground group, as the terminal sends it on Ctrl-C."""
        os.killpg(self.proc.pid, signal.SIGINT)

    def wait(self, timeout: float = 60.0) -> int:
        """Its exit status."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"still running after {timeout}s\n{self.stdout()}\n{self.stderr()[-3000:]}"
            ) from None

    def wait_output(self, text: str, timeout: float = 120.0) -> None:
        """Until it printed `text`; fail if it exits first."""

        def printed() -> bool:
            if text in self.stdout():
                return True
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"exited with {self.proc.returncode} before printing {text!r}:\n"
                    f"{self.stdout()}\n{self.stderr()[-3000:]}"
                )
            return False

        wait_for(printed, timeout, repr(text))

    def child_running(self, program: str) -> bool:
        """True while a process of this run runs `program` (a word of its command line)."""
        return any(program in cmdline for _pid, cmdline in processes_with(self.marker))

    def assert_nothing_left(self) -> None:
        """No process of this run, no server on its data directory, all its ports free."""
        deadline = time.monotonic() + 10  # orphans of a killed group need a moment to go
        while processes_with(self.marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert processes_with(self.marker) == []
        assert postmasters_of(self.datadir) == []
        assert not (self.datadir / "postmaster.pid").exists()
        for name, port in self.ports.items():
            assert port_free(port), f"{name} {port} still taken"

    def assert_no_traceback(self) -> None:
        """Nothing of this run (its children included) printed a traceback."""
        stderr = self.stderr()
        assert "Traceback" not in stderr, stderr[-3000:]
        assert "KeyboardInterrupt" not in stderr, stderr[-3000:]

    def kill(self) -> None:
        """Whatever is left of it, at the end of a test that failed half-way."""
        for pid, _cmdline in processes_with(self.marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        EmbeddedPostgres(self.datadir, 1).stop("immediate")


@pytest.fixture
def start_run(tmp_path: Path) -> Iterator[Callable[..., Run]]:
    """Start runs of scripts.run_local; whatever they leave is killed at the end."""
    runs: list[Run] = []

    def start(
        state_dir: Path,
        *args: str,
        env: dict[str, str] | None = None,
        ports: dict[str, int] | None = None,
    ) -> Run:
        marker = uuid.uuid4().hex
        ports = ports or dict(zip(PORT_VARIABLES, free_ports(3), strict=True))
        environment = {
            k: v
            for k, v in os.environ.items()
            if k not in ("DATABASE_URL", "GUNICORN_BIND", "ADMIN_TOKEN")
        }
        environment.update({name: str(port) for name, port in ports.items()})
        environment.update(
            SHUTDOWN_TIMEOUT_SECONDS="5", WORKER_CONCURRENCY="1", GUNICORN_WORKERS="1"
        )
        environment.update({MARKER: marker, **(env or {})})
        n = len(runs)
        out, err = tmp_path / f"run{n}.out", tmp_path / f"run{n}.err"
        with out.open("wb") as stdout, err.open("wb") as stderr:
            proc = subprocess.Popen(
                [sys.executable, "-m", "scripts.run_local", "--state-dir", str(state_dir), *args],
                cwd=pg.ROOT,
                env=environment,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,  # a job of its own: ctrl_c() signals its group
            )
        run = Run(proc, marker, state_dir, out, err, ports)
        runs.append(run)
        return run

    yield start
    for run in runs:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()
        run.kill()


def new_state_dir() -> Path:
    """A state directory inside the checkout's .pgdata/ (see the module docstring)."""
    path = pg.ROOT / ".pgdata" / f"{STATE_PREFIX}{uuid.uuid4().hex[:12]}"
    path.mkdir(parents=True)
    return path


@pytest.fixture
def state_dir() -> Iterator[Path]:
    """A fresh state directory, deleted after the test."""
    path = new_state_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def shared_state() -> Iterator[Path]:
    """A state directory whose embedded data directory the Ctrl-C tests share (one initdb)."""
    path = new_state_dir()
    yield path
    EmbeddedPostgres(path / ".pgdata" / "dev", 1).stop("immediate")
    shutil.rmtree(path, ignore_errors=True)


# -- before anything starts ------------------------------------------------------------------


@pytest.mark.parametrize("variable", PORT_VARIABLES)
def test_a_busy_port_stops_the_run_before_it_starts_anything(
    start_run: Callable[..., Run], state_dir: Path, variable: str
) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        ports = dict(zip(PORT_VARIABLES, free_ports(3), strict=True))
        ports[variable] = busy
        run = start_run(state_dir, ports=ports)
        status = run.wait(30)
        assert status == 1
        assert f"port {busy}" in run.stderr()
        assert f"{variable}=<port> make run" in run.stderr()
    assert BANNER not in run.stdout()
    assert not run.datadir.exists()  # no embedded server was even prepared
    run.assert_nothing_left()
    run.assert_no_traceback()


def test_an_invalid_port_is_a_configuration_error(
    start_run: Callable[..., Run], state_dir: Path
) -> None:
    run = start_run(state_dir, env={"WORKER_METRICS_PORT": "91000"})
    assert run.wait(30) == 2
    assert "WORKER_METRICS_PORT must be between 0 and 65535" in run.stderr()
    assert not run.datadir.exists()


def test_a_guessable_admin_token_is_a_configuration_error(
    start_run: Callable[..., Run], state_dir: Path
) -> None:
    run = start_run(state_dir, env={"ADMIN_TOKEN": "change-me-please-0123456789"})
    assert run.wait(30) == 2
    assert "ADMIN_TOKEN is the published placeholder" in run.stderr()
    assert "secrets.token_urlsafe(32)" in run.stderr()
    assert not run.datadir.exists()


def test_a_worker_that_cannot_start_means_no_banner_and_a_failed_exit(
    start_run: Callable[..., Run], state_dir: Path, fresh_db_url: str
) -> None:
    # WORKER_CONCURRENCY=0 is refused by the supervisor (exit 2) once the API is already up.
    run = start_run(state_dir, env={"DATABASE_URL": fresh_db_url, "WORKER_CONCURRENCY": "0"})
    status = run.wait(60)
    assert status == 1
    assert "the worker supervisor exited with status 2 while starting" in run.stderr()
    assert BANNER not in run.stdout()
    run.assert_nothing_left()
    run.assert_no_traceback()


@pytest.mark.skipif(os.geteuid() != 0, reason="what root does differently")
def test_as_root_a_checkout_the_server_user_cannot_enter_stops_with_what_to_do(
    start_run: Callable[..., Run], state_dir: Path
) -> None:
    private = state_dir / "private"
    private.mkdir(mode=0o700)
    run = start_run(private)
    assert run.wait(30) == 1
    stderr = run.stderr()
    assert f"cannot enter {private} (mode 0700, owner root)" in stderr
    assert "set DATABASE_URL" in stderr
    assert "run this as a non-root user" in stderr
    assert private.stat().st_mode & 0o777 == 0o700
    assert BANNER not in run.stdout()
    run.assert_nothing_left()
    run.assert_no_traceback()


# -- Ctrl-C at each point of start-up, and while serving ---------------------------------------


def test_ctrl_c_during_initdb_stops_everything(
    start_run: Callable[..., Run], shared_state: Path
) -> None:
    shutil.rmtree(shared_state / ".pgdata" / "dev", ignore_errors=True)
    run = start_run(shared_state)
    wait_for(lambda: run.child_running("/initdb"), 30, "initdb")
    run.ctrl_c()
    assert run.wait() == 130
    assert "stopped during start-up" in run.stderr()
    run.assert_nothing_left()
    run.assert_no_traceback()


def test_ctrl_c_right_after_the_embedded_server_started_stops_it(
    start_run: Callable[..., Run], shared_state: Path
) -> None:
    run = start_run(shared_state)
    run.wait_output("the embedded PostgreSQL is up")
    run.ctrl_c()
    assert run.wait() == 130
    assert "the embedded PostgreSQL stopped" in run.stdout()
    run.assert_nothing_left()
    run.assert_no_traceback()


def test_ctrl_c_during_the_migrations_stops_everything(
    start_run: Callable[..., Run], shared_state: Path
) -> None:
    run = start_run(shared_state)
    wait_for(lambda: run.child_running("alembic"), 60, "alembic upgrade")
    run.ctrl_c()
    assert run.wait() == 130
    assert BANNER not in run.stdout()
    run.assert_nothing_left()
    run.assert_no_traceback()


def test_a_second_run_in_the_same_checkout_stops_nothing_and_ctrl_c_stops_the_first(
    start_run: Callable[..., Run], shared_state: Path
) -> None:
    first = start_run(shared_state)
    first.wait_output(BANNER)
    base = f"http://127.0.0.1:{first.ports['PORT']}"
    assert requests.get(f"{base}/ready", timeout=5).status_code == 200
    health = f"http://127.0.0.1:{first.ports['WORKER_METRICS_PORT']}/health"
    assert requests.get(health, timeout=5).status_code == 200
    postmaster = EmbeddedPostgres(first.datadir, 1).postmaster_pid()
    assert postmaster is not None
    assert (shared_state / ".run" / "run_local.pid").read_text().strip() == str(first.proc.pid)

    # The same checkout, on other ports: the instance check, not a port, stops it, at once.
    started = time.monotonic()
    second = start_run(shared_state)
    assert second.wait(30) == 1
    assert time.monotonic() - started < 10
    assert f"already running from this checkout (pid {first.proc.pid}" in second.stderr()
    assert BANNER not in second.stdout()
    second.assert_no_traceback()
    # ... and the first still has its database.
    assert EmbeddedPostgres(first.datadir, 1).postmaster_pid() == postmaster
    assert requests.get(f"{base}/ready", timeout=5).json()["database"] == "ok"

    first.ctrl_c()
    assert first.wait() == 0
    assert "fairq stopped" in first.stdout()
    first.assert_nothing_left()
    first.assert_no_traceback()
