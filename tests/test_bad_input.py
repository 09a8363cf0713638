"""Bad input on the task API: always a 4xx with the error body, never a row (design §1.6, §3)."""

from __future__ import annotations

import datetime as dt
import json
from http import HTTPStatus
from typing import Any

import pytest
from flask.testing import FlaskClient
from sqlalchemy.orm import Session
from werkzeug.test import TestResponse

from tests.factories import CompanyWithKey, MakeCompany, count_tasks, json_of

JSON = "application/json"


def post_task(
    client: FlaskClient,
    company: CompanyWithKey,
    body: str | bytes | dict[str, Any],
    *,
    headers: dict[str, str] | None = None,
    content_type: str = JSON,
) -> TestResponse:
    """POST `body` (raw text, or an object sent as JSON) to the company's task collection."""
    data = json.dumps(body) if isinstance(body, dict) else body
    return client.post(
        f"/companies/{company.id}/tasks",
        data=data,
        headers={**company.headers, **(headers or {})},
        content_type=content_type,
    )


def assert_error(response: TestResponse, status: int, *, location: str | None = None) -> Any:
    """Assert the flask-smorest error body for `status`; return `errors[location]` if asked."""
    assert response.status_code == status, response.get_data(as_text=True)[:500]
    body = json_of(response)
    assert body["code"] == status
    assert body["status"] == HTTPStatus(status).phrase
    assert isinstance(body["message"], str)
    assert body["message"]
    if location is None:
        return None
    return body["errors"][location]


def assert_nothing_stored(db_session: Session, company: CompanyWithKey) -> None:
    """The failed request left no task behind."""
    assert count_tasks(db_session, company.id) == 0


def nested(depth: int) -> dict[str, Any]:
    """`depth` objects nested in each other: `nested(2) == {"k": {}}`."""
    node: dict[str, Any] = {}
    for _ in range(depth - 1):
        node = {"k": node}
    return node


def test_malformed_json_is_400_and_nothing_is_stored(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    response = post_task(client, company, '{"type": "noop",')

    errors = assert_error(response, 400, location="json")
    assert errors
    assert_nothing_stored(db_session, company)


def test_body_that_is_not_utf8_is_400(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    response = post_task(client, company, b'{"type": "\xff\xfe"}')

    assert_error(response, 400)
    assert "UTF-8" in json_of(response)["message"]
    assert_nothing_stored(db_session, company)


def test_json_nested_10000_deep_is_400_not_a_recursion_error(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    depth = 10_000
    body = '{"type": "noop", "payload": ' + '{"a": ' * depth + "{}" + "}" * depth + "}"

    response = post_task(client, company, body)

    errors = assert_error(response, 400, location="json")
    assert "nested too deeply" in errors[0]
    assert_nothing_stored(db_session, company)


def test_arrays_nested_10000_deep_are_400_too(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    response = post_task(client, company, "[" * 10_000 + "]" * 10_000)

    assert_error(response, 400)
    assert_nothing_stored(db_session, company)


def test_body_over_1_mib_is_413_and_nothing_is_stored(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    body = {"type": "webhook", "payload": {"url": "https://example.com", "body": "x" * 2**20}}

    response = post_task(client, company, body)

    assert_error(response, 413)
    assert_nothing_stored(db_session, company)


@pytest.mark.parametrize("payload", [[], "text", 1, None, True])
def test_payload_that_is_not_an_object_is_422_and_nothing_is_stored(
    client: FlaskClient, company: CompanyWithKey, db_session: Session, payload: object
) -> None:
    response = post_task(client, company, {"type": "noop", "payload": payload})

    errors = assert_error(response, 422, location="json")
    assert errors["payload"]
    assert_nothing_stored(db_session, company)


def test_body_that_is_not_an_object_is_422(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    response = post_task(client, company, '["noop"]')

    errors = assert_error(response, 422, location="json")
    assert errors["_schema"]
    assert_nothing_stored(db_session, company)


def _webhook_with_text(size: int) -> dict[str, Any]:
    """A webhook payload exactly `size` bytes long when serialized compactly."""
    payload = {"url": "https://example.com", "body": ""}
    overhead = len(json.dumps(payload, separators=(",", ":")))
    payload["body"] = "x" * (size - overhead)
    return payload


def test_payload_over_64_kib_is_422_and_nothing_is_stored(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    response = post_task(
        client, company, {"type": "webhook", "payload": _webhook_with_text(64 * 1024 + 1)}
    )

    errors = assert_error(response, 422, location="json")
    assert "65536 bytes" in errors["payload"][0]
    assert_nothing_stored(db_session, company)


def test_payload_of_exactly_64_kib_is_accepted(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    response = post_task(
        client, company, {"type": "webhook", "payload": _webhook_with_text(64 * 1024)}
    )

    assert response.status_code == 201, response.get_data(as_text=True)[:300]
    assert count_tasks(db_session, company.id) == 1


@pytest.mark.parametrize(
    ("payload", "where"),
    [
        ({"url": "https://example.com", "body": "a\u0000b"}, ["body"]),
        ({"url": "https://example.com", "body": {"a\u0000": 1}}, ["body", "a\u0000"]),
        ({"url": "https://example.com", "body": [1, ["deep \u0000"]]}, ["body", "1", "0"]),
        ({"url": "https://example.com", "headers": {"X-A": "\u0000"}}, ["headers", "X-A"]),
        ({"url": "https://example.com/\u0000"}, ["url"]),
    ],
    ids=["in-a-value", "in-a-key", "in-a-nested-list", "in-a-header", "in-the-url"],
)
def test_payload_containing_nul_is_422_naming_where_and_nothing_is_stored(
    client: FlaskClient,
    company: CompanyWithKey,
    db_session: Session,
    payload: dict[str, Any],
    where: list[str],
) -> None:
    response = post_task(client, company, {"type": "webhook", "payload": payload})

    errors = assert_error(response, 422, location="json")
    at = errors["payload"]
    for step in where:
        at = at[step]
    assert "\\u0000" in at[0]
    assert f"json.payload.{'.'.join(where)}" in json_of(response)["message"]
    assert_nothing_stored(db_session, company)


def test_payload_nested_33_deep_is_422_and_nothing_is_stored(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    # The payload object is depth 1, its `body` value depth 2.
    payload = {"url": "https://example.com", "body": nested(32)}

    response = post_task(client, company, {"type": "webhook", "payload": payload})

    errors = assert_error(response, 422, location="json")
    assert "at most 32 levels" in errors["payload"][0]
    assert_nothing_stored(db_session, company)


def test_lists_count_as_nesting_levels(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    body: list[Any] = []
    for _ in range(31):
        body = [body]
    payload = {"url": "https://example.com", "body": body}

    response = post_task(client, company, {"type": "webhook", "payload": payload})

    errors = assert_error(response, 422, location="json")
    assert "at most 32 levels" in errors["payload"][0]
    assert_nothing_stored(db_session, company)


def test_payload_nested_32_deep_is_accepted(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    payload = {"url": "https://example.com", "body": nested(31)}

    response = post_task(client, company, {"type": "webhook", "payload": payload})

    assert response.status_code == 201, response.get_data(as_text=True)[:300]
    assert json_of(response)["payload"] == payload
    assert count_tasks(db_session, company.id) == 1


def test_unknown_top_level_field_is_422_and_nothing_is_stored(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    response = post_task(client, company, {"type": "noop", "priority": 1})

    errors = assert_error(response, 422, location="json")
    assert errors["priority"] == ["Unknown field."]
    assert_nothing_stored(db_session, company)


def test_missing_type_is_422_and_nothing_is_stored(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    response = post_task(client, company, {"payload": {}})

    errors = assert_error(response, 422, location="json")
    assert errors["type"]
    assert_nothing_stored(db_session, company)


def test_naive_run_at_is_422_and_nothing_is_stored(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    response = post_task(client, company, {"type": "noop", "run_at": "2030-01-01T00:00:00"})

    errors = assert_error(response, 422, location="json")
    assert errors["run_at"]
    assert_nothing_stored(db_session, company)


def test_run_at_with_an_offset_sets_run_after(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    response = post_task(client, company, {"type": "noop", "run_at": "2030-01-01T09:30:00+02:00"})

    assert response.status_code == 201, response.get_data(as_text=True)[:300]
    run_after = json_of(response)["run_after"]
    assert dt.datetime.fromisoformat(run_after) == dt.datetime(2030, 1, 1, 7, 30, tzinfo=dt.UTC)
    assert count_tasks(db_session, company.id) == 1


@pytest.mark.parametrize(
    "run_at",
    ["0001-01-01T00:00:00+14:00", "9999-12-31T23:00:00-05:00", "1969-12-31T23:59:59Z"],
    ids=["before-year-1-in-utc", "after-year-9999-in-utc", "before-1970"],
)
def test_run_at_outside_the_storable_range_is_422_not_a_5xx(
    client: FlaskClient, company: CompanyWithKey, db_session: Session, run_at: str
) -> None:
    response = post_task(client, company, {"type": "noop", "run_at": run_at})

    errors = assert_error(response, 422, location="json")
    assert errors["run_at"]
    assert_nothing_stored(db_session, company)


@pytest.mark.parametrize(
    "timeout_seconds",
    [None, 0, 86_401, "60", 1.5],
    ids=["null", "zero", "over-a-day", "string", "fraction"],
)
def test_a_timeout_that_is_not_a_whole_number_of_seconds_in_range_is_422(
    client: FlaskClient, company: CompanyWithKey, db_session: Session, timeout_seconds: Any
) -> None:
    """Every task has its timeout (the column is NOT NULL): a null is refused like the rest,
    naming the field, never stored nor a 5xx."""
    response = post_task(client, company, {"type": "noop", "timeout_seconds": timeout_seconds})

    errors = assert_error(response, 422, location="json")
    assert errors["timeout_seconds"]
    assert_nothing_stored(db_session, company)


def test_unknown_type_is_422_listing_the_known_types(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    response = post_task(client, company, {"type": "mine_bitcoin"})

    errors = assert_error(response, 422, location="json")
    message = errors["type"][0]
    assert "mine_bitcoin" in message
    for known in ("noop", "send_email", "sleep", "webhook"):
        assert known in message
    assert_nothing_stored(db_session, company)


@pytest.mark.parametrize(
    ("task_type", "payload", "field"),
    [
        ("sleep", {"seconds": 301}, "seconds"),
        ("sleep", {"seconds": -1}, "seconds"),
        ("sleep", {}, "seconds"),
        ("send_email", {"to": "not-an-address", "subject": "hi"}, "to"),
        ("send_email", {"to": "a@example.com", "subject": ""}, "subject"),
        ("webhook", {"url": "ftp://example.com/x"}, "url"),
        ("webhook", {"url": "https://example.com", "headers": {"X": 1}}, "headers"),
        ("noop", {"extra": 1}, "extra"),
    ],
)
def test_payload_that_does_not_match_its_type_is_422_keyed_under_payload(
    client: FlaskClient,
    company: CompanyWithKey,
    db_session: Session,
    *,
    task_type: str,
    payload: dict[str, Any],
    field: str,
) -> None:
    response = post_task(client, company, {"type": task_type, "payload": payload})

    errors = assert_error(response, 422, location="json")
    assert errors["payload"][field]
    assert_nothing_stored(db_session, company)


@pytest.mark.parametrize("max_attempts", [0, 51, -1, "3", True, 2.5, None])
def test_max_attempts_outside_1_to_50_or_not_an_integer_is_422(
    client: FlaskClient, company: CompanyWithKey, db_session: Session, max_attempts: object
) -> None:
    response = post_task(client, company, {"type": "noop", "max_attempts": max_attempts})

    errors = assert_error(response, 422, location="json")
    assert errors["max_attempts"]
    assert_nothing_stored(db_session, company)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/companies/not-a-uuid"),
        ("PATCH", "/companies/not-a-uuid"),
        ("PATCH", "/companies/12345"),
        ("GET", "/companies/not-a-uuid/tasks"),
        ("POST", "/companies/not-a-uuid/tasks"),
        ("GET", "/companies/{company}/tasks/not-a-uuid"),
        ("POST", "/companies/{company}/tasks/not-a-uuid/cancel"),
        ("POST", "/companies/{company}/tasks/not-a-uuid/retry"),
        ("GET", "/companies/{company}/tasks/12345"),
    ],
)
def test_path_ids_that_are_not_uuids_are_404_with_a_json_body(
    client: FlaskClient,
    company: CompanyWithKey,
    db_session: Session,
    method: str,
    path: str,
) -> None:
    response = client.open(
        path.format(company=company.id), method=method, headers=company.headers, json={}
    )

    assert_error(response, 404)
    assert_nothing_stored(db_session, company)


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("limit=0", "limit"),
        ("limit=101", "limit"),
        ("limit=ten", "limit"),
        ("offset=-1", "offset"),
        ("offset=100001", "offset"),
        ("status=bogus", "status"),
    ],
)
def test_list_query_out_of_range_is_422_naming_the_field(
    client: FlaskClient, company: CompanyWithKey, query: str, field: str
) -> None:
    response = client.get(f"/companies/{company.id}/tasks?{query}", headers=company.headers)

    errors = assert_error(response, 422, location="query")
    assert list(errors) == [field]


@pytest.mark.parametrize(
    "key",
    ["", "k" * 256, "caf\u00e9", "two words", "tab\tinside"],
    ids=["empty", "256-chars", "non-ascii", "space", "tab"],
)
def test_invalid_idempotency_key_is_422_naming_the_header_and_nothing_is_stored(
    client: FlaskClient, company: CompanyWithKey, db_session: Session, key: str
) -> None:
    response = post_task(client, company, {"type": "noop"}, headers={"Idempotency-Key": key})

    errors = assert_error(response, 422, location="headers")
    assert errors["Idempotency-Key"]
    assert_nothing_stored(db_session, company)


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer wrong-token", "Bearer ", "Basic dXNlcjpwYXNz", "fq_without_scheme"],
    ids=["missing", "wrong", "empty", "basic", "no-scheme"],
)
def test_missing_or_wrong_token_is_401_with_www_authenticate_bearer(
    client: FlaskClient, company: CompanyWithKey, db_session: Session, authorization: str | None
) -> None:
    headers = {} if authorization is None else {"Authorization": authorization}

    response = client.post(f"/companies/{company.id}/tasks", json={"type": "noop"}, headers=headers)

    assert_error(response, 401)
    assert response.headers["WWW-Authenticate"].startswith("Bearer")
    assert_nothing_stored(db_session, company)


@pytest.mark.parametrize(
    ("path", "authorization"),
    [
        ("/companies/{id}/tasks", None),
        ("/companies/{id}/tasks", "Bearer wrong-token"),
        ("/companies/{id}/task-batches", "Basic dXNlcjpwYXNz"),
        ("/companies", "company-key"),  # an admin endpoint: a company's key is refused
    ],
    ids=["missing", "wrong", "basic", "company-key-on-admin-endpoint"],
)
def test_a_401_names_the_authorization_header_under_errors(
    client: FlaskClient, company: CompanyWithKey, path: str, authorization: str | None
) -> None:
    if authorization == "company-key":
        headers = company.headers
    else:
        headers = {} if authorization is None else {"Authorization": authorization}

    response = client.post(path.format(id=company.id), json={"type": "noop"}, headers=headers)

    assert_error(response, 401)
    body = json_of(response)
    assert set(body) == {"code", "status", "message", "errors"}
    assert body["errors"] == {"headers": {"Authorization": [body["message"]]}}


def test_unauthenticated_caller_gets_401_before_any_validation(
    client: FlaskClient, company: CompanyWithKey
) -> None:
    response = client.post(f"/companies/{company.id}/tasks", data="{", content_type=JSON)

    assert_error(response, 401)


def test_another_companys_key_is_404_and_nothing_is_stored(
    client: FlaskClient, make_company: MakeCompany, db_session: Session
) -> None:
    victim, intruder = make_company("victim"), make_company("intruder")

    response = client.post(
        f"/companies/{victim.id}/tasks", json={"type": "noop"}, headers=intruder.headers
    )

    assert_error(response, 404)
    assert_nothing_stored(db_session, victim)
    assert_nothing_stored(db_session, intruder)


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e400", "-1e400"])
def test_nan_infinity_and_out_of_range_numbers_are_400(
    client: FlaskClient, company: CompanyWithKey, db_session: Session, number: str
) -> None:
    body = '{"type": "webhook", "payload": {"url": "https://example.com", "body": ' + number + "}}"

    response = post_task(client, company, body)

    errors = assert_error(response, 400, location="json")
    assert number.lstrip("-") in errors[0]
    assert_nothing_stored(db_session, company)


@pytest.mark.parametrize(
    "body",
    [
        '{"type": "webhook", "payload": {"url": "https://example.com", "body": "\\ud800"}}',
        '{"type": "webhook", "payload": {"url": "https://example.com", "body": {"\\udfff": 1}}}',
        '{"type": "noop\\udc00"}',
    ],
    ids=["high-alone-in-a-value", "low-alone-in-a-key", "in-the-type"],
)
def test_unpaired_surrogate_escape_is_400_and_nothing_is_stored(
    client: FlaskClient, company: CompanyWithKey, db_session: Session, body: str
) -> None:
    # Python's json accepts it; UTF-8, psycopg and jsonb cannot hold the result.
    response = post_task(client, company, body, headers={"Idempotency-Key": "k"})

    errors = assert_error(response, 400, location="json")
    assert "surrogate" in errors[0]
    assert_nothing_stored(db_session, company)


def test_escaped_surrogate_pair_is_one_valid_character(
    client: FlaskClient, company: CompanyWithKey
) -> None:
    body = (
        '{"type": "webhook", "payload": {"url": "https://example.com", "body": "\\ud83d\\ude00"}}'
    )

    response = post_task(client, company, body, headers={"Idempotency-Key": "k"})

    assert response.status_code == 201, response.get_data(as_text=True)[:300]
    assert json_of(response)["payload"]["body"] == "\U0001f600"


def test_list_type_filter_containing_nul_is_422_not_a_5xx(
    client: FlaskClient, company: CompanyWithKey
) -> None:
    response = client.get(f"/companies/{company.id}/tasks?type=no%00op", headers=company.headers)

    errors = assert_error(response, 422, location="query")
    assert errors["type"]


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "application/xml"]
)
def test_non_json_content_type_with_a_body_is_415(
    client: FlaskClient, company: CompanyWithKey, db_session: Session, content_type: str
) -> None:
    response = post_task(client, company, '{"type": "noop"}', content_type=content_type)

    headers = assert_error(response, 415, location="headers")
    assert "application/json" in json_of(response)["message"]
    assert headers == {"Content-Type": [json_of(response)["message"]]}
    assert_nothing_stored(db_session, company)


@pytest.mark.parametrize("seconds", ["5", True, None, [1]])
def test_sleep_seconds_must_be_a_json_number_and_nothing_is_stored(
    client: FlaskClient, company: CompanyWithKey, db_session: Session, seconds: object
) -> None:
    response = post_task(client, company, {"type": "sleep", "payload": {"seconds": seconds}})

    errors = assert_error(response, 422, location="json")
    assert "seconds" in errors["payload"]
    assert_nothing_stored(db_session, company)


@pytest.mark.parametrize(
    "header",
    [
        ("X-Ok", "a\r\nX-Injected: 1", "value"),
        ("X-Ok", "caf\u00e9", "value"),
        ("Bad Name", "v", "key"),
        ("X:Colon", "v", "key"),
    ],
)
def test_webhook_header_that_http_cannot_carry_is_422_and_nothing_is_stored(
    client: FlaskClient,
    company: CompanyWithKey,
    db_session: Session,
    header: tuple[str, str, str],
) -> None:
    name, value, part = header
    payload = {"url": "https://example.com/hook", "headers": {name: value}}
    response = post_task(client, company, {"type": "webhook", "payload": payload})

    errors = assert_error(response, 422, location="json")
    assert errors["payload"]["headers"][name][part]
    assert_nothing_stored(db_session, company)


@pytest.mark.parametrize("subject", ["s\r\nBcc: x@example.com", "line\nbreak", "nul\x01"])
def test_email_subject_with_a_line_break_is_422_and_nothing_is_stored(
    client: FlaskClient, company: CompanyWithKey, db_session: Session, subject: str
) -> None:
    payload = {"to": "a@example.com", "subject": subject}
    response = post_task(client, company, {"type": "send_email", "payload": payload})

    errors = assert_error(response, 422, location="json")
    assert errors["payload"]["subject"]
    assert_nothing_stored(db_session, company)


@pytest.mark.parametrize(
    ("method", "path", "named"),
    [
        ("GET", "/companies/{company}/tasks/not-a-uuid", ["task_id"]),
        ("POST", "/companies/{company}/tasks/12345/cancel", ["task_id"]),
        ("GET", "/companies/nope/tasks", ["company_id"]),
        ("GET", "/companies/nope/tasks/also-not", ["company_id", "task_id"]),
        ("POST", "/companies/1/task-batches", ["company_id"]),
        # Forms Python's uuid.UUID reads but the routes refuse.
        ("GET", "/companies/{{{company}}}/tasks", ["company_id"]),
        ("GET", "/companies/{company.hex}/tasks", ["company_id"]),
        ("GET", "/companies/urn:uuid:{company}/tasks", ["company_id"]),
    ],
)
def test_a_path_id_that_is_not_a_uuid_is_a_404_naming_it(
    client: FlaskClient, company: CompanyWithKey, method: str, path: str, named: list[str]
) -> None:
    response = client.open(
        path.format(company=company.id), method=method, headers=company.headers, json={}
    )

    errors = assert_error(response, 404, location="path")
    assert errors == {name: ["Not a valid UUID."] for name in named}
    assert all(name in json_of(response)["message"] for name in named)


@pytest.mark.parametrize("path", ["/nope", "/companies/{company}/tasks/x/y"])
def test_a_path_no_route_has_is_a_plain_404(
    client: FlaskClient, company: CompanyWithKey, path: str
) -> None:
    response = client.get(path.format(company=company.id), headers=company.headers)

    assert_error(response, 404)
    assert "errors" not in json_of(response)


def test_a_method_no_route_takes_on_a_path_with_a_bad_id_is_a_plain_404(
    client: FlaskClient, company: CompanyWithKey
) -> None:
    """No route would take DELETE there, whatever the id: nothing to name."""
    response = client.delete("/companies/nope/tasks", headers=company.headers)

    assert_error(response, 404)
    assert "errors" not in json_of(response)
