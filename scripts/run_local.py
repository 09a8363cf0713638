"""Start fairq locally: PostgreSQL, migrations, the API on :8000 and the worker supervisor.

`make run` calls this. PostgreSQL comes from `DATABASE_URL` when set, else an embedded
PostgreSQL 16 with its data in `.pgdata/dev`. The admin token comes from `ADMIN_TOKEN`, else
one is generated once and kept in `.run/admin_token`. Ctrl-C (or SIGTERM) stops everything
gracefully: TERM to the API and the worker, then the embedded server.

Usage (from the repository root; `make run` installs the virtualenv first):
    .venv/bin/python -m scripts.run_local [--port 8000] [--no-worker]
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from devtools.embedded_postgres import EmbeddedPostgres
from devtools.stack import ensure_database

ROOT = Path(__file__).resolve().parent.parent

EMBEDDED_PORT = 54329
RUN_DIR = ROOT / ".run"


def admin_token() -> str:
    """`ADMIN_TOKEN`, or a token generated once and kept in `.run/admin_token`."""
    path = RUN_DIR / "admin_token"
    token = os.environ.get("ADMIN_TOKEN", "").strip()
    if not token and path.exists():
        token = path.read_text().strip()
    token = token or secrets.token_urlsafe(24)
    # Kept in a file so the README's curl lines can read it from any shell.
    RUN_DIR.mkdir(exist_ok=True)
    path.write_text(token + "\n")
    path.chmod(0o600)
    return token


def wait_until_serving(
    url: str,
    procs: list[subprocess.Popen[bytes]],
    stopping: Callable[[], bool],
    timeout: float = 60.0,
) -> bool:
    """Poll `url` until it answers 200; False if a process exits, we stop, or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stopping():
        if any(proc.poll() is not None for proc in procs):
            return False
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


def start_database() -> tuple[EmbeddedPostgres | None, str] | None:
    """`DATABASE_URL`, or start the embedded server; None (after saying why) if it fails."""
    database_url = os.environ.get("DATABASE_URL", "").strip()
    if database_url:
        return None, database_url
    embedded = EmbeddedPostgres(ROOT / ".pgdata" / "dev", EMBEDDED_PORT)
    print(f"starting embedded PostgreSQL 16 on 127.0.0.1:{EMBEDDED_PORT} (.pgdata/dev)")
    try:
        embedded.start()
    except (subprocess.CalledProcessError, TimeoutError) as exc:
        detail = exc.stderr if isinstance(exc, subprocess.CalledProcessError) else exc
        print(
            f"\ncannot start the embedded PostgreSQL (is port {EMBEDDED_PORT} in use? "
            f"`ss -ltnp | grep {EMBEDDED_PORT}`), or set DATABASE_URL to a server you run."
            f"\nLast lines of its log:\n{str(detail).strip()[-1500:]}",
            file=sys.stderr,
        )
        return None
    return embedded, embedded.url("fairq")


def main() -> int:
    """Run until interrupted; return the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m scripts.run_local", description=(__doc__ or "").split("\n\nUsage")[0]
    )
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
    parser.add_argument("--no-worker", action="store_true", help="start only the API")
    args = parser.parse_args()

    started = start_database()
    if started is None:
        return 1
    embedded, database_url = started
    ensure_database(database_url)

    token = admin_token()
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "ADMIN_TOKEN": token,
        "GUNICORN_BIND": os.environ.get("GUNICORN_BIND", f"127.0.0.1:{args.port}"),
    }
    py = sys.executable
    subprocess.run([py, "-m", "alembic", "upgrade", "head"], cwd=ROOT, env=env, check=True)

    # One metrics directory per process tree: the API's and the worker's must differ.
    api_env = {**env, "PROMETHEUS_MULTIPROC_DIR": str(RUN_DIR / "prometheus-api")}
    worker_env = {
        **env,
        "PROMETHEUS_MULTIPROC_DIR": str(RUN_DIR / "prometheus-worker"),
        # Local development: like the API, reachable from this machine only.
        "WORKER_METRICS_HOST": os.environ.get("WORKER_METRICS_HOST", "127.0.0.1"),
    }
    procs: list[subprocess.Popen[bytes]] = [
        subprocess.Popen(
            [py, "-m", "gunicorn", "-c", "deploy/gunicorn.conf.py", "wsgi:app"],
            cwd=ROOT,
            env=api_env,
            # Own process group: Ctrl-C reaches only us, and we stop children with TERM
            # (graceful) instead of the terminal's INT (gunicorn's quick shutdown).
            process_group=0,
        )
    ]
    worker_main = ROOT / "worker" / "__main__.py"
    if not args.no_worker and worker_main.exists():
        procs.append(
            subprocess.Popen([py, "-m", "worker"], cwd=ROOT, env=worker_env, process_group=0)
        )

    stopping = False

    def request_stop(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)

    base = f"http://127.0.0.1:{args.port}"
    # Announce only once the API answers, so the first curl pasted works.
    if not wait_until_serving(f"{base}/health", procs, lambda: stopping):
        print(f"the API did not come up on {base}; stopping", file=sys.stderr, flush=True)
        stopping = True
    print(
        f"\nfairq is running on {base} (docs: {base}/docs)\n"
        f"Admin token: {token}\n\n"
        "Next, in another shell in this directory, create a company:\n\n"
        "  ADMIN_TOKEN=$(cat .run/admin_token)\n"
        f'  curl -s -X POST {base}/companies -H "Authorization: Bearer $ADMIN_TOKEN" '
        "-H 'Content-Type: application/json' -d '{\"name\": \"Acme\"}'\n\n"
        "Press Ctrl-C to stop everything.\n",
        flush=True,
    )
    status = 0
    try:
        while not stopping:
            for proc in procs:
                if proc.poll() is not None:
                    print(f"{proc.args!r} exited with {proc.returncode}; stopping", flush=True)
                    stopping, status = True, 1
            time.sleep(0.2)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                proc.kill()
        if embedded is not None:
            embedded.stop()
            print("embedded PostgreSQL stopped")
    return status


if __name__ == "__main__":
    sys.exit(main())
