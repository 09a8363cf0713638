"""A pause stops what it says: once it answers, no worker starts another of the company's tasks.

The claim never takes a paused company's tasks (tests/test_pause.py); these tests are about the
tasks a worker already holds when the pause comes: a batch in hand, on one thread or several.
Each is handed back unstarted, its attempt not counted, and none starts after the pause
answered. Real threads, real PostgreSQL; the pause is `db.companies.pause_company` followed by
the API's wait (`db.workers.PAUSE_SEEN_WITHIN_SECONDS`).
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from sqlalchemy.orm import Session, sessionmaker

from db import companies, workers
from db.engine import driver_connection
from tests import test_processing
from tests.factories import insert_company, insert_tasks
from tests.supervisor_harness import wait_for
from tests.test_processing import Register, rows, run_pass
from tests.test_worker_threads import Spans, threads
from worker import processing
from worker.tasktypes.base import TaskContext

sessions = test_processing.sessions
register = test_processing.register

pytestmark = pytest.mark.timeout(60)


class Pauser:
    """Pauses a company from another thread, as the API does, once told to; records when the
    pause answered (`time.monotonic()`)."""

    def __init__(self, sessions: sessionmaker[Session], company_id: uuid.UUID) -> None:
        self._sessions = sessions
        self._company_id = company_id
        self.go = threading.Event()
        self.answered = threading.Event()
        self.answered_at = float("inf")
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.go.wait()
        with self._sessions() as session:
            companies.pause_company(driver_connection(session, transaction=False), self._company_id)
            session.commit()
        time.sleep(workers.PAUSE_SEEN_WITHIN_SECONDS)  # the API's wait before it answers
        self.answered_at = time.monotonic()
        self.answered.set()

    def join(self) -> None:
        self._thread.join(10)


def statuses(sessions: sessionmaker[Session], ids: list[uuid.UUID]) -> list[str]:
    return [row["status"] for row in rows(sessions, ids)]


@pytest.mark.parametrize("n", [1, 4], ids=["one-thread", "four-threads"])
def test_a_pause_hands_back_the_unstarted_rest_of_a_batch_in_hand_and_none_starts_after_it_answers(
    sessions: sessionmaker[Session], register: Register, n: int
) -> None:
    paused = insert_company(sessions, "paused").id
    other = insert_company(sessions, "other").id
    spans = Spans()
    pauser = Pauser(sessions, paused)

    def nap(task: TaskContext) -> None:
        spans.enter(task)
        pauser.go.set()  # the company is paused while its first tasks run
        time.sleep(0.1)
        spans.leave(task)

    register("nap", nap)
    mine = insert_tasks(sessions, paused, 80, task_type="nap")
    theirs = insert_tasks(sessions, other, 20, task_type="nap")
    before = {row["id"]: row for row in rows(sessions, mine)}

    result = run_pass(sessions, settings=threads(n, batch_size=100))
    pauser.join()

    # Every task of the batch was in hand: a company alone with work fills a batch.
    assert result.claimed == 100
    started = set(spans.entered)
    assert all(spans.started[t] <= pauser.answered_at for t in mine if t in started)
    handed_back = [row for row in rows(sessions, mine) if row["id"] not in started]
    # Many of its tasks were still in hand: the pause answers a second after it committed,
    # while 10 (one thread) or 40 (four) tasks a second start.
    assert len(handed_back) >= 30
    for row in handed_back:
        original = before[row["id"]]
        assert (row["status"], row["attempts"], row["lease_token"], row["locked_by"]) == (
            "pending", 0, None, None,
        )  # fmt: skip
        assert row["run_after"] == original["run_after"]  # its place in line kept
    assert set(statuses(sessions, [t for t in mine if t in started])) == {"completed"}
    # The other company's tasks in the same batch all ran.
    assert statuses(sessions, theirs) == ["completed"] * 20
    assert result == processing.PassResult(
        claimed=100, completed=len(started), released=len(handed_back)
    )


def test_a_batch_in_hand_is_handed_back_while_a_long_handler_still_runs(
    sessions: sessionmaker[Session], register: Register
) -> None:
    paused = insert_company(sessions, "paused").id
    pauser = Pauser(sessions, paused)
    ids: list[uuid.UUID] = []
    seen_pending: list[int] = []

    def long(task: TaskContext) -> None:
        if task.task_id != ids[0]:
            return
        pauser.go.set()
        pauser.answered.wait(5)
        # The lease keeper hands the rest back while this handler still runs, not at the end
        # of the pass: resumed meanwhile, they would be claimable at once.
        rest = ids[1:]
        seen_pending.append(
            wait_for(
                lambda: statuses(sessions, rest) == ["pending"] * len(rest),
                5,
                "the rest of the batch handed back",
            )
        )

    register("long", long)
    ids.extend(insert_tasks(sessions, paused, 10, task_type="long"))

    result = run_pass(sessions, settings=threads(1, batch_size=10))

    assert seen_pending == [True]
    assert result == processing.PassResult(claimed=10, completed=1, released=9)
    assert [row["attempts"] for row in rows(sessions, ids[1:])] == [0] * 9
