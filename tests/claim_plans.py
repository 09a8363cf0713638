"""Reading the claim's query plans in tests: EXPLAIN under the claim's planner settings."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from sqlalchemy.orm import Session

from db import fair_share, queue
from db.engine import driver_connection


def plan_nodes(
    node: dict[str, Any], parents: tuple[str, ...] = ()
) -> Iterator[tuple[dict[str, Any], tuple[str, ...]]]:
    """Every node of an EXPLAIN (FORMAT JSON) plan, with the node types above it."""
    yield node, parents
    for child in node.get("Plans", []):
        yield from plan_nodes(child, (*parents, node["Node Type"]))


def explain(
    session: Session, sql: str, params: dict[str, Any], *, analyze: bool = False
) -> dict[str, Any]:
    """EXPLAIN (FORMAT JSON) of a claim statement on the claim's connection, effects undone.

    With `analyze`, also ANALYZE and BUFFERS: the statement runs, in a savepoint rolled back.
    The statement runs after `_SERIALIZE_CLAIMERS`, whose planner settings it is written for.
    """
    options = "ANALYZE, BUFFERS, FORMAT JSON" if analyze else "FORMAT JSON"
    connection = driver_connection(session)
    savepoint = session.begin_nested()
    try:
        connection.execute(queue._SERIALIZE_CLAIMERS, {"key": queue.CLAIM_LOCK_KEY})
        row = connection.execute(f"EXPLAIN ({options}) {sql}", params).fetchone()
    finally:
        savepoint.rollback()
    assert row is not None
    plan: dict[str, Any] = row[0][0]
    return plan


def contenders_params(batch_size: int) -> dict[str, Any]:
    """The parameters of `_CONTENDERS` in a claim's first round."""
    return {"batch_size": batch_size, "promote_limit": queue.PROMOTE_LIMIT, "exclude": []}


def first_round_params(session: Session, batch_size: int, worker_id: str) -> dict[str, Any]:
    """The parameters of `_CLAIM` in a claim's first round, computed as `queue.claim` does.

    Takes the claimers' lock and pins the plan first (`_SERIALIZE_CLAIMERS`), and promotes
    due companies (`_CONTENDERS`), as the claim does before its `_CLAIM`.
    """
    connection = driver_connection(session)
    connection.execute(queue._SERIALIZE_CLAIMERS, {"key": queue.CLAIM_LOCK_KEY})
    contenders, credit = queue._contenders(connection, batch_size, exclude=[])
    allocation = fair_share.allocate(contenders, batch_size, credit)
    return queue.claim_parameters(worker_id, allocation)
