"""Reading the claim in tests: the plans of its statements, and its settle on its own.

`fairq_claim` (db/sql/claim.sql) is a PL/pgSQL function: EXPLAIN of its call shows a
Function Scan and nothing of the statements it runs. Those are nested statements, which the
`auto_explain` module logs with their plans (`log_nested_statements`); logged at NOTICE, they
reach the client, and `claim_statements` collects them from psycopg's notice handler. A
server without auto_explain (the embedded PostgreSQL of `make test`) skips these tests.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from db import claims
from db.engine import driver_connection

NO_AUTO_EXPLAIN = (
    "this PostgreSQL server has no auto_explain module (the embedded PostgreSQL of `make test` "
    "does not ship it), and the plans of the statements inside fairq_claim are read through "
    "it; run these tests against a server that has it (TEST_DATABASE_URL)"
)

# The claim's statements, told apart by a piece of their text (db/sql/claim.sql).
CONTENDERS = "WITH ring AS"
CLAIM = "WITH allotted AS"
SETTLE = "SET due_at = CASE WHEN s.short THEN d.due_at"


def plan_nodes(
    node: dict[str, Any], parents: tuple[str, ...] = ()
) -> Iterator[tuple[dict[str, Any], tuple[str, ...]]]:
    """Every node of an EXPLAIN (FORMAT JSON) plan, with the node types above it."""
    yield node, parents
    for child in node.get("Plans", []):
        yield from plan_nodes(child, (*parents, node["Node Type"]))


@dataclass(frozen=True)
class Statement:
    """A statement the claim ran, as auto_explain logged it: its text and its plan."""

    text: str
    # auto_explain's JSON object: "Plan", and "Settings" (the planner settings in force that
    # differ from their defaults), "JIT" when the statement was compiled.
    explained: dict[str, Any]

    @property
    def plan(self) -> dict[str, Any]:
        """The plan's top node, as `plan_nodes` walks it."""
        node: dict[str, Any] = self.explained["Plan"]
        return node


def require_auto_explain(session: Session) -> None:
    """Load auto_explain into the session's connection, or skip the test."""
    savepoint = session.begin_nested()
    try:
        session.execute(text("LOAD 'auto_explain'"))
    except Exception as exc:
        savepoint.rollback()
        if isinstance(getattr(exc, "orig", None), psycopg.errors.UndefinedFile):
            pytest.skip(NO_AUTO_EXPLAIN)
        raise
    savepoint.commit()


def claim_statements(
    session: Session,
    batch_size: int,
    *,
    worker_id: str = "plan:1",
    analyze: bool = False,
) -> tuple[list[claims.ClaimedTask], list[Statement]]:
    """Claim a batch with auto_explain on; return the batch and every statement logged.

    The statements of `fairq_claim` in the order they ran, then the call itself, with the
    statements of the triggers the claim fires among them. With `analyze`, the plans carry
    actual rows, loops and buffers. The claim runs in a savepoint, then rolled back: its rows
    and locks are undone, but not the sequences it moved (the cursor, ring positions). Skips
    the test on a server without auto_explain.
    """
    require_auto_explain(session)
    connection = driver_connection(session)
    logged: list[str] = []

    def collect(diagnostic: psycopg.errors.Diagnostic) -> None:
        message = diagnostic.message_primary or ""
        if "plan:\n" in message:
            logged.append(message.split("plan:\n", 1)[1])

    settings = {
        "auto_explain.log_min_duration": "0",
        "auto_explain.log_nested_statements": "on",
        "auto_explain.log_format": "json",
        "auto_explain.log_level": "notice",
        "auto_explain.log_settings": "on",
        "auto_explain.log_analyze": "on" if analyze else "off",
        "auto_explain.log_buffers": "on" if analyze else "off",
        "auto_explain.log_timing": "off",
        "client_min_messages": "notice",
    }
    savepoint = session.begin_nested()
    connection.add_notice_handler(collect)
    try:
        # SET LOCAL, undone with the savepoint; in one statement, which auto_explain does
        # not log (it was off when the statement started).
        connection.execute(
            "SELECT set_config(s.name, s.value, true) "
            "FROM unnest(CAST(%s AS text[]), CAST(%s AS text[])) AS s(name, value)",
            (list(settings), list(settings.values())),
        )
        batch = claims.claim(
            driver_connection(session, transaction=False),
            worker_id=worker_id,
            batch_size=batch_size,
        )
        # auto_explain logs a statement when its executor ends, which for the call is when
        # its portal is closed: at the next statement, this one. It turns the logging off,
        # after its own start, so it is not logged itself.
        connection.execute("SELECT set_config('auto_explain.log_min_duration', '-1', true)")
    finally:
        connection.remove_notice_handler(collect)
        savepoint.rollback()
    statements = []
    for entry in logged:
        explained = json.loads(entry)
        statements.append(Statement(explained["Query Text"], explained))
    return batch, statements


def pick(statements: Sequence[Statement], marker: str) -> list[Statement]:
    """The statements whose text holds `marker` (a round's, or the settle), at least one."""
    found = [s for s in statements if marker in s.text]
    assert found, f"no statement of the claim holds {marker!r}: {[s.text for s in statements]}"
    return found


def claim_settings(session: Session) -> dict[str, str]:
    """The settings `fairq_claim` runs under (its SET clauses), by name."""
    config = session.execute(
        text("SELECT proconfig FROM pg_proc WHERE oid = 'fairq_claim'::regproc")
    ).scalar_one()
    return dict(entry.split("=", 1) for entry in config)


def explain(
    session: Session, sql: str, params: dict[str, Any], *, analyze: bool = False
) -> dict[str, Any]:
    """EXPLAIN (FORMAT JSON) of a statement under the claim's settings, effects undone.

    For statements of the tests' own (a control to compare the claim with): the claim's
    statements are read with `claim_statements`. With `analyze`, also ANALYZE and BUFFERS:
    the statement runs, in a savepoint rolled back with the settings.
    """
    options = "ANALYZE, BUFFERS, FORMAT JSON" if analyze else "FORMAT JSON"
    connection = driver_connection(session)
    savepoint = session.begin_nested()
    try:
        for name, value in claim_settings(session).items():
            connection.execute("SELECT set_config(%s, %s, true)", (name, value))
        row = connection.execute(f"EXPLAIN ({options}) {sql}", params).fetchone()
    finally:
        savepoint.rollback()
    assert row is not None
    plan: dict[str, Any] = row[0][0]
    return plan


def settle_statement(session: Session) -> str:
    """The claim's settle, the UPDATE of the companies that ran short, as a statement alone.

    Read from the function the database runs, its company list a parameter
    (`%(company_ids)s`) instead of the companies whose wake-up lock the claim got: what
    the settle would do without those locks.
    """
    source = session.execute(
        text("SELECT prosrc FROM pg_proc WHERE oid = 'fairq_claim'::regproc")
    ).scalar_one()
    found = re.search(
        r"UPDATE company_queues q\s+SET due_at = CASE WHEN s\.short THEN d\.due_at.*?;",
        source,
        re.DOTALL,
    )
    assert found, "the claim's settle moved; update the test"
    statement = found.group(0)
    assert statement.count("ANY(settled)") == 1, statement
    assert statement.count("ANY(exhausted)") == 1, statement
    assert statement.count("ANY(served)") == 1, statement
    assert statement.count("now_ts") == 2, statement
    # Every company given ran short (the settle proper, not a floor's raise alone).
    companies = "ANY(CAST(%(company_ids)s AS uuid[]))"
    return (
        statement.replace("ANY(settled)", companies)
        .replace("ANY(exhausted)", companies)
        .replace("ANY(served)", "ANY(CAST('{}' AS uuid[]))")
        .replace("now_ts", "clock_timestamp()")
    )
