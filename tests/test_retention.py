"""Retention never deletes a task that is being brought back to life (design §1.1, §4)."""

from __future__ import annotations

from sqlalchemy import Engine, text

from db import maintenance, queue
from db.engine import driver_connection, make_sessionmaker
from tests.factories import insert_company, insert_task


def test_retention_skips_a_task_whose_retry_is_in_flight_and_it_survives(
    fresh_engine: Engine,
) -> None:
    with make_sessionmaker(fresh_engine)() as setup:
        company = insert_company(setup)
        task = insert_task(
            setup, company.id, status="failed", finished_at=text("now() - interval '8 days'")
        )

    sessions = make_sessionmaker(fresh_engine)
    with sessions() as api, sessions() as retention:
        # The API moves the task back to pending but has not committed yet.
        queue.retry_task(driver_connection(api, transaction=False), company.id, task.id)
        deleted = maintenance.delete_expired_tasks(
            driver_connection(retention, transaction=False), retention_seconds=7 * 86400
        )
        retention.commit()
        api.commit()

    assert deleted == 0
    with fresh_engine.connect() as conn:
        status = conn.execute(
            text("SELECT status FROM tasks WHERE id = :id"), {"id": task.id}
        ).scalar_one_or_none()
    assert status == "pending"


def test_an_idempotency_key_whose_task_was_deleted_creates_a_new_task(
    fresh_engine: Engine,
) -> None:
    with make_sessionmaker(fresh_engine)() as session:
        company = insert_company(session)
        first, created = queue.create_task(
        driver_connection(session, transaction=False),
        company_id=company.id, type="noop", payload={}, idempotency_key="k-1",
            request_hash="h",
        )  # fmt: skip
        session.commit()
        session.execute(text("DELETE FROM tasks WHERE id = :id"), {"id": first.id})
        session.commit()

        second, created_again = queue.create_task(
        driver_connection(session, transaction=False),
        company_id=company.id, type="noop", payload={}, idempotency_key="k-1",
            request_hash="h",
        )  # fmt: skip
        session.commit()

    assert created
    assert created_again
    assert second.id != first.id
