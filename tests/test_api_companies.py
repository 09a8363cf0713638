"""The company endpoints: the admin creates tenants and sets their limits, a tenant reads itself
(design §2, §3)."""

from __future__ import annotations

import datetime as dt
import hashlib
import uuid
from collections.abc import Iterator
from http import HTTPStatus
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import text
from sqlalchemy.orm import Session
from werkzeug.test import TestResponse

from api import database
from api.companies.schemas import CompanyLimitsSchema
from db import companies, models
from db import errors as db_errors
from db.engine import driver_connection
from tests.conftest import ADMIN_TOKEN, make_test_app
from tests.factories import MakeCompany, company_limits, json_of

COMPANY_FIELDS = {
    "id", "name", "created_at", "weight", "max_in_flight", "max_pending", "paused",
}  # fmt: skip


def test_admin_creates_a_company_and_gets_its_api_key_once(
    client: FlaskClient, admin_headers: dict[str, str]
) -> None:
    response = client.post("/companies", json={"name": "Acme"}, headers=admin_headers)

    assert response.status_code == 201
    company = json_of(response)
    assert set(company) == COMPANY_FIELDS | {"api_key", "api_key_id"}
    uuid.UUID(company["id"])
    assert company["name"] == "Acme"
    assert dt.datetime.fromisoformat(company["created_at"]).tzinfo is not None
    assert len(company["api_key"]) >= 32
    assert company["max_pending"] == 1_000_000  # DEFAULT_MAX_PENDING's default
    assert company["paused"] is False


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
    assert set(body) == COMPANY_FIELDS
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
        database.close(app)

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

    stored = (
        db_session.execute(
            text("SELECT *, row_to_json(k)::text AS as_json FROM api_keys k WHERE id = :id"),
            {"id": created["api_key_id"]},
        )
        .mappings()
        .one()
    )

    assert stored["key_hash"] == hashlib.sha256(key.encode()).hexdigest()
    assert str(stored["company_id"]) == created["id"]
    for found in (row, stored):
        assert key not in found["as_json"]
        for column, value in found.items():
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


# --- weight and max_in_flight ----------------------------------------------------------------

JSON = "application/json"


def patch_company(
    client: FlaskClient,
    company_id: object,
    body: object,
    headers: dict[str, str],
) -> TestResponse:
    """PATCH `body` (sent as JSON) to one company."""
    return client.patch(f"/companies/{company_id}", json=body, headers=headers)


def assert_error_naming(response: TestResponse, status: int, field: str) -> dict[str, Any]:
    """Assert an error body for `status` whose message and `errors.json` name `field`."""
    assert response.status_code == status, response.get_data(as_text=True)[:500]
    body = json_of(response)
    assert body["code"] == status
    assert body["status"] == HTTPStatus(status).phrase
    assert field in body["message"], body["message"]
    assert body["errors"]["json"][field]
    return body


def test_created_company_has_weight_1_and_no_in_flight_limit_by_default(
    client: FlaskClient, admin_headers: dict[str, str], db_session: Session
) -> None:
    response = client.post("/companies", json={"name": "Acme"}, headers=admin_headers)

    assert response.status_code == 201
    created = json_of(response)
    assert (created["weight"], created["max_in_flight"]) == (1, None)
    assert company_limits(db_session, uuid.UUID(created["id"])) == (1, None)


@pytest.mark.parametrize(
    ("limits", "expected"),
    [
        ({"weight": 7, "max_in_flight": 3}, (7, 3)),
        ({"weight": 1000}, (1000, None)),
        ({"max_in_flight": 100_000}, (1, 100_000)),
        ({"weight": 1, "max_in_flight": 1}, (1, 1)),
        ({"max_in_flight": None}, (1, None)),
    ],
    ids=["both", "weight-max", "in-flight-max", "minimums", "in-flight-null"],
)
def test_create_company_with_limits_stores_and_shows_them(
    client: FlaskClient,
    admin_headers: dict[str, str],
    db_session: Session,
    limits: dict[str, object],
    expected: tuple[int, int | None],
) -> None:
    response = client.post("/companies", json={"name": "Acme", **limits}, headers=admin_headers)

    assert response.status_code == 201, response.get_data(as_text=True)[:300]
    created = json_of(response)
    assert (created["weight"], created["max_in_flight"]) == expected
    assert company_limits(db_session, uuid.UUID(created["id"])) == expected
    shown = json_of(client.get(f"/companies/{created['id']}", headers=admin_headers))
    assert (shown["weight"], shown["max_in_flight"]) == expected


# Values no limit accepts: a 422 naming the field. `2.0` is a JSON float, not an integer.
BAD_WEIGHTS = [True, False, 2.0, 2.5, "2", "", [2], {"v": 2}, 0, -1, 1001, 10**20, None]
BAD_WEIGHT_IDS = [
    "true", "false", "float-2.0", "float", "string", "empty-string", "list", "object",
    "zero", "negative", "1001", "huge", "null",
]  # fmt: skip
BAD_IN_FLIGHTS = [True, 2.0, "5", [5], 0, -3, 100_001, 10**20]
BAD_IN_FLIGHT_IDS = ["true", "float-2.0", "string", "list", "zero", "negative", "100001", "huge"]


@pytest.mark.parametrize("weight", BAD_WEIGHTS, ids=BAD_WEIGHT_IDS)
def test_create_company_with_a_bad_weight_is_422_naming_it_and_nothing_is_stored(
    client: FlaskClient, admin_headers: dict[str, str], db_session: Session, weight: object
) -> None:
    before = db_session.execute(text("SELECT count(*) FROM companies")).scalar_one()

    response = client.post(
        "/companies", json={"name": "A", "weight": weight}, headers=admin_headers
    )

    assert_error_naming(response, 422, "weight")
    assert db_session.execute(text("SELECT count(*) FROM companies")).scalar_one() == before


@pytest.mark.parametrize("max_in_flight", BAD_IN_FLIGHTS, ids=BAD_IN_FLIGHT_IDS)
def test_create_company_with_a_bad_max_in_flight_is_422_naming_it_and_nothing_is_stored(
    client: FlaskClient, admin_headers: dict[str, str], db_session: Session, max_in_flight: object
) -> None:
    before = db_session.execute(text("SELECT count(*) FROM companies")).scalar_one()

    response = client.post(
        "/companies", json={"name": "A", "max_in_flight": max_in_flight}, headers=admin_headers
    )

    assert_error_naming(response, 422, "max_in_flight")
    assert db_session.execute(text("SELECT count(*) FROM companies")).scalar_one() == before


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"weight": 5}, (5, 40)),
        ({"max_in_flight": 2}, (3, 2)),
        ({"max_in_flight": None}, (3, None)),
        ({"weight": 1000, "max_in_flight": 100_000}, (1000, 100_000)),
        ({"weight": 1, "max_in_flight": 1}, (1, 1)),
        ({"weight": 3, "max_in_flight": 40}, (3, 40)),
    ],
    ids=["weight-only", "in-flight-only", "in-flight-null", "both-max", "both-min", "same"],
)
def test_admin_patch_sets_the_given_limits_and_keeps_the_other(
    client: FlaskClient,
    admin_headers: dict[str, str],
    db_session: Session,
    make_company: MakeCompany,
    *,
    body: dict[str, object],
    expected: tuple[int, int | None],
) -> None:
    company, bystander = make_company("target"), make_company("bystander")
    first = patch_company(client, company.id, {"weight": 3, "max_in_flight": 40}, admin_headers)
    assert first.status_code == 200, first.get_data(as_text=True)[:300]

    response = patch_company(client, company.id, body, admin_headers)

    assert response.status_code == 200, response.get_data(as_text=True)[:300]
    shown = json_of(response)
    assert set(shown) == COMPANY_FIELDS
    assert (shown["id"], shown["name"]) == (str(company.id), "target")
    assert (shown["weight"], shown["max_in_flight"]) == expected
    assert company_limits(db_session, company.id) == expected
    assert company_limits(db_session, bystander.id) == (1, None)


def test_patched_limits_are_visible_in_get_to_the_company_and_the_admin(
    client: FlaskClient, admin_headers: dict[str, str], make_company: MakeCompany
) -> None:
    company = make_company()

    patched = patch_company(client, company.id, {"weight": 9, "max_in_flight": 4}, admin_headers)

    assert patched.status_code == 200
    for headers in (company.headers, admin_headers):
        shown = json_of(client.get(f"/companies/{company.id}", headers=headers))
        assert (shown["weight"], shown["max_in_flight"]) == (9, 4)


@pytest.mark.parametrize("weight", BAD_WEIGHTS, ids=BAD_WEIGHT_IDS)
def test_patch_with_a_bad_weight_is_422_naming_it_and_changes_nothing(
    client: FlaskClient,
    admin_headers: dict[str, str],
    db_session: Session,
    make_company: MakeCompany,
    weight: object,
) -> None:
    company = make_company()

    response = patch_company(
        client, company.id, {"weight": weight, "max_in_flight": 5}, admin_headers
    )

    assert_error_naming(response, 422, "weight")
    assert company_limits(db_session, company.id) == (1, None)


@pytest.mark.parametrize("max_in_flight", BAD_IN_FLIGHTS, ids=BAD_IN_FLIGHT_IDS)
def test_patch_with_a_bad_max_in_flight_is_422_naming_it_and_changes_nothing(
    client: FlaskClient,
    admin_headers: dict[str, str],
    db_session: Session,
    make_company: MakeCompany,
    max_in_flight: object,
) -> None:
    company = make_company()

    response = patch_company(
        client, company.id, {"weight": 5, "max_in_flight": max_in_flight}, admin_headers
    )

    assert_error_naming(response, 422, "max_in_flight")
    assert company_limits(db_session, company.id) == (1, None)


@pytest.mark.parametrize("field", ["name", "api_key", "id", "created_at", "priority"])
def test_patch_with_another_field_is_422_naming_it_and_changes_nothing(
    client: FlaskClient,
    admin_headers: dict[str, str],
    db_session: Session,
    make_company: MakeCompany,
    field: str,
) -> None:
    company = make_company("before")

    response = patch_company(client, company.id, {"weight": 5, field: "x"}, admin_headers)

    body = assert_error_naming(response, 422, field)
    assert body["errors"]["json"][field] == ["Unknown field."]
    assert company_limits(db_session, company.id) == (1, None)
    assert (
        json_of(client.get(f"/companies/{company.id}", headers=admin_headers))["name"] == "before"
    )


@pytest.mark.parametrize(
    "send",
    [
        {"json": {}},
        {"data": "{}", "content_type": JSON},
        {},
    ],
    ids=["empty-object", "empty-object-raw", "no-body-at-all"],
)
def test_patch_without_any_limit_is_422_saying_to_send_one(
    client: FlaskClient,
    admin_headers: dict[str, str],
    make_company: MakeCompany,
    send: dict[str, Any],
) -> None:
    company = make_company()

    response = client.patch(f"/companies/{company.id}", headers=admin_headers, **send)

    assert response.status_code == 422, response.get_data(as_text=True)[:300]
    body = json_of(response)
    assert body["code"] == 422
    assert "at least one of: weight, max_in_flight" in body["message"]
    assert body["errors"]["json"]["_schema"] == [
        "send at least one of: weight, max_in_flight, max_pending"
    ]


@pytest.mark.parametrize(
    "data", ["null", "[]", '"weight"', "5"], ids=["null", "array", "string", "number"]
)
def test_patch_body_that_is_not_an_object_is_422(
    client: FlaskClient,
    admin_headers: dict[str, str],
    db_session: Session,
    make_company: MakeCompany,
    data: str,
) -> None:
    company = make_company()

    response = client.patch(
        f"/companies/{company.id}", data=data, content_type=JSON, headers=admin_headers
    )

    assert response.status_code == 422
    assert json_of(response)["errors"]["json"]
    assert company_limits(db_session, company.id) == (1, None)


@pytest.mark.parametrize(
    ("data", "content_type", "status"),
    [
        ('{"weight": ', JSON, 400),
        ('{"weight": 2,}', JSON, 400),
        ('{"weight": 2, "weight": 3}', JSON, 400),
        ('{"weight": NaN}', JSON, 400),
        ('{"weight": 1e400}', JSON, 400),
        ('{"weight": 2}', "text/plain", 415),
        ('{"weight": 2}', "application/x-www-form-urlencoded", 415),
        ('{"weight": 2}', f"{JSON}; charset=latin-1", 415),
    ],
    ids=[
        "cut", "trailing-comma", "duplicate-key", "nan", "beyond-a-double",
        "text-plain", "form", "latin-1",
    ],
)  # fmt: skip
def test_malformed_or_non_json_patch_body_is_4xx_and_changes_nothing(
    client: FlaskClient,
    admin_headers: dict[str, str],
    db_session: Session,
    make_company: MakeCompany,
    *,
    data: str,
    content_type: str,
    status: int,
) -> None:
    company = make_company()

    response = client.patch(
        f"/companies/{company.id}", data=data, content_type=content_type, headers=admin_headers
    )

    assert response.status_code == status, response.get_data(as_text=True)[:300]
    body = json_of(response)
    assert body["code"] == status
    assert body["message"]
    assert company_limits(db_session, company.id) == (1, None)


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer not-the-admin-token", f"Bearer {ADMIN_TOKEN}x", "Basic dXNlcjpwYXNz"],
    ids=["missing", "wrong", "admin-token-plus-one", "basic"],
)
def test_patch_without_the_admin_token_is_401_and_changes_nothing(
    client: FlaskClient,
    db_session: Session,
    make_company: MakeCompany,
    authorization: str | None,
) -> None:
    company = make_company()
    headers = {} if authorization is None else {"Authorization": authorization}

    response = patch_company(client, company.id, {"weight": 5}, headers)

    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"].startswith("Bearer")
    assert json_of(response)["code"] == 401
    assert company_limits(db_session, company.id) == (1, None)


def test_unauthenticated_patch_is_401_before_any_validation(
    client: FlaskClient, make_company: MakeCompany
) -> None:
    company = make_company()

    response = client.patch(f"/companies/{company.id}", data="{", content_type=JSON)

    assert response.status_code == 401
    assert json_of(response)["code"] == 401


def test_a_company_key_cannot_patch_even_its_own_company(
    client: FlaskClient, make_company: MakeCompany, db_session: Session
) -> None:
    company, other = make_company("self"), make_company("other")
    # The answer an admin-only endpoint gives a company key: POST /companies.
    create = client.post("/companies", json={"name": "x"}, headers=company.headers)

    for target in (company, other):
        response = patch_company(client, target.id, {"weight": 1000}, company.headers)

        assert response.status_code == 401
        assert json_of(response) == json_of(create)
        assert company_limits(db_session, target.id) == (1, None)


def test_patch_of_an_unknown_company_is_404(
    client: FlaskClient, admin_headers: dict[str, str]
) -> None:
    response = patch_company(client, uuid.uuid4(), {"weight": 2}, admin_headers)

    assert response.status_code == 404
    assert json_of(response)["message"] == "company not found"


@pytest.mark.parametrize("company_id", ["not-a-uuid", "12345", "acme"])
def test_patch_of_a_company_id_that_is_not_a_uuid_is_a_json_404(
    client: FlaskClient, admin_headers: dict[str, str], company_id: str
) -> None:
    response = patch_company(client, company_id, {"weight": 2}, admin_headers)

    assert response.status_code == 404
    assert json_of(response)["code"] == 404


def test_patch_without_admin_token_configured_is_503_saying_so(main_db_url: str) -> None:
    app = make_test_app(main_db_url, admin_token=None)
    try:
        response = app.test_client().patch(
            f"/companies/{uuid.uuid4()}",
            json={"weight": 2},
            headers={"Authorization": "Bearer anything-at-all-here"},
        )
    finally:
        database.close(app)

    assert response.status_code == 503
    assert "ADMIN_TOKEN" in json_of(response)["message"]


def test_update_company_limits_is_one_statement_raising_not_found(db_session: Session) -> None:
    with pytest.raises(db_errors.NotFound):
        companies.update_company_limits(
            driver_connection(db_session, transaction=False), uuid.uuid4(), weight=2
        )
    with pytest.raises(ValueError, match="weight, max_in_flight or max_pending"):
        companies.update_company_limits(
            driver_connection(db_session, transaction=False), uuid.uuid4()
        )


# --- The database's CHECKs behind the schema -------------------------------------------------


@pytest.fixture(scope="module")
def check_app(main_db_url: str) -> Iterator[Flask]:
    """An app with a route writing limits past validation, straight into the CHECKs.

    The write is never committed: it runs in a transaction of its own, rolled back when the
    error leaves it.
    """
    app = make_test_app(main_db_url)
    app.config["TESTING"] = False  # let error handlers run as in production

    @app.post("/unchecked/<field>/<int(signed=True):value>")
    def unchecked(field: str, value: int) -> str:
        with database.transaction() as conn:
            company = companies.create_company(conn, name="unchecked")
            companies.update_company_limits(conn, company.id, **{field: value})
        raise AssertionError("the CHECK constraint let the value through")

    yield app
    database.close(app)


@pytest.mark.parametrize(
    ("field", "value"),
    [("weight", 0), ("weight", 1001), ("max_in_flight", 0), ("max_in_flight", 100_001)],
)
def test_check_violation_of_a_limit_is_a_422_naming_the_field_not_a_500(
    check_app: Flask, field: str, value: int
) -> None:
    response = check_app.test_client().post(f"/unchecked/{field}/{value}")

    body = assert_error_naming(response, 422, field)
    assert "Must be greater than or equal to" in body["errors"]["json"][field][0]
    assert "violates" not in body["message"]  # the driver's text stays in the log


def test_schema_bounds_are_the_check_constraints_bounds() -> None:
    assert (models.MIN_WEIGHT, models.MAX_WEIGHT) == (1, 1000)
    assert (models.MIN_IN_FLIGHT, models.MAX_IN_FLIGHT) == (1, 100_000)
    limits = CompanyLimitsSchema()
    for field, low, high in (
        ("weight", models.MIN_WEIGHT, models.MAX_WEIGHT),
        ("max_in_flight", models.MIN_IN_FLIGHT, models.MAX_IN_FLIGHT),
    ):
        assert limits.validate({field: low}) == {}
        assert limits.validate({field: high}) == {}
        assert field in limits.validate({field: low - 1})
        assert field in limits.validate({field: high + 1})


# --- OpenAPI ---------------------------------------------------------------------------------


def test_patch_is_documented_with_every_status_and_described_fields(client: FlaskClient) -> None:
    spec = json_of(client.get("/openapi.json"))
    operation = spec["paths"]["/companies/{company_id}"]["patch"]

    assert "admin only" in operation["summary"]
    responses = operation["responses"]
    assert {"200", "400", "401", "404", "413", "415", "422", "503"} <= set(responses)
    for code in ("400", "401", "404", "413", "415", "503"):
        assert responses[code]["description"], code
    assert "company" in responses["401"]["description"]
    schemas = spec["components"]["schemas"]
    limits = schemas["CompanyLimits"]["properties"]
    assert set(limits) == {"weight", "max_in_flight", "max_pending"}
    assert (limits["weight"]["minimum"], limits["weight"]["maximum"]) == (1, 1000)
    assert (limits["max_in_flight"]["minimum"], limits["max_in_flight"]["maximum"]) == (1, 100_000)
    assert limits["max_in_flight"]["nullable"] is True
    assert (limits["max_pending"]["minimum"], limits["max_pending"]["maximum"]) == (1, 10**7)
    assert limits["max_pending"]["nullable"] is True
    assert limits["weight"].get("nullable") is not True
    for name in ("CompanyLimits", "CompanyCreate", "Company"):
        for field in ("weight", "max_in_flight", "max_pending"):
            assert schemas[name]["properties"][field]["description"], (name, field)
    assert "at least one" in operation["requestBody"]["description"].lower()
