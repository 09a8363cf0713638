"""Task results (design §6): what a handler returns, stored with its completion as `result`.

`task_result.encode` decides in the pass what can be stored, so no result `jsonb` refuses
ever reaches the completion statement, which writes a whole batch: what it accepts,
PostgreSQL stores as the same JSON; what it refuses fails its own task, for good.
"""

from __future__ import annotations

import functools
import json
import math
import types
import uuid
from decimal import Decimal
from typing import Any

import pytest
from flask.testing import FlaskClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import text
from sqlalchemy.exc import DataError
from sqlalchemy.orm import Session, sessionmaker

from db import claims
from db.engine import driver_connection
from tests import pg, test_processing
from tests.factories import CreatedTask, MakeCompany, MakeTask, insert_tasks, json_of
from tests.test_processing import Recorder, Register, rows, run_pass
from worker import processing
from worker.processing import task_result
from worker.processing.task_result import MAX_RESULT_BYTES, UnstorableResult
from worker.tasktypes.base import JsonValue, TaskContext

# The processing tests' fixtures: sessions on a fresh database, a task type per test.
sessions = test_processing.sessions
register = test_processing.register

# -- what can be stored -------------------------------------------------------------------


def test_a_result_is_compact_utf8_json() -> None:
    assert task_result.encode({"a": [1, 2.5, "é", None, True]}) == '{"a":[1,2.5,"é",null,true]}'


def test_mappings_and_sequences_of_any_kind_are_written_as_objects_and_arrays() -> None:
    value = types.MappingProxyType({"ids": (1, 2), "range": range(3)})

    assert task_result.encode(value) == '{"ids":[1,2],"range":[0,1,2]}'


def _nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


def _cycle() -> list[Any]:
    value: list[Any] = []
    value.append(value)
    return value


@pytest.mark.parametrize(
    ("value", "why"),
    [
        pytest.param({1, 2}, "not JSON: a set", id="set"),
        pytest.param(b"bytes", "not JSON: a bytes", id="bytes"),
        pytest.param(object(), "not JSON: a object", id="object"),
        pytest.param(math.nan, "not JSON: Out of range float", id="nan"),
        pytest.param({"x": -math.inf}, "not JSON: Out of range float", id="infinity"),
        pytest.param(_cycle(), "not JSON: Circular reference", id="cycle"),
        pytest.param(10**5000, "not JSON: Exceeds the limit", id="huge-integer"),
        pytest.param(_nested(100_000), "nested too deeply", id="deep"),
        pytest.param({"a": "x\x00y"}, r"U\+0000", id="nul-in-a-value"),
        pytest.param({"k\x00": 1}, r"U\+0000", id="nul-in-a-key"),
        pytest.param(["\ud800"], "lone surrogate", id="lone-surrogate"),
        pytest.param("x" * MAX_RESULT_BYTES, "65,538 bytes of JSON", id="over-64-kib"),
    ],
)
def test_a_value_that_cannot_be_stored_is_refused_saying_why(value: object, why: str) -> None:
    with pytest.raises(UnstorableResult, match=why):
        task_result.encode(value)


def test_the_limit_is_64_kib_of_json_counted_in_utf8_bytes() -> None:
    assert len(task_result.encode("x" * (MAX_RESULT_BYTES - 2))) == MAX_RESULT_BYTES
    # Two bytes per "é": half as many characters fit.
    assert task_result.encode("é" * (MAX_RESULT_BYTES // 2 - 1))
    with pytest.raises(UnstorableResult):
        task_result.encode("é" * (MAX_RESULT_BYTES // 2))


def test_a_backslash_before_u0000_is_text_not_a_nul(db_session: Session) -> None:
    stored = task_result.encode({"path": "C:\\u0000"})

    assert _stored(db_session, stored) == {"path": "C:\\u0000"}


def test_jsonb_refuses_the_nul_that_encode_refuses(db_session: Session) -> None:
    # Why the rule exists: one such result would fail the whole batch's completion.
    with pytest.raises(DataError, match="unsupported Unicode"), db_session.begin_nested():
        _stored(db_session, json.dumps("x\x00"))


def _stored(session: Session, result: str) -> Any:
    return session.execute(text("SELECT CAST(:r AS jsonb)"), {"r": result}).scalar_one()


def _exact(text_: str) -> Any:
    # Numbers as Decimal: jsonb keeps a number's decimal value, not Python's float.
    return json.loads(text_, parse_float=Decimal, parse_int=Decimal)


# Any character, surrogates and U+0000 included; every JSON scalar; nested containers.
_text = st.text(st.characters(exclude_categories=()), max_size=20)
_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(10**30), max_value=10**30),
        st.floats(allow_nan=False, allow_infinity=False),
        _text,
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(_text, children, max_size=4)
    ),
    max_leaves=20,
)


@settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=300,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(value=_values)
def test_what_encode_accepts_jsonb_stores_as_the_same_json(
    db_session: Session, value: object
) -> None:
    try:
        encoded = task_result.encode(value)
    except UnstorableResult as exc:
        why = str(exc)
    else:
        why = ""
    if why:
        # Only for what jsonb or UTF-8 cannot hold: these values are small and shallow.
        assert "U+0000" in why or "surrogate" in why
        return
    stored = db_session.execute(
        text("SELECT CAST(CAST(:r AS jsonb) AS text)"), {"r": encoded}
    ).scalar_one()
    assert _exact(stored) == _exact(encoded)


# -- stored with the completion ---------------------------------------------------------


def test_complete_tasks_stores_each_result_and_null_where_there_is_none(
    db_session: Session, make_company: MakeCompany, claimed_task: MakeTask
) -> None:
    company = make_company().id
    with_result, without = claimed_task(company), claimed_task(company)
    leases = [claims.Lease(t.id, t.lease_token) for t in (with_result, without)]  # type: ignore[arg-type]

    lost = claims.complete_tasks(
        driver_connection(db_session, transaction=False), leases, ['{"n":1}', None]
    )

    assert lost == []
    stored: dict[uuid.UUID, Any] = dict(
        db_session.execute(
            text("SELECT id, result FROM tasks WHERE id = ANY(:ids)"),
            {"ids": [with_result.id, without.id]},
        ).all()
    )
    assert stored == {with_result.id: {"n": 1}, without.id: None}


def test_handlers_results_are_stored_with_their_completions(
    sessions: sessionmaker[Session], fresh_company_id: uuid.UUID, register: Register
) -> None:
    returns: dict[str, JsonValue] = {
        "object": {"id": 42, "ok": True}, "array": [1, "two"], "string": "é", "none": None,
    }  # fmt: skip
    for name, value in returns.items():
        register(name, functools.partial(_returning, value))
    ids = {name: insert_tasks(sessions, fresh_company_id, 1, task_type=name)[0] for name in returns}

    assert run_pass(sessions) == processing.PassResult(claimed=4, completed=4)

    stored = dict(zip(ids, rows(sessions, list(ids.values())), strict=True))
    assert {name: row["result"] for name, row in stored.items()} == returns
    assert {row["status"] for row in stored.values()} == {"completed"}


def _returning(value: JsonValue, task: TaskContext) -> JsonValue:
    return value


def test_an_unstorable_result_fails_its_task_for_good_and_the_rest_of_the_batch_completes(
    sessions: sessionmaker[Session], fresh_company_id: uuid.UUID, register: Register
) -> None:
    register("big", lambda task: "x" * MAX_RESULT_BYTES)
    register("nan", lambda task: {"ratio": math.nan})
    register("fine", lambda task: {"ok": True})
    big = insert_tasks(sessions, fresh_company_id, 1, task_type="big", newest_age_seconds=30)
    nan = insert_tasks(sessions, fresh_company_id, 1, task_type="nan", newest_age_seconds=20)
    fine = insert_tasks(sessions, fresh_company_id, 1, task_type="fine", newest_age_seconds=10)
    noop = insert_tasks(sessions, fresh_company_id, 1, task_type="noop")
    observer = Recorder()

    result = run_pass(sessions, observer=observer)

    assert result == processing.PassResult(claimed=4, completed=2, failed=2)
    big_row, nan_row, fine_row, noop_row = rows(sessions, big + nan + fine + noop)
    assert (big_row["status"], big_row["attempts"], big_row["result"]) == ("failed", 1, None)
    assert big_row["last_error"] == (
        "the handler returned a result that cannot be stored: the result is 65,538 bytes of "
        "JSON, more than the 65,536 allowed"
    )
    assert nan_row["status"] == "failed"
    assert "Out of range float" in nan_row["last_error"]
    assert (fine_row["status"], fine_row["result"]) == ("completed", {"ok": True})
    assert (noop_row["status"], noop_row["result"]) == ("completed", None)
    assert ("failed", "big", True) in observer.calls


def test_a_result_left_unwritten_by_a_database_error_is_written_by_the_next_pass(
    sessions: sessionmaker[Session],
    fresh_company_id: uuid.UUID,
    register: Register,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    register("answer", lambda task: {"answer": 42})
    [task_id] = insert_tasks(sessions, fresh_company_id, 1, task_type="answer")
    unwritten = processing.UnwrittenOutcomes()
    with monkeypatch.context() as patched:
        patched.setattr(claims, "complete_tasks", _database_down)
        with pytest.raises(DataError):
            run_pass(sessions, unwritten=unwritten)
    assert unwritten.completions == 1

    with pg.worker_pool(sessions) as pool:
        written = processing.write_unwritten(pool, unwritten)
    assert written == processing.PassResult(completed=1)
    [stored] = rows(sessions, [task_id])
    assert (stored["status"], stored["result"]) == ("completed", {"answer": 42})


def _database_down(*args: Any) -> set[uuid.UUID]:
    raise DataError("UPDATE tasks ...", None, Exception("the database refused"))


# -- shown by the API, also for POST /workers/process -----------------------------------


@pytest.mark.usefixtures("quiet_processing_logs")
def test_post_workers_process_stores_results_the_task_json_shows(
    client: FlaskClient,
    make_company: MakeCompany,
    created_task: CreatedTask,
    admin_headers: dict[str, str],
    register: Register,
) -> None:
    register("answer", lambda task: {"answer": 42, "attempt": task.attempt})
    company = make_company()
    answered, noop = created_task(company, "answer"), created_task(company)

    response = client.post("/workers/process", headers=admin_headers)

    assert json_of(response)["completed"] == 2
    shown = [
        json_of(client.get(f"/companies/{company.id}/tasks/{task['id']}", headers=company.headers))
        for task in (answered, noop)
    ]
    assert [task["result"] for task in shown] == [{"answer": 42, "attempt": 1}, None]
    assert answered["result"] is None  # nothing until it completes


@pytest.fixture
def quiet_processing_logs(caplog: pytest.LogCaptureFixture) -> Any:
    """Keep the pass's per-task log lines out of the captured output."""
    with caplog.at_level("WARNING", logger="fairq.worker.processing"):
        yield
