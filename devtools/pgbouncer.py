"""A PgBouncer in transaction pooling mode in front of a PostgreSQL server, for tests.

Runs the system's `pgbouncer` (the Debian package) as a child process with a configuration of
its own: listening on a free 127.0.0.1 port, no Unix socket, every database of the server
reachable under its own name, `auth_type = any` (the test server trusts its clients), and
`pool_mode = transaction`, as PgBouncer is deployed in front of many hosts.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
from sqlalchemy.engine import make_url

from devtools.embedded_postgres import free_port

# PgBouncer refuses to run as root; started by root it switches to this user (`-u`).
_UNPRIVILEGED_USERS = ("postgres", "nobody")


@contextmanager
def pgbouncer(
    server_url: str, program: str, *, pool_size: int = 20, ready_timeout: float = 10.0
) -> Iterator[str]:
    """Run PgBouncer in front of `server_url`'s server; yield `server_url` through it.

    `program` is the path of the `pgbouncer` executable. The yielded URL names the same
    database and user, with PgBouncer's host and port. Raises `RuntimeError` with PgBouncer's
    output when it does not accept connections within `ready_timeout` seconds.
    """
    server = make_url(server_url)
    port = free_port()
    # A directory of its own that an unprivileged PgBouncer can read (mkdtemp's is 0700).
    workdir = Path(tempfile.mkdtemp(prefix="fairq-pgbouncer-"))
    workdir.chmod(0o755)
    config = workdir / "pgbouncer.ini"
    backend = f"host={server.host or '127.0.0.1'} port={server.port or 5432}"
    if server.username:
        backend += f" user={server.username}"
    config.write_text(
        "[databases]\n"
        f"* = {backend}\n"
        "[pgbouncer]\n"
        "listen_addr = 127.0.0.1\n"
        f"listen_port = {port}\n"
        "unix_socket_dir =\n"
        "auth_type = any\n"
        "pool_mode = transaction\n"
        "max_client_conn = 1000\n"
        f"default_pool_size = {pool_size}\n"
        # psycopg sends it at connect; PgBouncer would otherwise refuse the connection.
        "ignore_startup_parameters = extra_float_digits\n"
    )
    config.chmod(0o644)
    argv = [program]
    if os.geteuid() == 0:
        argv += ["-u", _unprivileged_user()]
    log_path = workdir / "pgbouncer.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen([*argv, str(config)], stdout=log, stderr=subprocess.STDOUT)
    pooled = server.set(host="127.0.0.1", port=port).render_as_string(hide_password=False)
    try:
        _wait_accepting(pooled, process, log_path, ready_timeout)
        yield pooled
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def _unprivileged_user() -> str:
    for name in _UNPRIVILEGED_USERS:
        try:
            pwd.getpwnam(name)
        except KeyError:
            continue
        return name
    raise RuntimeError(f"PgBouncer will not run as root, and none of {_UNPRIVILEGED_USERS} exists")


def _wait_accepting(url: str, process: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    conninfo = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"pgbouncer exited with {process.returncode}:\n{log.read_text()}")
        try:
            with psycopg.connect(conninfo, connect_timeout=2) as conn:
                conn.execute("SELECT 1")
            return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"pgbouncer not accepting:\n{log.read_text()}") from None
            time.sleep(0.1)
