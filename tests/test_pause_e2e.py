"""Pause and resume end to end: the real worker supervisor, the API over real HTTP.

One child claiming one task at a time, polling only every 10 s: a paused company's tasks stop
being claimed (the one running finishes), the other company's tasks run meanwhile, and the
resume's NOTIFY starts the paused company's tasks again within a second.
"""

from __future__ import annotations

import signal
import time
import uuid
from typing import Any

import pytest
import requests
from sqlalchemy import Engine, text

from tests.conftest import ADMIN_TOKEN, serve_app
from tests.supervisor_harness import StartSupervisor, wait_for
from worker import wakeups

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


class Api:
    """The API at `base` and what the test created through it."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.keys: dict[str, str] = {}

    def company(self, name: str) -> str:
        """Create a company (admin); return its id and remember its key."""
        response = requests.post(
            f"{self.base}/companies", json={"name": name}, headers=ADMIN, timeout=10
        )
        assert response.status_code == 201, response.text
        body: dict[str, Any] = response.json()
        self.keys[body["id"]] = body["api_key"]
        return str(body["id"])

    def headers(self, company: str) -> dict[str, str]:
        """Authorization with the company's own key."""
        return {"Authorization": f"Bearer {self.keys[company]}"}

    def task(self, company: str, type: str = "noop", payload: dict[str, Any] | None = None) -> str:
        """Create a task; return its id."""
        response = requests.post(
            f"{self.base}/companies/{company}/tasks",
            json={"type": type, "payload": payload or {}},
            headers=self.headers(company),
            timeout=10,
        )
        assert response.status_code == 201, response.text
        return str(response.json()["id"])

    def act(self, company: str, action: str, headers: dict[str, str]) -> dict[str, Any]:
        """POST /companies/{company}/{action}; the company JSON."""
        response = requests.post(
            f"{self.base}/companies/{company}/{action}", headers=headers, timeout=10
        )
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body


def tasks_of(engine: Engine, company: str) -> dict[str, dict[str, Any]]:
    """The company's tasks by id: status, attempts, started_at."""
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT id, status, attempts, started_at FROM tasks WHERE company_id = :c"),
            {"c": uuid.UUID(company)},
        ).mappings()
        return {str(row["id"]): dict(row) for row in rows}


def started(engine: Engine, company: str) -> set[str]:
    """The company's tasks a claim ever took."""
    return {i for i, row in tasks_of(engine, company).items() if row["started_at"] is not None}


def listening(engine: Engine) -> bool:
    """Whether a child LISTENs for wake-ups."""
    with engine.connect() as conn:
        return bool(
            conn.execute(
                # This database's: another test process may run children at the same time.
                text(
                    "SELECT count(*) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND application_name = :name"
                ),
                {"name": wakeups.LISTEN_APPLICATION_NAME},
            ).scalar_one()
        )


def test_a_paused_companys_tasks_stop_being_claimed_and_run_after_resume(
    supervisor: StartSupervisor, fresh_db_url: str, fresh_engine: Engine
) -> None:
    with serve_app(fresh_db_url) as port:
        api = Api(f"http://127.0.0.1:{port}")
        paused, other = api.company("paused"), api.company("other")
        sup = supervisor("--concurrency", "1", "--poll-interval", "10", WORKER_BATCH_SIZE="1")
        sup.wait_ready(1)
        wait_for(lambda: listening(fresh_engine), 10, "the child to LISTEN")

        queued = [api.task(paused, "sleep", {"seconds": 0.3}) for _ in range(8)]
        wait_for(
            lambda: any(
                r["status"] == "completed" for r in tasks_of(fresh_engine, paused).values()
            ),
            15,
            "the paused company's first task to complete",
        )

        assert api.act(paused, "pause", api.headers(paused))["paused"] is True

        taken = started(fresh_engine, paused)
        assert 1 <= len(taken) < len(queued)
        # Its new task is accepted, and its NOTIFY wakes the child: a pass that passes it over.
        kept = api.task(paused)
        theirs = [api.task(other) for _ in range(3)]
        wait_for(
            lambda: (
                all(r["status"] == "completed" for r in tasks_of(fresh_engine, other).values())
                and len(tasks_of(fresh_engine, other)) == len(theirs)
            ),
            15,
            "the other company's tasks to complete while the first is paused",
        )
        # The task running when the pause came finishes; nothing else of it starts.
        wait_for(
            lambda: all(
                r["status"] != "processing" for r in tasks_of(fresh_engine, paused).values()
            ),
            10,
            "the running task of the paused company to finish",
        )
        # A batch that was full sends the child straight into another pass: let it run.
        time.sleep(0.5)
        rows = tasks_of(fresh_engine, paused)
        assert started(fresh_engine, paused) == taken
        assert {rows[i]["status"] for i in taken} == {"completed"}
        waiting = set(queued) - taken | {kept}
        assert {(rows[i]["status"], rows[i]["attempts"]) for i in waiting} == {("pending", 0)}

        with fresh_engine.connect() as conn:
            resumed_at = conn.execute(text("SELECT clock_timestamp()")).scalar_one()
        assert api.act(paused, "resume", ADMIN)["paused"] is False

        wait_for(
            lambda: all(
                r["status"] == "completed" for r in tasks_of(fresh_engine, paused).values()
            ),
            20,
            "the paused company's tasks to run after the resume",
        )
        first_start = min(tasks_of(fresh_engine, paused)[i]["started_at"] for i in waiting)
        # The child polls every 10 s: only the resume's NOTIFY explains a start this soon.
        assert (first_start - resumed_at).total_seconds() < 1.0

    sup.send(signal.SIGTERM)
    assert sup.wait(30) == 0
