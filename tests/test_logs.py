"""Structured logs: one line per request and per task transition, and never a payload.

The API's request lines and the processing pass's task lines are read as the JSON the
handler writes (`LOG_FORMAT=json`), from the captured stderr; the pass's records are also
read from `caplog`. `common.logging`'s batching is checked against a stream that counts writes.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import logging
import os
import re
import runpy
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from flask import Flask
from flask.testing import FlaskClient
from marshmallow import RAISE, Schema, fields
from sqlalchemy import Engine, text

from api.settings import ApiSettings
from common import logging as fairq_logging
from common.environment import SettingsError
from tests import pg
from tests.conftest import ADMIN_TOKEN, JoinedSource, make_test_app
from tests.factories import CompanyWithKey, MakeCompany, insert_tasks, json_of
from worker import processing, tasktypes
from worker.errors import PermanentTaskError
from worker.settings import WorkerSettings
from worker.tasktypes.base import TaskContext, TaskType

ROOT = Path(__file__).resolve().parent.parent
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
TASK_FIELDS = {"event", "task_id", "company_id", "type", "attempt", "duration_ms"}
REQUEST_FIELDS = {"event", "method", "route", "status", "duration_ms", "request_id"}


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def json_app(main_db_url: str) -> Iterator[Flask]:
    """An app built with LOG_FORMAT=json; the `fairq` loggers are put back afterwards."""
    logger = logging.getLogger("fairq")
    handlers, level = list(logger.handlers), logger.level
    app = make_test_app(main_db_url, log_format="json")
    yield app
    from api import database

    database.close(app)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    for handler in handlers:
        logger.addHandler(handler)
    logger.setLevel(level)


@pytest.fixture
def client(json_app: Flask, db_conn: psycopg.Connection[Any]) -> Iterator[FlaskClient]:
    """Test client of the JSON app, its requests joined to the test's outer transaction."""
    from api import database

    before = database.install(json_app, JoinedSource(db_conn))
    # The JSON handler must be the one on `fairq`, whatever app was built since.
    fairq_logging.configure("INFO", "json", logger="fairq")
    yield json_app.test_client()
    database.install(json_app, before)


def json_lines(err: str) -> list[dict[str, Any]]:
    """Every line of captured stderr as a JSON object (fails on a line that is not one)."""
    records = []
    for line in err.splitlines():
        record = json.loads(line)
        assert isinstance(record, dict), line
        records.append(record)
    return records


def events(records: list[dict[str, Any]], event: str) -> list[dict[str, Any]]:
    """The records of one `event`."""
    return [r for r in records if r.get("event") == event]


Register = Callable[[str, Callable[[TaskContext], None]], None]


class SecretPayload(Schema):
    """`{"secret": str}`: the payload of the test types."""

    class Meta:
        unknown = RAISE

    secret = fields.String(required=True)


@pytest.fixture
def register(monkeypatch: pytest.MonkeyPatch) -> Register:
    """`register(name, handler)` adds a task type taking `{"secret": ...}`, for this test."""

    def add(name: str, handler: Callable[[TaskContext], None]) -> None:
        task_type = TaskType(name, "test type", SecretPayload, handler)
        monkeypatch.setitem(tasktypes.REGISTRY, name, task_type)

    return add


def create_task(
    client: FlaskClient, company: CompanyWithKey, type_: str, payload: dict[str, Any], **body: Any
) -> dict[str, Any]:
    """POST a task; return its JSON."""
    response = client.post(
        f"/companies/{company.id}/tasks",
        json={"type": type_, "payload": payload, **body},
        headers=company.headers,
    )
    assert response.status_code == 201, response.get_data(as_text=True)
    return json_of(response)


# -- API: one line per request ---------------------------------------------------------------


def test_a_request_logs_exactly_one_json_line_with_its_fields(
    client: FlaskClient, make_company: MakeCompany, capsys: pytest.CaptureFixture[str]
) -> None:
    company = make_company()
    task = create_task(client, company, "noop", {})
    capsys.readouterr()

    response = client.get(
        f"/companies/{company.id}/tasks/{task['id']}",
        headers={**company.headers, "X-Request-ID": "req-123"},
    )

    assert response.status_code == 200
    [line] = json_lines(capsys.readouterr().err)
    assert line.keys() >= REQUEST_FIELDS
    assert line["event"] == "http.request"
    assert line["level"] == "INFO"
    assert line["logger"] == "fairq.api.request"
    assert line["method"] == "GET"
    assert line["route"] == "/companies/<uuid:company_id>/tasks/<uuid:task_id>"
    assert line["status"] == 200
    assert isinstance(line["duration_ms"], float)
    assert line["duration_ms"] >= 0
    assert line["request_id"] == "req-123"
    assert line["company_id"] == str(company.id)
    assert line["task_id"] == task["id"]
    assert "admin" not in line
    assert "path" not in line, "a matched request logs its route template, not its path"


def test_an_unmatched_path_is_logged_escaped_without_a_route(
    client: FlaskClient, capsys: pytest.CaptureFixture[str]
) -> None:
    response = client.get("/no/such/path%0Aforged line")

    assert response.status_code == 404
    [line] = json_lines(capsys.readouterr().err)
    assert line["route"] is None
    assert line["status"] == 404
    assert line["path"] == "/no/such/path\\nforged line"
    assert "company_id" not in line


def test_an_admin_request_is_marked_admin_without_a_company(
    client: FlaskClient, capsys: pytest.CaptureFixture[str]
) -> None:
    response = client.post("/companies", json={"name": "logged"}, headers=ADMIN)

    assert response.status_code == 201
    [line] = events(json_lines(capsys.readouterr().err), "http.request")
    assert (line["route"], line["status"], line["admin"]) == ("/companies", 201, True)
    assert "company_id" not in line
    assert json_of(response)["api_key"] not in json.dumps(line)


def test_a_sane_request_id_is_echoed_back(client: FlaskClient) -> None:
    sent = "abc-DEF_0123.~!" + "x" * 113  # 128 visible ASCII characters

    response = client.get("/health", headers={"X-Request-ID": sent})

    assert response.headers["X-Request-ID"] == sent


@pytest.mark.parametrize(
    "sent",
    ["", "x" * 129, "has space", "tab\there", "caf\u00e9"],
    ids=["empty", "too-long", "space", "control", "non-ascii"],
)
def test_an_unacceptable_request_id_is_replaced_by_a_generated_one(
    client: FlaskClient, capsys: pytest.CaptureFixture[str], sent: str
) -> None:
    response = client.get("/health", headers={"X-Request-ID": sent})

    echoed = response.headers["X-Request-ID"]
    assert re.fullmatch(r"[0-9a-f]{32}", echoed)
    [line] = json_lines(capsys.readouterr().err)
    assert line["request_id"] == echoed


def test_every_response_gets_a_fresh_request_id_when_none_is_sent(client: FlaskClient) -> None:
    first = client.get("/health").headers["X-Request-ID"]
    second = client.get("/no-such-page").headers["X-Request-ID"]

    assert first != second
    assert re.fullmatch(r"[0-9a-f]{32}", first)


def test_the_text_format_keeps_one_readable_line_per_request(
    client: FlaskClient, capsys: pytest.CaptureFixture[str]
) -> None:
    fairq_logging.configure("INFO", "text", logger="fairq")

    client.get("/health", headers={"X-Request-ID": "text-1"})

    [line] = capsys.readouterr().err.splitlines()
    assert re.search(r" INFO \[\d+\] fairq\.api\.request: GET /health 200 in [\d.]+ ms", line)
    assert "(request text-1)" in line


def test_gunicorn_access_log_is_off_unless_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    # The app's line replaces it; two lines per request would double the log volume.
    conf = str(ROOT / "deploy" / "gunicorn.conf.py")
    monkeypatch.delenv("GUNICORN_ACCESSLOG", raising=False)
    assert runpy.run_path(conf)["accesslog"] is None
    monkeypatch.setenv("GUNICORN_ACCESSLOG", "-")
    assert runpy.run_path(conf)["accesslog"] == "-"


def test_api_settings_read_log_level_and_format_like_the_worker() -> None:
    env = {"DATABASE_URL": "postgresql+psycopg://u@h/d", "LOG_LEVEL": "debug", "LOG_FORMAT": "JSON"}

    settings = ApiSettings.from_env(env)

    assert (settings.log_level, settings.log_format) == ("DEBUG", "json")
    assert (settings.log_level, settings.log_format) == (
        WorkerSettings.from_env(env).log_level, WorkerSettings.from_env(env).log_format,
    )  # fmt: skip
    for name, value in (("LOG_LEVEL", "LOUD"), ("LOG_FORMAT", "xml")):
        with pytest.raises(SettingsError, match=name):
            ApiSettings.from_env({**env, name: value})


# -- worker: one line per task transition ----------------------------------------------------


def test_a_processed_task_logs_one_completed_line_with_its_fields(
    client: FlaskClient, make_company: MakeCompany, capsys: pytest.CaptureFixture[str]
) -> None:
    company = make_company()
    task = create_task(client, company, "noop", {})
    capsys.readouterr()

    response = client.post("/workers/process", headers=ADMIN)

    assert json_of(response)["completed"] == 1
    records = json_lines(capsys.readouterr().err)
    [claimed] = events(records, "tasks.claimed")
    assert claimed["count"] == 1
    [completed] = events(records, "task.completed")
    assert completed.keys() >= TASK_FIELDS
    assert completed["task_id"] == task["id"]
    assert completed["company_id"] == str(company.id)
    assert completed["type"] == "noop"
    assert completed["attempt"] == 1
    assert isinstance(completed["duration_ms"], float)
    assert completed["duration_ms"] >= 0
    assert f"task {task['id']}" in completed["message"]
    assert "completed on attempt 1" in completed["message"]
    # ... and the request that ran the pass has its own single line.
    assert len(events(records, "http.request")) == 1


def test_no_payload_content_reaches_the_logs(
    client: FlaskClient,
    make_company: MakeCompany,
    register: Register,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    marker = f"payload-marker-{uuid.uuid4().hex}"

    def quote_and_retry(task: TaskContext) -> None:
        raise ValueError(f"cannot use {task.payload['secret']}")

    def quote_and_refuse(task: TaskContext) -> None:
        raise PermanentTaskError(f"refused {task.payload['secret']}") from KeyError(marker)

    register("leak_ok", lambda task: None)
    register("leak_retry", quote_and_retry)
    register("leak_fail", quote_and_refuse)
    register("leak_last", quote_and_retry)
    company = make_company()
    payload = {"secret": marker}
    tasks = [
        create_task(client, company, "leak_ok", payload),
        create_task(client, company, "leak_retry", payload),
        create_task(client, company, "leak_fail", payload),
        create_task(client, company, "leak_last", payload, max_attempts=1),
    ]
    # A replay and a rejected body carry the marker too.
    for _ in range(2):
        client.post(
            f"/companies/{company.id}/tasks",
            json={"type": "leak_ok", "payload": payload},
            headers={**company.headers, "Idempotency-Key": "k1"},
        )
    rejected = client.post(
        f"/companies/{company.id}/tasks",
        json={"type": "noop", "payload": payload},
        headers=company.headers,
    )
    assert rejected.status_code == 422

    with caplog.at_level(logging.DEBUG, logger="fairq"):  # tracebacks too
        result = json_of(client.post("/workers/process", headers=ADMIN))

    assert (result["completed"], result["retried"], result["failed"]) == (2, 1, 2)
    errors = [
        json_of(client.get(f"/companies/{company.id}/tasks/{t['id']}", headers=company.headers))[
            "last_error"
        ]
        for t in tasks[1:]
    ]
    assert all(marker in error for error in errors), "the marker did reach the error path"
    err = capsys.readouterr().err
    assert marker not in err
    records = json_lines(err)
    assert {"task.completed", "task.retried", "task.failed", "task.traceback"} <= {
        r.get("event") for r in records
    }
    [retried] = events(records, "task.retried")
    assert (retried["attempt"], retried["error_type"]) == (1, "ValueError")
    assert retried["retry_in_s"] >= 0
    assert sorted(r["error_type"] for r in events(records, "task.failed")) == [
        "PermanentTaskError", "ValueError",
    ]  # fmt: skip
    assert any("quote_and_retry" in r["message"] for r in events(records, "task.traceback"))
    for formatter in (fairq_logging.JsonFormatter(), fairq_logging.TextFormatter()):
        for record in caplog.records:
            assert marker not in formatter.format(record)


# -- the pass's other transitions, in-process on a fresh database -----------------------------

# What the tasks of these tests carry: the test types' payload.
PAYLOAD = {"secret": "s"}


def task_records(caplog: pytest.LogCaptureFixture, event: str) -> list[logging.LogRecord]:
    """Captured records of the pass with this `event`."""
    return [r for r in caplog.records if getattr(r, "event", None) == event]


def test_released_tasks_log_one_line_each(
    fresh_engine: Engine, fresh_company_id: uuid.UUID, caplog: pytest.LogCaptureFixture
) -> None:
    ids = insert_tasks(fresh_engine, fresh_company_id, 4, task_type="noop")
    checks = iter([False, False])  # before the claim and before the first task; then stop

    with caplog.at_level(logging.INFO, logger="fairq"), pg.worker_pool(fresh_engine) as pool:
        result = processing.run_pass(pool, worker_id="logs:1", stop=lambda: next(checks, True))

    assert (result.completed, result.released) == (1, 3)
    [completed] = task_records(caplog, "task.completed")
    released = task_records(caplog, "task.released")
    assert {getattr(r, "task_id", None) for r in released} == {str(i) for i in ids} - {
        getattr(completed, "task_id", None)
    }
    assert len(released) == 3
    for record in released:
        assert record.levelno == logging.INFO
        assert (getattr(record, "attempt", None), getattr(record, "duration_ms", 0)) == (1, None)
        assert getattr(record, "company_id", None) == str(fresh_company_id)
        rendered = json.loads(fairq_logging.JsonFormatter().format(record))
        assert rendered.keys() >= TASK_FIELDS


def test_a_lost_lease_logs_one_line_with_the_action_that_changed_nothing(
    fresh_engine: Engine,
    fresh_company_id: uuid.UUID,
    register: Register,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def overtaken(task: TaskContext) -> None:
        with fresh_engine.begin() as conn:
            conn.execute(
                text("UPDATE tasks SET lease_token = gen_random_uuid() WHERE id = :id"),
                {"id": task.task_id},
            )

    register("overtaken", overtaken)
    [task_id] = insert_tasks(
        fresh_engine, fresh_company_id, 1, task_type="overtaken", payload=PAYLOAD
    )

    with caplog.at_level(logging.INFO, logger="fairq"), pg.worker_pool(fresh_engine) as pool:
        result = processing.run_pass(pool, worker_id="logs:1")

    assert result.lease_lost == 1
    [record] = task_records(caplog, "task.lease_lost")
    assert record.levelno == logging.WARNING
    assert getattr(record, "task_id", None) == str(task_id)
    assert getattr(record, "action", None) == "complete"
    assert isinstance(getattr(record, "duration_ms", None), float)
    assert task_records(caplog, "task.completed") == []


def test_a_poison_pill_logs_one_failed_line(
    fresh_engine: Engine, fresh_company_id: uuid.UUID, caplog: pytest.LogCaptureFixture
) -> None:
    [task_id] = insert_tasks(fresh_engine, fresh_company_id, 1, task_type="noop", payload=PAYLOAD)
    with fresh_engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE tasks SET status = 'processing', attempts = max_attempts, "
                "lease_token = gen_random_uuid(), locked_by = 'gone:1', "
                "locked_at = now() - interval '1 hour' WHERE id = :id"
            ),
            {"id": task_id},
        )

    with caplog.at_level(logging.INFO, logger="fairq"), pg.worker_pool(fresh_engine) as pool:
        result = processing.run_pass(pool, worker_id="logs:1")

    assert result.failed == 1
    [record] = task_records(caplog, "task.failed")
    assert getattr(record, "task_id", None) == str(task_id)
    assert getattr(record, "error_type", None) == "WorkerLost"
    assert getattr(record, "attempt", None) == 5


# -- worker.logging: batching and formatters --------------------------------------------------


class CountingStream(io.StringIO):
    """A text stream that counts its writes."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, s: str) -> int:
        self.writes += 1
        return super().write(s)


@pytest.fixture
def counted() -> Iterator[tuple[logging.Logger, CountingStream]]:
    """A logger of its own writing through `configure`'s kind of handler to a `CountingStream`."""
    stream = CountingStream()
    handler = fairq_logging.make_handler("text", stream, capacity=5)
    logger = logging.getLogger(f"fairq-test.{uuid.uuid4().hex}")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    yield logger, stream
    logger.removeHandler(handler)


def test_outside_a_batch_every_line_is_written_at_once(
    counted: tuple[logging.Logger, CountingStream],
) -> None:
    logger, stream = counted

    logger.info("one")
    logger.info("two")

    assert stream.writes == 2
    assert stream.getvalue().count("\n") == 2


def test_the_lines_of_a_batch_are_written_in_one_write_when_it_ends(
    counted: tuple[logging.Logger, CountingStream],
) -> None:
    logger, stream = counted

    with fairq_logging.batched():
        for n in range(4):
            logger.info("line %d", n)
        assert stream.writes == 0

    assert stream.writes == 1
    assert [line.rsplit(": ", 1)[1] for line in stream.getvalue().splitlines()] == [
        "line 0", "line 1", "line 2", "line 3",
    ]  # fmt: skip


def test_a_warning_writes_what_was_held_at_once_and_in_order(
    counted: tuple[logging.Logger, CountingStream],
) -> None:
    logger, stream = counted

    with fairq_logging.batched():
        logger.info("before")
        logger.warning("trouble")
        assert stream.writes == 1
        assert stream.getvalue().splitlines()[-1].endswith("trouble")
        logger.info("after")
        assert "after" not in stream.getvalue()

    assert stream.getvalue().splitlines()[-1].endswith("after")


def test_a_full_buffer_is_written_before_the_batch_ends(
    counted: tuple[logging.Logger, CountingStream],
) -> None:
    logger, stream = counted

    with fairq_logging.batched():
        for n in range(7):
            logger.info("line %d", n)
        assert stream.writes == 1  # capacity 5
        fairq_logging.flush()  # what a child does right before os._exit
        assert stream.writes == 2
        assert stream.getvalue().count("\n") == 7


def test_a_held_line_is_written_once_it_has_waited_long_enough(
    counted: tuple[logging.Logger, CountingStream], monkeypatch: pytest.MonkeyPatch
) -> None:
    logger, stream = counted
    monkeypatch.setattr(fairq_logging, "MAX_HOLD_SECONDS", 0.05)

    with fairq_logging.batched():
        logger.info("waiting")
        fairq_logging.write_due()
        assert stream.writes == 0
        time.sleep(0.06)
        fairq_logging.write_due()  # what the lease keeper does every tick
        assert stream.writes == 1


def test_a_slow_batch_does_not_hold_finished_tasks_lines_until_it_ends(
    fresh_engine: Engine,
    fresh_company_id: uuid.UUID,
    register: Register,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Longer than the completion flush delay: the first task's line is then held until the
    # lease keeper's `write_due`, not written by the next record's arrival.
    monkeypatch.setattr(fairq_logging, "MAX_HOLD_SECONDS", 0.3)
    stream = io.StringIO()
    handler = fairq_logging.make_handler("json", stream)
    logger = logging.getLogger("fairq.worker.processing")
    first: list[uuid.UUID] = []
    seen_during_pass: list[bool] = []

    def slow(task: TaskContext) -> None:
        if not first:
            first.append(task.task_id)
            return
        # The first task's completed line is written while this one still runs.
        deadline = time.monotonic() + 5
        while str(first[0]) not in stream.getvalue() and time.monotonic() < deadline:
            time.sleep(0.02)
        seen_during_pass.append(str(first[0]) in stream.getvalue())

    register("slow", slow)
    insert_tasks(fresh_engine, fresh_company_id, 2, task_type="slow", payload=PAYLOAD)
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with pg.worker_pool(fresh_engine) as pool:
            result = processing.run_pass(pool, worker_id="logs:1")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)

    assert result.completed == 2
    assert seen_during_pass == [True]


def test_a_forked_child_does_not_write_the_lines_its_parent_holds() -> None:
    read_fd, write_fd = os.pipe()
    with os.fdopen(write_fd, "w") as stream, os.fdopen(read_fd) as reader:
        handler = fairq_logging.make_handler("text", stream)
        logger = logging.getLogger(f"fairq-test.{uuid.uuid4().hex}")
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
        try:
            with fairq_logging.batched():
                logger.info("held by the parent")
                pid = os.fork()
                if pid == 0:  # pragma: no cover  (the child)
                    code = 1
                    try:  # never return into pytest from the child
                        fairq_logging.flush()
                        logger.info("child line")
                        handler.flush()
                        code = 0
                    finally:
                        os._exit(code)
                _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0
        finally:
            logger.removeHandler(handler)
        stream.close()
        output = reader.read()
    assert output.count("held by the parent") == 1
    assert output.count("child line") == 1


@pytest.mark.parametrize("created", [0.0, 1_700_000_000.0, 1_700_000_000.9995, 1_700_000_001.25])
def test_the_formatters_cached_time_matches_an_uncached_one(created: float) -> None:
    record = logging.LogRecord("fairq.x", logging.INFO, "f", 1, "m", None, None)
    record.created, record.msecs = created, (created - int(created)) * 1000

    rendered = json.loads(fairq_logging.JsonFormatter().format(record))
    text_line = fairq_logging.TextFormatter().format(record)

    expected = dt.datetime.fromtimestamp(created, dt.UTC).isoformat(timespec="milliseconds")
    assert rendered["time"] == expected
    assert text_line == logging.Formatter(fairq_logging.TEXT_FORMAT).format(record)
