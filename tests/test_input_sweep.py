"""Hostile input beyond test_bad_input.py: a clear 4xx naming what is wrong, never a 5xx or a row.

Most requests go through the Flask test client. What only a real HTTP server sees (header size
limits, chunked bodies, broken framing) goes to gunicorn started with deploy/gunicorn.conf.py,
over raw sockets (design §1.6, §3).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any

import pytest
from flask.testing import FlaskClient
from sqlalchemy import Engine, func, pool, select, text
from sqlalchemy.orm import Session
from werkzeug.test import TestResponse

from db.engine import make_engine
from db.models import Company
from devtools.embedded_postgres import free_port
from tests import pg
from tests.conftest import ADMIN_TOKEN
from tests.factories import (
    CompanyWithKey,
    company_limits,
    count_tasks,
    insert_company,
    json_of,
)

ROOT = Path(__file__).resolve().parent.parent
JSON = "application/json"


def post_raw(
    client: FlaskClient,
    company: CompanyWithKey,
    body: str | bytes,
    *,
    content_type: str | None = JSON,
    headers: dict[str, str] | None = None,
) -> TestResponse:
    """POST `body` as is to the company's task collection (no Content-Type if None)."""
    all_headers = {**company.headers, **(headers or {})}
    if content_type is not None:
        all_headers["Content-Type"] = content_type
    return client.post(f"/companies/{company.id}/tasks", data=body, headers=all_headers)


def assert_error(response: TestResponse, status: int, *names: str) -> dict[str, Any]:
    """Assert the error body for `status` whose message names each of `names`; return it."""
    assert response.status_code == status, response.get_data(as_text=True)[:500]
    body = json_of(response)
    assert body["code"] == status
    assert body["status"] == HTTPStatus(status).phrase
    for name in names:
        assert name in body["message"], body["message"]
    # No Python internals in what a client reads.
    for hint in ("sys.", "Traceback", "utf-8-sig", "Exception"):
        assert hint not in body["message"]
    return body


def nothing_stored(session: Session, company: CompanyWithKey) -> bool:
    """True when the company has no task: what every refused create must leave."""
    return count_tasks(session, company.id) == 0


# --- Content-Type and encoding -------------------------------------------------------------


def test_body_without_any_content_type_is_415(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    response = post_raw(client, company, '{"type": "noop"}', content_type=None)

    assert_error(response, 415, "application/json")
    assert nothing_stored(db_session, company)


@pytest.mark.parametrize("charset", ["latin-1", "ISO-8859-1", "utf-16", "ascii"])
def test_json_declared_in_another_charset_than_utf8_is_415_naming_it(
    client: FlaskClient, company: CompanyWithKey, db_session: Session, charset: str
) -> None:
    # latin-1 "\xc3\xa9" is "Ã©", which decoded as UTF-8 would be stored as "é".
    body = '{"type": "webhook", "payload": {"url": "https://example.com", "body": "Ã©"}}'

    response = post_raw(
        client, company, body.encode("latin-1"), content_type=f"{JSON}; charset={charset}"
    )

    assert_error(response, 415, "UTF-8", charset)
    assert nothing_stored(db_session, company)


@pytest.mark.parametrize("content_type", [f"{JSON}; charset=utf-8", f"{JSON}; charset=UTF8"])
def test_json_declared_as_utf8_is_accepted(
    client: FlaskClient, company: CompanyWithKey, content_type: str
) -> None:
    response = post_raw(client, company, '{"type": "noop"}', content_type=content_type)

    assert response.status_code == 201


def companies(session: Session) -> int:
    """How many companies are stored."""
    return session.execute(select(func.count()).select_from(Company)).scalar_one()


def test_company_create_in_latin1_is_415_too(
    client: FlaskClient, admin_headers: dict[str, str], db_session: Session
) -> None:
    before = companies(db_session)

    response = client.post(
        "/companies",
        data='{"name": "Caf\xe9"}'.encode("latin-1"),
        headers={**admin_headers, "Content-Type": f"{JSON}; charset=latin-1"},
    )

    assert_error(response, 415, "UTF-8")
    assert companies(db_session) == before


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'\xef\xbb\xbf{"type": "noop"}', "byte order mark"),
        ('{"type": "noop"}'.encode("utf-16"), "not UTF-8"),
    ],
    ids=["utf8-bom", "utf16"],
)
def test_bom_or_utf16_body_is_400_with_our_message(
    client: FlaskClient, company: CompanyWithKey, db_session: Session, body: bytes, message: str
) -> None:
    response = post_raw(client, company, body)

    assert_error(response, 400, message)
    assert nothing_stored(db_session, company)


# --- Numbers ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "number", ["1e400", "-1e400", "9" * 310, "-" + "9" * 310, "9" * 5000, "1" + "0" * 10_000]
)
@pytest.mark.parametrize("where", ["max_attempts", "payload"])
def test_number_beyond_the_range_of_a_double_is_400_with_a_clean_message(
    client: FlaskClient, company: CompanyWithKey, db_session: Session, number: str, where: str
) -> None:
    if where == "max_attempts":
        body = f'{{"type": "noop", "max_attempts": {number}}}'
    else:
        body = f'{{"type": "sleep", "payload": {{"seconds": {number}}}}}'

    response = post_raw(client, company, body)

    error = assert_error(response, 400, "out of range")
    assert len(error["message"]) < 200  # the number is cut short, not echoed in full
    assert nothing_stored(db_session, company)


@pytest.mark.parametrize(
    "max_attempts", ["3.0", "false", "1e2", str(10**20), "9" * 300, '"5"', "[5]"]
)
def test_max_attempts_that_is_no_integer_from_1_to_50_is_422_naming_it(
    client: FlaskClient, company: CompanyWithKey, db_session: Session, max_attempts: str
) -> None:
    response = post_raw(client, company, f'{{"type": "noop", "max_attempts": {max_attempts}}}')

    error = assert_error(response, 422, "max_attempts")
    assert error["errors"]["json"]["max_attempts"]
    assert nothing_stored(db_session, company)


# --- Duplicate keys --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "key"),
    [
        ('{"type": "noop", "type": "sleep", "payload": {"seconds": 1}}', "type"),
        ('{"type": "sleep", "payload": {"seconds": 1, "seconds": 300}}', "seconds"),
        ('{"type": "noop", "payload": {}, "payload": {}}', "payload"),
    ],
    ids=["top-level", "in-the-payload", "same-value-twice"],
)
def test_duplicate_json_key_is_400_naming_the_key(
    client: FlaskClient, company: CompanyWithKey, db_session: Session, body: str, key: str
) -> None:
    # Which duplicate wins differs between parsers: the body we would validate, store and
    # fingerprint for Idempotency-Key might not be the one a proxy or the client saw.
    response = post_raw(client, company, body, headers={"Idempotency-Key": "dup-1"})

    assert_error(response, 400, "duplicate key", repr(key))
    assert nothing_stored(db_session, company)


def test_duplicate_key_in_a_company_create_is_400(
    client: FlaskClient, admin_headers: dict[str, str], db_session: Session
) -> None:
    before = companies(db_session)

    response = client.post(
        "/companies",
        data='{"name": "a", "name": "b"}',
        headers={**admin_headers, "Content-Type": JSON},
    )

    assert_error(response, 400, "duplicate key 'name'")
    assert companies(db_session) == before


# --- Company limits: weight and max_in_flight ------------------------------------------------


def send_company(
    client: FlaskClient,
    method: str,
    company: CompanyWithKey,
    admin_headers: dict[str, str],
    body: str | bytes,
) -> TestResponse:
    """Send raw JSON `body` as the admin: a create (POST /companies) or a PATCH of `company`."""
    path = "/companies" if method == "POST" else f"/companies/{company.id}"
    headers = {**admin_headers, "Content-Type": JSON}
    return client.open(path, method=method, data=body, headers=headers)


def limits_unchanged(session: Session, company: CompanyWithKey, before: int) -> bool:
    """True when no company was added and `company` still has the default limits."""
    return companies(session) == before and company_limits(session, company.id) == (1, None)


@pytest.mark.parametrize(
    "value",
    ["2.0", "1e2", "-0.0", "false", str(10**20), "-" + str(10**20), '"5"', '" 5"', "[5]", "{}"],
)
@pytest.mark.parametrize("field", ["weight", "max_in_flight"])
@pytest.mark.parametrize("method", ["POST", "PATCH"])
def test_company_limit_that_is_no_integer_in_range_is_422_naming_it(
    client: FlaskClient,
    company: CompanyWithKey,
    admin_headers: dict[str, str],
    db_session: Session,
    *,
    method: str,
    field: str,
    value: str,
) -> None:
    before = companies(db_session)
    name = '"name": "n", ' if method == "POST" else ""

    response = send_company(client, method, company, admin_headers, f'{{{name}"{field}": {value}}}')

    error = assert_error(response, 422, field)
    assert list(error["errors"]["json"]) == [field]
    assert limits_unchanged(db_session, company, before)


@pytest.mark.parametrize("number", ["1e400", "9" * 310, "-" + "9" * 5000])
@pytest.mark.parametrize("method", ["POST", "PATCH"])
def test_company_limit_beyond_the_range_of_a_double_is_400_with_a_clean_message(
    client: FlaskClient,
    company: CompanyWithKey,
    admin_headers: dict[str, str],
    db_session: Session,
    *,
    method: str,
    number: str,
) -> None:
    before = companies(db_session)

    response = send_company(
        client, method, company, admin_headers, f'{{"name": "n", "weight": {number}}}'
    )

    error = assert_error(response, 400, "out of range")
    assert len(error["message"]) < 200
    assert limits_unchanged(db_session, company, before)


def test_duplicate_key_in_a_company_patch_is_400_naming_it(
    client: FlaskClient, company: CompanyWithKey, admin_headers: dict[str, str], db_session: Session
) -> None:
    before = companies(db_session)

    response = send_company(
        client, "PATCH", company, admin_headers, '{"weight": 1000, "weight": 1}'
    )

    assert_error(response, 400, "duplicate key 'weight'")
    assert limits_unchanged(db_session, company, before)


def test_company_patch_over_1_mib_is_413(
    client: FlaskClient, company: CompanyWithKey, admin_headers: dict[str, str], db_session: Session
) -> None:
    before = companies(db_session)
    body = '{"weight": 2' + " " * 2**20 + "}"

    response = send_company(client, "PATCH", company, admin_headers, body)

    assert_error(response, 413)
    assert limits_unchanged(db_session, company, before)


@pytest.mark.parametrize("method", ["PUT", "DELETE", "POST"])
def test_other_methods_on_a_company_are_a_json_405_allowing_get_and_patch(
    client: FlaskClient,
    company: CompanyWithKey,
    admin_headers: dict[str, str],
    db_session: Session,
    method: str,
) -> None:
    before = companies(db_session)

    response = client.open(
        f"/companies/{company.id}", method=method, headers=admin_headers, json={"weight": 5}
    )

    assert_error(response, 405)
    assert {"GET", "PATCH"} <= {m.strip() for m in response.headers["Allow"].split(",")}
    assert limits_unchanged(db_session, company, before)


# --- Idempotency-Key -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    [" key", "key ", "a\x01b", "a\x7fb", "a\x1bb", "\u2028", "\U0001f600", "k\xe9y"],
    ids=["leading-space", "trailing-space", "soh", "del", "esc", "line-sep", "emoji", "latin1"],
)
def test_idempotency_key_with_spaces_control_or_non_ascii_characters_is_422_naming_it(
    client: FlaskClient, company: CompanyWithKey, db_session: Session, key: str
) -> None:
    response = post_raw(client, company, '{"type": "noop"}', headers={"Idempotency-Key": key})

    error = assert_error(response, 422, "Idempotency-Key")
    assert error["errors"]["headers"]["Idempotency-Key"]
    assert nothing_stored(db_session, company)


# --- run_at ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "run_at",
    [
        "2030-01-01",
        "2030-01-01T00:00:00",
        "1893456000",
        1893456000,
        "now",
        "tomorrow",
        "10000-01-01T00:00:00Z",
        "+10000-01-01T00:00:00Z",
        "2030-01-01T00:00:00+25:00",
        "2030-02-30T00:00:00Z",
        "",
        None,
    ],
    ids=[
        "date-only",
        "no-offset",
        "epoch-string",
        "epoch-number",
        "now",
        "tomorrow",
        "year-10000",
        "signed-year-10000",
        "offset-25h",
        "february-30",
        "empty",
        "null",
    ],
)
def test_run_at_in_a_weird_format_is_422_naming_it(
    client: FlaskClient, company: CompanyWithKey, db_session: Session, run_at: object
) -> None:
    response = post_raw(client, company, json.dumps({"type": "noop", "run_at": run_at}))

    error = assert_error(response, 422, "run_at")
    assert error["errors"]["json"]["run_at"]
    assert nothing_stored(db_session, company)


# --- Payload shape ---------------------------------------------------------------------------


def arrays(depth: int) -> Any:
    """`depth` arrays nested in each other: `arrays(2) == [[]]`."""
    node: list[Any] = []
    for _ in range(depth - 1):
        node = [node]
    return node


@pytest.mark.parametrize(("levels", "status"), [(31, 201), (32, 422)])
def test_payload_of_arrays_is_accepted_at_depth_32_and_refused_at_33(
    client: FlaskClient, company: CompanyWithKey, db_session: Session, levels: int, status: int
) -> None:
    # The payload object is depth 1, so its `body` of `levels` arrays reaches 1 + levels.
    payload = {"url": "https://example.com", "body": arrays(levels)}

    response = post_raw(client, company, json.dumps({"type": "webhook", "payload": payload}))

    assert response.status_code == status, response.get_data(as_text=True)[:300]
    if status == 422:
        assert_error(response, 422, "payload")
        assert nothing_stored(db_session, company)
    else:
        assert json_of(response)["payload"] == payload


@pytest.mark.parametrize("length", [101, 100_000])
def test_type_longer_than_100_characters_is_422_and_not_echoed_in_full(
    client: FlaskClient, company: CompanyWithKey, db_session: Session, length: int
) -> None:
    response = post_raw(client, company, json.dumps({"type": "x" * length}))

    assert_error(response, 422, "type")
    assert len(response.get_data()) < 2000
    assert nothing_stored(db_session, company)


@pytest.mark.parametrize(
    "body", ["null", '"noop"', "42", "true", ""], ids=["null", "string", "number", "bool", "empty"]
)
def test_body_that_is_not_a_json_object_is_422(
    client: FlaskClient, company: CompanyWithKey, db_session: Session, body: str
) -> None:
    response = post_raw(client, company, body)

    assert_error(response, 422, "json")
    assert nothing_stored(db_session, company)


# --- Query string ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("limit=1&limit=2", "limit"),
        ("offset=0&offset=5", "offset"),
        ("status=pending&status=failed", "status"),
        ("type=noop&type=sleep", "type"),
        ("limit=1.5", "limit"),
        ("limit=-5", "limit"),
        ("limit=1e1", "limit"),
        ("limit=%2B5", "limit"),
        ("limit=%205", "limit"),
        ("limit=1_0", "limit"),
        ("limit=%D9%A3", "limit"),
        ("limit=0x10", "limit"),
        ("limit=" + "9" * 5000, "limit"),
        ("limit=", "limit"),
        ("offset=NaN", "offset"),
    ],
    ids=[
        "limit-twice",
        "offset-twice",
        "status-twice",
        "type-twice",
        "float",
        "negative",
        "exponent",
        "plus-sign",
        "leading-space",
        "underscore",
        "arabic-indic-digit",
        "hex",
        "5000-digits",
        "empty",
        "nan",
    ],
)
def test_list_query_value_repeated_or_not_a_plain_integer_is_422_naming_it(
    client: FlaskClient, company: CompanyWithKey, query: str, field: str
) -> None:
    response = client.get(f"/companies/{company.id}/tasks?{query}", headers=company.headers)

    error = assert_error(response, 422, f"query.{field}")
    assert list(error["errors"]["query"]) == [field]


def test_unknown_query_parameters_are_422_naming_each(
    client: FlaskClient, company: CompanyWithKey
) -> None:
    # A misspelt filter must not quietly list everything (`?stauts=failed`).
    response = client.get(
        f"/companies/{company.id}/tasks?limit=2&stauts=failed&limit_=9&LIMIT=7",
        headers=company.headers,
    )

    error = assert_error(response, 422, "query.stauts")
    assert sorted(error["errors"]["query"]) == ["LIMIT", "limit_", "stauts"]
    assert error["errors"]["query"]["stauts"] == ["Unknown field."]


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/companies/{company}/tasks"),
        ("POST", "/companies/{company}/task-batches"),
        ("GET", "/companies/{company}"),
        ("GET", "/companies/{company}/stats"),
        ("POST", "/companies/{company}/pause"),
        ("POST", "/companies/{company}/resume"),
    ],
)
def test_a_query_parameter_of_a_view_that_takes_none_is_422_naming_it(
    client: FlaskClient, company: CompanyWithKey, db_session: Session, method: str, path: str
) -> None:
    # `?priority=high` on a create must not create a task that ignored it.
    body = {"type": "noop", "payload": {}}
    json_body = {"tasks": [body]} if path.endswith("task-batches") else body
    response = client.open(
        path.format(company=company.id) + "?priority=high&run_at=later",
        method=method,
        headers=company.headers,
        json=json_body if method == "POST" else None,
    )

    error = assert_error(response, 422, "query.priority")
    unknown = ["Unknown field."]
    assert error["errors"]["query"] == {"priority": unknown, "run_at": unknown}
    assert db_session.execute(text("SELECT count(*) FROM tasks")).scalar_one() == 0
    assert not db_session.execute(text("SELECT bool_or(paused) FROM companies")).scalar_one()


def test_probes_answer_whatever_query_string_a_load_balancer_adds(client: FlaskClient) -> None:
    assert client.get("/health?ts=1").status_code == 200
    assert client.get("/task-types?ts=1").status_code == 200


# --- Paths, methods and tokens ---------------------------------------------------------------


@pytest.mark.parametrize(
    "suffix", ["/", f"/{uuid.UUID(int=1)}/", f"/{uuid.UUID(int=1)}/cancel/", "//"]
)
def test_path_with_a_trailing_or_doubled_slash_is_a_json_404(
    client: FlaskClient, company: CompanyWithKey, suffix: str
) -> None:
    response = client.get(f"/companies/{company.id}/tasks{suffix}", headers=company.headers)

    assert_error(response, 404)


@pytest.mark.parametrize(
    ("method", "suffix", "allowed"),
    [
        ("PUT", "", {"GET", "POST"}),
        ("DELETE", "", {"GET", "POST"}),
        ("PATCH", "", {"GET", "POST"}),
        ("PUT", "/{task}", {"GET"}),
        ("DELETE", "/{task}", {"GET"}),
        ("GET", "/{task}/cancel", {"POST"}),
        ("DELETE", "/{task}/retry", {"POST"}),
    ],
)
def test_method_not_allowed_is_a_json_405_with_an_allow_header(
    client: FlaskClient,
    company: CompanyWithKey,
    db_session: Session,
    *,
    method: str,
    suffix: str,
    allowed: set[str],
) -> None:
    path = f"/companies/{company.id}/tasks" + suffix.format(task=uuid.uuid4())

    response = client.open(path, method=method, headers=company.headers, json={"type": "noop"})

    assert_error(response, 405)
    assert allowed <= {m.strip() for m in response.headers["Allow"].split(",")}
    assert nothing_stored(db_session, company)


@pytest.mark.parametrize(
    "authorization",
    [
        "Bearer " + "x" * 10_000,
        "Bearer " + "fq_" + "A" * 10_000,
        "Basic " + base64.b64encode(f"admin:{ADMIN_TOKEN}".encode()).decode(),
        "Bearer\t" + ADMIN_TOKEN + "\x00",
        "Token " + ADMIN_TOKEN,
    ],
    ids=["10kb-token", "10kb-key-shaped", "basic-with-the-admin-token", "nul", "other-scheme"],
)
def test_authorization_that_is_not_a_known_bearer_token_is_401(
    client: FlaskClient, db_session: Session, authorization: str
) -> None:
    before = companies(db_session)

    response = client.post(
        "/companies", json={"name": "intruder"}, headers={"Authorization": authorization}
    )

    assert_error(response, 401)
    assert response.headers["WWW-Authenticate"].startswith("Bearer")
    assert companies(db_session) == before


# --- A real server: gunicorn with deploy/gunicorn.conf.py ------------------------------------


@dataclass(frozen=True)
class Gunicorn:
    """A running gunicorn serving the app on 127.0.0.1:`port`, its database and a company."""

    port: int
    engine: Engine
    company: CompanyWithKey
    log: Path

    def tasks(self) -> int:
        """How many tasks the company has."""
        with Session(self.engine) as session:
            return count_tasks(session, self.company.id)


@pytest.fixture(scope="module")
def gunicorn(server: pg.TestServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gunicorn]:
    """`python -m gunicorn -c deploy/gunicorn.conf.py wsgi:app` on a fresh database."""
    name = server.create_from_template("fairq_test_gunicorn")
    url = server.url(name)
    engine = make_engine(url, application_name="fairq-tests", poolclass=pool.NullPool)
    with Session(engine) as session:
        company = insert_company(session)
    port = free_port()
    log = tmp_path_factory.mktemp("gunicorn") / "gunicorn.log"
    env = {
        **os.environ,
        "DATABASE_URL": url,
        "ADMIN_TOKEN": ADMIN_TOKEN,
        "GUNICORN_BIND": f"127.0.0.1:{port}",
        "GUNICORN_WORKERS": "1",
    }
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "-c", "deploy/gunicorn.conf.py", "wsgi:app"],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_until_serving(port, process, log)
        yield Gunicorn(port, engine, company, log)
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        engine.dispose()
        server.drop(name)


def _wait_until_serving(port: int, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"gunicorn exited with {process.returncode}:\n{log.read_text()}")
        try:
            status, _, _ = exchange(port, b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        except OSError:
            time.sleep(0.1)
            continue
        if status == 200:
            return
    pytest.fail(f"gunicorn did not answer /health within 30 s:\n{log.read_text()}")


def exchange(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send raw `request` bytes, read one response: `(status, headers, body)`.

    The request is sent from a thread while the response is read, so a server that answers
    before reading the whole body (413) neither deadlocks nor loses its answer; then the
    sending side is shut, so the server sees the end of a body that was cut short.
    """
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:

        def send() -> None:
            # OSError: the server answered and closed before reading everything, which is fine.
            with contextlib.suppress(OSError):
                sock.sendall(request)
                sock.shutdown(socket.SHUT_WR)  # EOF: a body cut short ends here

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        received = b""
        try:
            while not _complete(received):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                received += chunk
        except ConnectionResetError:
            pass  # what arrived before the reset is the answer
        sender.join(timeout=10)
    head, _, body = received.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0].startswith("HTTP/1."), received[:200]
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), headers, body


def _complete(received: bytes) -> bool:
    head, sep, body = received.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return False


def chunked(body: bytes, size: int = 65536) -> bytes:
    """`body` in Transfer-Encoding: chunked framing."""
    pieces = [body[i : i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


def post_request(gunicorn: Gunicorn, *headers: bytes, body: bytes = b"") -> bytes:
    """A raw POST to the company's tasks with its key, `headers` and `body` appended."""
    lines = [
        f"POST /companies/{gunicorn.company.id}/tasks HTTP/1.1".encode(),
        b"Host: test",
        f"Authorization: Bearer {gunicorn.company.api_key}".encode(),
        b"Content-Type: application/json",
        b"Connection: close",
        *headers,
    ]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def json_error(status: int, body: bytes) -> dict[str, Any]:
    """The error body the app sent for `status`."""
    error: dict[str, Any] = json.loads(body)
    assert error["code"] == status
    assert error["message"]
    return error


@pytest.mark.slow
def test_chunked_body_over_1_mib_is_413_through_gunicorn(gunicorn: Gunicorn) -> None:
    # werkzeug stops reading a streamed body at MAX_CONTENT_LENGTH without an error: without
    # our check, these 2 MiB were cut to their first MiB and parsed as that (a 400 at best).
    body = b'{"type": "noop"' + b" " * (2 * 2**20) + b"}"
    before = gunicorn.tasks()

    status, _, answer = exchange(
        gunicorn.port, post_request(gunicorn, b"Transfer-Encoding: chunked", body=chunked(body))
    )

    assert status == 413
    assert "1048576 bytes" in json_error(413, answer)["message"]
    assert gunicorn.tasks() == before


@pytest.mark.slow
@pytest.mark.parametrize(("size", "status"), [(2**20, 201), (2**20 + 1, 413)])
def test_chunked_body_of_exactly_1_mib_is_accepted_and_one_byte_more_is_413(
    gunicorn: Gunicorn, size: int, status: int
) -> None:
    start, end = b'{"type": "noop",', b'"max_attempts": 1}'
    body = start + b" " * (size - len(start) - len(end)) + end
    before = gunicorn.tasks()

    got, _, answer = exchange(
        gunicorn.port, post_request(gunicorn, b"Transfer-Encoding: chunked", body=chunked(body))
    )

    assert got == status, answer[:300]
    assert gunicorn.tasks() == before + (1 if status == 201 else 0)


@pytest.mark.slow
def test_small_chunked_body_creates_the_task_through_gunicorn(gunicorn: Gunicorn) -> None:
    before = gunicorn.tasks()
    body = b'{"type": "sleep", "payload": {"seconds": 1}}'

    status, _, answer = exchange(
        gunicorn.port,
        post_request(gunicorn, b"Transfer-Encoding: chunked", body=chunked(body, size=7)),
    )

    assert status == 201, answer[:300]
    assert json.loads(answer)["payload"] == {"seconds": 1}
    assert gunicorn.tasks() == before + 1


@pytest.mark.slow
@pytest.mark.parametrize(
    "framing",
    [b"zz\r\n{}\r\n0\r\n\r\n", b"2\r\n{}XX0\r\n\r\n", b"5\r\n{}"],
    ids=["bad-chunk-size", "missing-chunk-terminator", "cut-short"],
)
def test_broken_chunked_framing_is_a_json_400_not_a_500(gunicorn: Gunicorn, framing: bytes) -> None:
    before = gunicorn.tasks()

    status, _, answer = exchange(
        gunicorn.port, post_request(gunicorn, b"Transfer-Encoding: chunked", body=framing)
    )

    assert status == 400, answer[:300]
    assert "could not be read" in json_error(400, answer)["message"]
    assert gunicorn.tasks() == before


@pytest.mark.slow
@pytest.mark.parametrize(
    "header",
    [
        b"X-Big: " + b"x" * 100_000,
        b"Authorization: Bearer " + b"x" * 10_000,
        b"Idempotency-Key: " + b"k" * 9000,
    ],
    ids=["100kb-header", "10kb-bearer-token", "9kb-idempotency-key"],
)
def test_oversized_header_is_refused_by_gunicorn_with_431(
    gunicorn: Gunicorn, header: bytes
) -> None:
    before = gunicorn.tasks()

    status, _, _ = exchange(gunicorn.port, post_request(gunicorn, header, body=b""))

    assert status in (400, 431)
    assert gunicorn.tasks() == before


@pytest.mark.slow
@pytest.mark.parametrize(
    ("request_bytes", "statuses"),
    [
        (b"GET /health?" + b"a" * 10_000 + b" HTTP/1.1\r\nHost: t\r\n\r\n", {414, 400}),
        (
            b"GET /health HTTP/1.1\r\nHost: t\r\n"
            + b"".join(b"X-H%d: v\r\n" % i for i in range(150))
            + b"\r\n",
            {431, 400},
        ),
        (
            b"POST /companies HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            {400},
        ),
        (b"POST /companies HTTP/1.1\r\nHost: t\r\nContent-Length: -1\r\n\r\n", {400}),
        (b"GET /health HTTP/1.1\r\nHost: t\r\nX-A: a\x00b\r\n\r\n", {400}),
    ],
    ids=[
        "10kb-request-line",
        "150-headers",
        "content-length-and-chunked",
        "negative-length",
        "nul",
    ],
)
def test_malformed_http_is_a_4xx_from_gunicorn(
    gunicorn: Gunicorn, request_bytes: bytes, statuses: set[int]
) -> None:
    status, _, _ = exchange(gunicorn.port, request_bytes)

    assert status in statuses
