"""Tenant isolation: a company sees and changes only its own tasks (design §1.5).

Every cross-tenant request is a 404 (never a 403, which would confirm the id exists), carries
none of the other company's data, and changes nothing.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import pytest
from flask.testing import FlaskClient
from sqlalchemy.orm import Session

from tests.factories import (
    CompanyWithKey,
    CreatedTask,
    MakeCompany,
    MakeTask,
    count_tasks,
    json_of,
)


@dataclass(frozen=True)
class Tenants:
    """Two companies, each with one pending and one cancelled task."""

    me: CompanyWithKey
    other: CompanyWithKey
    my_task: str
    other_pending: str
    other_cancelled: str


@pytest.fixture
def tenants(make_company: MakeCompany, make_task: MakeTask) -> Tenants:
    """Two companies with tasks; `other`'s rows carry markers that must never leak."""
    me, other = make_company("me-corp"), make_company("other-corp-secret-name")
    mine = make_task(me.id)
    pending = make_task(
        other.id, type="webhook", payload={"url": "https://other.example/secret-path"}
    )
    cancelled = make_task(other.id, status="cancelled", last_error="other-secret-error")
    return Tenants(me, other, str(mine.id), str(pending.id), str(cancelled.id))


# (method, path template): {me}/{other} are company ids, {task} a task id of `other`.
CROSS_TENANT_REQUESTS = [
    ("GET", "/companies/{other}"),
    ("GET", "/companies/{other}/tasks"),
    ("POST", "/companies/{other}/tasks"),
    ("GET", "/companies/{other}/tasks/{task}"),
    ("POST", "/companies/{other}/tasks/{task}/cancel"),
    ("POST", "/companies/{other}/tasks/{task}/retry"),
    ("GET", "/companies/{me}/tasks/{task}"),
    ("POST", "/companies/{me}/tasks/{task}/cancel"),
    ("POST", "/companies/{me}/tasks/{task}/retry"),
]


def _other_status(client: FlaskClient, tenants: Tenants, task_id: str) -> dict[str, Any]:
    response = client.get(
        f"/companies/{tenants.other.id}/tasks/{task_id}", headers=tenants.other.headers
    )
    return json_of(response)


@pytest.mark.parametrize("task_kind", ["pending", "cancelled"])
@pytest.mark.parametrize(("method", "template"), CROSS_TENANT_REQUESTS)
def test_cross_tenant_request_is_404_leaks_nothing_and_changes_nothing(
    client: FlaskClient,
    tenants: Tenants,
    db_session: Session,
    *,
    method: str,
    template: str,
    task_kind: str,
) -> None:
    task_id = tenants.other_pending if task_kind == "pending" else tenants.other_cancelled
    before = _other_status(client, tenants, task_id)
    path = template.format(me=tenants.me.id, other=tenants.other.id, task=task_id)

    response = client.open(
        path,
        method=method,
        headers=tenants.me.headers,
        json={"type": "noop"} if method == "POST" else None,
    )

    assert response.status_code == 404, response.get_data(as_text=True)
    assert json_of(response)["code"] == 404
    text = response.get_data(as_text=True)
    for secret in (
        str(tenants.other.id),
        tenants.other_pending,
        tenants.other_cancelled,
        "other-corp-secret-name",
        "secret-path",
        "other-secret-error",
    ):
        assert secret not in text
    assert _other_status(client, tenants, task_id) == before
    assert count_tasks(db_session, tenants.other.id) == 2
    assert count_tasks(db_session, tenants.me.id) == 1


@pytest.mark.parametrize(("method", "template"), CROSS_TENANT_REQUESTS)
def test_foreign_ids_get_the_same_404_as_ids_that_do_not_exist(
    client: FlaskClient, tenants: Tenants, method: str, template: str
) -> None:
    def call(other: object, task: object) -> tuple[int, Any]:
        path = template.format(me=tenants.me.id, other=other, task=task)
        response = client.open(
            path,
            method=method,
            headers=tenants.me.headers,
            json={"type": "noop"} if method == "POST" else None,
        )
        return response.status_code, response.get_json()

    assert call(tenants.other.id, tenants.other_pending) == call(uuid.uuid4(), uuid.uuid4())


def test_listing_returns_only_own_tasks(
    client: FlaskClient, tenants: Tenants, created_task: CreatedTask
) -> None:
    created = created_task(tenants.me)

    mine = json_of(client.get(f"/companies/{tenants.me.id}/tasks", headers=tenants.me.headers))
    theirs = json_of(
        client.get(f"/companies/{tenants.other.id}/tasks", headers=tenants.other.headers)
    )

    assert {t["id"] for t in mine["items"]} == {tenants.my_task, created["id"]}
    assert {t["company_id"] for t in mine["items"]} == {str(tenants.me.id)}
    assert {t["id"] for t in theirs["items"]} == {
        tenants.other_pending,
        tenants.other_cancelled,
    }


@pytest.mark.parametrize("query", ["status=pending", "status=cancelled", "type=webhook"])
def test_filtered_listing_never_includes_other_companies_tasks(
    client: FlaskClient, tenants: Tenants, query: str
) -> None:
    page = json_of(
        client.get(f"/companies/{tenants.me.id}/tasks?{query}", headers=tenants.me.headers)
    )

    assert {t["company_id"] for t in page["items"]} <= {str(tenants.me.id)}
    assert tenants.other_pending not in str(page)
    assert tenants.other_cancelled not in str(page)


def test_each_company_still_reaches_its_own_tasks(client: FlaskClient, tenants: Tenants) -> None:
    mine = client.get(
        f"/companies/{tenants.me.id}/tasks/{tenants.my_task}", headers=tenants.me.headers
    )
    theirs = client.post(
        f"/companies/{tenants.other.id}/tasks/{tenants.other_cancelled}/retry",
        headers=tenants.other.headers,
    )

    assert mine.status_code == 200
    assert theirs.status_code == 200
    assert json_of(theirs)["status"] == "pending"
