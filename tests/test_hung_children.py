"""Hung children (design §5): the supervisor kills a silent child and its tasks run at once.

Real processes and real signals: SIGSTOP freezes every thread of a child, as a debugger, a
frozen cgroup or a runaway C extension would. The stale window is a minute in these tests,
so only the take-back by the next booted child can explain tasks that run again within
seconds.
"""

from __future__ import annotations

import os
import signal
import time
import uuid

from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from db import queue
from db.engine import driver_connection
from tests import supervisor_harness as harness
from tests.factories import MakeCompany, MakeTask, insert_company, insert_tasks
from tests.supervisor_harness import StartSupervisor, wait_for
from worker import child

# Long enough that a task coming back within the tests' waits was not taken back by expiry.
NO_EXPIRY = {"STALE_AFTER_SECONDS": "60"}


def _holders(engine: Engine) -> dict[str, int]:
    """`locked_by` of the processing tasks, and how many each holds."""
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT locked_by, count(*) FROM tasks WHERE status = 'processing' GROUP BY 1")
        ).all()
    return {str(holder): int(count) for holder, count in rows}


def _held_by(engine: Engine, pid: int) -> int:
    return sum(n for holder, n in _holders(engine).items() if holder.endswith(f":{pid}"))


def _attempts(engine: Engine, ids: list[uuid.UUID]) -> list[int]:
    return [harness.task_row(engine, task_id)["attempts"] for task_id in ids]


def test_a_stopped_child_is_killed_replaced_and_its_tasks_run_at_once(
    supervisor: StartSupervisor, fresh_engine: Engine
) -> None:
    company = insert_company(fresh_engine).id
    tasks = insert_tasks(fresh_engine, company, 4, task_type="sleep", payload={"seconds": 0.5})
    sup = supervisor(
        "--concurrency", "2", "--batch-size", "4",
        WORKER_CHILD_TIMEOUT_SECONDS="2", **NO_EXPIRY,
    )  # fmt: skip
    children = sup.wait_ready(2)
    victim = wait_for(
        lambda: next((pid for pid in children if _held_by(fresh_engine, pid) >= 3), None),
        10,
        "a child to hold the batch",
    )

    os.kill(victim, signal.SIGSTOP)
    stopped_at = time.monotonic()
    sup.seen_children.add(victim)
    held = _held_by(fresh_engine, victim)  # it can write nothing more

    wait_for(lambda: not harness.is_alive(victim), 6, "the stopped child to be killed")
    assert time.monotonic() - stopped_at < 5  # timeout 2 s, checked every second
    wait_for(
        lambda: harness.status_counts(fresh_engine) == {"completed": 4},
        15,
        f"every task to complete on another child:\n{sup.log()[-3000:]}",
    )
    assert time.monotonic() - stopped_at < 20  # far from the 60 s stale window
    # Taken back like an expired lease: the claim that died with the child counts.
    assert sorted(_attempts(fresh_engine, tasks)) == [1] * (4 - held) + [2] * held
    survivors = sup.wait_children(2)
    assert victim not in survivors
    log = sup.log()
    assert f"child {victim} gave no sign of life" in log
    assert "likely out of memory" not in log
    assert f"took back {held} tasks held by dead children ({child.worker_id(victim)})" in log
    metrics = sup.metrics()
    assert metrics["worker_child_timeouts_total"] == 1
    assert metrics["worker_child_restarts_total"] == 0
    assert metrics["worker_children"] == 2
    sup.send(signal.SIGTERM)
    assert sup.wait(15) == 0


def test_a_child_running_a_handler_longer_than_the_timeout_is_not_killed(
    supervisor: StartSupervisor, fresh_engine: Engine
) -> None:
    company = insert_company(fresh_engine).id
    (task,) = insert_tasks(fresh_engine, company, task_type="sleep", payload={"seconds": 3})
    sup = supervisor("--concurrency", "2", WORKER_CHILD_TIMEOUT_SECONDS="1", **NO_EXPIRY)
    children = sup.wait_ready(2)

    wait_for(
        lambda: harness.task_row(fresh_engine, task)["status"] == "completed",
        10,
        f"the 3 s task to complete:\n{sup.log()[-3000:]}",
    )

    # Alive while its handler ran three timeouts long, and so was the idle one: the lease
    # keeper held the lease meanwhile, and killing the child would have run the task twice.
    assert harness.task_row(fresh_engine, task)["attempts"] == 1
    assert sorted(sup.children()) == sorted(children)
    assert "gave no sign of life" not in sup.log()
    assert sup.metrics()["worker_child_timeouts_total"] == 0
    sup.send(signal.SIGTERM)
    assert sup.wait(15) == 0


def test_a_child_stuck_outside_a_pass_is_killed_and_says_where_while_one_in_a_pass_waits(
    supervisor: StartSupervisor, fresh_engine: Engine
) -> None:
    sup = supervisor("--concurrency", "1", WORKER_CHILD_TIMEOUT_SECONDS="2", **NO_EXPIRY)
    (working,) = sup.wait_ready(1)
    with fresh_engine.connect() as conn, conn.begin():
        # Every statement on tasks now waits (up to the 30 s statement timeout): the working
        # child's next pass, and the boot check of a new child, which is no pass.
        conn.execute(text("LOCK TABLE tasks IN ACCESS EXCLUSIVE MODE"))
        time.sleep(0.5)  # the working child is in a pass, waiting for the lock
        sup.send(signal.SIGTTIN)
        wait_for(
            lambda: "gave no sign of life" in sup.log(),
            8,
            f"the booting child to be killed:\n{sup.log()[-3000:]}",
        )
    log = sup.log()
    assert "main thread stuck for" in log
    assert "in _boot" in log  # the stack faulthandler wrote, once the thread went silent
    assert f"child {working} gave no sign of life" not in log
    pids = sup.wait_ready(2)
    assert working in pids
    assert sup.metrics()["worker_child_timeouts_total"] >= 1
    sup.send(signal.SIGTERM)
    assert sup.wait(15) == 0


def test_a_killed_childs_tasks_are_taken_back_without_waiting_for_the_stale_window(
    supervisor: StartSupervisor, fresh_engine: Engine
) -> None:
    company = insert_company(fresh_engine).id
    (slow,) = insert_tasks(fresh_engine, company, task_type="sleep", payload={"seconds": 30})
    sup = supervisor("--concurrency", "1", **NO_EXPIRY)
    (victim,) = sup.wait_ready(1)
    wait_for(lambda: _held_by(fresh_engine, victim) == 1, 10, "the child to start the task")

    os.kill(victim, signal.SIGKILL)  # as the OOM killer would
    sup.seen_children.add(victim)

    def requeued() -> bool:
        row = harness.task_row(fresh_engine, slow)
        return bool(row["attempts"] == 2 and row["status"] == "processing")

    # Replaced after 0.25 s, and the replacement takes the task back when it boots.
    wait_for(requeued, 10, f"the replacement to run the task again:\n{sup.log()[-3000:]}")
    assert not _held_by(fresh_engine, victim)
    assert sup.metrics()["worker_child_restarts_total"] == 1
    sup.send(signal.SIGQUIT)
    assert sup.wait(15) == 0


def test_expire_leases_of_takes_back_only_the_dead_holders_leases(
    db_session: Session, make_company: MakeCompany, claimed_task: MakeTask, make_task: MakeTask
) -> None:
    company = make_company().id
    running = claimed_task(company, locked_by="host:1", locked_at=text("now() - interval '3s'"))
    poison = claimed_task(company, locked_by="host:1", attempts=5, max_attempts=5)
    other = claimed_task(company, locked_by="host:2")
    done = make_task(company, status="completed")

    expired = {
        e.id: e
        for e in queue.expire_leases_of(
            driver_connection(db_session, transaction=False), ["host:1", "host:9"]
        )
    }

    assert set(expired) == {running.id, poison.id}
    assert expired[running.id].locked_by == "host:1"
    assert not expired[running.id].failed
    assert expired[poison.id].failed
    rows = {
        row.id: row
        for row in db_session.execute(
            text(
                "SELECT id, status, attempts, lease_token, locked_by, run_after, last_error, "
                "finished_at FROM tasks WHERE company_id = :c"
            ),
            {"c": company},
        )
    }
    back = rows[running.id]
    assert (back.status, back.attempts, back.lease_token, back.locked_by) == (
        "pending", 1, None, None,
    )  # fmt: skip
    # First in its company's line: runnable since its holder was last known alive.
    assert back.run_after == running.locked_at
    failed = rows[poison.id]
    assert failed.status == "failed"
    assert failed.finished_at is not None
    assert "worker lost" in failed.last_error
    assert "host:1" in failed.last_error
    assert rows[other.id].status == "processing"
    assert rows[other.id].locked_by == "host:2"
    assert rows[done.id].status == "completed"
    # A late write of the dead holder, fenced by its old token, changes nothing.
    assert running.lease_token is not None
    assert (
        queue.complete_tasks(
            driver_connection(db_session, transaction=False),
            [queue.Lease(running.id, running.lease_token)],
        )
        == set()
    )
    assert queue.expire_leases_of(driver_connection(db_session, transaction=False), []) == []
