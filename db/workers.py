"""What worker processes read about the companies of the tasks they hold.

Statements of the worker's own bookkeeping, sent to psycopg directly; each function takes the
connection and never commits (the caller owns the transaction).
"""

from __future__ import annotations

import uuid
from collections.abc import Collection
from typing import Any

import psycopg

# A worker trusts what it read of its companies' pauses (`paused_companies`) for at most this
# long, counted from before the read was sent; a pause answers only this long after it
# committed (`api`). Together: once a pause has answered, no worker starts another of the
# company's tasks (README "Pause and resume", design §4 "Pause").
PAUSE_SEEN_WITHIN_SECONDS = 0.5

_PAUSED_COMPANIES = "SELECT id FROM companies WHERE id = ANY(%(ids)s) AND paused"


def paused_companies(
    conn: psycopg.Connection[Any], company_ids: Collection[uuid.UUID]
) -> set[uuid.UUID]:
    """Which of `company_ids` are paused now: primary-key probes, a read that writes nothing."""
    if not company_ids:
        return set()
    rows = conn.execute(_PAUSED_COMPANIES, {"ids": list(company_ids)}).fetchall()
    return {row[0] for row in rows}
