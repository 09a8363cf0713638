"""A database outage under the real API and supervisor (design §1.1, §1.6, §3 /health /ready).

The test owns its PostgreSQL (a dedicated embedded server on a free port), stops it for a few
seconds while the API (gunicorn) and a supervisor run, checks how each endpoint degrades, then
starts it again and checks that everything created before and after completes.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests
from sqlalchemy import Engine, text

from devtools import chaos, stack
from devtools.embedded_postgres import EmbeddedPostgres, free_port
from devtools.webhook_receiver import Receiver
from tests import pg
from tests.conftest import ADMIN_TOKEN
from tests.factories import insert_company, insert_tasks
from tests.supervisor_harness import wait_for
from worker import wakeups

OUTAGE_SECONDS = 4.0
# Longer than `BOOT_FAILURE_LIMIT` failed boots in a row take (restart backoff 0.25 + 0.5 +
# 1 + 2 + 4 s, plus the boots): what stopped the supervisor before replacement children
# waited out an unreachable database (WORKER_BOOT_TIMEOUT_SECONDS).
LONG_OUTAGE_SECONDS = 11.0
# /ready must give its verdict well within a probe's usual timeout.
READY_LIMIT_SECONDS = 3.0
FAST = {"STALE_AFTER_SECONDS": "2", "WORKER_POLL_INTERVAL": "0.2", "LOG_LEVEL": "INFO"}


@pytest.fixture(scope="module")
def outage_server() -> Iterator[pg.TestServer]:
    """A PostgreSQL only this module's tests use (and stop), destroyed at the end.

    One for the module: its initdb and migrations take seconds, and each test gets a database
    of its own copied from the migrated template (`own_database`).
    """
    server = EmbeddedPostgres(
        pg.ROOT / ".pgdata" / f"outage-{uuid.uuid4().hex[:12]}",
        free_port(),
        options={"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"},
    )
    try:
        server.start()
        test_server = pg.TestServer(server.url(), server)
        test_server.build_template()
        yield test_server
    finally:
        server.destroy()


@pytest.fixture
def own_postgres(outage_server: pg.TestServer) -> EmbeddedPostgres:
    """The module's server, running (a test that failed may have left it stopped)."""
    assert outage_server.embedded is not None
    outage_server.embedded.start()
    return outage_server.embedded


@pytest.fixture
def own_database(own_postgres: EmbeddedPostgres, outage_server: pg.TestServer) -> str:
    """URL of a new migrated database on `own_postgres`, for this test only."""
    return outage_server.url(outage_server.create_from_template())


@dataclass
class Client:
    """A company's view of the API through one keep-alive session."""

    base: str
    session: requests.Session = field(default_factory=requests.Session)
    company_id: str = ""

    def create_company(self) -> None:
        """Create the company as the admin and use its key from now on."""
        response = self.session.post(
            f"{self.base}/companies",
            json={"name": "outage"},
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
            timeout=10,
        )
        assert response.status_code == 201, response.text
        self.company_id = response.json()["id"]
        self.session.headers["Authorization"] = f"Bearer {response.json()['api_key']}"

    def create(
        self, type: str = "noop", payload: dict[str, object] | None = None
    ) -> requests.Response:
        """POST one task."""
        return self.session.post(
            f"{self.base}/companies/{self.company_id}/tasks",
            json={"type": type, "payload": payload or {}},
            timeout=10,
        )

    def create_ok(self, count: int, type: str = "noop", **payload: object) -> list[str]:
        """Create `count` tasks that must succeed; return their ids."""
        ids = []
        for _ in range(count):
            response = self.create(type, payload)
            assert response.status_code == 201, response.text
            ids.append(str(response.json()["id"]))
        return ids


def _statuses(engine: Engine, ids: list[str]) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT status, count(*) FROM tasks WHERE id = ANY(CAST(:ids AS uuid[])) "
                "GROUP BY status"
            ),
            {"ids": ids},
        ).all()
    return {str(status): int(n) for status, n in rows}


def _listeners(engine: Engine) -> int:
    """How many worker children hold their LISTEN connection (booted children)."""
    with engine.connect() as conn:
        count: int = conn.execute(
            text(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND application_name = :name"
            ),
            {"name": wakeups.LISTEN_APPLICATION_NAME},
        ).scalar_one()
    return count


def _responses_by_status(api: stack.ApiServer) -> dict[str, float]:
    """Requests the API answered, by status, from its own /metrics (every gunicorn worker)."""
    samples = stack.parse_metrics(requests.get(f"{api.base_url}/metrics", timeout=10).text)
    found: dict[str, float] = {}
    for name, value in samples.items():
        if name.startswith("flask_http_request_total{"):
            status = name.split('status="', 1)[1].split('"', 1)[0]
            found[status] = found.get(status, 0.0) + value
    return found


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_database_outage_degrades_the_api_cleanly_and_workers_resume(
    own_postgres: EmbeddedPostgres, own_database: str, tmp_path: Path
) -> None:
    url = own_database
    engine = stack.script_engine(url)
    with ExitStack() as running:
        running.callback(engine.dispose)
        api = running.enter_context(
            stack.api_server(url, tmp_path / "api", admin_token=ADMIN_TOKEN, env=FAST)
        )
        sup = running.enter_context(
            stack.supervisor(url, tmp_path / "worker", concurrency=2, env=FAST)
        )
        client = Client(api.base_url)
        running.callback(client.session.close)
        client.create_company()
        before = client.create_ok(20)
        # Tasks in hand when the server stops: their completion cannot be written.
        in_hand = client.create_ok(2, "sleep", seconds=1.5)
        wait_for(lambda: _statuses(engine, in_hand).get("processing"), 10, "a sleep task to run")
        supervisor_pid, children = sup.pid, sup.children()

        own_postgres.stop("fast")
        ready_seconds: list[float] = []
        refused = 0
        deadline = time.monotonic() + OUTAGE_SECONDS
        while time.monotonic() < deadline:
            assert requests.get(f"{api.base_url}/health", timeout=5).status_code == 200

            started = time.monotonic()
            ready = requests.get(f"{api.base_url}/ready", timeout=10)
            ready_seconds.append(time.monotonic() - started)
            assert ready.status_code == 503
            assert ready.json() == {"status": "unavailable", "database": "unreachable"}

            metrics = requests.get(f"{api.base_url}/metrics", timeout=10)
            assert metrics.status_code == 200
            assert "tasks_by_status" not in metrics.text  # no stale or made-up queue gauges
            assert "flask_http_request_duration_seconds" in metrics.text

            created = client.create()
            assert created.status_code == 503, created.text
            assert created.json()["code"] == 503
            assert created.headers["Retry-After"]
            refused += 1
            time.sleep(0.2)
        assert max(ready_seconds) < READY_LIMIT_SECONDS, ready_seconds
        assert refused >= 3

        own_postgres.start()
        api.wait_ready(15)
        after = client.create_ok(20)
        everything = before + in_hand + after
        wait_for(
            lambda: _statuses(engine, everything) == {"completed": len(everything)},
            30,
            f"every task to complete (now {_statuses(engine, everything)}):\n{sup.log()[-3000:]}",
        )

        # The workers resumed by themselves: same supervisor, and it never stopped.
        assert sup.running()
        assert sup.pid == supervisor_pid
        restarts = stack.metric_total(sup.metrics(), "worker_child_restarts_total")
        assert (sup.children(), restarts) == (children, 0), sup.log()[-3000:]
        # Never a 500: the outage showed as 503 wherever it showed.
        statuses = _responses_by_status(api)
        assert statuses.get("503", 0) >= 2 * refused, statuses
        assert not [s for s in statuses if s.startswith("5") and s != "503"], statuses


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_child_lost_during_a_database_outage_is_replaced_once_the_database_returns(
    own_postgres: EmbeddedPostgres, own_database: str, tmp_path: Path
) -> None:
    url = own_database
    engine = stack.script_engine(url)
    with ExitStack() as running:
        running.callback(engine.dispose)
        sup = running.enter_context(
            stack.supervisor(url, tmp_path / "worker", concurrency=2, env=FAST)
        )
        victim, survivor = sup.children()
        wait_for(lambda: _listeners(engine) == 2, 15, "both children to boot and LISTEN")

        own_postgres.stop("fast")
        # A child dies while the database is down (OOM killer, or an operator's HUP/TTIN):
        # its replacements cannot boot until the database is back.
        os.kill(victim, signal.SIGKILL)
        time.sleep(LONG_OUTAGE_SECONDS)
        assert sup.running(), sup.log()[-3000:]
        assert survivor in sup.children()
        own_postgres.start()

        # The supervisor kept going: the survivor works at once, a replacement boots.
        company = insert_company(engine).id
        tasks = insert_tasks(engine, company, 10)
        wait_for(
            lambda: _statuses(engine, [str(t) for t in tasks]) == {"completed": 10},
            20,
            f"the tasks to complete:\n{sup.log()[-3000:]}",
        )
        wait_for(
            lambda: len(sup.children()) == 2 and survivor in sup.children(),
            20,
            f"a replacement child:\n{sup.log()[-3000:]}",
        )
        assert sup.running()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tasks_finished_during_a_short_outage_are_recorded_without_running_again(
    own_postgres: EmbeddedPostgres, own_database: str, tmp_path: Path
) -> None:
    url = own_database
    engine = stack.script_engine(url)
    env = {**FAST, "STALE_AFTER_SECONDS": "30", "WEBHOOK_ALLOW_PRIVATE": "true"}
    with ExitStack() as running:
        running.callback(engine.dispose)
        # Each delivery takes 50 ms: the child is in the middle of a batch when the server
        # stops, and the batch ends before the server is back.
        receiver = running.enter_context(Receiver(delay=0.05))
        sup = running.enter_context(
            stack.supervisor(url, tmp_path / "worker", concurrency=1, env=env)
        )
        wait_for(lambda: _listeners(engine) == 1, 15, "the child to boot and LISTEN")
        company = insert_company(engine).id
        payload = {"url": receiver.url}
        tasks = [str(t) for t in insert_tasks(engine, company, 40, task_type="webhook",
                                              payload=payload)]  # fmt: skip
        wait_for(lambda: len(receiver.deliveries()) >= 3, 10, "the first deliveries")

        own_postgres.stop("fast")
        time.sleep(3.0)
        own_postgres.start()

        # Well before the leases of the interrupted batch expire (30 s): the child retries
        # the database every 0.5, 1, 2, 4 s, so it is back within about 4 s.
        finished = chaos.wait_until(
            lambda: _statuses(engine, tasks) == {"completed": len(tasks)}, 8
        )
        deliveries = receiver.deliveries()
        assert finished, (_statuses(engine, tasks), sup.log()[-2000:])
        assert [key for key, got in deliveries.items() if len(got) > 1] == []
