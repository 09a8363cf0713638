"""End to end: the compose commands as real processes on a fresh database, over real HTTP.

Runs exactly `E2E_COMMANDS` (the commands docker-compose.yml runs, tests/test_deploy_files.py)
through `deploy/entrypoint.sh`, as the image does: the migration, gunicorn with
`deploy/gunicorn.conf.py`, and the worker supervisor. A company creates one task of each type;
webhooks go to a local HTTP receiver and mail to a local SMTP server (aiosmtpd). Then both
metrics endpoints are checked against design §7, both processes get SIGTERM and must exit 0,
and their logs must hold no traceback and one line per request.
"""

from __future__ import annotations

import email
import email.policy
import json
import os
import re
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import requests
from aiosmtpd.controller import Controller
from flask import Flask
from sqlalchemy import Engine, text

from api import metrics
from devtools.embedded_postgres import free_port
from tests.supervisor_harness import wait_for
from tests.test_deploy_files import E2E_COMMANDS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

ROOT = Path(__file__).resolve().parent.parent
ENTRYPOINT = ROOT / "deploy" / "entrypoint.sh"
ADMIN_TOKEN = "4QWI5QH6jzNFC7xjrPs_03wKCWyIZxq1ofFMqF-e7IA"
STOP_TIMEOUT = 30.0
# Flags the test adds to a compose command (the worker's metrics port is chosen by the OS).
EXTRA_ARGS: dict[str, Callable[[Path], list[str]]] = {
    "worker": lambda workdir: ["--metrics-port-file", str(workdir / "worker.port")],
}
# Any UUID, with or without dashes: a raw task or company id in a label value.
UUID_RE = re.compile(
    r"[0-9a-fA-F]{8}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{12}"
)
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def resolve(command: list[str]) -> list[str]:
    """A compose command with its program run by this virtualenv's interpreter."""
    program, *args = command
    modules = {"python": [], "gunicorn": ["-m", "gunicorn"], "alembic": ["-m", "alembic"]}
    return [sys.executable, *modules[program], *args]


def unresolve(argv: list[str]) -> list[str]:
    """The compose command `resolve` made `argv` from."""
    assert argv[0] == sys.executable
    if argv[1:2] == ["-m"] and argv[2] in ("gunicorn", "alembic"):
        return [argv[2], *argv[3:]]
    return ["python", *argv[1:]]


def extra_args(name: str, workdir: Path) -> list[str]:
    """What the test appends to service `name`'s command."""
    return EXTRA_ARGS[name](workdir) if name in EXTRA_ARGS else []


def samples(body: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text -> (name, labels, value) for every sample."""
    found = []
    for line in body.splitlines():
        match = _SAMPLE.match(line)
        if match and not line.startswith("#"):
            labels = dict(_LABEL.findall(match.group(2) or ""))
            found.append((match.group(1), labels, float(match.group(3))))
    return found


# -- local SMTP and HTTP receivers ------------------------------------------------------------


class SmtpRecorder:
    """aiosmtpd handler keeping every message it accepts."""

    def __init__(self) -> None:
        self.messages: list[email.message.EmailMessage] = []

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        """Keep the message."""
        message = email.message_from_bytes(envelope.content, policy=email.policy.default)
        self.messages.append(message)
        return "250 Message accepted for delivery"


@dataclass
class Receiver:
    """A local webhook receiver: the Idempotency-Key of every POST it answered."""

    port: int = 0
    keys: list[str | None] = field(default_factory=list)

    @property
    def url(self) -> str:
        """Where to send webhooks."""
        return f"http://127.0.0.1:{self.port}/hook"


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    """A webhook receiver thread that answers 200."""
    state = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
            state.keys.append(self.headers.get("Idempotency-Key"))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            """Quiet."""

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = False
    state.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture
def smtp() -> Iterator[tuple[SmtpRecorder, int]]:
    """A local SMTP server; yields its recorder and port."""
    recorder = SmtpRecorder()
    port = free_port()
    controller = Controller(recorder, hostname="127.0.0.1", port=port)
    controller.start()
    try:
        yield recorder, port
    finally:
        controller.stop()


# -- the processes ----------------------------------------------------------------------------


@dataclass
class Process:
    """One started compose command, its output in `workdir/<name>.log`."""

    name: str
    argv: list[str]
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        """Its stdout and stderr so far."""
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        """SIGTERM, then the exit status (fails the test after `STOP_TIMEOUT`)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.name} still running {STOP_TIMEOUT}s after SIGTERM")


@dataclass
class Stack:
    """Starts compose commands; kills whatever is still running at teardown."""

    workdir: Path
    env: dict[str, str]
    started: list[Process] = field(default_factory=list)
    argvs: dict[str, list[str]] = field(default_factory=dict)

    def argv(self, name: str) -> list[str]:
        """The argv of service `name`: the entrypoint, then its resolved compose command."""
        argv = [str(ENTRYPOINT), *resolve(E2E_COMMANDS[name]), *extra_args(name, self.workdir)]
        self.argvs[name] = argv
        return argv

    def run(self, name: str, **env: str) -> subprocess.CompletedProcess[str]:
        """Run service `name` to completion (the one-shot migration)."""
        return subprocess.run(
            self.argv(name), cwd=ROOT, env={**self.env, **env}, capture_output=True, text=True,
            timeout=60, check=False, stdin=subprocess.DEVNULL,
        )  # fmt: skip

    def start(self, name: str, **env: str) -> Process:
        """Start service `name` in the background."""
        argv = self.argv(name)
        log_path = self.workdir / f"{name}.log"
        with log_path.open("wb") as out:
            proc = subprocess.Popen(
                argv, cwd=ROOT, env={**self.env, **env}, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )  # fmt: skip
        process = Process(name, argv, proc, log_path)
        self.started.append(process)
        return process

    def kill_all(self) -> None:
        """SIGKILL every process group still alive (teardown after a failure)."""
        for process in self.started:
            if process.proc.poll() is None:
                process.proc.kill()
                process.proc.wait(10)


@pytest.fixture
def stack(tmp_path: Path, fresh_db_url: str) -> Iterator[Stack]:
    """The environment every compose service gets here, and cleanup."""
    env = {
        **os.environ,
        "DATABASE_URL": fresh_db_url,
        "LOG_LEVEL": "INFO",
        "LOG_FORMAT": "json",
    }
    running = Stack(tmp_path, env)
    yield running
    running.kill_all()


def test_the_compose_commands_run_tasks_end_to_end_and_stop_cleanly(
    stack: Stack,
    fresh_engine: Engine,
    receiver: Receiver,
    smtp: tuple[SmtpRecorder, int],
    shared_app: Flask,
) -> None:
    smtp_recorder, smtp_port = smtp
    api_port = free_port()
    api_url = f"http://127.0.0.1:{api_port}"

    # -- migrate (a no-op on the migrated copy, which proves the command works) ----------------
    with fresh_engine.connect() as conn:
        head = conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one()
    migrated = stack.run("migrate")
    assert migrated.returncode == 0, migrated.stderr
    with fresh_engine.connect() as conn:
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one() == head

    # -- start the API and the worker ----------------------------------------------------------
    api = stack.start(
        "api",
        ADMIN_TOKEN=ADMIN_TOKEN,
        GUNICORN_BIND=f"127.0.0.1:{api_port}",
        PROMETHEUS_MULTIPROC_DIR=str(stack.workdir / "api"),
        GUNICORN_WORKERS="2",
    )
    worker = stack.start(
        "worker",
        WORKER_METRICS_PORT="0",
        PROMETHEUS_MULTIPROC_DIR=str(stack.workdir / "worker"),
        SMTP_URL=f"smtp://127.0.0.1:{smtp_port}",
        WEBHOOK_ALLOW_PRIVATE="true",
        WORKER_POLL_INTERVAL="0.1",
        WORKER_CONCURRENCY="2",
        SHUTDOWN_TIMEOUT_SECONDS="10",
    )
    # Exactly the compose commands (plus the worker's port file), so the two cannot drift.
    assert set(stack.argvs) == set(E2E_COMMANDS)
    for name, argv in stack.argvs.items():
        assert argv[0] == str(ENTRYPOINT)
        assert unresolve(argv[1:]) == [*E2E_COMMANDS[name], *extra_args(name, stack.workdir)]
    sent_ids: list[str] = []

    def call(method: str, path: str, **kw: Any) -> requests.Response:
        """One request with a request id of its own; the API must echo it."""
        request_id = f"e2e-{uuid.uuid4().hex[:12]}"
        headers = {"X-Request-ID": request_id, **kw.pop("headers", {})}
        response = requests.request(method, api_url + path, headers=headers, timeout=10, **kw)
        sent_ids.append(request_id)  # answered, so logged
        assert response.headers["X-Request-ID"] == request_id
        return response

    def api_ready() -> bool:
        if api.proc.poll() is not None:
            pytest.fail(f"gunicorn exited with {api.proc.returncode}:\n{api.log()[-3000:]}")
        try:
            return call("GET", "/ready").status_code == 200
        except requests.ConnectionError:
            return False

    wait_for(api_ready, 30, "the API to be ready")
    port_file = stack.workdir / "worker.port"

    def worker_port() -> int | None:
        if worker.proc.poll() is not None:
            pytest.fail(f"worker exited with {worker.proc.returncode}:\n{worker.log()[-3000:]}")
        return int(port_file.read_text()) if port_file.exists() else None

    worker_url = f"http://127.0.0.1:{wait_for(worker_port, 30, 'the worker metrics port')}"

    # -- a company and one task of each type, over HTTP ----------------------------------------
    created = call(
        "POST", "/companies", json={"name": "e2e"},
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
    )  # fmt: skip
    assert created.status_code == 201, created.text
    company = created.json()
    auth = {"Authorization": f"Bearer {company['api_key']}"}
    bodies: list[dict[str, Any]] = [
        {"type": "noop", "payload": {}},
        {"type": "sleep", "payload": {"seconds": 0.2}},
        {"type": "webhook", "payload": {"url": receiver.url, "body": {"hello": "world"}}},
        {"type": "send_email", "payload": {"to": "e2e@example.com", "subject": "Hi", "body": "x"}},
    ]
    tasks: dict[str, str] = {}
    for body in bodies:
        response = call("POST", f"/companies/{company['id']}/tasks", json=body, headers=auth)
        assert response.status_code == 201, response.text
        tasks[body["type"]] = response.json()["id"]

    def all_completed() -> bool:
        statuses = {
            call("GET", f"/companies/{company['id']}/tasks/{task_id}", headers=auth).json()[
                "status"
            ]
            for task_id in tasks.values()
        }
        assert not statuses & {"failed", "cancelled"}, statuses
        return statuses == {"completed"}

    wait_for(all_completed, 30, f"tasks {tasks} to complete (worker log:\n{worker.log()[-3000:]})")

    # -- the side effects carry the task id ------------------------------------------------------
    assert receiver.keys == [tasks["webhook"]]
    [message] = smtp_recorder.messages
    assert message["Message-ID"] == f"<{tasks['send_email']}@fairq>"

    # -- metrics ---------------------------------------------------------------------------------
    api_samples = samples(call("GET", "/metrics").text)
    worker_metrics = requests.get(f"{worker_url}/metrics", timeout=10)
    assert worker_metrics.status_code == 200
    worker_samples = samples(worker_metrics.text)
    for name, labels, _ in api_samples + worker_samples:
        for value in labels.values():
            assert not UUID_RE.search(value), f"raw id in a label of {name}: {labels}"
    rules = {rule.rule for rule in shared_app.url_map.iter_rules()} | {metrics.UNMATCHED_RULE}
    durations = [
        labels for name, labels, _ in api_samples
        if name == "flask_http_request_duration_seconds_count"
    ]  # fmt: skip
    assert durations
    assert {labels["url_rule"] for labels in durations} <= rules
    assert "/companies/<uuid:company_id>/tasks/<uuid:task_id>" in {
        labels["url_rule"] for labels in durations
    }
    by_status = {
        labels["status"]: value for name, labels, value in api_samples if name == "tasks_by_status"
    }
    assert by_status["completed"] == 4
    assert any(name == "oldest_eligible_pending_age_seconds" for name, _, _ in api_samples)
    completed_total = sum(
        value for name, _, value in worker_samples if name == "tasks_completed_total"
    )
    with fresh_engine.connect() as conn:
        completed_rows = conn.execute(
            text("SELECT count(*) FROM tasks WHERE status = 'completed'")
        ).scalar_one()
    assert completed_total == completed_rows == 4
    assert [value for name, _, value in worker_samples if name == "worker_children"] == [2.0]

    # -- SIGTERM: both stop gracefully -----------------------------------------------------------
    assert api.stop() == 0, api.log()[-3000:]
    assert worker.stop() == 0, worker.log()[-3000:]

    # -- logs ------------------------------------------------------------------------------------
    api_log, worker_log = api.log(), worker.log()
    assert "Traceback" not in api_log
    assert "Traceback" not in worker_log
    api_records = [json.loads(line) for line in api_log.splitlines() if line.startswith("{")]
    per_request: dict[str, int] = {}
    for record in api_records:
        if record.get("event") == "http.request":
            per_request[record["request_id"]] = per_request.get(record["request_id"], 0) + 1
    assert per_request == dict.fromkeys(sent_ids, 1), "one line per request"
    assert not re.search(r'"(GET|POST) /\S* HTTP/1\.1"', api_log), "gunicorn's access log is off"
    worker_records = [json.loads(line) for line in worker_log.splitlines()]
    completed_lines = [r for r in worker_records if r.get("event") == "task.completed"]
    assert sorted(r["task_id"] for r in completed_lines) == sorted(tasks.values())
    assert {r["company_id"] for r in completed_lines} == {company["id"]}
