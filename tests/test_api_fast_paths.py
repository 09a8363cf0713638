"""The hot path's shortcuts against the library code they stand for (decision 0005).

- `StrictJsonParser.loader` against webargs' `parse`: the create's body and its
  Idempotency-Key header are loaded by `loader`'s functions (`api.parser.Blueprint.arguments`);
  whatever a client sends, both give the same arguments, or abort with the same status and
  error body.
- The dashboard's session of a request without cookies against Flask's.
"""

from __future__ import annotations

import json
from typing import Any

from flask import Flask
from flask.sessions import SecureCookieSessionInterface
from hypothesis import example, given
from hypothesis import strategies as st
from marshmallow import Schema
from werkzeug.exceptions import HTTPException

from api.companies.schemas import CompanyCreateSchema
from api.parser import Blueprint, StrictJsonParser
from api.tasks.schemas import (
    IdempotencyHeaderSchema,
    TaskBatchCreateSchema,
    TaskCreateSchema,
    TaskListQuerySchema,
)
from tests.strategies import json_scalars, json_values
from tests.test_properties import PROPERTIES
from worker import tasktypes

app = Flask("parser-fast-path")
app.config["MAX_CONTENT_LENGTH"] = 4096
parser: StrictJsonParser = Blueprint.ARGUMENTS_PARSER
BODY_SCHEMAS: tuple[Schema, ...] = (
    TaskCreateSchema(),
    TaskBatchCreateSchema(),
    CompanyCreateSchema(),
)

task_types = st.one_of(st.sampled_from(tasktypes.names()), json_scalars)
run_ats = st.one_of(
    json_scalars,
    st.datetimes(timezones=st.timezones()).map(lambda value: value.isoformat()),
    st.sampled_from(["1969-12-31T23:59:59Z", "9999-01-01T00:00:00+00:00", "2030-01-01T00:00"]),
)
bodies = st.one_of(
    st.fixed_dictionaries(
        {},
        optional={
            "type": task_types,
            "payload": json_values,
            "run_at": run_ats,
            "max_attempts": json_scalars,
            "timeout_seconds": json_scalars,
            "name": json_scalars,
            "tasks": st.lists(json_values, max_size=3),
            "colour": json_values,  # unknown to every schema
        },
    ),
    json_values,
)
# The encoded body: JSON, JSON cut short, or any bytes; with or without Content-Length.
raw_bodies = st.one_of(
    bodies.map(lambda body: json.dumps(body).encode()),
    bodies.map(lambda body: json.dumps(body).encode()[:-1]),
    st.binary(max_size=64),
    st.just(b""),
    st.just(b"x" * 5000),
)
content_types = st.sampled_from(
    [None, "application/json", "application/json; charset=latin-1", "text/plain"]
)


def outcome(schema: Schema, location: str, fast: bool, **request: Any) -> tuple[Any, ...]:
    """What loading `schema` from the request gives: ("ok", args) or ("abort", code, body)."""
    with app.test_request_context("/", method="POST", **request) as ctx:
        try:
            if fast:
                load = parser.loader(schema, location)
                assert load is not None
                return ("ok", load(ctx.request))
            return ("ok", parser.parse(schema, ctx.request, location=location))
        except HTTPException as exc:
            data = getattr(exc, "data", {})
            shown = {key: data[key] for key in ("message", "messages", "errors") if key in data}
            return ("abort", exc.code, shown)


@PROPERTIES
@given(
    schema=st.sampled_from(BODY_SCHEMAS),
    body=raw_bodies,
    content_type=content_types,
    chunked=st.booleans(),
)
@example(TaskCreateSchema(), b'{"type": "noop", "max_attempts": 2}', "application/json", False)
@example(TaskCreateSchema(), b'{"type": "nope", "max_attempts": 0}', "application/json", True)
def test_body_loads_as_webargs_does(
    schema: Schema, body: bytes, content_type: str | None, chunked: bool
) -> None:
    """Same arguments or same abort for any body, content type and framing."""
    headers = {"Content-Type": content_type} if content_type else {}
    if chunked:
        headers["Transfer-Encoding"] = "chunked"
    request: dict[str, Any] = {"data": body, "headers": headers}
    expected = outcome(schema, "json", False, **request)
    assert outcome(schema, "json", True, **request) == expected


header_values = st.one_of(
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=10),
    st.text(st.characters(codec="latin-1", exclude_characters="\r\n"), max_size=6),
    st.just("k" * 256),
)


@PROPERTIES
@given(
    keys=st.lists(header_values, max_size=2),
    spelling=st.sampled_from(["Idempotency-Key", "idempotency-key", "IDEMPOTENCY-KEY"]),
    others=st.dictionaries(st.sampled_from(["X-A", "Idempotency", "Key"]), header_values),
)
def test_headers_load_as_webargs_does(
    keys: list[str], spelling: str, others: dict[str, str]
) -> None:
    """Same arguments or same 422 for an absent, repeated or invalid Idempotency-Key."""
    headers = [*others.items(), *((spelling, key) for key in keys)]
    schema = IdempotencyHeaderSchema()
    expected = outcome(schema, "headers", False, headers=headers)
    assert outcome(schema, "headers", True, headers=headers) == expected


def test_other_locations_keep_webargs_parse() -> None:
    """A query schema has no loader: `Blueprint.arguments` leaves it to webargs."""
    assert parser.loader(TaskListQuerySchema(), "query") is None


def test_session_without_cookies_is_flasks(shared_app: Flask) -> None:
    """No Cookie header: the same empty session class as Flask's own would open."""
    interface = shared_app.session_interface
    assert isinstance(interface, SecureCookieSessionInterface)
    with shared_app.test_request_context("/companies") as ctx:
        ours = interface.open_session(shared_app, ctx.request)
        flasks = SecureCookieSessionInterface.open_session(interface, shared_app, ctx.request)
    assert type(ours) is type(flasks)
    assert ours is not None
    assert dict(ours) == dict(flasks or {}) == {}
    assert not ours.modified
    assert not ours.accessed
