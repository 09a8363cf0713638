"""Start fairq locally: PostgreSQL, migrations, the API and the worker supervisor.

`make run` calls this. PostgreSQL comes from `DATABASE_URL` when set, else an embedded
PostgreSQL 16 with its data in `.pgdata/dev`. The admin token comes from `ADMIN_TOKEN`, else
one is generated once and kept in `.run/admin_token`.

Before it starts anything it checks that no other instance runs from this checkout (the lock
`.run/run_local.pid` holds its pid) and that every port it needs is free: the API's (`PORT`,
8000), the worker's metrics (`WORKER_METRICS_PORT`, 9100) and the embedded server's
(`EMBEDDED_PG_PORT`, 54329); else it stops at once, naming the instance or the port, and
touches nothing. The banner appears once the API answers `/ready` and the worker `/health`.
Ctrl-C (or SIGTERM) at any moment stops what this run started, and only that: TERM to the API
and the worker (a second Ctrl-C kills them), then the embedded server.

Exit status: 0 stopped by Ctrl-C or SIGTERM once running; 1 something could not start, or
stopped by itself (the message says what); 2 an invalid setting (the message names it); 130
interrupted during start-up.

Usage (from the repository root; `make run` installs the virtualenv first):
    .venv/bin/python -m scripts.run_local [--port 8000] [--no-worker] [--state-dir DIR]
"""

from __future__ import annotations

# Standard library only up here: the signal handlers are installed first thing in main(), and
# everything heavier is imported after, so a Ctrl-C during start-up never meets Python's
# default handler (a KeyboardInterrupt traceback).
import argparse
import contextlib
import errno
import fcntl
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from devtools.embedded_postgres import EmbeddedPostgres, EmbeddedPostgresError

ROOT = Path(__file__).resolve().parent.parent

DEFAULT_API_PORT = 8000
DEFAULT_EMBEDDED_PORT = 54329
LOCAL_HOST = "127.0.0.1"
READY_TIMEOUT_SECONDS = 60.0
# Past the worker's default SHUTDOWN_TIMEOUT_SECONDS (30) and gunicorn's graceful timeout (30).
STOP_TIMEOUT_SECONDS = 40.0

INVALID_SETTING_EXIT = 2
INTERRUPTED_EXIT = 128 + signal.SIGINT


class StartupError(Exception):
    """Start-up cannot go on; the message says why and what to do. Carries the exit status."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status


class Interrupted(Exception):
    """Ctrl-C or SIGTERM arrived during a step that cannot poll for it."""


class StopRequest:
    """Ctrl-C and SIGTERM: recorded, never raised, except inside `interruptible()`.

    Every step polls `requested` between its waits, so no exception lands in the middle of
    starting or stopping a process (where a half-started child would be lost).
    """

    def __init__(self) -> None:
        self.count = 0
        self._interruptible = False

    def install(self) -> None:
        """Handle SIGINT and SIGTERM from now on."""
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)

    def requested(self) -> bool:
        """True once a stop was asked for (a method: it changes under the caller's feet)."""
        return self.count > 0

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.count += 1
        # os.write, not print: a handler that prints while the main code prints fails.
        if self.count == 1:
            os.write(2, b"\nstopping everything this run started (Ctrl-C again: at once)\n")
        if self._interruptible:
            self._interruptible = False
            raise Interrupted

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """Within the block a stop request raises `Interrupted` (a blocking call in Python)."""
        if self.requested():
            raise Interrupted
        self._interruptible = True
        try:
            yield
        finally:
            self._interruptible = False


@dataclass(frozen=True)
class Config:
    """What this run uses, read and checked before anything starts."""

    state_dir: Path
    api_port: int
    metrics_host: str
    metrics_port: int  # 0: any free port
    database_url: str | None  # None: the embedded server
    embedded_port: int
    worker: bool

    @property
    def run_dir(self) -> Path:
        """Pid lock, admin token, metrics directories, the worker's metrics port."""
        return self.state_dir / ".run"

    @property
    def data_dir(self) -> Path:
        """The embedded server's data."""
        return self.state_dir / ".pgdata" / "dev"

    @property
    def base_url(self) -> str:
        """Where the API answers."""
        return f"http://{LOCAL_HOST}:{self.api_port}"


def read_config(args: argparse.Namespace, environ: Mapping[str, str]) -> Config:
    """The settings of this run; `StartupError` (status 2) naming the variable if invalid."""
    from api.settings import check_admin_token
    from common.environment import SettingsError, env_int, env_str
    from worker.settings import WorkerSettings

    env = dict(environ)
    if args.port is not None:
        env["PORT"] = args.port
    if env.get("GUNICORN_BIND", "").strip():
        raise StartupError(
            f"GUNICORN_BIND is set ({env['GUNICORN_BIND']}), but make run binds the API to "
            f"{LOCAL_HOST}:PORT: unset GUNICORN_BIND and choose the port with PORT",
            INVALID_SETTING_EXIT,
        )
    try:
        config = Config(
            state_dir=Path(args.state_dir).resolve() if args.state_dir else ROOT,
            api_port=env_int(env, "PORT", DEFAULT_API_PORT, minimum=1, maximum=65535),
            metrics_host=env_str(env, "WORKER_METRICS_HOST", LOCAL_HOST),
            metrics_port=env_int(
                env, "WORKER_METRICS_PORT", WorkerSettings.metrics_port, minimum=0, maximum=65535
            ),
            database_url=env.get("DATABASE_URL", "").strip() or None,
            embedded_port=env_int(
                env, "EMBEDDED_PG_PORT", DEFAULT_EMBEDDED_PORT, minimum=1, maximum=65535
            ),
            worker=not args.no_worker,
        )
        # The API would refuse it after the database started: say so now.
        if env.get("ADMIN_TOKEN", "").strip():
            check_admin_token(env["ADMIN_TOKEN"].strip())
    except SettingsError as exc:
        raise StartupError(f"invalid configuration: {exc}", INVALID_SETTING_EXIT) from None
    named = [("PORT", config.api_port)]
    if config.worker and config.metrics_port:
        named.append(("WORKER_METRICS_PORT", config.metrics_port))
    if config.database_url is None:
        named.append(("EMBEDDED_PG_PORT", config.embedded_port))
    for i, (name, port) in enumerate(named):
        for other, other_port in named[i + 1 :]:
            if port == other_port:
                raise StartupError(
                    f"invalid configuration: {name} and {other} are both {port}",
                    INVALID_SETTING_EXIT,
                )
    return config


# -- checks before anything starts -----------------------------------------------------------


def lock_instance(run_dir: Path) -> int:
    """Take this checkout's instance lock and write our pid in it; return its descriptor.

    The lock (flock on `.run/run_local.pid`) belongs to the process, so a run that died any
    way at all, even by SIGKILL, leaves no stale lock behind.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "run_local.pid"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise StartupError(
            f"fairq is already running from this checkout (pid {pid}, in {path}). "
            f"Use that one, or stop it first: Ctrl-C in its terminal, or `kill {pid}`."
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def unlock_instance(fd: int) -> None:
    """Empty the pid file and release the lock."""
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
    os.close(fd)


def cannot_listen(host: str, port: int) -> str | None:
    """Why a server could not listen on host:port right now, or None if it could.

    SO_REUSEADDR like gunicorn, the supervisor and PostgreSQL: a port held only by
    connections in TIME_WAIT is free to them.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return "in use"
            return exc.strerror or str(exc)
    return None


def check_ports(config: Config, embedded: EmbeddedPostgres | None) -> None:
    """`StartupError` naming the first port this run needs that is not free, and its variable."""
    wanted = [("the API", "PORT", LOCAL_HOST, config.api_port)]
    if config.worker and config.metrics_port:
        port = config.metrics_port
        wanted.append(("the worker's metrics", "WORKER_METRICS_PORT", config.metrics_host, port))
    if embedded is not None:
        wanted.append(("the embedded PostgreSQL", "EMBEDDED_PG_PORT", LOCAL_HOST, embedded.port))
    for what, variable, host, port in wanted:
        reason = cannot_listen(host, port)
        if reason is None:
            continue
        raise StartupError(
            f"port {port} for {what} on {host} is {reason}; nothing was started. "
            f"Free it (`ss -ltnp 'sport = :{port}'` shows who holds it) or choose another "
            f"port: {variable}=<port> make run"
        )


def check_embedded_not_running(embedded: EmbeddedPostgres) -> None:
    """`StartupError` if this checkout's embedded server runs although no instance does."""
    pid = embedded.postmaster_pid()
    if pid is not None:
        raise StartupError(
            f"the embedded PostgreSQL of this checkout ({embedded.datadir}) is running "
            f"(pid {pid}), left by an earlier run that did not stop it; nothing was started. "
            f"Stop it with `kill -INT {pid}` and run again."
        )


# -- the run ----------------------------------------------------------------------------------


def admin_token(run_dir: Path) -> str:
    """`ADMIN_TOKEN`, or a token generated once and kept in `.run/admin_token` (made again
    when the one kept there would be refused: `api.settings.check_admin_token`)."""
    from api.settings import check_admin_token
    from common.environment import SettingsError

    path = run_dir / "admin_token"
    token = os.environ.get("ADMIN_TOKEN", "").strip()
    if not token and path.exists():
        token = path.read_text().strip()
        try:
            check_admin_token(token)
        except SettingsError:
            token = ""
    token = token or secrets.token_urlsafe(32)
    # Kept in a file so the README's curl lines can read it from any shell.
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(token + "\n")
    path.chmod(0o600)
    return token


def answers(url: str) -> bool:
    """True when `url` answers 200 now."""
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def say(message: str, *, error: bool = False) -> None:
    """One line for the person at the terminal."""
    print(message, file=sys.stderr if error else sys.stdout, flush=True)


class LocalRun:
    """One `make run`: everything it started, so that exactly that is stopped at the end."""

    def __init__(self, config: Config, stop: StopRequest):
        self.config = config
        self.stop = stop
        self.lock_fd: int | None = None
        self.embedded: EmbeddedPostgres | None = None
        self.migration: subprocess.Popen[bytes] | None = None
        self.api: subprocess.Popen[bytes] | None = None
        self.worker: subprocess.Popen[bytes] | None = None

    @property
    def metrics_port_file(self) -> Path:
        """Where the supervisor writes the port it listens on."""
        return self.config.run_dir / "worker-metrics.port"

    def run(self) -> int:
        """Check, start, serve until stopped; return the exit status. Call `shut_down` after."""
        config = self.config
        self.lock_fd = lock_instance(config.run_dir)
        embedded = None
        if config.database_url is None:
            embedded = EmbeddedPostgres(config.data_dir, config.embedded_port)
            check_embedded_not_running(embedded)
        check_ports(config, embedded)
        if self.stop.requested():
            return INTERRUPTED_EXIT

        database_url = config.database_url or self.start_embedded(embedded)
        if self.stop.requested():
            return INTERRUPTED_EXIT
        self.create_database(database_url)
        if not self.migrate(database_url):
            return INTERRUPTED_EXIT
        self.start_services(database_url)
        if not self.wait_ready():
            return INTERRUPTED_EXIT
        self.banner()
        return self.serve()

    def start_embedded(self, embedded: EmbeddedPostgres | None) -> str:
        """Start the embedded server (checked free above); return the fairq database URL."""
        assert embedded is not None
        say(
            f"starting the embedded PostgreSQL 16 on {LOCAL_HOST}:{embedded.port} "
            f"(data in {embedded.datadir})"
        )
        # Recorded before it starts: a start cut short is stopped too.
        self.embedded = embedded
        try:
            embedded.start()
        except EmbeddedPostgresError as exc:
            raise StartupError(f"cannot start the embedded PostgreSQL: {exc}") from None
        except (subprocess.CalledProcessError, TimeoutError) as exc:
            detail = exc.stderr if isinstance(exc, subprocess.CalledProcessError) else exc
            raise StartupError(
                "cannot start the embedded PostgreSQL; set DATABASE_URL to a server you run "
                f"instead. The end of its log:\n{str(detail).strip()[-1500:]}"
            ) from None
        say(f"the embedded PostgreSQL is up (pid {embedded.postmaster_pid()})")
        return embedded.url("fairq")

    def create_database(self, database_url: str) -> None:
        """Create the database when the server lacks it."""
        import psycopg

        from devtools.stack import ensure_database

        try:
            with self.stop.interruptible():
                ensure_database(database_url)
        except psycopg.Error as exc:
            raise StartupError(f"cannot reach the database: {exc}") from None

    def migrate(self, database_url: str) -> bool:
        """`alembic upgrade head` in a process group of its own; False if stopped meanwhile."""
        say("migrating the database (alembic upgrade head)")
        self.migration = subprocess.Popen(
            [sys.executable, "-m", "alembic", "upgrade", "head"],
            cwd=ROOT,
            env={**os.environ, "DATABASE_URL": database_url},
            # Ctrl-C reaches only us; we end it with TERM (no traceback) if asked to stop.
            process_group=0,
        )
        while self.migration.poll() is None:
            if self.stop.requested():
                return False
            time.sleep(0.05)
        if self.migration.returncode != 0:
            raise StartupError(f"the migrations failed (exit status {self.migration.returncode})")
        return True

    def start_services(self, database_url: str) -> None:
        """Start gunicorn and the supervisor, each in a process group of its own."""
        config = self.config
        run_dir = config.run_dir
        token = admin_token(run_dir)
        env = {
            **os.environ,
            "DATABASE_URL": database_url,
            "ADMIN_TOKEN": token,
            "GUNICORN_BIND": f"{LOCAL_HOST}:{config.api_port}",
        }
        py = sys.executable
        # Own process groups: Ctrl-C reaches only us, and we stop them with TERM (graceful)
        # instead of the terminal's INT (gunicorn's quick shutdown). One metrics directory
        # per process tree: the API's and the worker's must differ.
        self.api = subprocess.Popen(
            [py, "-m", "gunicorn", "-c", "deploy/gunicorn.conf.py", "wsgi:app"],
            cwd=ROOT,
            env={**env, "PROMETHEUS_MULTIPROC_DIR": str(run_dir / "prometheus-api")},
            process_group=0,
        )
        if not config.worker:
            return
        self.metrics_port_file.unlink(missing_ok=True)
        worker_env = {
            **env,
            "PROMETHEUS_MULTIPROC_DIR": str(run_dir / "prometheus-worker"),
            "WORKER_METRICS_PORT": str(config.metrics_port),
            # Local development: like the API, reachable from this machine only.
            "WORKER_METRICS_HOST": config.metrics_host,
        }
        self.worker = subprocess.Popen(
            [py, "-m", "worker", "--metrics-port-file", str(self.metrics_port_file)],
            cwd=ROOT,
            env=worker_env,
            process_group=0,
        )

    def services(self) -> list[tuple[str, subprocess.Popen[bytes]]]:
        """The API and the worker, as far as started."""
        named = [("the API (gunicorn)", self.api), ("the worker supervisor", self.worker)]
        return [(name, proc) for name, proc in named if proc is not None]

    def worker_health_url(self) -> str | None:
        """The supervisor's /health, once it has said which port it listens on."""
        try:
            port = int(self.metrics_port_file.read_text())
        except (OSError, ValueError):
            return None
        host = self.config.metrics_host
        if host in ("0.0.0.0", "::"):  # every address: this machine's is one of them
            host = LOCAL_HOST
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{port}/health"

    def wait_ready(self) -> bool:
        """Until the API answers /ready and the worker /health; False if stopped meanwhile."""
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        api_ready = worker_ready = False
        while not (api_ready and (worker_ready or self.worker is None)):
            if self.stop.requested():
                return False
            for name, proc in self.services():
                if proc.poll() is not None:
                    raise StartupError(
                        f"{name} exited with status {proc.returncode} while starting "
                        "(its messages are above); stopping"
                    )
            if time.monotonic() > deadline:
                waiting = [] if api_ready else [f"{self.config.base_url}/ready"]
                if self.worker is not None and not worker_ready:
                    waiting.append("the worker's /health")
                raise StartupError(
                    f"no answer from {' and '.join(waiting)} after {READY_TIMEOUT_SECONDS:.0f} s; "
                    "stopping"
                )
            api_ready = api_ready or answers(f"{self.config.base_url}/ready")
            health = self.worker_health_url()
            worker_ready = worker_ready or (health is not None and answers(health))
            time.sleep(0.1)
        return True

    def banner(self) -> None:
        """Say how to use it, now that it answers."""
        base = self.config.base_url
        run_dir = self.config.run_dir
        token_path = run_dir / "admin_token"
        shown = token_path.relative_to(ROOT) if token_path.is_relative_to(ROOT) else token_path
        worker = ""
        if self.worker is not None:
            health = self.worker_health_url() or ""
            worker = f"Worker supervisor: metrics and health on {health.removesuffix('/health')}\n"
        say(
            f"\nfairq is running on {base} (docs: {base}/docs)\n"
            f"{worker}"
            f"Admin token: {token_path.read_text().strip()}\n\n"
            "Next, in another shell in this directory, create a company:\n\n"
            f"  ADMIN_TOKEN=$(cat {shown})\n"
            f'  curl -s -X POST {base}/companies -H "Authorization: Bearer $ADMIN_TOKEN" '
            "-H 'Content-Type: application/json' -d '{\"name\": \"Acme\"}'\n\n"
            "Press Ctrl-C to stop everything.\n"
        )

    def serve(self) -> int:
        """Until a stop request (0) or a process exits by itself (1)."""
        while not self.stop.requested():
            for name, proc in self.services():
                if proc.poll() is not None:
                    say(f"{name} exited with status {proc.returncode}; stopping", error=True)
                    return 1
            time.sleep(0.2)
        return 0

    def shut_down(self) -> None:
        """Stop what this run started, newest first; only that. Never raises `Interrupted`."""
        if self.migration is not None and self.migration.poll() is None:
            self._stop_group(self.migration, signal.SIGTERM, 10.0)
        for _name, proc in reversed(self.services()):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _name, proc in reversed(self.services()):
            self._stop_group(proc, None, STOP_TIMEOUT_SECONDS)
        if self.embedded is not None and self.embedded.is_running():
            try:
                self.embedded.stop()
                say("the embedded PostgreSQL stopped")
            except subprocess.CalledProcessError as exc:
                say(f"could not stop the embedded PostgreSQL: {exc.stderr}", error=True)
        if self.lock_fd is not None:
            unlock_instance(self.lock_fd)
            self.lock_fd = None

    def _stop_group(
        self, proc: subprocess.Popen[bytes], signum: signal.Signals | None, timeout: float
    ) -> None:
        """Signal (if given), wait up to `timeout` (or a second Ctrl-C), then kill the group.

        The group goes too: a gunicorn worker or worker child left behind by its parent dies
        with it.
        """
        if signum is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signum)
        deadline = time.monotonic() + timeout
        # A second Ctrl-C (or SIGTERM): at once.
        while proc.poll() is None and time.monotonic() < deadline and self.stop.count < 2:
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    parser = argparse.ArgumentParser(
        prog="python -m scripts.run_local",
        description=(__doc__ or "").split("\n\nUsage")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--port", help=f"the API's port (env PORT, default {DEFAULT_API_PORT})")
    parser.add_argument("--no-worker", action="store_true", help="start only the API")
    parser.add_argument(
        "--state-dir",
        metavar="DIR",
        help="keep .run/ and .pgdata/dev in DIR instead of the repository root",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run until interrupted; return the exit status."""
    stop = StopRequest()
    stop.install()
    args = build_parser().parse_args(argv)
    local: LocalRun | None = None
    try:
        local = LocalRun(read_config(args, os.environ), stop)
        status = local.run()
    except StartupError as exc:
        say(str(exc), error=True)
        status = exc.status
    except Interrupted:
        status = INTERRUPTED_EXIT
    finally:
        if local is not None:
            local.shut_down()
    if status == INTERRUPTED_EXIT:
        say("stopped during start-up", error=True)
    elif stop.requested() and status == 0:
        say("fairq stopped")
    return status


if __name__ == "__main__":
    sys.exit(main())
