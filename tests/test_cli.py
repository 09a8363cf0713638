"""`python -m worker` command line (design §5, §8): help, --once, configuration errors."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

from db import claims
from tests import supervisor_harness as harness
from tests.factories import insert_company, insert_tasks
from worker import cli


def _run(tmp_path: Path, *args: str, **env: str | None) -> tuple[int, str, str]:
    """Run `python -m worker *args` to completion; return (status, stdout, stderr)."""
    environment = dict(os.environ)
    for key, value in env.items():
        if value is None:
            environment.pop(key, None)
        else:
            environment[key] = value
    out, err = tmp_path / "stdout.log", tmp_path / "stderr.log"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        status = subprocess.run(
            [sys.executable, "-m", "worker", *args],
            cwd=harness.ROOT, env=environment, stdout=stdout, stderr=stderr,
            stdin=subprocess.DEVNULL, timeout=60, check=False,
        ).returncode  # fmt: skip
    return status, out.read_text(), err.read_text()


def test_help_documents_every_flag_with_its_variable(tmp_path: Path) -> None:
    status, out, _ = _run(tmp_path, "--help")
    assert status == 0
    for flag in cli.FLAGS:
        assert flag.flag in out
        assert flag.variable in out
    for extra in ("--once", "--metrics-port-file", "DATABASE_URL", "SHUTDOWN_TIMEOUT_SECONDS"):
        assert extra in out


def test_once_runs_one_pass_and_prints_its_counts(
    tmp_path: Path, fresh_db_url: str, fresh_engine: Engine
) -> None:
    company = insert_company(fresh_engine).id
    insert_tasks(fresh_engine, company, 3)
    insert_tasks(fresh_engine, company, task_type="no_such_type")

    status, out, err = _run(
        tmp_path, "--once", DATABASE_URL=fresh_db_url, LOG_FORMAT="json", LOG_LEVEL="INFO"
    )

    assert status == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary == {
        "claimed": 4, "completed": 3, "retried": 0, "failed": 1, "released": 0, "lease_lost": 0,
    }  # fmt: skip
    assert harness.status_counts(fresh_engine) == {"completed": 3, "failed": 1}
    records = [json.loads(line) for line in err.splitlines()]  # LOG_FORMAT=json: one per line
    assert {"time", "level", "logger", "pid", "message"} <= records[0].keys()
    assert any(r["level"] == "WARNING" and "no_such_type" in r["message"] for r in records)


@pytest.mark.parametrize(
    ("args", "env", "names"),
    [
        ((), {"WORKER_CONCURRENCY": "0"}, ["WORKER_CONCURRENCY"]),
        (("--batch-size", "zero"), {}, ["WORKER_BATCH_SIZE", "--batch-size"]),
        (("--poll-interval", "-1"), {}, ["WORKER_POLL_INTERVAL", "--poll-interval"]),
        ((), {"DATABASE_URL": None}, ["DATABASE_URL"]),
        ((), {"LOG_LEVEL": "LOUD"}, ["LOG_LEVEL"]),
    ],
)
def test_invalid_configuration_exits_2_naming_the_variable(
    tmp_path: Path, args: tuple[str, ...], env: dict[str, str | None], names: list[str]
) -> None:
    environment: dict[str, str | None] = {
        "DATABASE_URL": "postgresql+psycopg://postgres@127.0.0.1:1/none", **env,
    }  # fmt: skip
    status, _, err = _run(tmp_path, *args, **environment)
    assert status == 2
    assert "invalid configuration" in err
    for name in names:
        assert name in err


def test_taken_metrics_port_exits_1_with_a_message(tmp_path: Path, fresh_db_url: str) -> None:
    with socket.create_server(("0.0.0.0", 0)) as taken:
        port = str(taken.getsockname()[1])
        status, _, err = _run(tmp_path, "--metrics-port", port, DATABASE_URL=fresh_db_url)
    assert status == 1
    assert f"cannot serve metrics on 0.0.0.0:{port}" in err


class _SlowReceiver(BaseHTTPRequestHandler):
    """Takes a webhook's POST, tells the test it arrived, answers 200 a second later."""

    arrived: threading.Event

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.arrived.set()
        time.sleep(1)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_args: object) -> None:
        pass


def test_sigterm_during_once_finishes_the_task_in_hand_and_hands_back_the_rest(
    tmp_path: Path, fresh_db_url: str, fresh_engine: Engine
) -> None:
    # Webhooks to a receiver of the test's own: its first request is the first handler
    # started, so the signal comes with a task in hand, however slow the box.
    arrived = threading.Event()
    receiver = ThreadingHTTPServer(
        ("127.0.0.1", 0), type("Receiver", (_SlowReceiver,), {"arrived": arrived})
    )
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{receiver.server_address[1]}/hook"
    company = insert_company(fresh_engine).id
    insert_tasks(fresh_engine, company, 3, task_type="webhook", payload={"url": url})
    environment = {
        **os.environ, "DATABASE_URL": fresh_db_url, "WEBHOOK_ALLOW_PRIVATE": "true",
        "WORKER_THREADS": "1",
    }  # fmt: skip
    try:
        with (tmp_path / "out.log").open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "worker", "--once"],
                cwd=harness.ROOT, env=environment, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )  # fmt: skip
            try:
                assert arrived.wait(30), "the first webhook never arrived"
                proc.send_signal(signal.SIGTERM)
                status = proc.wait(timeout=15)
            finally:
                proc.kill()
                proc.wait()
    finally:
        receiver.shutdown()
        receiver.server_close()

    assert status == 0, (tmp_path / "out.log").read_text()
    # The first task was in hand and completes; the two never started are pending again.
    assert harness.status_counts(fresh_engine) == {"completed": 1, "pending": 2}


def test_once_reports_a_driver_error_in_the_claim_as_a_database_error(
    tmp_path: Path, fresh_db_url: str, fresh_engine: Engine
) -> None:
    with fresh_engine.connect() as conn:
        database = conn.execute(text("SELECT current_database()")).scalar_one()
        # The worker's own statement_timeout (30 s) raises the same kind of error; a database
        # level lock_timeout gets there in 300 ms (the worker's options do not override it).
        conn.execute(text(f'ALTER DATABASE "{database}" SET lock_timeout = 300'))
        conn.commit()
    holder = fresh_engine.connect()
    try:
        # Another claimer that holds the claimers' lock for longer than the timeout.
        holder.execute(text("SELECT pg_advisory_lock(:key)"), {"key": claims.CLAIM_LOCK_KEY})
        holder.commit()
        environment = {**os.environ, "DATABASE_URL": fresh_db_url}
        done = subprocess.run(
            [sys.executable, "-m", "worker", "--once"],
            cwd=harness.ROOT, env=environment, capture_output=True, text=True,
            stdin=subprocess.DEVNULL, timeout=60, check=False,
        )  # fmt: skip
    finally:
        holder.close()

    assert done.returncode == 1
    assert "fairq worker: database error" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
