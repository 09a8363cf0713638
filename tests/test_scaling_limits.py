"""Scaling up (design §5): a cap on children, and children that cannot connect stop nobody.

The database's connection limit is a role's `CONNECTION LIMIT` on the test's fresh database:
starved without restarting the server, and undone with one ALTER ROLE.
"""

from __future__ import annotations

import re
import signal
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy import Engine
from sqlalchemy.engine import make_url

from common.environment import SettingsError
from tests import pg
from tests import supervisor_harness as harness
from tests.factories import insert_company, insert_tasks
from tests.supervisor_harness import StartSupervisor, wait_for
from tests.test_settings import URL, readme_defaults
from worker.settings import WorkerSettings

# Connections of one booted child, idle or busy: its pool's two (a pass's, its liveness
# thread's heartbeat's) and its LISTEN connection.
CONNECTIONS_PER_CHILD = 3


class LimitedRole:
    """A login role on the fresh database whose connections are capped; `url` logs in as it."""

    def __init__(self, name: str, url: str, admin_url: str) -> None:
        self.name = name
        self.url = url
        self._admin_url = admin_url

    def limit(self, connections: int) -> None:
        """Set its `CONNECTION LIMIT`."""
        self._admin(f'ALTER ROLE "{self.name}" CONNECTION LIMIT {int(connections)}')

    def connections(self) -> int:
        """Its connections open right now."""
        with psycopg.connect(self._admin_url, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE usename = %s", [self.name]
            ).fetchone()
        assert row is not None
        return int(row[0])

    def _admin(self, statement: str) -> None:
        with psycopg.connect(self._admin_url, autocommit=True) as conn:
            conn.execute(statement)


@pytest.fixture
def limited_role(fresh_db_url: str) -> Iterator[LimitedRole]:
    """A role allowed to use the fresh database's tables, with no connection limit yet.

    Not a superuser: connection limits do not apply to superusers.
    """
    name = f"fairq_limited_{uuid.uuid4().hex[:8]}"
    admin = pg.libpq(fresh_db_url)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE ROLE "{name}" LOGIN')
        conn.execute(f'GRANT USAGE ON SCHEMA public TO "{name}"')
        conn.execute(
            f'GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO "{name}"'
        )
        conn.execute(f'GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO "{name}"')
    url = make_url(fresh_db_url).set(username=name, password=None)
    yield LimitedRole(name, url.render_as_string(hide_password=False), admin)
    # After the `supervisor` fixture's teardown (requested later): its processes are dead.
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                     [name])  # fmt: skip
        conn.execute(f'DROP OWNED BY "{name}"')
        conn.execute(f'DROP ROLE "{name}"')


def test_children_that_cannot_connect_are_retried_while_the_working_ones_carry_on(
    limited_role: LimitedRole, supervisor: StartSupervisor, fresh_engine: Engine
) -> None:
    limited_role.limit(2 * CONNECTIONS_PER_CHILD)
    sup = supervisor(
        "--concurrency", "2",
        DATABASE_URL=limited_role.url, WORKER_BOOT_TIMEOUT_SECONDS="0",
    )  # fmt: skip
    working = sup.wait_ready(2)
    wait_for(
        lambda: limited_role.connections() == 2 * CONNECTIONS_PER_CHILD,
        5,
        "each child to hold its connections",
    )

    # A third child finds no connection left: it fails to boot, again and again.
    sup.send(signal.SIGTTIN)
    wait_for(
        lambda: "5 failures in a row; 2 working children carry on" in sup.log(),
        15,
        f"five boot failures in a row:\n{sup.log()[-3000:]}",
    )
    assert "too many connections" in sup.log()
    # More failures in a row than once stopped the supervisor: it and its children still work.
    assert sup.proc.poll() is None
    assert working == [pid for pid in sup.children() if pid in working]
    company = insert_company(fresh_engine).id
    tasks = insert_tasks(fresh_engine, company, 20)
    wait_for(
        lambda: harness.status_counts(fresh_engine) == {"completed": len(tasks)},
        10,
        "the working children to run new tasks",
    )
    # One booting child at a time, with backoff: never a burst of connection attempts.
    spawned = re.findall(r"spawned child (\d+)", sup.log())
    assert len(spawned) <= 2 + 6

    # Room again: the next attempt boots.
    limited_role.limit(3 * CONNECTIONS_PER_CHILD)
    pids = sup.wait_ready(3, timeout=20)
    assert set(working) <= set(pids)
    assert sup.metrics()["worker_children"] == 3
    sup.send(signal.SIGTERM)
    assert sup.wait(15) == 0


def test_ttin_beyond_the_maximum_is_logged_and_ignored(supervisor: StartSupervisor) -> None:
    sup = supervisor("--concurrency", "1", WORKER_MAX_CONCURRENCY="2")
    sup.wait_ready(1)
    sup.send(signal.SIGTTIN)
    sup.wait_children(2)
    sup.send(signal.SIGTTIN)
    wait_for(lambda: "SIGTTIN ignored" in sup.log(), 5, "the ignored SIGTTIN")

    assert len(sup.children()) == 2
    assert "already 2 children, WORKER_MAX_CONCURRENCY" in sup.log()
    # TTOU counts from the capped number: one TTOU is one child fewer.
    sup.send(signal.SIGTTOU)
    sup.wait_children(1)
    sup.send(signal.SIGTERM)
    assert sup.wait(15) == 0


def test_more_children_than_the_maximum_is_a_configuration_error_naming_both() -> None:
    with pytest.raises(SettingsError, match=r"^WORKER_CONCURRENCY .*WORKER_MAX_CONCURRENCY"):
        WorkerSettings.from_env(
            {"DATABASE_URL": URL, "WORKER_CONCURRENCY": "8", "WORKER_MAX_CONCURRENCY": "4"}
        )
    settings = WorkerSettings.from_env(
        {"DATABASE_URL": URL, "WORKER_CONCURRENCY": "40", "WORKER_MAX_CONCURRENCY": "40"}
    )
    assert (settings.concurrency, settings.max_concurrency) == (40, 40)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("WORKER_MAX_CONCURRENCY", "0"),
        ("WORKER_MAX_CONCURRENCY", "257"),
        ("WORKER_CHILD_TIMEOUT_SECONDS", "0.5"),
        ("WORKER_CHILD_TIMEOUT_SECONDS", "soon"),
    ],
)
def test_the_new_worker_settings_reject_a_bad_value_naming_the_variable(
    name: str, value: str
) -> None:
    with pytest.raises(SettingsError, match=f"^{name}"):
        WorkerSettings.from_env({"DATABASE_URL": URL, name: value})


@pytest.mark.parametrize("name", ["WORKER_MAX_CONCURRENCY", "WORKER_CHILD_TIMEOUT_SECONDS"])
def test_the_readme_states_the_default_of_the_new_worker_settings(name: str) -> None:
    stated = {"DATABASE_URL": URL, name: readme_defaults()[name]}

    assert WorkerSettings.from_env(stated) == WorkerSettings.from_env({"DATABASE_URL": URL})


def test_a_child_uses_its_pools_two_connections_however_busy(
    limited_role: LimitedRole, supervisor: StartSupervisor, fresh_engine: Engine
) -> None:
    # Room for the LISTEN connection and the pool's two: a third at any moment (a pass, its
    # lease keeper, the heartbeat, retention) would be refused and logged.
    limited_role.limit(CONNECTIONS_PER_CHILD)
    company = insert_company(fresh_engine).id
    tasks = insert_tasks(fresh_engine, company, 30, task_type="sleep", payload={"seconds": 0.02})
    sup = supervisor(
        "--concurrency", "1", "--batch-size", "5",
        DATABASE_URL=limited_role.url, STALE_AFTER_SECONDS="1",  # heartbeats every 0.2 s
    )  # fmt: skip
    sup.wait_ready(1)
    wait_for(
        lambda: harness.status_counts(fresh_engine) == {"completed": len(tasks)},
        15,
        f"every task to complete:\n{sup.log()[-3000:]}",
    )
    assert "too many connections" not in sup.log()
    assert limited_role.connections() == CONNECTIONS_PER_CHILD
    sup.send(signal.SIGTERM)
    assert sup.wait(15) == 0
