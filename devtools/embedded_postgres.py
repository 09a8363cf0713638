"""An embedded PostgreSQL 16 for `make run`, tests and scripts when no server is configured.

Uses the server binaries shipped in the `pgserver` wheel (the `embedded` extra) but drives
`initdb`/`pg_ctl` itself, so the server listens on 127.0.0.1:<port> (worker children and
gunicorn connect over TCP like in production) and tests can stop and restart it.
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import shutil
import socket
import stat
import subprocess
import time
from pathlib import Path

# PostgreSQL refuses to run as root; under root we run it as this unprivileged user.
_SERVER_USER = "pgserver"


def _bin_dir() -> Path:
    # find_spec, not import: importing pgserver runs its own server machinery and warns.
    spec = importlib.util.find_spec("pgserver")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the embedded PostgreSQL needs the 'embedded' extra: pip install '.[embedded]'"
        )
    return Path(spec.submodule_search_locations[0]) / "pginstall" / "bin"


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class EmbeddedPostgres:
    """A PostgreSQL server owned by this process tree, data in `datadir`, on 127.0.0.1:`port`.

    `start()` initializes the data directory on first use and is a no-op when the server is
    already running there; `stop()` and `restart()` use `pg_ctl` (fast shutdown). Raises
    `subprocess.CalledProcessError` with the server log on failure.
    """

    def __init__(self, datadir: Path, port: int, *, options: dict[str, str] | None = None):
        self.datadir = datadir.resolve()
        self.port = port
        self.options = {"listen_addresses": "127.0.0.1", "port": str(port), **(options or {})}
        self._bin = _bin_dir()
        self._user: str | None = _SERVER_USER if os.geteuid() == 0 else None

    @property
    def log_path(self) -> Path:
        """The server log, kept beside the data directory."""
        return self.datadir.parent / f"{self.datadir.name}.log"

    def url(self, database: str = "postgres") -> str:
        """SQLAlchemy URL for `database` on this server (trust auth, user `postgres`)."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def _run(self, *args: str) -> None:
        cmd = [str(self._bin / args[0]), *args[1:]]
        kwargs: dict[str, object] = {}
        if self._user is not None:
            kwargs["user"] = self._user
        # Fixed binaries from the wheel, argument lists, no shell.
        result = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            check=False,
            **kwargs,  # type: ignore[call-overload]
        )
        if result.returncode != 0:
            log = self.log_path.read_text() if self.log_path.exists() else ""
            raise subprocess.CalledProcessError(
                result.returncode, cmd, result.stdout, f"{result.stderr}\n{log[-4000:]}"
            )

    def _prepare_permissions(self) -> None:
        if self._user is None:
            return
        try:
            pwd.getpwnam(self._user)
        except KeyError:
            subprocess.run(["useradd", "-s", "/bin/sh", self._user], check=True)
        entry = pwd.getpwnam(self._user)
        # The server user must traverse every parent of the data directory and run the binaries.
        traverse = stat.S_IXGRP | stat.S_IXOTH | stat.S_IRGRP | stat.S_IROTH
        for parent in [*self.datadir.parents, *self._bin.parents]:
            mode = parent.stat().st_mode
            if mode & traverse != traverse:
                parent.chmod(mode | traverse)
        for root, dirs, files in os.walk(self._bin.parent):
            for name in dirs + files:
                path = Path(root, name)
                path.chmod(path.stat().st_mode | traverse)
        self.datadir.mkdir(parents=True, exist_ok=True)
        os.chown(self.datadir, entry.pw_uid, entry.pw_gid)
        self.log_path.touch()
        os.chown(self.log_path, entry.pw_uid, entry.pw_gid)

    def is_running(self) -> bool:
        """True when a postmaster answers on this data directory."""
        pid_file = self.datadir / "postmaster.pid"
        if not pid_file.exists():
            return False
        try:
            pid = int(pid_file.read_text().splitlines()[0])
            os.kill(pid, 0)
        except (ValueError, IndexError, ProcessLookupError):
            return False
        return True

    def start(self) -> str:
        """Initialize (first time) and start the server; return the `postgres` database URL."""
        self.datadir.mkdir(parents=True, exist_ok=True)
        self._prepare_permissions()
        if not (self.datadir / "PG_VERSION").exists():
            self._run(
                "initdb", "-D", str(self.datadir), "-U", "postgres", "--auth=trust",
                "--encoding=UTF8", "--no-sync",
            )  # fmt: skip
        if not self.is_running():
            opts = " ".join(f"-c {k}={v}" for k, v in self.options.items())
            # The socket directory is the data directory: no shared /tmp or /run state.
            self._run(
                "pg_ctl", "-D", str(self.datadir), "-l", str(self.log_path), "-w", "-t", "60",
                "-o", f"{opts} -c unix_socket_directories='{self.datadir}'", "start",
            )  # fmt: skip
        self._wait_ready()
        return self.url()

    def _wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                time.sleep(0.1)
        raise TimeoutError(f"embedded PostgreSQL did not listen on {self.port} in {timeout}s")

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (`pg_ctl stop -m mode`); a no-op when it is not running."""
        if self.is_running():
            self._run("pg_ctl", "-D", str(self.datadir), "-w", "-t", "60", "-m", mode, "stop")

    def restart(self) -> None:
        """Stop then start again on the same port and data."""
        self.stop()
        self.start()

    def destroy(self) -> None:
        """Stop the server and delete its data directory and log."""
        self.stop("immediate")
        shutil.rmtree(self.datadir, ignore_errors=True)
        self.log_path.unlink(missing_ok=True)
