"""Property-based fuzzing of every operation in /openapi.json (design §1.6, §3), with schemathesis.

Each operation gets schema-valid and schema-violating requests, sent with real tokens to the
real app on a fresh database (requests commit). Every response must be a non-5xx, carry a
status the operation documents explicitly (flask-smorest adds a `default` response to every
operation, which makes schemathesis' own `status_code_conformance` accept anything), and match
the documented body schema; error bodies have the one error shape. Reproducible: hypothesis
runs derandomized with no example database. POST /workers/process is fuzzed too: its database
holds only `noop` tasks, so a pass runs no network handler and takes milliseconds.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import schemathesis
from flask import Flask
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import Case, GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    response_schema_conformance,
    status_code_conformance,
)
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from api import create_app, database
from api.settings import ApiSettings
from tests.conftest import ADMIN_TOKEN, make_test_app
from tests.factories import CompanyWithKey, insert_company, insert_task

# Per operation, half of them schema-violating: about 10 s for all operations together.
EXAMPLES_PER_OPERATION = 40


# The spec does not depend on the database: an app that never connects serves it, so the
# operations are known when pytest collects. Requests go to a real app per test.
SPEC_APP = create_app(ApiSettings(database_url="postgresql+psycopg://spec@127.0.0.1:9/unused"))
SCHEMA = schemathesis.openapi.from_wsgi("/openapi.json", SPEC_APP)
SPEC: dict[str, Any] = SPEC_APP.test_client().get("/openapi.json").get_json()
OPERATIONS = sorted(
    f"{method.upper()} {path}"
    for path, item in SPEC["paths"].items()
    for method in item
    if method != "parameters"
)


@schemathesis.hook
def before_call(context: schemathesis.HookContext, case: Case[Any], kwargs: dict[str, Any]) -> None:
    """Send the token a test passed as `fuzz_token=` (None: no Authorization header).

    Set here rather than on the case beforehand: schemathesis' negative mode mutates the
    bearer header too and then strips it at send time, unless a `before_call` hook restores
    it. Without this, most schema-violating bodies would stop at the 401.
    """
    if "fuzz_token" not in kwargs:
        return
    token = kwargs.pop("fuzz_token")
    if token is not None:
        case.headers["Authorization"] = f"Bearer {token}"


@dataclass(frozen=True)
class World:
    """The app under test and what it stores: `me` is the caller, `other` another tenant."""

    app: Flask
    me: CompanyWithKey
    other: CompanyWithKey
    task_ids: tuple[str, ...]


@pytest.fixture
def world(fresh_db_url: str, fresh_engine: Engine) -> Iterator[World]:
    """An app on a fresh database with two companies and `me`'s tasks in every status."""
    with Session(fresh_engine) as session:
        me, other = insert_company(session, "me"), insert_company(session, "other")
        # noop only: a fuzzed POST /workers/process runs these, and must stay fast and offline.
        # Finished ones finished a minute ago, in the windows of the stats endpoints.
        ids = tuple(
            str(insert_task(session, me.id, status=status, **finished).id)
            for status, finished in (
                ("pending", {}),
                ("processing", {}),
                ("completed", {"finished_at": text("now() - interval '1 minute'")}),
                ("failed", {"finished_at": text("now() - interval '1 minute'")}),
                ("cancelled", {"finished_at": text("now() - interval '1 minute'")}),
            )
        )
    app = make_test_app(fresh_db_url)
    # The pool makes its connections in background threads, which draw from `random` (the
    # jitter of their lifetime), and hypothesis fails a test whose draws saw the global
    # random state change: every connection is made before the first draw.
    source = database.source_of(app)
    assert isinstance(source, database.Pooled)
    source.pool.open(wait=True)
    yield World(app, me, other, ids)
    database.close(app)


def _valid_task_bodies() -> st.SearchStrategy[tuple[str, dict[str, Any]]]:
    """(type, payload) pairs every registered type accepts, so creates get past validation."""
    text = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=20)
    return st.one_of(
        st.just(("noop", {})),
        st.floats(0, 300).map(lambda s: ("sleep", {"seconds": s})),
        text.map(lambda s: ("send_email", {"to": "a@example.com", "subject": s or "hi"})),
        text.map(lambda s: ("webhook", {"url": "https://example.com/hook", "body": s})),
    )


# Idempotency-Keys of fuzzed batch items: few, so that batches replay and reuse each other's.
BATCH_KEYS = st.sampled_from([None, "fuzz-1", "fuzz-2"])


def _operation(label: str) -> tuple[Any, dict[str, Any]]:
    operation = SCHEMA.find_operation_by_label(label)
    assert operation is not None
    method, path = label.split(" ", 1)
    return operation, SPEC["paths"][path][method.lower()]


def _tokens(world: World, path: str, raw: dict[str, Any]) -> list[str | None]:
    """Tokens to send, the right one most often: also a wrong, an absent and a foreign one.

    The right one is the admin token on admin-only operations (their summary says so, as on
    PATCH /companies/{company_id}), else the company's key on a company's path.
    """
    if raw.get("security") == []:  # public
        return [None, None, "not-a-token"]
    wrong = [None, "not-a-token"]
    if "{company_id}" not in path:
        return [ADMIN_TOKEN] * 6 + [world.me.api_key, *wrong]
    if "(admin only)" in raw.get("summary", ""):
        return [ADMIN_TOKEN] * 6 + [world.me.api_key, world.other.api_key, *wrong]
    return [world.me.api_key] * 6 + [world.other.api_key, ADMIN_TOKEN, *wrong]


def _documented_statuses(raw: dict[str, Any]) -> set[int]:
    return {int(code) for code in raw["responses"] if code != "default"}


def _assert_error_shape(status: int, body: Any) -> None:
    """design §3: `{"code", "status", "message", "errors"?}` for every error."""
    assert isinstance(body, dict), body
    assert set(body) <= {"code", "status", "message", "errors"}, body
    assert body["code"] == status, body
    assert isinstance(body["message"], str), body
    assert body["message"], body


# The operations that pause and resume a company, and the `paused` each must leave.
PAUSES = {
    "POST /companies/{company_id}/pause": True,
    "POST /companies/{company_id}/resume": False,
}


def _assert_paused_as_answered(world: World, body: Any, paused: bool) -> None:
    """The answer, the company and the claim's copy of the flag agree; paused is out of the ring."""
    assert body["paused"] is paused, body
    with world.app.app_context():
        stored = (
            database.connection()
            .execute(
                "SELECT c.paused, q.paused, q.ready FROM companies c "
                "JOIN company_queues q ON q.company_id = c.id WHERE c.id = %(id)s",
                {"id": body["id"]},
            )
            .fetchone()
        )
    assert stored is not None
    assert (stored[0], stored[1]) == (paused, paused), stored
    assert not (paused and stored[2]), stored


def _has_inputs(operation: Any) -> bool:
    return bool(
        len(operation.path_parameters)
        or len(operation.query)
        or len(operation.headers)
        or len(operation.body)
    )


@pytest.mark.slow
@pytest.mark.parametrize("label", OPERATIONS)
def test_operation_never_fails_and_answers_only_as_documented(label: str, world: World) -> None:
    operation, raw = _operation(label)
    path = label.split(" ", 1)[1]
    strategy = operation.as_strategy(GenerationMode.POSITIVE)
    if _has_inputs(operation):
        strategy = st.one_of(strategy, operation.as_strategy(GenerationMode.NEGATIVE))
    documented = _documented_statuses(raw)
    tokens = _tokens(world, path, raw)

    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        case: Case[Any] = data.draw(strategy, label="case")
        params = case.path_parameters if case.path_parameters is not None else {}
        if "company_id" in params and data.draw(st.integers(0, 9), label="foreign") < 8:
            params["company_id"] = str(world.me.id)
        if "task_id" in params and data.draw(st.integers(0, 9), label="unknown") < 8:
            params["task_id"] = data.draw(st.sampled_from(world.task_ids), label="task")
        body = case.body
        creates = label == "POST /companies/{company_id}/tasks"
        if creates and isinstance(body, dict) and data.draw(st.booleans(), label="valid type"):
            body["type"], body["payload"] = data.draw(_valid_task_bodies(), label="type")
        batch = label == "POST /companies/{company_id}/task-batches"
        tasks = body.get("tasks") if batch and isinstance(body, dict) else None
        if isinstance(tasks, list) and data.draw(st.booleans(), label="valid items"):
            # Valid items, with keys from a small set: replays, repeats and reused keys.
            for item in (item for item in tasks if isinstance(item, dict)):
                item["type"], item["payload"] = data.draw(_valid_task_bodies(), label="item")
                item["idempotency_key"] = data.draw(BATCH_KEYS, label="key")
        token = data.draw(st.sampled_from(tokens), label="token")
        case.headers.pop("Authorization", None)

        response = case.call(app=world.app, fuzz_token=token)

        case.validate_response(
            response,
            checks=[not_a_server_error, status_code_conformance, response_schema_conformance],
        )
        assert response.status_code in documented, (
            f"{label} answered {response.status_code}, documented: {sorted(documented)}\n"
            f"{case.as_curl_command()}\n{response.text[:500]}"
        )
        if response.status_code >= 400:
            _assert_error_shape(response.status_code, json.loads(response.text))
        if response.status_code == 200 and label in PAUSES:
            _assert_paused_as_answered(world, json.loads(response.text), PAUSES[label])

    run()


def test_every_operation_of_the_app_is_fuzzed() -> None:
    routes = {
        f"{method} {rule.rule}"
        for rule in SPEC_APP.url_map.iter_rules()
        # The dashboard's HTML pages are not in the OpenAPI document (tests/test_dashboard.py).
        if not rule.endpoint.startswith("dashboard.")
        for method in rule.methods or ()
        if method not in {"HEAD", "OPTIONS"}
    }
    # Routes that are not API operations: the spec and docs themselves, static files, metrics.
    not_operations = {
        "GET /openapi.json",
        "GET /docs",
        "GET /docs/assets/<path:filename>",
        "GET /static/<path:filename>",
        "GET /metrics",
    }
    as_spec_paths = {re.sub(r"<uuid:(\w+)>", r"{\1}", route) for route in routes - not_operations}

    assert as_spec_paths == set(OPERATIONS)


def test_every_pattern_in_the_spec_is_an_ecma_262_regex() -> None:
    # OpenAPI `pattern` is ECMA-262. Python-only anchors (`\\A`, `\\Z`) made standard JSON
    # Schema validators (jsonschema-rs, which schemathesis uses) refuse the spec: "not a regex".
    import jsonschema_rs

    patterns: list[str] = []

    def collect(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                patterns.append(node["pattern"])
            for value in node.values():
                collect(value)
        elif isinstance(node, list):
            for value in node:
                collect(value)

    collect(SPEC)
    idempotency_key = SPEC["paths"]["/companies/{company_id}/tasks"]["post"]["parameters"][0]

    assert patterns
    for pattern in patterns:
        # Raises ValidationError when `pattern` is not an ECMA-262 regex.
        jsonschema_rs.validator_for({"type": "string", "pattern": pattern})
    key = jsonschema_rs.validator_for(idempotency_key["schema"])
    assert key.is_valid("order-42:retry/1")
    for bad in ("two words", "tab\tinside", "line\n", "caf\u00e9", ""):
        assert not key.is_valid(bad), bad
