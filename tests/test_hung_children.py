"""Hung and dead children (design §5): the supervisor kills a silent child, and its tasks go
back once its heartbeat is stale (decision 0010).

Real processes and real signals: SIGSTOP freezes every thread of a child, as a debugger, a
frozen cgroup or a runaway C extension would; its alive pipe and its `workers` row fall
silent together.
"""

from __future__ import annotations

import os
import signal
import socket
import time
import uuid

from sqlalchemy import Engine, text

from tests import supervisor_harness as harness
from tests.factories import insert_company, insert_tasks
from tests.supervisor_harness import StartSupervisor, wait_for

# Long enough that a task coming back within the tests' waits was not taken back by the sweep.
NO_EXPIRY = {"STALE_AFTER_SECONDS": "60"}
# Short: a dead child's heartbeat is stale within seconds (beats every 0.8 s, sweeps every
# 0.4 s), long enough that a live child on a loaded box is not found dead.
SHORT_STALE = 4.0


def _holders(engine: Engine) -> dict[str, int]:
    """`locked_by` of the processing tasks, and how many each holds."""
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT locked_by, count(*) FROM tasks WHERE status = 'processing' GROUP BY 1")
        ).all()
    return {str(holder): int(count) for holder, count in rows}


def _held_by(engine: Engine, pid: int) -> int:
    return sum(n for holder, n in _holders(engine).items() if f":{pid}:" in holder)


def _worker_rows(engine: Engine) -> list[int]:
    """The pids of the `workers` rows."""
    with engine.connect() as conn:
        return sorted(conn.execute(text("SELECT pid FROM workers")).scalars())


def _attempts(engine: Engine, ids: list[uuid.UUID]) -> list[int]:
    return [harness.task_row(engine, task_id)["attempts"] for task_id in ids]


def test_a_stopped_child_is_killed_replaced_and_its_tasks_run_once_its_heartbeat_is_stale(
    supervisor: StartSupervisor, fresh_engine: Engine
) -> None:
    company = insert_company(fresh_engine).id
    tasks = insert_tasks(fresh_engine, company, 4, task_type="sleep", payload={"seconds": 0.5})
    sup = supervisor(
        "--concurrency", "2", "--batch-size", "4",
        WORKER_CHILD_TIMEOUT_SECONDS="2", STALE_AFTER_SECONDS=str(SHORT_STALE),
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
    # The stale window, a sweep interval and the handlers' half second, with room for a
    # loaded box.
    assert time.monotonic() - stopped_at < SHORT_STALE + 10
    # The claim that died with the child counts.
    assert sorted(_attempts(fresh_engine, tasks)) == [1] * (4 - held) + [2] * held
    survivors = sup.wait_children(2)
    assert victim not in survivors
    log = sup.log()
    assert f"child {victim} gave no sign of life" in log
    assert "likely out of memory" not in log
    assert f"holder {socket.gethostname()}:{victim}:" in log  # the sweep's line per task
    assert victim not in _worker_rows(fresh_engine)  # its row went with its leases
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


def test_a_killed_childs_tasks_are_taken_back_once_its_heartbeat_is_stale(
    supervisor: StartSupervisor, fresh_engine: Engine
) -> None:
    company = insert_company(fresh_engine).id
    (slow,) = insert_tasks(fresh_engine, company, task_type="sleep", payload={"seconds": 30})
    sup = supervisor("--concurrency", "1", STALE_AFTER_SECONDS=str(SHORT_STALE))
    (victim,) = sup.wait_ready(1)
    wait_for(lambda: _held_by(fresh_engine, victim) == 1, 10, "the child to start the task")
    assert _worker_rows(fresh_engine) == [victim]

    os.kill(victim, signal.SIGKILL)  # as the OOM killer would
    killed_at = time.monotonic()
    sup.seen_children.add(victim)

    def requeued() -> bool:
        row = harness.task_row(fresh_engine, slow)
        return bool(row["attempts"] == 2 and row["status"] == "processing")

    # The replacement's sweep finds the dead child's heartbeat stale and takes the task back.
    wait_for(requeued, SHORT_STALE + 10, f"the task to run again:\n{sup.log()[-3000:]}")
    assert time.monotonic() - killed_at >= SHORT_STALE - 1  # not before its row went stale
    assert not _held_by(fresh_engine, victim)
    (replacement,) = sup.children()
    assert _worker_rows(fresh_engine) == [replacement]
    assert sup.metrics()["worker_child_restarts_total"] == 1
    sup.send(signal.SIGQUIT)
    assert sup.wait(15) == 0
