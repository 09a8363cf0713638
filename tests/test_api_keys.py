"""A company's API keys: issued, listed, rotated with an overlap, revoked, expired (issue 28,
part 5). Real PostgreSQL, real apps; two apps on one database stand for two API processes."""

from __future__ import annotations

import datetime as dt
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from api import auth, database
from db import api_keys
from db.engine import driver_connection
from tests.conftest import ADMIN_TOKEN, Clock, make_test_app
from tests.factories import CompanyWithKey, add_key, insert_company, json_of
from tests.pg import libpq

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
KEY_FIELDS = {
    "id", "company_id", "created_at", "last_used_at", "expires_at", "revoked_at", "active",
}  # fmt: skip


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def keys_of(client: FlaskClient, company_id: uuid.UUID, headers: dict[str, str]) -> Any:
    response = client.get(f"/companies/{company_id}/keys", headers=headers)
    assert response.status_code == 200, response.json
    return json_of(response)["keys"]


def can_read(client: FlaskClient, company_id: uuid.UUID, key: str) -> int:
    return client.get(f"/companies/{company_id}/tasks", headers=bearer(key)).status_code


# -- listing ----------------------------------------------------------------------------------


def test_a_company_lists_its_keys_without_secret_or_hash(
    client: FlaskClient, company: CompanyWithKey
) -> None:
    listed = keys_of(client, company.id, company.headers)

    assert len(listed) == 1
    assert set(listed[0]) == KEY_FIELDS
    assert listed[0]["active"] is True
    assert listed[0]["revoked_at"] is None
    assert listed[0]["expires_at"] is None
    body = client.get(f"/companies/{company.id}/keys", headers=company.headers).get_data(
        as_text=True
    )
    assert company.api_key not in body
    assert auth.hash_api_key(company.api_key) not in body


def test_the_admin_lists_any_company_and_another_company_gets_404(
    client: FlaskClient, company: CompanyWithKey, make_company: Any
) -> None:
    other: CompanyWithKey = make_company("other")

    assert len(keys_of(client, company.id, ADMIN)) == 1
    for method, path in (
        ("get", f"/companies/{company.id}/keys"),
        ("post", f"/companies/{company.id}/keys"),
        ("delete", f"/companies/{company.id}/keys/{uuid.uuid4()}"),
        ("post", f"/companies/{company.id}/keys/{uuid.uuid4()}/rotate"),
    ):
        response = getattr(client, method)(path, headers=other.headers, json={})
        assert response.status_code == 404, (method, path, response.json)
    unknown = client.get(f"/companies/{uuid.uuid4()}/keys", headers=ADMIN)
    assert unknown.status_code == 404


def test_listing_needs_a_token(client: FlaskClient, company: CompanyWithKey) -> None:
    response = client.get(f"/companies/{company.id}/keys")

    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"].startswith("Bearer")


# -- issuing ----------------------------------------------------------------------------------


@pytest.mark.parametrize("headers", ["own", "admin"])
def test_a_new_key_works_beside_the_old_one_and_its_secret_is_shown_once(
    client: FlaskClient, company: CompanyWithKey, headers: str
) -> None:
    auth_headers = company.headers if headers == "own" else ADMIN
    response = client.post(f"/companies/{company.id}/keys", headers=auth_headers, json={})

    assert response.status_code == 201, response.json
    issued = json_of(response)
    assert set(issued) == KEY_FIELDS | {"api_key"}
    assert issued["api_key"].startswith(auth.API_KEY_PREFIX)
    assert can_read(client, company.id, issued["api_key"]) == 200
    assert can_read(client, company.id, company.api_key) == 200
    listed = keys_of(client, company.id, company.headers)
    assert issued["id"] in {key["id"] for key in listed}
    assert all("api_key" not in key for key in listed)


def test_a_key_issued_with_an_expiry_says_when(
    client: FlaskClient, company: CompanyWithKey
) -> None:
    at = (dt.datetime.now(dt.UTC) + dt.timedelta(days=2)).replace(microsecond=0)
    by_seconds = json_of(
        client.post(
            f"/companies/{company.id}/keys",
            headers=company.headers,
            json={"expires_in_seconds": 3600},
        )
    )
    by_moment = json_of(
        client.post(
            f"/companies/{company.id}/keys",
            headers=company.headers,
            json={"expires_at": at.isoformat()},
        )
    )

    in_an_hour = dt.datetime.fromisoformat(by_seconds["expires_at"])
    assert abs((in_an_hour - dt.datetime.now(dt.UTC)).total_seconds() - 3600) < 60
    assert dt.datetime.fromisoformat(by_moment["expires_at"]) == at


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"expires_in_seconds": 0}, "expires_in_seconds"),
        ({"expires_in_seconds": "60"}, "expires_in_seconds"),
        ({"expires_in_seconds": True}, "expires_in_seconds"),
        ({"expires_in_seconds": 10**12}, "expires_in_seconds"),
        ({"expires_at": "2000-01-01T00:00:00+00:00"}, "expires_at"),
        ({"expires_at": "2030-01-01T00:00:00"}, "expires_at"),  # no offset
        ({"expires_at": "soon"}, "expires_at"),
        ({"expires_at": "2099-01-01T00:00:00+00:00", "expires_in_seconds": 60}, "expires_at"),
        ({"name": "ci"}, "name"),
    ],
)
def test_a_bad_expiry_is_a_422_naming_the_field(
    client: FlaskClient, company: CompanyWithKey, body: dict[str, Any], field: str
) -> None:
    response = client.post(f"/companies/{company.id}/keys", headers=company.headers, json=body)

    assert response.status_code == 422
    assert field in json_of(response)["errors"]["json"]
    assert len(keys_of(client, company.id, company.headers)) == 1


def test_a_company_holds_at_most_max_active_keys(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    for _ in range(api_keys.MAX_ACTIVE_KEYS - 1):
        add_key(db_session, company.id, auth.new_api_key())

    refused = client.post(f"/companies/{company.id}/keys", headers=company.headers, json={})

    assert refused.status_code == 409
    assert str(api_keys.MAX_ACTIVE_KEYS) in json_of(refused)["message"]


# -- revoking ---------------------------------------------------------------------------------


def issue(client: FlaskClient, company: CompanyWithKey, **body: Any) -> dict[str, Any]:
    response = client.post(f"/companies/{company.id}/keys", headers=company.headers, json=body)
    assert response.status_code == 201, response.json
    return json_of(response)


def test_a_revoked_key_gets_401_at_once_and_stays_listed(
    client: FlaskClient, company: CompanyWithKey
) -> None:
    new = issue(client, company)
    assert can_read(client, company.id, company.api_key) == 200  # now in this process's cache
    old_id = next(key["id"] for key in keys_of(client, company.id, ADMIN) if key["id"] != new["id"])

    revoked = client.delete(
        f"/companies/{company.id}/keys/{old_id}", headers=bearer(new["api_key"])
    )

    assert revoked.status_code == 200, revoked.json
    assert json_of(revoked)["revoked_at"] is not None
    assert json_of(revoked)["active"] is False
    assert can_read(client, company.id, company.api_key) == 401
    assert can_read(client, company.id, new["api_key"]) == 200
    states = {key["id"]: key["active"] for key in keys_of(client, company.id, ADMIN)}
    assert states == {new["id"]: True, old_id: False}


def test_revoking_a_revoked_key_changes_nothing(
    client: FlaskClient, company: CompanyWithKey
) -> None:
    new = issue(client, company)
    url = f"/companies/{company.id}/keys/{new['id']}"
    first = json_of(client.delete(url, headers=company.headers))
    again = client.delete(url, headers=company.headers)

    assert again.status_code == 200
    assert json_of(again)["revoked_at"] == first["revoked_at"]


def test_a_company_may_not_revoke_its_last_active_key_but_the_admin_may(
    client: FlaskClient, company: CompanyWithKey
) -> None:
    key_id = keys_of(client, company.id, company.headers)[0]["id"]
    url = f"/companies/{company.id}/keys/{key_id}"

    refused = client.delete(url, headers=company.headers)
    assert refused.status_code == 409
    assert "last active" in json_of(refused)["message"]
    assert can_read(client, company.id, company.api_key) == 200

    assert client.delete(url, headers=ADMIN).status_code == 200
    assert can_read(client, company.id, company.api_key) == 401


def test_a_key_of_another_company_is_404_even_for_the_admin_on_the_wrong_path(
    client: FlaskClient, company: CompanyWithKey, make_company: Any
) -> None:
    other: CompanyWithKey = make_company("other")
    other_key = keys_of(client, other.id, other.headers)[0]["id"]

    for headers in (company.headers, ADMIN):
        response = client.delete(f"/companies/{company.id}/keys/{other_key}", headers=headers)
        assert response.status_code == 404
    assert can_read(client, other.id, other.api_key) == 200


# -- rotating ---------------------------------------------------------------------------------


def test_rotation_gives_a_new_key_and_the_old_one_works_for_the_overlap(
    client: FlaskClient, company: CompanyWithKey
) -> None:
    key_id = keys_of(client, company.id, company.headers)[0]["id"]

    response = client.post(
        f"/companies/{company.id}/keys/{key_id}/rotate",
        headers=company.headers,
        json={"overlap_seconds": 600},
    )

    assert response.status_code == 201, response.json
    rotated = json_of(response)
    assert rotated["replaces"]["id"] == key_id
    old_expiry = dt.datetime.fromisoformat(rotated["replaces"]["expires_at"])
    assert abs((old_expiry - dt.datetime.now(dt.UTC)).total_seconds() - 600) < 60
    assert rotated["expires_at"] is None
    assert can_read(client, company.id, company.api_key) == 200
    assert can_read(client, company.id, rotated["api_key"]) == 200


def test_rotation_without_overlap_retires_the_old_key_at_once(
    client: FlaskClient, company: CompanyWithKey
) -> None:
    key_id = keys_of(client, company.id, company.headers)[0]["id"]
    assert can_read(client, company.id, company.api_key) == 200  # cached

    rotated = json_of(
        client.post(
            f"/companies/{company.id}/keys/{key_id}/rotate",
            headers=company.headers,
            json={"overlap_seconds": 0},
        )
    )

    assert can_read(client, company.id, company.api_key) == 401
    assert can_read(client, company.id, rotated["api_key"]) == 200
    again = client.post(f"/companies/{company.id}/keys/{key_id}/rotate", headers=ADMIN, json={})
    assert again.status_code == 409  # expired already


@pytest.mark.parametrize(
    ("body", "field"),
    [({"overlap_seconds": -1}, "overlap_seconds"), ({"overlap_seconds": 1.5}, "overlap_seconds")],
)
def test_a_bad_overlap_is_a_422_naming_it(
    client: FlaskClient, company: CompanyWithKey, body: dict[str, Any], field: str
) -> None:
    key_id = keys_of(client, company.id, company.headers)[0]["id"]
    response = client.post(
        f"/companies/{company.id}/keys/{key_id}/rotate", headers=company.headers, json=body
    )

    assert response.status_code == 422
    assert field in json_of(response)["errors"]["json"]


# -- expiry, last use, and two API processes ---------------------------------------------------


def test_last_used_is_written_at_most_once_a_minute(
    client: FlaskClient, company: CompanyWithKey, db_session: Session
) -> None:
    conn = driver_connection(db_session, transaction=False)
    key_hash = auth.hash_api_key(company.api_key)

    def last_used() -> dt.datetime | None:
        row = conn.execute(
            "SELECT last_used_at FROM api_keys WHERE key_hash = %s", [key_hash]
        ).fetchone()
        assert row is not None
        found: dt.datetime | None = row[0]
        return found

    assert last_used() is None
    assert api_keys.find_active_key(conn, key_hash) is not None
    first = last_used()
    assert first is not None
    api_keys.find_active_key(conn, key_hash)
    assert last_used() == first  # within the minute: no write
    conn.execute(
        "UPDATE api_keys SET last_used_at = now() - interval '61 seconds' WHERE key_hash = %s",
        [key_hash],
    )
    api_keys.find_active_key(conn, key_hash)
    touched = last_used()
    assert touched is not None
    assert touched > first - dt.timedelta(seconds=1)


@pytest.fixture
def two_apps(fresh_db_url: str) -> Iterator[tuple[Flask, Flask]]:
    """Two apps on one database, as two API processes: each its own pool and key cache."""
    first, second = make_test_app(fresh_db_url), make_test_app(fresh_db_url)
    yield first, second
    for app in (first, second):
        database.close(app)


def test_an_expired_key_gets_401_at_its_expiry_on_every_process_even_while_remembered(
    two_apps: tuple[Flask, Flask], fresh_engine: Engine
) -> None:
    first, second = two_apps
    company = insert_company(fresh_engine)
    client = first.test_client()
    short = issue(client, company, expires_in_seconds=1)
    for app in two_apps:
        assert can_read(app.test_client(), company.id, short["api_key"]) == 200
        assert auth.key_cache(app).get(auth.hash_api_key(short["api_key"])) == company.id

    time.sleep(1.1)

    for app in two_apps:
        assert can_read(app.test_client(), company.id, short["api_key"]) == 401
    assert can_read(second.test_client(), company.id, company.api_key) == 200


def test_a_key_revoked_by_one_process_is_refused_by_another_within_the_cache_bound(
    two_apps: tuple[Flask, Flask],
    fresh_db_url: str,
    fresh_engine: Engine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bound is `KEY_CACHE_SECONDS`: the other process refuses the key once that long has
    passed since it looked it up, and a process that had not seen it refuses it at once."""
    revoker, other = two_apps
    with Session(fresh_engine) as session:
        company = insert_company(session)
        spare = auth.new_api_key()
        add_key(session, company.id, spare)
        session.commit()
        key_id = session.execute(
            text("SELECT id FROM api_keys WHERE key_hash = :h"),
            {"h": auth.hash_api_key(company.api_key)},
        ).scalar_one()
    clock = Clock()
    monkeypatch.setattr(auth.key_cache(other), "clock", clock)
    client, other_client = revoker.test_client(), other.test_client()
    assert can_read(other_client, company.id, company.api_key) == 200  # remembered there

    assert client.delete(f"/companies/{company.id}/keys/{key_id}", headers=ADMIN).status_code == 200

    assert can_read(client, company.id, company.api_key) == 401
    clock.now += auth.KEY_CACHE_SECONDS - 0.5
    assert can_read(other_client, company.id, company.api_key) == 200  # within the bound
    clock.now += 0.6
    assert can_read(other_client, company.id, company.api_key) == 401
    third = make_test_app(fresh_db_url)
    try:
        assert can_read(third.test_client(), company.id, company.api_key) == 401
        assert can_read(third.test_client(), company.id, spare) == 200
    finally:
        database.close(third)


def test_the_company_and_its_first_key_are_created_together(client: FlaskClient) -> None:
    created = json_of(client.post("/companies", json={"name": "Acme"}, headers=ADMIN))

    listed = keys_of(client, uuid.UUID(created["id"]), bearer(created["api_key"]))
    assert [key["id"] for key in listed] == [created["api_key_id"]]


def test_deleting_a_company_deletes_its_keys(fresh_db_url: str) -> None:
    with psycopg.connect(libpq(fresh_db_url), autocommit=True) as conn:
        company_id = conn.execute(
            "INSERT INTO companies (name) VALUES ('x') RETURNING id"
        ).fetchone()
        assert company_id is not None
        with conn.transaction():
            api_keys.issue_key(conn, company_id[0], "h1")
        conn.execute("DELETE FROM companies WHERE id = %s", company_id)
        row = conn.execute("SELECT count(*) FROM api_keys").fetchone()
    assert row == (0,)
