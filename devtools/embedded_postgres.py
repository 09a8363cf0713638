"""An embedded PostgreSQL 16 for `make run`, tests and scripts when no server is configured.

Uses the server binaries shipped in the `pgserver` wheel (the `embedded` extra) but drives
`initdb`/`pg_ctl` itself, so the server listens on 127.0.0.1:<port> (worker children and
gunicorn connect over TCP like in production) and tests can stop and restart it.

Only the data directory, its log and the directories created for them are touched: no user
is created, and no existing directory gets another mode or owner. PostgreSQL refuses to run
as root, so under root the server runs as an existing unprivileged user (`nobody`, or the
owner of an existing data directory), and only if that user can reach the data directory and
the binaries as they are; otherwise `start()` raises `EmbeddedPostgresError` saying what to
do instead.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pwd
import shutil
import socket
import stat
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

# Under root, the server runs as this existing unprivileged user (never created here).
UNPRIVILEGED_USER = "nobody"


class EmbeddedPostgresError(RuntimeError):
    """The embedded server cannot run here as things are; the message says what to do."""


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
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """Return `count` distinct TCP ports on 127.0.0.1 that were free a moment ago.

    All are held open until every one is picked: one at a time, the kernel may hand out the
    same port twice.
    """
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        for _ in range(count):
            sock = held.enter_context(socket.socket())
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
        return ports


@dataclass(frozen=True)
class ServerAccount:
    """The unprivileged account the server runs as when we are root."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]

    @classmethod
    def of(cls, entry: pwd.struct_passwd) -> ServerAccount:
        """The account of a passwd entry, with every group it belongs to."""
        groups = tuple(os.getgrouplist(entry.pw_name, entry.pw_gid))
        return cls(entry.pw_name, entry.pw_uid, entry.pw_gid, groups)

    def can_enter(self, directory: Path) -> bool:
        """True when this account may traverse `directory`, judged by its mode bits."""
        info = directory.stat()
        if info.st_uid == self.uid:
            return bool(info.st_mode & stat.S_IXUSR)
        if info.st_gid in self.groups:
            return bool(info.st_mode & stat.S_IXGRP)
        return bool(info.st_mode & stat.S_IXOTH)


def _describe(directory: Path) -> str:
    info = directory.stat()
    try:
        owner = pwd.getpwuid(info.st_uid).pw_name
    except KeyError:
        owner = str(info.st_uid)
    return f"{directory} (mode {stat.S_IMODE(info.st_mode):04o}, owner {owner})"


class EmbeddedPostgres:
    """A PostgreSQL server owned by this process tree, data in `datadir`, on 127.0.0.1:`port`.

    `start()` initializes the data directory on first use and is a no-op when the server is
    already running there; `stop()` and `restart()` use `pg_ctl` (fast shutdown). Raises
    `subprocess.CalledProcessError` with the server log on failure, `EmbeddedPostgresError`
    when, as root, no unprivileged user can run it without changes outside the data directory.
    `initdb` and `pg_ctl` run in a session of their own, so a Ctrl-C meant for the caller does
    not cut them short: the caller decides what to stop.
    """

    def __init__(self, datadir: Path, port: int, *, options: dict[str, str] | None = None):
        self.datadir = datadir.resolve()
        self.port = port
        self.options = {"listen_addresses": "127.0.0.1", "port": str(port), **(options or {})}
        self._bin = _bin_dir()
        self._account: ServerAccount | None = None

    @property
    def log_path(self) -> Path:
        """The server log, kept beside the data directory."""
        return self.datadir.parent / f"{self.datadir.name}.log"

    def url(self, database: str = "postgres") -> str:
        """SQLAlchemy URL for `database` on this server (trust auth, user `postgres`)."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def _run(self, *args: str) -> None:
        cmd = [str(self._bin / args[0]), *args[1:]]
        # Under root, as the server account with its own groups only (none of root's).
        account = self.server_account() if os.geteuid() == 0 else None
        # Fixed binaries from the wheel, argument lists, no shell.
        result = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            check=False,
            cwd=self.datadir.parent,
            start_new_session=True,
            user=None if account is None else account.uid,
            group=None if account is None else account.gid,
            extra_groups=None if account is None else account.groups,
        )
        if result.returncode != 0:
            log = self.log_path.read_text() if self.log_path.exists() else ""
            raise subprocess.CalledProcessError(
                result.returncode, cmd, result.stdout, f"{result.stderr}\n{log[-4000:]}"
            )

    def server_account(self) -> ServerAccount:
        """The account the server runs as under root; raises `EmbeddedPostgresError`.

        The owner of an initialized data directory when that is not root (a server keeps its
        owner), else `UNPRIVILEGED_USER`. Never created here.
        """
        if self._account is not None:
            return self._account
        if (self.datadir / "PG_VERSION").exists() and self.datadir.stat().st_uid != 0:
            uid = self.datadir.stat().st_uid
            try:
                entry = pwd.getpwuid(uid)
            except KeyError:
                raise EmbeddedPostgresError(
                    f"{self.datadir} belongs to uid {uid}, which has no account: delete it "
                    "to start afresh, or set DATABASE_URL to a PostgreSQL server you run"
                ) from None
        else:
            try:
                entry = pwd.getpwnam(UNPRIVILEGED_USER)
            except KeyError:
                raise EmbeddedPostgresError(
                    "PostgreSQL refuses to run as root, and this machine has no "
                    f"{UNPRIVILEGED_USER!r} user to run the embedded server as (none is "
                    "created for it). Instead: set DATABASE_URL (TEST_DATABASE_URL for the "
                    "tests) to a PostgreSQL server you run, or run this as a non-root user."
                ) from None
        self._account = ServerAccount.of(entry)
        return self._account

    def _prepare_as_root(self) -> None:
        """Check the server account can reach everything it needs; hand it the data directory.

        Only directories created here get a mode (0755, whatever the umask) and only the data
        directory and its log get an owner; nothing that existed before is changed.
        """
        account = self.server_account()
        missing = [p for p in [*reversed(self.datadir.parents)] if not p.exists()]
        for directory in missing:
            directory.mkdir()
            directory.chmod(0o755)
        pginstall = self._bin.parent
        needed = [*reversed(self.datadir.parents), *reversed(pginstall.parents), pginstall]
        needed += [pginstall / name for name in ("bin", "lib", "share")]
        for directory in needed:
            if not account.can_enter(directory):
                raise EmbeddedPostgresError(
                    "PostgreSQL refuses to run as root, so as root the embedded server runs as "
                    f"the unprivileged user {account.name!r}, who cannot enter "
                    f"{_describe(directory)}; no existing directory is changed to let it in. "
                    "Instead: set DATABASE_URL (TEST_DATABASE_URL for the tests) to a "
                    "PostgreSQL server you run, run this as a non-root user, or move the "
                    "checkout (with its .venv) below directories every user may enter "
                    "(mode o+x on each)."
                )
        self._check_binaries(account)
        if not self.datadir.exists():
            self.datadir.mkdir(mode=0o700)
        if not (self.datadir / "PG_VERSION").exists():
            os.chown(self.datadir, account.uid, account.gid)
        if not self.log_path.exists():
            self.log_path.touch()
        if self.log_path.stat().st_uid != account.uid:
            os.chown(self.log_path, account.uid, account.gid)

    def postmaster_pid(self) -> int | None:
        """The pid of the postmaster running on this data directory, or None."""
        pid_file = self.datadir / "postmaster.pid"
        try:
            pid = int(pid_file.read_text().splitlines()[0])
        except (OSError, ValueError, IndexError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass  # alive, another user's
        # A pid file left by a crash may name a pid since reused by another program.
        try:
            if "postgres" not in Path(f"/proc/{pid}/comm").read_text():
                return None
        except OSError:
            pass  # no /proc: trust the pid file
        return pid

    def _check_binaries(self, account: ServerAccount) -> None:
        """Run `postgres --version` as the account: the binaries and their libraries load."""
        try:
            self._run("postgres", "--version")
        except (OSError, subprocess.CalledProcessError) as exc:
            detail = exc.stderr if isinstance(exc, subprocess.CalledProcessError) else exc
            raise EmbeddedPostgresError(
                f"the unprivileged user {account.name!r} cannot run the PostgreSQL binaries in "
                f"{self._bin} ({str(detail).strip()}). Instead: set DATABASE_URL "
                "(TEST_DATABASE_URL for the tests) to a PostgreSQL server you run, or run this "
                "as a non-root user."
            ) from exc

    def is_running(self) -> bool:
        """True when a postmaster runs on this data directory."""
        return self.postmaster_pid() is not None

    def start(self) -> str:
        """Initialize (first time) and start the server; return the `postgres` database URL."""
        if os.geteuid() == 0:
            self._prepare_as_root()
        else:
            self.datadir.mkdir(parents=True, exist_ok=True)
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
