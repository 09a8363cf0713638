"""The company endpoints: the admin creates tenants, a tenant reads itself (DESIGN §2, §3)."""

from __future__ import annotations

import datetime as dt
import hashlib
import uuid

import pytest
from flask.testing import FlaskClient
from sqlalchemy import text
from sqlalchemy.orm import Session

from api import database
from tests.conftest import make_test_app
from tests.factories import MakeCompany, json_of


def test_admin_creates_a_company_and_gets_its_api_key_once(
    client: FlaskClient, admin_headers: dict[str, str]
) -> None:
    response = client.post("/companies", json={"name": "Acme"}, headers=admin_headers)

    assert response.status_code == 201
    company = json_of(response)
    assert set(company) == {"id", "name", "created_at", "api_key"}
    uuid.UUID(company["id"])
    assert company["name"] == "Acme"
    assert dt.datetime.fromisoformat(company["created_at"]).tzinfo is not None
    assert len(company["api_key"]) >= 32


def test_the_returned_api_key_authenticates_as_that_company(
    client: FlaskClient, admin_headers: dict[str, str]
) -> None:
    created = json_of(client.post("/companies", json={"name": "Acme"}, headers=admin_headers))
    headers = {"Authorization": f"Bearer {created['api_key']}"}

    response = client.get(f"/companies/{created['id']}", headers=headers)

    assert response.status_code == 200
    assert json_of(response)["id"] == created["id"]


def test_each_company_gets_a_different_api_key(
    client: FlaskClient, admin_headers: dict[str, str]
) -> None:
    keys = {
        json_of(client.post("/companies", json={"name": "Same"}, headers=admin_headers))["api_key"]
        for _ in range(3)
    }

    assert len(keys) == 3


def test_name_of_200_characters_is_accepted(
    client: FlaskClient, admin_headers: dict[str, str]
) -> None:
    response = client.post("/companies", json={"name": "n" * 200}, headers=admin_headers)

    assert response.status_code == 201
    assert json_of(response)["name"] == "n" * 200


@pytest.mark.parametrize(
    "body",
    [
        {"name": ""},
        {"name": "n" * 201},
        {},
        {"name": None},
        {"name": 7},
        {"name": "a\u0000b"},
        {"name": "a", "x": 1},
    ],
    ids=["empty", "201-chars", "missing", "null", "number", "nul-character", "unknown-field"],
)
def test_invalid_company_body_is_422_and_nothing_is_stored(
    client: FlaskClient,
    admin_headers: dict[str, str],
    db_session: Session,
    body: dict[str, object],
) -> None:
    before = db_session.execute(text("SELECT count(*) FROM companies")).scalar_one()

    response = client.post("/companies", json=body, headers=admin_headers)

    assert response.status_code == 422
    error = json_of(response)
    assert error["code"] == 422
    field = "x" if "x" in body else "name"
    assert error["errors"]["json"][field]
    assert db_session.execute(text("SELECT count(*) FROM companies")).scalar_one() == before


@pytest.mark.parametrize("data", ['{"name": ', '{"name": "\\ud800"}'], ids=["cut", "surrogate"])
def test_malformed_company_body_is_400_and_nothing_is_stored(
    client: FlaskClient, admin_headers: dict[str, str], db_session: Session, data: str
) -> None:
    before = db_session.execute(text("SELECT count(*) FROM companies")).scalar_one()

    response = client.post(
        "/companies", data=data, content_type="application/json", headers=admin_headers
    )

    assert response.status_code == 400
    assert json_of(response)["code"] == 400
    assert json_of(response)["errors"]["json"]
    assert db_session.execute(text("SELECT count(*) FROM companies")).scalar_one() == before


@pytest.mark.parametrize(
    "authorization", [None, "Bearer not-the-admin-token"], ids=["missing", "wrong"]
)
def test_create_company_without_the_admin_token_is_401(
    client: FlaskClient, authorization: str | None
) -> None:
    headers = {} if authorization is None else {"Authorization": authorization}

    response = client.post("/companies", json={"name": "Acme"}, headers=headers)

    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"].startswith("Bearer")
    assert json_of(response)["code"] == 401


def test_a_company_key_cannot_create_companies(
    client: FlaskClient, make_company: MakeCompany
) -> None:
    company = make_company()

    response = client.post("/companies", json={"name": "Other"}, headers=company.headers)

    assert response.status_code == 401
    assert json_of(response)["code"] == 401


def test_company_key_reads_its_company_without_the_api_key(
    client: FlaskClient, make_company: MakeCompany
) -> None:
    company = make_company("Acme")

    response = client.get(f"/companies/{company.id}", headers=company.headers)

    assert response.status_code == 200
    body = json_of(response)
    assert set(body) == {"id", "name", "created_at"}
    assert (body["id"], body["name"]) == (str(company.id), "Acme")
    assert company.api_key not in response.get_data(as_text=True)


def test_admin_reads_any_company(
    client: FlaskClient, make_company: MakeCompany, admin_headers: dict[str, str]
) -> None:
    first, second = make_company("first"), make_company("second")

    for company in (first, second):
        response = client.get(f"/companies/{company.id}", headers=admin_headers)
        assert response.status_code == 200
        assert json_of(response)["name"] == company.name


def test_company_key_on_another_company_is_404(
    client: FlaskClient, make_company: MakeCompany
) -> None:
    mine, theirs = make_company("mine"), make_company("theirs")

    response = client.get(f"/companies/{theirs.id}", headers=mine.headers)

    assert response.status_code == 404
    assert json_of(response)["code"] == 404
    assert "theirs" not in response.get_data(as_text=True)


def test_admin_reading_an_unknown_company_is_404(
    client: FlaskClient, admin_headers: dict[str, str]
) -> None:
    response = client.get(f"/companies/{uuid.uuid4()}", headers=admin_headers)

    assert response.status_code == 404
    assert json_of(response)["message"] == "company not found"


def test_create_company_without_admin_token_configured_is_503_saying_so(
    main_db_url: str,
) -> None:
    app = make_test_app(main_db_url, admin_token=None)
    try:
        response = app.test_client().post(
            "/companies",
            json={"name": "Acme"},
            headers={"Authorization": "Bearer anything-at-all-here"},
        )
    finally:
        with app.app_context():
            database.engine().dispose()

    assert response.status_code == 503
    body = json_of(response)
    assert body["code"] == 503
    assert "not configured" in body["message"]
    assert "ADMIN_TOKEN" in body["message"]


def test_stored_key_is_only_its_sha256_hex_digest(
    client: FlaskClient, admin_headers: dict[str, str], db_session: Session
) -> None:
    created = json_of(client.post("/companies", json={"name": "Acme"}, headers=admin_headers))
    key = created["api_key"]

    row = (
        db_session.execute(
            text("SELECT *, row_to_json(c)::text AS as_json FROM companies c WHERE id = :id"),
            {"id": created["id"]},
        )
        .mappings()
        .one()
    )

    assert row["api_key_hash"] == hashlib.sha256(key.encode()).hexdigest()
    assert key not in row["as_json"]
    for column, value in row.items():
        assert key not in str(value), column


@pytest.mark.parametrize("name", ["   ", "line\nbreak", "tab\there", "bell\x07", "c1\x85"])
def test_blank_or_multiline_company_name_is_422_naming_the_field(
    client: FlaskClient, admin_headers: dict[str, str], db_session: Session, name: str
) -> None:
    before = db_session.scalar(text("SELECT count(*) FROM companies"))

    response = client.post("/companies", json={"name": name}, headers=admin_headers)

    assert response.status_code == 422
    assert json_of(response)["errors"]["json"]["name"]
    assert db_session.scalar(text("SELECT count(*) FROM companies")) == before
