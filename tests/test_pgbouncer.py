"""The API and the worker through a real PgBouncer in transaction pooling mode.

Behind a transaction pooler every transaction may land on another server connection, so a
statement prepared by name on one is unknown, or already taken, on the next (psycopg prepares
a statement it has run five times); `DATABASE_POOL_MODE=transaction` turns that off. LISTEN
needs a session of its own: the children listen on `LISTEN_DATABASE_URL`, straight to the
server. Everything else the claim relies on (transaction-scoped advisory locks, `SET LOCAL`,
pipelined statements) holds within one transaction, and so through the pooler.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from sqlalchemy import Engine, text

from devtools import stack
from devtools.pgbouncer import pgbouncer
from tests import system_tools
from tests.conftest import ADMIN_TOKEN
from tests.supervisor_harness import FAST_ENV, wait_for

pytestmark = pytest.mark.slow

TASKS = 2000
COMPANIES = 4


@pytest.fixture
def pooled_url(fresh_db_url: str) -> Iterator[str]:
    """`fresh_db_url` through a PgBouncer in transaction mode, with a small server pool."""
    program = system_tools.require("pgbouncer", package="pgbouncer")
    # Fewer server connections than the API's threads and the children together: the
    # pooler really hands each transaction whichever connection is free.
    with pgbouncer(fresh_db_url, program, pool_size=4) as url:
        yield url


def test_api_and_workers_drain_tasks_created_over_http_through_pgbouncer(
    tmp_path: Path, fresh_db_url: str, fresh_engine: Engine, pooled_url: str
) -> None:
    pooled = {"DATABASE_POOL_MODE": "transaction"}
    api_env = {**pooled, "GUNICORN_WORKERS": "2", "GUNICORN_THREADS": "8"}
    worker_env = {**FAST_ENV, **pooled, "LISTEN_DATABASE_URL": fresh_db_url}
    (tmp_path / "api").mkdir()
    (tmp_path / "worker").mkdir()
    with stack.api_server(
        pooled_url, tmp_path / "api", admin_token=ADMIN_TOKEN, env=api_env
    ) as api:
        companies = stack.create_companies(api.base_url, ADMIN_TOKEN, COMPANIES)
        with stack.supervisor(
            pooled_url, tmp_path / "worker", concurrency=2, env=worker_env
        ) as sup:
            statuses = _create_tasks(api.base_url, companies)
            assert statuses == {201: TASKS}, statuses
            wait_for(
                lambda: _count(fresh_engine, "completed") == TASKS,
                timeout=120,
                what=f"{TASKS} tasks completed",
            )
            worker_log = sup.log()
        api_log = api.log()

    assert _count(fresh_engine, "failed") == 0
    for log in (api_log, worker_log):
        assert "prepared statement" not in log
        assert "Traceback" not in log
    assert " 500 " not in api_log


def _create_tasks(base_url: str, companies: list[stack.Company]) -> dict[int, int]:
    """Create `TASKS` tasks from 16 threads, every fourth with an Idempotency-Key."""

    def create(n: int) -> int:
        company = companies[n % len(companies)]
        headers = {"Authorization": f"Bearer {company.api_key}"}
        if n % 4 == 0:
            headers["Idempotency-Key"] = f"order-{n}"
        response = requests.post(
            f"{base_url}/companies/{company.id}/tasks",
            json={"type": "noop", "payload": {}},
            headers=headers,
            timeout=30,
        )
        return response.status_code

    statuses: dict[int, int] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
        for status in pool.map(create, range(TASKS)):
            statuses[status] = statuses.get(status, 0) + 1
    return statuses


def _count(engine: Engine, status: str) -> int:
    with engine.connect() as conn:
        count: int = conn.execute(
            text("SELECT count(*) FROM tasks WHERE status = :status"), {"status": status}
        ).scalar_one()
    return count
